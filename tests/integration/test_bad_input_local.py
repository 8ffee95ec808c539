"""Bad input met by a real daemon: a node that has never been up is reported at submit with its
connection error; a submission over the control socket is checked as the CLI checks it, and nothing
is started when it is refused; a wait for nodes says what it waits for and ends at --node-wait; and
a rank's coloured output reaches the events, coord status, the dashboard and an alert as plain text.

The cluster: one local node (``a``), one whose SSH port is closed (``never``: never up, with an
error at once) and one whose port accepts and never answers (``slow``: connecting, for as long as
the test lasts)."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import stat
import time
import unicodedata
import urllib.request
from pathlib import Path

import pytest

from tests.integration.daemon_harness import DaemonProcess, coord, environment, short_tempdir

TOKEN = "bad-input-test-token-0123456789"

CLUSTER = """\
[cluster]
name = "bad-input"
state_dir = "{root}/state"

[ssh]
keepalive_s = 0.5
connect_timeout_s = 600

[dashboard]
listen = "127.0.0.1:0"
token = "{token}"

[[nodes]]
name = "a"
host = "local"
workdir = "{root}/a"

[[nodes]]
name = "never"
host = "127.0.0.1"
port = {closed}
python = "/usr/bin/python3"
workdir = "/tmp/never"

[[nodes]]
name = "slow"
host = "127.0.0.1"
port = {silent}
python = "/usr/bin/python3"
workdir = "/tmp/slow"

