"""Broadcasts through real agents (local transport, one agent process per node, real TCP between
them): every node gets the file whole and verified, relayed node to node, and a relay lost
mid-transfer is routed around with what its receivers already hold kept."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.relay import Relay
from coordinator.nodes.agent_bundle import build_bundle
from coordinator.config.cluster_file import NodeConfig, SshSettings
from coordinator.nodes.session import UP, NodeSession
from coordinator.relay.broadcast import HEAD, Source, Target, broadcast
from shared import relay as wire


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _leftovers(root: Path) -> list[str]:
    return [p.name for p in root.rglob("*") if ".coord-relay-" in p.name]


async def _sessions(tmp_path: Path, names: list[str]) -> tuple[dict[str, NodeSession], list[asyncio.Task]]:
    bundle = build_bundle()
    settings = SshSettings(keepalive_s=0.5)
    sessions = {name: NodeSession(NodeConfig(name=name, host="local", python=sys.executable,
                                             workdir=str(tmp_path / name)),
                                  settings, bundle) for name in names}
    tasks = [asyncio.ensure_future(s.run()) for s in sessions.values()]
    deadline = time.monotonic() + 30
    while not all(s.state == UP for s in sessions.values()):
        assert time.monotonic() < deadline, {n: s.view.reason for n, s in sessions.items()}
        await asyncio.sleep(0.05)
    return sessions, tasks


async def _stop(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # The agents' pipe transports are closed while the loop still runs, not by the collector later.
    await asyncio.sleep(0.1)
    gc.collect()
    await asyncio.sleep(0)


def _loopback(sender: str, receiver: str) -> str:
    return "127.0.0.1"


def test_a_file_reaches_every_node_through_a_chain_verified(tmp_path):
    source = tmp_path / "model.safetensors"
    source.write_bytes(os.urandom(6 << 20) + b"tail")
    sha = _sha(source)

    async def body():
        sessions, tasks = await _sessions(tmp_path, ["n1", "n2", "n3"])
        try:
            outcomes = await broadcast(sessions, Source(HEAD, str(source), source.stat().st_size, sha),
                                       [Target(n, "models/m.safetensors", 0o640) for n in sessions],
                                       address=_loopback, chunk_bytes=256 << 10)
        finally:
            await _stop(tasks)
        return outcomes

    outcomes = asyncio.run(body())
    assert all(o.ok for o in outcomes.values()), {n: o.detail for n, o in outcomes.items()}
    # A chain: the head feeds one node, each node the next; each file whole, with its mode.
    assert sorted(o.sender for o in outcomes.values()) == sorted([HEAD, "n1", "n2"])
    for name in ("n1", "n2", "n3"):
        landed = tmp_path / name / "models" / "m.safetensors"
        assert _sha(landed) == sha
        assert oct(landed.stat().st_mode & 0o777) == oct(0o640)
        assert _leftovers(tmp_path / name) == []


def test_a_node_source_sends_its_copy_and_a_changed_copy_is_refused(tmp_path):
    async def body():
        sessions, tasks = await _sessions(tmp_path, ["n1", "n2", "n3"])
        try:
            held = tmp_path / "n1" / "checkpoints" / "run" / "0000010_adapters.safetensors"
            held.parent.mkdir(parents=True)
            held.write_bytes(os.urandom(1 << 20))
            sha = _sha(held)
            outcomes = await broadcast(sessions, Source("n1", str(held), held.stat().st_size, sha),
                                       [Target(n, "checkpoints/run/local/0000010.safetensors") for n in ("n2", "n3")],
                                       address=_loopback, chunk_bytes=64 << 10)
            held.write_bytes(os.urandom(1 << 20))  # the same size, other bytes
            refused = await broadcast(sessions, Source("n1", str(held), held.stat().st_size, sha),
                                      [Target("n2", "checkpoints/run/local/again.safetensors")],
                                      address=_loopback, chunk_bytes=64 << 10)
        finally:
            await _stop(tasks)
        return sha, outcomes, refused

    sha, outcomes, refused = asyncio.run(body())
    assert all(o.ok for o in outcomes.values())
    for name in ("n2", "n3"):
        assert _sha(tmp_path / name / "checkpoints/run/local/0000010.safetensors") == sha
    assert not refused["n2"].ok and "no longer matches" in refused["n2"].detail
    assert not (tmp_path / "n2" / "checkpoints/run/local/again.safetensors").exists()
    assert _leftovers(tmp_path / "n2") == []


def test_a_relay_frozen_mid_transfer_is_routed_around_and_receivers_keep_their_chunks(tmp_path):
    source = tmp_path / "data.bin"
    source.write_bytes(os.urandom(24 << 20))
    sha = _sha(source)
    frozen: list[int] = []
    resumed_from: dict[str, int] = {}

    async def body():
        sessions, tasks = await _sessions(tmp_path, ["n1", "n2", "n3"])
        reroutes: list[str] = []

        def progress(update):
            # Freeze the first relay (n1's agent) once the node after it holds part of the file.
            if not frozen and update["node"] == "n2" and 0 < update["bytes_done"] < update["bytes_total"] // 2:
                pid = sessions["n1"].view.agent["pid"]
                os.kill(pid, signal.SIGSTOP)
                frozen.append(pid)
                resumed_from["n2"] = update["bytes_done"]

        def events(kind, text):
            reroutes.append(text)

        try:
            outcomes = await broadcast(sessions, Source(HEAD, str(source), source.stat().st_size, sha),
                                       [Target(n, "data/train.bin") for n in ("n1", "n2", "n3")],
                                       address=_loopback, chunk_bytes=64 << 10, progress=progress, events=events)
        finally:
            for pid in frozen:
                try:
                    os.kill(pid, signal.SIGCONT)  # the session may have ended it already
                except ProcessLookupError:
                    pass
            await _stop(tasks)
        return outcomes, reroutes

    outcomes, reroutes = asyncio.run(body())
    assert frozen, "the transfer ended before the relay could be frozen"
    assert not outcomes["n1"].ok and "lost" in outcomes["n1"].detail
    for name in ("n2", "n3"):
        assert outcomes[name].ok, outcomes[name].detail
        assert _sha(tmp_path / name / "data/train.bin") == sha
    assert outcomes["n2"].sender == HEAD and outcomes["n2"].reroutes == 1
    assert any("n2 now receives from head" in text for text in reroutes), reroutes
    assert not (tmp_path / "n1" / "data" / "train.bin").exists()


def test_a_receiver_takes_only_chunks_that_match_and_resumes_from_what_it_holds(tmp_path):
    good = os.urandom(300_000)
    bad = bytearray(good)
    bad[200_000] ^= 1
    chunk = 64 << 10
    plan = wire.ChunkPlan(len(good), chunk)
    hashes = [hashlib.sha256(good[i * chunk:(i + 1) * chunk]).digest() for i in range(plan.count)]
    root = tmp_path / "work"

    async def body():
        relay = Relay()
        opened = await relay.open_receiver("t1", "secret", str(root), "f.bin", len(good), 0o644,
                                           hashlib.sha256(good).hexdigest(), chunk, hashes)
        port = opened["port"]

        def reader(data):
            path = tmp_path / f"source-{len(opened_files)}"
            path.write_bytes(bytes(data))
            opened_files.append(os.open(path, os.O_RDONLY))
            return opened_files[-1]

        with pytest.raises(wire.RelayError, match="refused"):
            await wire.send_file("127.0.0.1", port, transfer="t1", token="wrong", plan=plan,
                                 fd=reader(good), available=lambda: plan.count)
        try:
            await wire.send_file("127.0.0.1", port, transfer="t1", token="secret", plan=plan,
                                 fd=reader(bad), available=lambda: plan.count)
        except wire.RelayError:
            pass  # the receiver hangs up on the bad chunk
        state = await relay.wait("t1", timeout=2)
        assert state["have"] == 3 and not state["done"]  # chunks 0-2 verified; chunk 3 held the flip
        assert "does not match its SHA256" in state["upstream_error"]
        assert not (root / "f.bin").exists()
        await wire.send_file("127.0.0.1", port, transfer="t1", token="secret", plan=plan,
                             fd=reader(good), available=lambda: plan.count,
                             on_sent=lambda n: sent.append(n))
        state = await relay.wait("t1", timeout=5)
        await relay.close("t1")
        return state

    sent: list[int] = []
    opened_files: list[int] = []
    state = asyncio.run(body())
    for fd in opened_files:
        os.close(fd)
    assert state["done"] and sent[0] == 4  # the second sender started at chunk 3, the first missing
    assert (root / "f.bin").read_bytes() == good
    assert _leftovers(root) == []


def test_paths_from_the_wire_are_checked_before_anything_is_written(tmp_path):
    root = tmp_path / "work"
    root.mkdir()
    (root / "link").symlink_to(tmp_path)

    async def body():
        relay = Relay()
        for bad in ("../x", "/etc/x", "link/x"):
            with pytest.raises(Exception, match="refused|outside|absolute|symlink"):
                await relay.open_receiver(f"t-{len(bad)}", "s", str(root), bad, 1, 0o644, "0" * 64, 1 << 20,
                                          [b"\0" * 32])

    asyncio.run(body())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_a_dead_agents_temporaries_are_removed_and_never_part_of_a_manifest(tmp_path):
    from shared.ignore import IgnoreRules
    from shared.manifest import scan_tree

    root = tmp_path / "work"
    (root / "data").mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = root / "data" / f".train.bin.coord-relay-{dead.pid}-1"  # its agent was killed mid-transfer
    stale.write_bytes(b"half")
    alive = root / "data" / f".train.bin.coord-relay-{os.getpid()}-9"  # this process: a transfer of its own
    alive.write_bytes(b"mine")
    manifest, _ = scan_tree(str(root), IgnoreRules())
    assert manifest == {}  # coord's temporaries are not user data

    data = b"x" * 1000

    async def body():
        relay = Relay()
        await relay.open_receiver("t", "s", str(root), "data/train.bin", len(data), 0o644,
                                  hashlib.sha256(data).hexdigest(), 1 << 20, [hashlib.sha256(data).digest()])
        await relay.close("t")

    asyncio.run(body())
    assert not stale.exists() and alive.exists()


def test_a_relay_whose_disk_fills_is_routed_around_at_once_and_keeps_nothing(tmp_path):
    """n1, first in the chain, runs out of room: it says so (where, and how much room it lacks), its
    temporary goes at once, and the nodes after it are fed from the head at once, not after a stall."""
    from coordinator.relay.broadcast import STALL_S
    from tests.integration.small_disk import open_under, small_disk

    source = tmp_path / "data.bin"
    source.write_bytes(os.urandom(6 << 20))
    sha = _sha(source)
    events: list[str] = []

    async def body():
        sessions, tasks = await _sessions(tmp_path, ["n1", "n2", "n3"])
        agent = sessions["n1"].view.agent["pid"]
        started = time.monotonic()
        try:
            outcomes = await broadcast(sessions, Source(HEAD, str(source), source.stat().st_size, sha),
                                       [Target(n, "data/train.bin") for n in ("n1", "n2", "n3")],
                                       address=_loopback, chunk_bytes=256 << 10,
                                       events=lambda kind, text: events.append(text))
            held = open_under(agent, tmp_path / "n1")
        finally:
            await _stop(tasks)
        return outcomes, time.monotonic() - started, held

    with small_disk(tmp_path / "n1", "1m"):
        outcomes, seconds, held = asyncio.run(body())
        assert not outcomes["n1"].ok and outcomes["n1"].node_failed
        assert f"no space left in {tmp_path}/n1/data" in outcomes["n1"].detail, outcomes["n1"].detail
        assert "still to write" in outcomes["n1"].detail and " free" in outcomes["n1"].detail
        assert _leftovers(tmp_path / "n1") == [] and held == []
        assert not (tmp_path / "n1" / "data" / "train.bin").exists()
    for name in ("n2", "n3"):
        assert outcomes[name].ok, outcomes[name].detail
        assert _sha(tmp_path / name / "data/train.bin") == sha
    assert outcomes["n2"].sender == HEAD, outcomes["n2"]
    assert any("n2 now receives from head" in text and "cannot hold" in text for text in events), events
    assert seconds < STALL_S / 2, seconds  # routed around when n1 said so, not after 15 s of silence


def test_a_receiver_its_relay_cannot_reach_is_fed_from_above_as_soon_as_the_relay_says_so(tmp_path):
    """n1 cannot connect to n2 (here: the broadcast address, which TCP refuses at once): n1 says so in its state, and
    n2 is fed by the head at once, not after 15 s without a chunk."""
    from coordinator.relay.broadcast import STALL_S

    source = tmp_path / "data.bin"
    source.write_bytes(os.urandom(4 << 20))
    sha = _sha(source)
    events: list[str] = []

    def address(sender: str, receiver: str) -> str:
        return "255.255.255.255" if (sender, receiver) == ("n1", "n2") else "127.0.0.1"

    async def body():
        sessions, tasks = await _sessions(tmp_path, ["n1", "n2", "n3"])
        started = time.monotonic()
        try:
            outcomes = await broadcast(sessions, Source(HEAD, str(source), source.stat().st_size, sha),
                                       [Target(n, "data/train.bin") for n in ("n1", "n2", "n3")],
                                       address=address, chunk_bytes=256 << 10,
                                       events=lambda kind, text: events.append(text))
        finally:
            await _stop(tasks)
        return outcomes, time.monotonic() - started

    outcomes, seconds = asyncio.run(body())
    assert all(o.ok for o in outcomes.values()), {n: o.detail for n, o in outcomes.items()}
    assert outcomes["n2"].sender == HEAD and outcomes["n3"].sender == "n2"
    assert any("n2 now receives from head" in text and "n1 could not send to it" in text for text in events), events
    assert seconds < STALL_S / 2, seconds
