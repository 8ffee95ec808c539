"""`coord sync` through a real daemon and three local nodes (real agents over the local transport):
an unchanged tree is proven by tree hashes alone, a small change moves one file and no listing, a
sync that fails halfway keeps what it wrote and the next one completes, and bytes that do not
match their hash never land under their final name."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shlex
import shutil
import signal
import sys

import pytest

from tests.integration.daemon_harness import (REPO, DaemonProcess, all_up, coord, environment, short_tempdir,
                                              write_local_cluster)
from tests.integration.small_disk import open_under, small_disk, temporaries

NODES = ("a", "b", "c")


@pytest.fixture
def cluster():
    root = short_tempdir()
    config = write_local_cluster(root, NODES, name="sync-test")
    source = root / "project"
    for i in range(300):
        path = source / f"pkg{i % 10}" / f"m{i:03d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"VALUE = {i}\n")
    (source / "run.sh").write_text("#!/bin/sh\necho run\n")
    (source / "run.sh").chmod(0o755)
    daemon = DaemonProcess(config, env=environment()).start()
    try:
        daemon.wait_for(all_up, 30, "all nodes up")
        yield daemon, root, source
    finally:
        daemon.stop(signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


def _sync(daemon, source) -> dict:
    result = coord("sync", "--json", "--config", str(daemon.config), "--source", str(source), env=daemon.env,
                   timeout=120)
    assert result.stdout, result.stderr
    return json.loads(result.stdout)


def _tree(path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and ".coord" not in p.relative_to(path).parts}


def test_an_unchanged_tree_is_proven_by_hashes_and_a_change_moves_one_file_and_no_listing(cluster):
    daemon, root, source = cluster
    first = _sync(daemon, source)
    assert first["status"] == "ok", first
    assert all(first["nodes"][n]["result"]["files_sent"] == 301 for n in NODES)
    assert all(_tree(root / n) == _tree(source) for n in NODES)
    assert first["source_reads"] == 1  # one read of the batch for the three nodes
    # Each node proved the source's tree by its hash after one flush at the end.
    assert set(first["consistency"]["hashes"].values()) == {first["source_tree_hash"]}

    noop = _sync(daemon, source)
    assert noop["status"] == "ok", noop
    assert {e["status"] for e in noop["nodes"].values()} == {"unchanged"}
    assert noop["listings_received"] == []  # no node sent its manifest: only tree hashes crossed
    assert noop["consistency"]["status"] == "pass" and noop["versus_source"]["a"]["matches"]

    (source / "pkg3" / "m003.py").write_text("VALUE = -3\n")
    one = _sync(daemon, source)
    assert one["status"] == "ok", one
    assert all(one["nodes"][n]["result"]["files_sent"] == 1 for n in NODES)
    assert one["listings_received"] == []  # planned from the tree the daemon knows each node holds
    assert all((root / n / "pkg3" / "m003.py").read_text() == "VALUE = -3\n" for n in NODES)

    # A file changed by hand on one node: that node's listing (and only its) is read, and repaired.
    (root / "b" / "pkg5" / "m005.py").write_text("VALUE = 'edited'\n")
    repaired = _sync(daemon, source)
    assert repaired["status"] == "ok", repaired
    assert repaired["listings_received"] == ["b"]
    assert repaired["nodes"]["b"]["result"]["files_sent"] == 1
    assert {repaired["nodes"][n]["status"] for n in ("a", "c")} == {"unchanged"}
    assert _tree(root / "b") == _tree(source)


def test_a_sync_that_fails_halfway_keeps_what_it_wrote_and_the_next_one_completes(cluster):
    daemon, root, source = cluster
    # On node b a directory stands where a source file goes: that file cannot be renamed into place.
    (root / "b" / "pkg4" / "m004.py").mkdir(parents=True)
    failed = _sync(daemon, source)
    assert failed["status"] == "failed" and failed["nodes"]["b"]["status"] == "failed", failed
    assert "IsADirectoryError" in failed["nodes"]["b"]["detail"] or "directory" in failed["nodes"]["b"]["detail"]
    assert failed["nodes"]["a"]["status"] == failed["nodes"]["c"]["status"] == "synced"
    assert not failed["versus_source"]["b"]["matches"]
    landed = _tree(root / "b")
    assert landed and all(landed[rel] == (source / rel).read_bytes() for rel in landed)  # nothing wrong landed
    assert not [p for p in (root / "b").rglob("*") if ".coord-" in p.name]  # and no temporary is left

    (root / "b" / "pkg4" / "m004.py").rmdir()
    again = _sync(daemon, source)
    assert again["status"] == "ok", again
    sent = again["nodes"]["b"]["result"]["files_sent"]
    assert 1 <= sent < 301 - len(landed) + 1  # only what the failed batch did not land
    assert {again["nodes"][n]["status"] for n in ("a", "c")} == {"unchanged"}
    assert _tree(root / "b") == _tree(source)


TAMPER = """
import asyncio, hashlib, json, sys
from coordinator.nodes.transport import LocalTransport
from shared import protocol as p
from shared.file_batch import pack_batch
from shared.rpc import Peer, RemoteError

