"""`coord drill` on a local cluster: a real job, a rank killed and one stopped, each recovery timed,
and nothing of the drill left behind (the nodes' own files untouched)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir

CLUSTER = """\
[cluster]
name = "drill-local"
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
workdir = "{root}/b"
"""


def tree(directory: Path) -> dict[str, str]:
    """Every path under ``directory`` with its content's first bytes (a file) or "dir"; the node's own caches
    left out, kept on purpose as after any job: MLX's compiled kernels (.coord/tmp) and the sync's hashes
    of the workdir's files (.coord/hashcache.json)."""
    found = {}
    for path in sorted(directory.rglob("*")):
        rel = str(path.relative_to(directory))
        if rel.startswith(".coord/tmp") or rel == ".coord/hashcache.json":
            continue
        found[rel] = "dir" if path.is_dir() else path.read_bytes()[:64].hex()
    return found


@pytest.fixture(scope="module")
def cluster():
    root = short_tempdir()
    for node in ("a", "b"):  # the user's own files in each workdir, which a drill must leave as they are
        (root / node / "model").mkdir(parents=True)
        (root / node / "model" / "config.json").write_text('{"mine": true}\n')
        (root / node / "notes.txt").write_text(f"node {node}\n")
    config = root / "cluster.toml"
    config.write_text(CLUSTER.format(root=root))
    daemon = DaemonProcess(config, env=environment()).start()
    daemon.wait_for(all_up, 30, "all nodes up")
    yield daemon, root
    daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_a_drill_times_a_killed_and_a_stopped_rank_and_leaves_nothing_behind(cluster):
    daemon, root = cluster
    before = {node: tree(root / node) for node in ("a", "b")}
    jobs_before = set(os.listdir(root / "state" / "jobs")) if (root / "state" / "jobs").exists() else set()
    done = coord("drill", "--config", str(daemon.config), "--json", env=daemon.env, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr + daemon.log_tail()
    report = json.loads(done.stdout)
    assert report["status"] == "ok" and report["restarts"] == 2, report
    kill, stop = report["faults"]
    assert (kill["signal"], kill["rank"], stop["signal"], stop["rank"]) == ("SIGKILL", 1, "SIGSTOP", 0), report
    for fault in (kill, stop):
        assert fault["detected_seconds"] is not None and fault["resumed_seconds"] is not None, fault
        assert 0 <= fault["detected_seconds"] < fault["resumed_seconds"] < 300, fault
        assert fault["steps_lost"] is not None and 0 <= fault["steps_lost"] <= fault["at_step"], fault
    assert "rank 1" in kill["how"] and "hung" in stop["how"], report
    assert kill["at_step"] >= 20 and report["step_seconds"] > 0 and report["cold_launch_seconds"] > 0, report
    assert report["left_behind"] == {}, report

    # Nothing of it is left: the nodes' trees as they were, no run directory on the head, no job, no event.
    after = {node: tree(root / node) for node in ("a", "b")}
    for node in ("a", "b"):
        assert after[node] == before[node], (node, sorted(set(after[node]) ^ set(before[node])))
    assert set(os.listdir(root / "state" / "jobs")) == jobs_before
    doc = daemon.status(events=10_000)
    assert not [job for job in doc["jobs"] if job["name"].startswith("drill-")], doc["jobs"]
    assert not [e for e in doc["events"] if (e.get("data") or {}).get("run") == report["run_id"]]
    every = json.loads(coord("status", "--config", str(daemon.config), "--json", "--all", env=daemon.env).stdout)
    assert not [job for job in every["jobs"] if job["run_id"] == report["run_id"]]
    left = subprocess.run(["pgrep", "-f", f"rank_runner --dir {root}"], capture_output=True, text=True).stdout
    assert left.strip() == ""


def test_a_drill_is_refused_on_one_node_and_on_a_node_it_does_not_know(cluster):
    daemon, _ = cluster
    one = coord("drill", "--config", str(daemon.config), "--nodes", "a", env=daemon.env)
    assert one.returncode == 2 and "a drill needs 2 nodes" in one.stderr, one.stderr
    unknown = coord("drill", "--config", str(daemon.config), "--nodes", "a,zz", env=daemon.env)
    assert unknown.returncode == 2 and "no node named zz" in unknown.stderr, unknown.stderr