[[alerts]]
name = "script"
command = ["{root}/notify"]
on = ["job_failed"]
"""

NOTIFY = """\
#!/bin/sh
cat >> "{root}/alerts.jsonl"
"""

# A rank that writes for a terminal: colours, a window title, a bell, then a known failure whose
# words the colours split, and exits 3.
COLOURFUL = (
    "import sys\n"
    "print('\\x1b[38;5;244mstep 1\\x1b[0m loss 2.0', flush=True)\n"
    "print('\\x1b]0;my title\\x07\\x1b[31m[METAL] Command buffer execution failed: Caused GPU "
    "\\x1b[1mTimeout\\x1b[22m Error\\x1b[0m\\x07', flush=True)\n"
    "sys.exit(3)\n")
SHOWN = "[METAL] Command buffer execution failed: Caused GPU Timeout Error"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _clean(text: str) -> bool:
    return not any(unicodedata.category(c) == "Cc" and c not in "\n" for c in text)


@pytest.fixture(scope="module")
def cluster():
    root = short_tempdir()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections (the kernel completes them) and never says a word
    notify = root / "notify"
    notify.write_text(NOTIFY.format(root=root))
    notify.chmod(notify.stat().st_mode | stat.S_IXUSR)
    config = root / "cluster.toml"
    config.write_text(CLUSTER.format(root=root, token=TOKEN, closed=_free_port(), silent=silent.getsockname()[1]))
    daemon = DaemonProcess(config, env=environment()).start()
    try:
        doc = daemon.wait_for(lambda d: {n["name"]: n["state"] for n in d["nodes"]}.get("a") == "up" and
                              {n["name"]: n["state"] for n in d["nodes"]}.get("never") == "down", 60,
                              "a up and never down")
        assert {n["name"]: n["state"] for n in doc["nodes"]}["slow"] == "connecting", doc["nodes"]
        yield daemon, root, doc["dashboard"]["url"]
    finally:
        daemon.stop()
        silent.close()
        shutil.rmtree(root, ignore_errors=True)


def test_a_node_never_up_is_reported_at_submit_with_its_connection_error(cluster):
    daemon, _, _ = cluster
    started = time.monotonic()
    refused = coord("run", "--config", str(daemon.config), "--name", "all", "--", "python", "-c", "pass",
                    env=daemon.env)
    assert refused.returncode == 2 and time.monotonic() - started < 20, refused.stderr
    assert "node never has not been up since coordd started: cannot connect to 127.0.0.1:" in refused.stderr
    assert "--nodes a,slow" in refused.stderr and "submitted" not in refused.stdout
    assert not [j for j in daemon.status()["jobs"] if j["name"] == "all"]


def test_the_control_socket_checks_a_submission_as_the_cli_does_and_starts_nothing(cluster):
    daemon, root, _ = cluster
    from coordinator.config.cluster_file import load_config
    from coordinator.control.server import call_daemon
    from shared.rpc import RemoteError

    (root / "train.py").write_text("")
    socket_path = load_config(daemon.config).socket
    base = {"name": "wire", "command": ["python", "train.py"], "nodes": ["a"]}
    for fields, words in (
        ({"source": str(root / "no-such-dir")}, "no such directory on the head"),
        ({"source": str(root / "train.py")}, "not a directory"),
        ({"save_every": float("nan")}, "--save-every must be a whole number"),
        ({"hang_timeout": float("inf")}, "--hang-timeout must be a number of seconds"),
        ({"node_wait": -1}, "--node-wait must be a number of seconds"),
        ({"priority": "high"}, "--priority must be a whole number"),
        ({"speed": 3}, "unknown field 'speed'"),
        ({"nodes": ["a", "zz"]}, "--nodes names zz, not a node of this cluster"),
    ):
        with pytest.raises(RemoteError) as refused:
            asyncio.run(call_daemon(socket_path, "run", {"spec": {**base, **fields}, "resume": False}))
        assert refused.value.code == "bad_args" and words in refused.value.message, refused.value.message
    assert not [j for j in daemon.status()["jobs"] if j["name"] == "wire"]
    # the same through the CLI: refused before the daemon is asked, naming the option
    cli = coord("run", "--config", str(daemon.config), "--nodes", "a", "--source", str(root / "train.py"), "--",
                "python", "train.py", env=daemon.env)
    assert cli.returncode == 2 and "argument --source" in cli.stderr and "not a directory" in cli.stderr


def test_a_wait_for_nodes_says_what_it_waits_for_and_ends_at_node_wait(cluster):
    daemon, _, _ = cluster
    started = time.monotonic()
    run = coord("run", "--config", str(daemon.config), "--name", "waits", "--nodes", "a,slow", "--node-wait", "3",
                "--", "python", "-c", "pass", env=daemon.env, timeout=120)
    assert run.returncode == 1 and time.monotonic() - started < 60, run.stdout + run.stderr
    assert "waiting for nodes, " in run.stdout and "of at most 3 s (--node-wait): slow: not up yet" in run.stdout
    assert "gave up waiting for nodes: not up within --node-wait 3 s: waiting for slow to be up; slow: " in run.stdout
    events = [e["message"] for e in daemon.status()["events"] if e["message"].startswith("waits:")]
    assert any("waiting for slow to be up" in m and "--node-wait" in m for m in events), events


def test_a_ranks_colours_reach_no_event_status_dashboard_or_alert(cluster):
    daemon, root, url = cluster
    submitted = coord("run", "--config", str(daemon.config), "--name", "colours", "--nodes", "a", "--max-restarts",
                      "0", "--detach", "--", "python", "-c", COLOURFUL, env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), "colours", env=daemon.env,
                   timeout=300)
    final = json.loads(waited.stdout)
    assert final["state"] == "failed" and f"exited with status 3: {SHOWN}" in final["error"], final
    assert [d["line"] for d in final["diagnoses"] if d.get("line")] == [SHOWN]
    # the raw log keeps every byte the rank wrote
    raw = coord("logs", "--config", str(daemon.config), "colours", env=daemon.env).stdout
    assert "\x1b[31m" in raw and "\x07" in raw

    # events
    doc = json.loads(coord("status", "--json", "--events", "200", "--config", str(daemon.config),
                           env=daemon.env).stdout)
    messages = [e["message"] for e in doc["events"] if e["message"].startswith("colours:")]
    assert any(SHOWN in m for m in messages) and all(_clean(m) for m in messages), messages
    # coord status, as a person reads it
    shown = coord("status", "--events", "200", "--config", str(daemon.config), env=daemon.env).stdout
    assert SHOWN in shown and _clean(shown), shown
    # the dashboard's document
    request = urllib.request.Request(url + "api/dashboard", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        body = answer.read().decode()
    dashboard = json.loads(body)
    job = next(j for j in dashboard["jobs"] if j["name"] == "colours")
    assert SHOWN in job["error"] and _clean(job["error"]) and [d["line"] for d in job["diagnoses"]] == [SHOWN], job
    assert "\\u001b" not in body and "\\u0007" not in body
    # the alert, as the command got it on its stdin
    alerts = root / "alerts.jsonl"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (alerts.exists() and "colours" in alerts.read_text()):
        time.sleep(0.2)
    sent = [json.loads(line) for line in alerts.read_text().splitlines()]
    failed = next(a for a in sent if a["job"] == "colours")
    assert SHOWN in failed["reason"] and _clean(failed["reason"]), failed
    assert "\\u001b" not in Path(alerts).read_text()