async def main(root):
    proc = await LocalTransport().start(sys.argv[2])
    peer = Peer(proc.reader, proc.writer, name="test")
    runner = asyncio.ensure_future(peer.run())
    await peer.call("hello", {"protocol": p.PROTOCOL_VERSION}, timeout=30)
    good, sent, arrived = b"print('good')\\n", b"print('what the head sent')\\n", b"print('tampered')\\n"
    outcome = {}
    try:
        await peer.call("put_files", {"root": root, "batch": pack_batch([
            ("good.py", 0o644, hashlib.sha256(good).hexdigest(), good),
            ("train.py", 0o644, hashlib.sha256(sent).hexdigest(), arrived)])})
        outcome["put_files"] = "written"
    except RemoteError as exc:
        outcome["put_files"] = exc.message
    state = await peer.call("sync_state", {"root": root, "patterns": [], "known": []}, timeout=30)
    outcome["files"] = state["files"]
    await peer.close()
    proc.terminate()
    runner.cancel()
    print(json.dumps(outcome))

asyncio.run(main(sys.argv[1]))
"""


def test_bytes_that_do_not_match_their_hash_never_land_under_their_final_name(tmp_path):
    """Through a real agent over the local transport: the whole batch is refused, nothing written."""
    root = tmp_path / "work"
    start = f"cd {shlex.quote(str(REPO))} && exec {shlex.quote(sys.executable)} -m agent"
    result = asyncio.run(asyncio.wait_for(_run(TAMPER, str(root), start), 60))
    assert "does not match its SHA256" in result["put_files"]
    assert result["files"] == []
    assert not [p for p in root.rglob("*") if ".coord" not in p.parts]


async def _run(script: str, *args: str) -> dict:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, *args, cwd=REPO,
                                                env=environment(), stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode(errors="replace")
    return json.loads(out)


@pytest.fixture
def node_b_on_a_small_disk():
    """Three local nodes, node b's workdir on a 2 MiB filesystem; a source that does not fit there."""
    root = short_tempdir()
    try:
        with small_disk(root / "b", "2m"):
            config = write_local_cluster(root, NODES, name="full-disk-test")
            source = root / "project"
            for i in range(20):
                path = source / "pkg" / f"m{i:02d}.py"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(f"VALUE = {i}\n")
            (source / "model").mkdir()
            (source / "model" / "weights.bin").write_bytes(os.urandom(6 << 20))  # two chunks, not relayed
            daemon = DaemonProcess(config, env=environment()).start()
            try:
                daemon.wait_for(all_up, 30, "all nodes up")
                yield daemon, root, source
            finally:
                daemon.stop(signal.SIGKILL)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_full_disk_is_named_cleaned_up_and_counted_as_it_is_ten_times_over(node_b_on_a_small_disk):
    """Node b's disk is too small: every sync says so (the node, the directory, the bytes still to write
    and the bytes free), credits b only with what landed, and b's agent holds no file open and leaves no
    temporary, however often the sync is retried."""
    daemon, root, source = node_b_on_a_small_disk
    agent = next(n for n in daemon.status()["nodes"] if n["name"] == "b")["agent"]["pid"]
    for attempt in range(10):
        report = _sync(daemon, source)
        entry = report["nodes"]["b"]
        assert report["status"] == "failed" and entry["status"] == "failed", (attempt, report)
        detail = entry["detail"]
        assert f"no space left in {root}/b/" in detail, detail
        assert "still to write" in detail and " free" in detail and "not yet on b" in detail, detail
        assert report["detail"].startswith("not synced: b (no space left in "), report["detail"]
        landed = entry["landed"]
        # The first sync was to send all 21 files, the next ones only what is still missing (the model).
        assert attempt > 0 or landed["planned_files"] == 21, landed
        assert landed["files"] < landed["planned_files"] and landed["bytes"] < landed["planned_bytes"], landed
        assert not [rel for rel in _tree(root / "b") if rel.startswith("model/")]  # the file never landed
        assert {report["nodes"][n]["status"] for n in ("a", "c")} <= {"synced", "unchanged"}
        assert open_under(agent, root / "b") == [], attempt  # no descriptor held on b's disk
        assert temporaries(root / "b") == [], attempt
    assert next(n for n in daemon.status()["nodes"] if n["name"] == "b")["agent"]["pid"] == agent  # one agent
    assert _tree(root / "a") == _tree(source)


