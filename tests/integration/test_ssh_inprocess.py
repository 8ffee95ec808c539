"""A node session over a real SSH session: an in-process asyncssh server runs the agent.

No system sshd: the server, its host key and the client key are generated here,
as asyncssh's own tests do, so host-key checking stays on and is exercised.
"""

from __future__ import annotations

import asyncio
import getpass
import os
import re
import shlex
import sys
import time
from pathlib import Path

import asyncssh
import pytest

from agent.server import serve
from coordinator.nodes.agent_bundle import build_bundle
from coordinator.config.cluster_file import NodeConfig, SshSettings
from coordinator.nodes.session import DOWN, UP, NodeSession


class SshFixture:
    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.host_key = asyncssh.generate_private_key("ssh-ed25519")
        self.client_key = asyncssh.generate_private_key("ssh-ed25519")
        self.client_key_path = tmp_path / "id_ed25519"
        self.client_key.write_private_key(str(self.client_key_path))
        self.empty_config = tmp_path / "ssh_config"
        self.empty_config.write_text("")
        self.known_hosts = tmp_path / "known_hosts"
        self.trusted = True
        self.agent_sessions = 0
        self.processes: list[asyncssh.SSHServerProcess] = []

    async def start(self):
        authorized = asyncssh.import_authorized_keys(self.client_key.export_public_key().decode())

        async def run_agent(process: asyncssh.SSHServerProcess) -> None:
            self.agent_sessions += 1
            self.processes.append(process)
            await serve(process.stdin, process.stdout, name="in-process-agent")
            process.exit(0)

        self.server = await asyncssh.create_server(
            asyncssh.SSHServer, "127.0.0.1", 0, server_host_keys=[self.host_key],
            authorized_client_keys=authorized, process_factory=run_agent, encoding=None)
        self.port = self.server.sockets[0].getsockname()[1]
        public = self.host_key.export_public_key().decode().strip()
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {public}\n" if self.trusted else "")

    def node(self) -> NodeConfig:
        return NodeConfig(name="ssh1", host="127.0.0.1", port=self.port, user=getpass.getuser(),
                          python=sys.executable, workdir=str(self.tmp / "work"))

    def settings(self, **overrides) -> SshSettings:
        values = dict(known_hosts=str(self.known_hosts), identity_file=str(self.client_key_path),
                      config=str(self.empty_config), keepalive_s=0.5, connect_timeout_s=5)
        values.update(overrides)
        return SshSettings(**values)

    def close(self):
        self.server.close()


async def _until(predicate, timeout: float) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def _with_session(fixture: SshFixture, settings: SshSettings, body):
    await fixture.start()
    session = NodeSession(fixture.node(), settings, build_bundle())
    task = asyncio.ensure_future(session.run())
    try:
        await asyncio.wait_for(body(session), 60)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        fixture.close()


def test_a_node_comes_up_over_ssh_with_its_facts(tmp_path):
    fixture = SshFixture(tmp_path)

    async def body(session: NodeSession):
        await _until(lambda: session.state == UP, 20)
        facts = session.view.facts
        assert facts["user"] == getpass.getuser()
        assert facts["python_version"] and facts["memory_bytes"] > 0
        assert session.view.agent["protocol"] == 1
        assert "time" in await session.call("ping", timeout=5)

    asyncio.run(_with_session(fixture, fixture.settings(), body))


def test_an_agent_that_dies_is_reconnected(tmp_path):
    fixture = SshFixture(tmp_path)

    async def body(session: NodeSession):
        await _until(lambda: session.state == UP, 20)
        fixture.processes[-1].channel.close()  # the agent's session ends under the daemon
        await _until(lambda: session.state != UP, 10)
        assert await _until(lambda: session.state == UP, 10) < 10
        assert fixture.agent_sessions == 2

    asyncio.run(_with_session(fixture, fixture.settings(), body))


def test_an_agent_beats_only_when_it_sent_nothing_else_and_is_lost_once_silent_for_three_intervals(
        tmp_path, monkeypatch):
    """The agent pushes a beat every keepalive_s in which it sent the head nothing else; the head sends
    nothing to learn it is alive. While the head's calls are answered, no beat goes. An agent that falls
    silent (its loop stuck, its path cut) is lost after three intervals (3 s at least)."""
    from agent import server

    fixture = SshFixture(tmp_path)
    beats: list[float] = []
    pings: list[float] = []
    stalled = asyncio.Event()
    real_heartbeat, real_ping = server.heartbeat, server.ping

    async def heartbeat(emit, interval, quiet_for):
        async def counted(beat):
            if stalled.is_set():
                await asyncio.sleep(3600)  # stuck: no beat, and the head calls nothing meanwhile
            beats.append(time.monotonic())
            await emit(beat)

        await real_heartbeat(counted, interval, quiet_for)

    async def ping():
        pings.append(time.monotonic())
        return await real_ping()

    monkeypatch.setattr(server, "heartbeat", heartbeat)
    monkeypatch.setattr(server, "ping", ping)

    async def body(session: NodeSession):
        await _until(lambda: session.state == UP, 20)
        await asyncio.sleep(2.0)
        assert len(beats) >= 3 and pings == [] and session.state == UP  # four intervals: beats, no ping
        busy_from = time.monotonic()
        while time.monotonic() - busy_from < 2.0:  # the head's calls answered every 0.1 s: no beat needed
            await session.call("ping", timeout=5)
            await asyncio.sleep(0.1)
        assert len([t for t in beats if t > busy_from + 0.5]) == 0, beats
        stalled.set()
        took = await _until(lambda: session.state != UP, 15)
        assert session.view.reason == "lost: agent sent nothing for 3 s (no heartbeat, no answer)", \
            session.view.reason
        assert 2.0 <= took <= 8.0, took  # three seconds after the last frame, within an interval or so

    asyncio.run(_with_session(fixture, fixture.settings(), body))


