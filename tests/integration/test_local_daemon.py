"""coordd with local nodes (agents over the local transport), driven by the real CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

from tests.integration.daemon_harness import (DaemonProcess, all_up, coord, environment, node_states,
                                              short_tempdir)

CLUSTER = """\
[cluster]
name = "local-test"
state_dir = "{root}/state"

[ssh]
keepalive_s = 0.5

[[nodes]]
name = "a"
host = "local"
workdir = "{root}/a"

[[nodes]]
name = "b"
host = "local"
python = "{python}"
workdir = "{root}/b"
"""


@pytest.fixture
def local_cluster():
    root = short_tempdir()
    home = root / "home"
    home.mkdir()
    config = root / "cluster.toml"
    config.write_text(CLUSTER.format(root=root, python=sys.executable))
    # A fresh HOME: the daemon must install the agent itself before it can start it.
    env = environment(HOME=str(home))
    daemon = DaemonProcess(config, env=env)
    yield daemon, root, env
    daemon.stop(signal.SIGKILL)
    for pid in _agent_pids(root):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


def _agent_pids(root) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "-x", ".* -m agent"], capture_output=True, text=True).stdout
    pids = []
    for pid in out.split():
        try:
            if str(root) in os.readlink(f"/proc/{pid}/cwd"):
                pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_all_local_nodes_come_up_with_their_facts(local_cluster):
    daemon, root, env = local_cluster
    started = time.monotonic()
    daemon.start()
    doc = daemon.wait_for(all_up, 30, "all nodes up")
    assert time.monotonic() - started < 15
    for node in doc["nodes"]:
        facts = node["facts"]
        assert facts["user"] and facts["hostname"] and facts["os"] == "Linux"
        assert facts["python_version"] and facts["memory_bytes"] > 0
        assert facts["mlx_version"] and facts["mlx_lm_version"]
        assert facts["workdir"] == str(root / node["name"])
    # the agent was installed privately under the (daemon user's) home
    installed = list((root / "home" / ".coord" / "agent").iterdir())
    assert len(installed) == 1 and (installed[0] / "BUNDLE_ID").is_file()
    kinds = [event["kind"] for event in doc["events"]]
    assert "daemon.started" in kinds and kinds.count("node.up") == 2
    text = coord("status", "--config", str(daemon.config), env=env)
    assert text.returncode == 0
    assert "2/2 nodes up" in text.stdout and "a " in text.stdout and "recent events" in text.stdout


def test_a_killed_agent_is_back_up_within_10_s(local_cluster):
    daemon, root, env = local_cluster
    daemon.start()
    doc = daemon.wait_for(all_up, 30, "all nodes up")
    victim = next(n for n in doc["nodes"] if n["name"] == "b")
    os.kill(victim["agent"]["pid"], signal.SIGKILL)
    doc = daemon.wait_for(lambda d: node_states(d)["b"] != "up", 10, "b seen down")
    killed = time.monotonic()
    doc = daemon.wait_for(lambda d: all_up(d) and next(n for n in d["nodes"] if n["name"] == "b")["agent"]["pid"]
                          != victim["agent"]["pid"], 10, "b back up")
    assert time.monotonic() - killed < 10
    assert any(e["kind"] == "node.down" and e["node"] == "b" for e in doc["events"])


def test_the_control_socket_is_private_and_sigterm_removes_it(local_cluster):
    daemon, root, env = local_cluster
    daemon.start()
    daemon.wait_for(all_up, 30, "all nodes up")
    socket_path = root / "state" / "coord.sock"
    assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o700
    assert daemon.stop(signal.SIGTERM) == 0
    assert not socket_path.exists()
    events = coord("status", "--json", "--config", str(daemon.config), env=env)
    assert events.returncode == 2


def test_two_daemons_on_one_state_dir_refuse_and_a_stale_socket_is_cleaned(local_cluster):
    daemon, root, env = local_cluster
    daemon.start()
    daemon.wait_for(all_up, 30, "all nodes up")
    second = coord("daemon", "--config", str(daemon.config), env=env, timeout=30)
    assert second.returncode == 2
    assert "already running" in second.stderr
    daemon.stop(signal.SIGKILL)  # crash: the socket file stays behind
    assert (root / "state" / "coord.sock").exists()
    again = DaemonProcess(daemon.config, env=env).start()
    try:
        doc = again.wait_for(all_up, 30, "all nodes up under the new daemon")
        assert doc["daemon"]["pid"] == again.proc.pid
    finally:
        again.stop()


def test_status_without_a_daemon_says_how_to_start_it(tmp_path):
    env = environment()
    config = tmp_path / "c.toml"
    config.write_text(CLUSTER.format(root=short_tempdir(), python=sys.executable))
    result = coord("status", "--config", str(config), env=env)
    assert result.returncode == 2
    assert "coordd is not running" in result.stderr
    assert f"coord daemon --config {config}" in result.stderr
    result = coord("status", "--socket", str(tmp_path / "none.sock"), env=env)
    assert result.returncode == 2 and str(tmp_path / "none.sock") in result.stderr


def test_a_bad_cluster_file_is_refused_before_anything_starts(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[cluster]\nname = "x"\n[[nodes]]\nname = "a"\nhost = "local"\nworkdir = "/w"\nport = "22"\n')
    result = coord("daemon", "--config", str(config), env=environment())
    assert result.returncode == 2
    assert f"{config}:7: nodes[0].port must be an integer" in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_a_connection_from_another_uid_is_refused(local_cluster):
    daemon, root, env = local_cluster
    daemon.start()
    daemon.wait_for(all_up, 30, "all nodes up")
    socket_path = root / "state" / "coord.sock"
    # Open the file permissions on purpose: the uid check must still refuse.
    os.chmod(root, 0o755)
    os.chmod(socket_path.parent, 0o755)
    os.chmod(socket_path, 0o666)
    client = (
        "import socket\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"s.connect({str(socket_path)!r})\n"
        "s.settimeout(5)\n"
        "try:\n"
        "    s.sendall(bytes.fromhex('00000012') + bytes.fromhex('84a174a3726571a2696401a16da6737461747573'))\n"
        "    print('answered' if s.recv(100) else 'refused')\n"
        "except (BrokenPipeError, ConnectionResetError):\n"
        "    print('refused')\n"
    )
    result = subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", client],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "refused"  # closed without an answer
    assert "control connection refused" in daemon.log_file.read_text()
    ok = daemon.status()  # its owner is still served
    assert ok["summary"]["up"] == 2


def test_init_writes_an_example_that_the_daemon_accepts(tmp_path):
    path = tmp_path / "coord.toml"
    assert coord("init", str(path)).returncode == 0
    assert "[[nodes]]" in path.read_text()
    again = coord("init", str(path))
    assert again.returncode == 2 and "--force" in again.stderr


def test_help_explains_every_command():
    result = coord("--help")
    for word in ("status", "init", "daemon", "--config"):
        assert word in result.stdout
    status_help = coord("status", "--help").stdout
    assert "--json" in status_help and "--watch" in status_help