def _sync_with(daemon, source, *options: str) -> dict:
    result = coord("sync", "--json", "--config", str(daemon.config), "--source", str(source), *options,
                   env=daemon.env, timeout=120)
    assert result.stdout, result.stderr
    return json.loads(result.stdout)


def test_links_and_names_are_said_out_loud_and_in_tree_links_arrive_as_links(cluster):
    """Through a real daemon and real agents: a link leading out of the source stops the sync before
    anything is sent (a dry run says the same, in the same words), naming too the name no node takes;
    with --follow-outside-links, in-tree links arrive as links and the outside directory by content,
    the name no node takes is left out and named, and every node's tree hash is the source's."""
    daemon, root, source = cluster
    (source / "weights" / "v1").mkdir(parents=True)
    (source / "weights" / "v1" / "config.json").write_text("{}\n")
    (source / "model").symlink_to("weights/v1")  # a directory inside the tree
    (source / "run_again.sh").symlink_to("run.sh")  # a file inside the tree
    (source / "pkg0" / "up.py").symlink_to("../pkg1/m001.py")  # climbs, but stays inside
    outside = root / "big-disk" / "data"
    outside.mkdir(parents=True)
    (outside / "train.jsonl").write_text('{"text": "hi"}\n')
    (source / "data").symlink_to(outside)
    (source / "odd\\name.txt").write_text("a backslash in a name\n")

    dry = _sync_with(daemon, source, "--dry-run")
    real = _sync_with(daemon, source)
    for report in (dry, real):
        assert report["status"] == "failed", report
        assert report["detail"].startswith("nothing was sent: 1 link the sync cannot send: data -> "), report["detail"]
        assert "--follow-outside-links" in report["detail"]
        assert "1 name not sent: odd\\\\name.txt (backslashes are not allowed)" in report["detail"]
        assert report["names_not_sent"] == [["odd\\\\name.txt", "backslashes are not allowed"]]
        [link] = report["outside_links"]
        assert link["path"] == "data" and link["action"] == "refused" and link["leads_to"] == str(outside)
        assert {e["status"] for e in report["nodes"].values()} == {"skipped"}
    assert dry["detail"] == real["detail"] and dry["outside_links"] == real["outside_links"]
    assert all(_tree(root / n) == {} for n in NODES)  # nothing was sent, by either

    followed = _sync_with(daemon, source, "--follow-outside-links")
    assert followed["status"] == "ok", followed
    assert "1 name not sent: odd\\\\name.txt (backslashes are not allowed)" in followed["detail"]
    assert followed["links"] == 3 and [e["action"] for e in followed["outside_links"]] == ["followed"]
    for n in NODES:
        node = root / n
        assert os.readlink(node / "model") == "weights/v1" and os.readlink(node / "run_again.sh") == "run.sh"
        assert os.readlink(node / "pkg0" / "up.py") == "../pkg1/m001.py"
        assert (node / "model" / "config.json").read_text() == "{}\n"  # through the link, on the node
        assert not (node / "data").is_symlink() and (node / "data" / "train.jsonl").read_text() == '{"text": "hi"}\n'
        assert not (node / "odd\\name.txt").exists()
    assert set(followed["consistency"]["hashes"].values()) == {followed["source_tree_hash"]}

    again = _sync_with(daemon, source, "--follow-outside-links")
    assert again["status"] == "ok" and {e["status"] for e in again["nodes"].values()} == {"unchanged"}, again