def test_an_unknown_host_key_keeps_the_node_down_with_the_fingerprint_and_the_fix(tmp_path):
    fixture = SshFixture(tmp_path)
    fixture.trusted = False  # nobody has trusted this host yet

    async def body(session: NodeSession):
        await _until(lambda: session.state == DOWN, 20)
        reason = session.view.reason
        assert fixture.host_key.get_fingerprint("sha256") in reason
        fingerprint = fixture.host_key.get_fingerprint("sha256")
        # No cluster file here (as for coord init's hosts): the command names the host and the files in use.
        assert reason.endswith(f"trust it with: coord trust 127.0.0.1 --port {fixture.port} --known-hosts "
                               f"{fixture.known_hosts} --ssh-config {fixture.empty_config} --fingerprint {fingerprint}")
        await asyncio.sleep(2)
        assert session.state == DOWN and fixture.agent_sessions == 0

    asyncio.run(_with_session(fixture, fixture.settings(), body))


def test_a_refused_key_is_reported_not_retried_with_passwords(tmp_path):
    fixture = SshFixture(tmp_path)
    other = tmp_path / "other_key"
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(other))

    async def body(session: NodeSession):
        await _until(lambda: session.state == DOWN, 20)
        assert "key authentication refused" in session.view.reason
        assert fixture.agent_sessions == 0

    asyncio.run(_with_session(fixture, fixture.settings(identity_file=str(other)), body))


def test_a_changed_host_key_is_said_first_and_its_fixes_work_as_printed(tmp_path):
    """known_hosts holds another key for [127.0.0.1]:PORT (a port other than 22, so the bracketed name):
    the node is down saying the key CHANGED, with both fingerprints and the removal command; once that
    has run, it is unknown with the trust command; once that has run, it comes up."""
    fixture = SshFixture(tmp_path)
    old = asyncssh.generate_private_key("ssh-ed25519")
    new = fixture.host_key.get_fingerprint("sha256")
    bystander = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))  # the CLI of this tree

    async def run(command: str) -> tuple[int | None, str]:
        argv = [sys.executable, "-m", "coordinator.cli.main", *shlex.split(command)[1:]] \
            if command.startswith("coord ") else ["sh", "-c", command]
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        return proc.returncode, out.decode()

    async def body(session: NodeSession):
        # The node's key changed since it was trusted (a reinstall); another host's line stays.
        fixture.known_hosts.write_text(f"10.9.9.9 {bystander}\n"
                                       f"[127.0.0.1]:{fixture.port} {old.export_public_key().decode().strip()}\n")
        await _until(lambda: session.state == DOWN and "CHANGED" in (session.view.reason or ""), 20)
        reason = session.view.reason
        assert reason.startswith(f"host key of 127.0.0.1:{fixture.port} has CHANGED: the node presents ssh-ed25519 "
                                 f"{new}, but {fixture.known_hosts}:2 holds ssh-ed25519 "
                                 f"{old.get_fingerprint('sha256')} for [127.0.0.1]:{fixture.port}."), reason
        remove = re.search(r"remove the old key with: (.*), then trust the new one", reason).group(1)
        assert remove == f"ssh-keygen -R '[127.0.0.1]:{fixture.port}' -f {fixture.known_hosts}"
        assert fixture.agent_sessions == 0
        status, out = await run(remove)
        assert status == 0, out
        assert fixture.known_hosts.read_text() == f"10.9.9.9 {bystander}\n"
        # Unknown now, not changed: the trust command of the unknown key, which works as printed.
        await _until(lambda: "is not trusted" in (session.view.reason or ""), 40)
        trust = re.search(r"trust it with: (coord trust .*)$", session.view.reason).group(1)
        assert trust.endswith(f"--fingerprint {new}") and session.state == DOWN
        status, out = await run(trust)
        assert status == 0, out
        await _until(lambda: session.state == UP, 40)

    fixture.trusted = False
    asyncio.run(_with_session(fixture, fixture.settings(), body))


@pytest.mark.parametrize("setting", ["none", "{known_hosts}"])  # no checking, or a file that trusts the node
def test_the_ssh_configs_known_hosts_settings_neither_move_nor_switch_off_the_check(tmp_path, monkeypatch, setting):
    """Without [ssh] known_hosts coord checks ~/.ssh/known_hosts, whatever the ssh config says: asyncssh
    would take `UserKnownHostsFile none` as no checking at all, and any other file as the one to check,
    which `coord trust` (writing ~/.ssh/known_hosts) and the fixes coord prints would not match."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    fixture = SshFixture(tmp_path)
    fixture.empty_config.write_text(f"UserKnownHostsFile {setting.format(known_hosts=fixture.known_hosts)}\n")

    async def body(session: NodeSession):
        await _until(lambda: session.state == DOWN, 20)
        assert "is not trusted" in session.view.reason and "not in ~/.ssh/known_hosts" in session.view.reason
        await asyncio.sleep(1)
        assert fixture.agent_sessions == 0  # never logged in to with an unchecked key

    asyncio.run(_with_session(fixture, fixture.settings(known_hosts=None), body))
