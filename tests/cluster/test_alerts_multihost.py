"""Alerts from a daemon in the head namespace of the three-node cluster: a job that fails on
every node is posted to a webhook, and a node whose link is cut is alerted as down once it has
been down longer than its threshold."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.daemon_harness import REPO, DaemonProcess, all_up, coord, environment, short_tempdir

pytestmark = pytest.mark.cluster

ALERTS = """
[[alerts]]
name = "hook"
webhook = "http://127.0.0.1:{port}/hook/s3cr3t"
on = ["job_failed", "node_down"]
node_down_minutes = 0.1
"""


def posted(out: Path) -> list[dict]:
    if not out.exists():
        return []
    return [json.loads(json.loads(line)["body"]) for line in out.read_text().splitlines()]


def wait_for_post(out: Path, predicate, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [alert for alert in posted(out) if predicate(alert)]
        if found:
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no {what} posted within {timeout} s; posted: {posted(out)}")


def test_a_failed_job_and_a_node_down_are_posted_to_a_webhook_from_the_head(netns_cluster):
    root = short_tempdir()
    head = ["ip", "netns", "exec", netns_cluster.head_ns]
    # The receiver listens on the head namespace's own loopback, where the daemon is.
    receiver = subprocess.Popen([*head, sys.executable, "-m", "tests.receiver", "--port-file", str(root / "port"),
                                 "--out", str(root / "posted.jsonl")], cwd=REPO, env=environment())
    daemon = None
    try:
        deadline = time.monotonic() + 30
        while not (root / "port").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        config = netns_cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state")
        config.write_text(config.read_text() + ALERTS.format(port=(root / "port").read_text()))
        daemon = DaemonProcess(config, env=environment(), prefix=head).start()
        daemon.wait_for(all_up, 60, "all nodes up")

        submitted = coord("run", "--config", str(config), "--name", "broken", "--max-restarts", "0", "--detach",
                          "--", "python", "-c", "import sys; sys.exit(1)", env=daemon.env)
        assert submitted.returncode == 0, submitted.stderr
        waited = coord("wait", "--quiet", "--json", "--config", str(config), "broken", env=daemon.env, timeout=300)
        final = json.loads(waited.stdout)
        assert waited.returncode == 1 and final["state"] == "failed", final
        alert = wait_for_post(root / "posted.jsonl", lambda a: a["event"] == "job_failed", 30, "job_failed")
        assert (alert["job"], alert["run_id"], alert["reason"]) == ("broken", final["run_id"], final["error"])

        netns_cluster.cut_link("n2")
        try:
            cut = time.time()
            down = wait_for_post(root / "posted.jsonl", lambda a: a["event"] == "node_down", 60, "node_down")
            assert down["node"] == "n2" and down["details"]["down_since"] >= cut - 1, down
            # no sooner than its threshold (6 s) after the daemon saw it down
            assert down["timestamp"] - down["details"]["down_since"] > 6, down
        finally:
            netns_cluster.restore_link("n2")
        daemon.wait_for(all_up, 60, "n2 back up")
        assert [a["event"] for a in posted(root / "posted.jsonl")] == ["job_failed", "node_down"]
    finally:
        if daemon is not None:
            daemon.stop()
        receiver.terminate()
        receiver.wait(10)
        shutil.rmtree(root, ignore_errors=True)
