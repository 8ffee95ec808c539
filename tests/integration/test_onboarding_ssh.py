"""`coord init --hosts` and `coord trust` over a real SSH session, without root or a system sshd.

An in-process asyncssh server (generated host key, generated client key, as asyncssh's own
tests do) runs each command through the real /bin/sh as the user running the tests, so the
probe finds this machine's real Pythons. The CLI runs as a subprocess, as a user runs it;
the terminal questions are answered through a real pseudo-terminal.
"""

from __future__ import annotations

import asyncio
import getpass
import importlib.metadata
import json
import os
import pty
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import asyncssh
import pytest

from coordinator.config.cluster_file import load_config
from tests.integration.daemon_harness import REPO


class ShellServer:
    """An SSH server on 127.0.0.1 that runs each command with /bin/sh -c, in a thread of its own."""

    def __init__(self, tmp: Path):
        # The user's home on the "remote" side: its own, so that what init finds does not
        # depend on the home of whoever runs the tests. The Python running the tests (it has
        # mlx and mlx-lm) is this user's ~/venv, as a node's would be: the login shell's
        # python3 (/usr/bin/python3) may well lack mlx.
        self.home = tmp / "home"
        self.home.mkdir()
        if sys.prefix != sys.base_prefix:  # a venv (the README's `.venv/bin/python -m pytest`)
            (self.home / "venv").symlink_to(sys.prefix, target_is_directory=True)
        else:  # a Python of its own finds its prefix through the link
            (self.home / "venv" / "bin").mkdir(parents=True)
            (self.home / "venv" / "bin" / "python").symlink_to(sys.executable)
        self.env = {**os.environ, "HOME": str(self.home)}
        self.host_key = asyncssh.generate_private_key("ssh-ed25519")
        self.client_key = tmp / "id_ed25519"
        client = asyncssh.generate_private_key("ssh-ed25519")
        client.write_private_key(str(self.client_key))
        self.authorized = client.export_public_key().decode()
        self.fingerprint = self.host_key.get_fingerprint("sha256")
        self.ssh_config = tmp / "ssh_config"
        self.ssh_config.write_text("")
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def run(process: asyncssh.SSHServerProcess) -> None:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", process.command, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self.env)
            out, err = await proc.communicate()
            process.stdout.write(out)
            process.stderr.write(err)
            process.exit(proc.returncode)

        async def start() -> None:
            self.server = await asyncssh.create_server(
                asyncssh.SSHServer, "127.0.0.1", 0, server_host_keys=[self.host_key],
                authorized_client_keys=asyncssh.import_authorized_keys(self.authorized),
                process_factory=run, encoding=None)
            self.port = self.server.sockets[0].getsockname()[1]
            self.ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def known_hosts_line(self) -> str:
        return f"[127.0.0.1]:{self.port} {self.host_key.export_public_key().decode().strip()}\n"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def server(tmp_path):
    s = ShellServer(tmp_path)
    yield s
    s.close()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _init_args(server: ShellServer, known_hosts: Path, output: Path) -> list[str]:
    return ["init", "--hosts", f"box={getpass.getuser()}@127.0.0.1:{server.port}", "-o", str(output),
            "--known-hosts", str(known_hosts), "--identity-file", str(server.client_key),
            "--ssh-config", str(server.ssh_config)]


def _coord(*args: str, stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env=_env(), cwd=REPO, stdin=stdin)


def _coord_on_a_terminal(args: list[str], answer: str) -> tuple[int, str, str]:
    """Run coord with a pseudo-terminal as stdin; type answer once the question is asked."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli.main", *args], stdin=slave,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=REPO)
    os.close(slave)
    asked, err = False, b""
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 0.2)
        if ready:
            err += os.read(proc.stderr.fileno(), 4096)
        if not asked and b"(yes/no/[fingerprint])" in err:
            os.write(master, answer.encode() + b"\n")
            asked = True
    out, rest = proc.communicate(timeout=60)
    os.close(master)
    return proc.returncode, out.decode(), (err + rest).decode()


def test_init_over_ssh_finds_this_machines_python_with_mlx_and_writes_a_file_the_daemon_loads(server, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(server.known_hosts_line())
    output = tmp_path / "cluster.toml"
    result = _coord(*_init_args(server, known_hosts, output), "--json")
    assert result.returncode == 0, result.stderr + result.stdout
    doc = json.loads(result.stdout)
    assert doc["written"] and doc["ok"]
    node = doc["nodes"][0]
    assert node["python"]["mlx"] == importlib.metadata.version("mlx")
    assert node["python"]["mlx_lm"] == importlib.metadata.version("mlx-lm")
    config = load_config(output)
    (loaded,) = config.nodes
    assert (loaded.name, loaded.host, loaded.port, loaded.user) == ("box", "127.0.0.1", server.port, getpass.getuser())
    assert loaded.workdir == str(server.home / "coord-work")
    assert config.ssh.known_hosts == str(known_hosts) and config.ssh.identity_file == str(server.client_key)
    # The Python written really has both packages.
    check = subprocess.run([loaded.python, "-c", "import mlx.core, mlx_lm"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert "mlx " + importlib.metadata.version("mlx") in output.read_text()
    # A second run does not overwrite it, unless told to.
    again = _coord(*_init_args(server, known_hosts, output))
    assert again.returncode == 2 and "already exists; use --force" in again.stderr
    assert _coord(*_init_args(server, known_hosts, output), "--force").returncode == 0


def test_an_unknown_host_key_is_refused_without_a_terminal_and_nothing_is_written(server, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    output = tmp_path / "cluster.toml"
    result = _coord(*_init_args(server, known_hosts, output))
    assert result.returncode == 1
    assert server.fingerprint in result.stdout
    assert f"coord trust 127.0.0.1 --port {server.port} --known-hosts {known_hosts}" in result.stdout
    assert not output.exists() and not known_hosts.exists()
    # The same host through `coord trust`: refused without a terminal and without --fingerprint...
    trust = ["trust", f"127.0.0.1:{server.port}", "--known-hosts", str(known_hosts), "--ssh-config",
             str(server.ssh_config)]
    refused = _coord(*trust)
    assert refused.returncode == 1 and server.fingerprint in refused.stderr and not known_hosts.exists()
    # ...refused with another key's fingerprint...
    other = asyncssh.generate_private_key("ssh-ed25519").get_fingerprint("sha256")
    wrong = _coord(*trust, "--fingerprint", other)
    assert wrong.returncode == 1 and "nothing added" in wrong.stderr and not known_hosts.exists()
    # ...and trusted with its own.
    right = _coord(*trust, "--fingerprint", server.fingerprint)
    assert right.returncode == 0, right.stderr
    assert known_hosts.read_text().split() == server.known_hosts_line().split()[:3]
    assert _coord(*_init_args(server, known_hosts, output)).returncode == 0


def test_at_a_terminal_the_key_is_trusted_only_on_yes(server, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    output = tmp_path / "cluster.toml"
    status, out, err = _coord_on_a_terminal(_init_args(server, known_hosts, output), "no")
    assert status == 1 and server.fingerprint in err and not output.exists()
    assert not known_hosts.exists() or known_hosts.read_text() == ""
    status, out, err = _coord_on_a_terminal(_init_args(server, known_hosts, output), "yes")
    assert status == 0, out + err
    assert known_hosts.read_text().split() == server.known_hosts_line().split()[:3]
    assert load_config(output).nodes[0].host == "127.0.0.1"
