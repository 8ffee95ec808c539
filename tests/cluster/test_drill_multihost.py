"""`coord drill` on the multi-host cluster: the fire drill over real SSH sessions, and the cluster
left as it was (every node's workdir, the daemon's jobs and events, no process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster.jobs import ranks_left, tiny_project_and_daemon
from tests.integration.daemon_harness import coord

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]


def tree(directory: Path) -> dict[str, tuple[str, int]]:
    """Every path under ``directory`` with its kind and mode; the node's own caches left out (MLX's
    compiled kernels, the sync's hashes of the workdir's files, and .coord that holds them): kept on purpose,
    as after any job."""
    found = {}
    for path in sorted(directory.rglob("*")):
        rel = str(path.relative_to(directory))
        if rel in (".coord", ".coord/hashcache.json") or rel.startswith(".coord/tmp"):
            continue
        found[rel] = ("dir" if path.is_dir() else path.read_bytes()[:32].hex(), path.stat().st_mode)
    return found


def test_a_drill_on_three_nodes_times_both_faults_and_leaves_the_cluster_as_it_was(netns_cluster):
    with tiny_project_and_daemon(netns_cluster) as setup:
        daemon = setup["daemon"]
        workdirs = {spec.name: Path(netns_cluster.node(spec.name).workdir) for spec in netns_cluster.nodes}
        for name, workdir in workdirs.items():  # the user's own files, which a drill must leave as they are
            (workdir / "model").mkdir(exist_ok=True)
            (workdir / "model" / "config.json").write_text('{"mine": true}\n')
            (workdir / "notes.txt").write_text(f"node {name}\n")
        before = {name: tree(workdir) for name, workdir in workdirs.items()}
        done = coord("drill", "--config", str(daemon.config), "--json", env=daemon.env, timeout=900)
        assert done.returncode == 0, done.stdout + done.stderr + daemon.log_tail()
        report = json.loads(done.stdout)
        assert report["status"] == "ok" and report["restarts"] == 2 and len(report["nodes"]) == 3, report
        kill, stop = report["faults"]
        assert (kill["rank"], stop["rank"]) == (2, 0), report
        for fault in (kill, stop):
            assert 0 <= fault["detected_seconds"] < fault["resumed_seconds"] < 300, fault
            assert 0 <= fault["steps_lost"] <= fault["at_step"], fault

        assert {name: tree(workdir) for name, workdir in workdirs.items()} == before
        doc = daemon.status(events=10_000)
        assert not [job for job in doc["jobs"] if job["run_id"] == report["run_id"]], doc["jobs"]
        assert not [e for e in doc["events"] if (e.get("data") or {}).get("run") == report["run_id"]]
        assert not (setup["root"] / "state" / "jobs" / report["run_id"]).exists()
        assert ranks_left(netns_cluster) == {}
