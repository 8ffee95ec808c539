"""`coord drill` on the multi-host cluster: the fire drill over real SSH sessions (a rank killed, one
stopped, a node's link taken down by its agent through sudo), and the cluster left as it was (every
node's workdir, the daemon's jobs and events, no process, the link up)."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
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


@contextmanager
def sudo_for_ip(user: str):
    """``user`` may run ip as root without a password (a sudoers rule, as a user who wants --cut-node adds)."""
    rule = Path(f"/etc/sudoers.d/coord-drill-{user}")
    ip = shutil.which("ip")
    rule.write_text(f"{user} ALL=(root) NOPASSWD: {ip}\n")
    rule.chmod(0o440)
    try:
        yield
    finally:
        rule.unlink(missing_ok=True)


def test_a_drill_on_three_nodes_times_every_fault_and_leaves_the_cluster_as_it_was(netns_cluster):
    last = netns_cluster.nodes[-1]
    with tiny_project_and_daemon(netns_cluster) as setup, sudo_for_ip(last.user):
        workdirs = {spec.name: Path(netns_cluster.node(spec.name).workdir) for spec in netns_cluster.nodes}
        for workdir in workdirs.values():  # the user's own files, which a drill must leave as they are (names
            (workdir / "drill-test-own").mkdir()  # no other test's project has: the workdirs outlive this test)
            (workdir / "drill-test-own" / "notes.txt").write_text("mine\n")
        try:
            _drill_and_check(netns_cluster, setup, workdirs, last)
        finally:
            for workdir in workdirs.values():
                shutil.rmtree(workdir / "drill-test-own", ignore_errors=True)


def _drill_and_check(netns_cluster, setup: dict, workdirs: dict[str, Path], last) -> None:
    """The drill with every fault, its report, and the cluster as it was before it."""
    daemon = setup["daemon"]
    before = {name: tree(workdir) for name, workdir in workdirs.items()}
    done = coord("drill", "--config", str(daemon.config), "--json", "--cut-node", "--cut-seconds", "15",
                 env=daemon.env, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr + daemon.log_tail()
    report = json.loads(done.stdout)
    assert report["status"] == "ok" and report["restarts"] == 3 and len(report["nodes"]) == 3, report
    kill, stop, cut = report["faults"]
    assert (kill["rank"], stop["rank"], cut["signal"], cut["node"]) == (2, 0, "link down", last.name), report
    # The link was down 15 s: the run cannot train again before it is back.
    assert cut["resumed_seconds"] >= 15 and "lost" in cut["how"], cut
    up = netns_cluster.exec_in(last.name, ["ip", "-j", "link", "show", "dev", "eth0"]).stdout
    assert json.loads(up)[0]["operstate"] in ("UP", "UNKNOWN"), up
    for fault in (kill, stop, cut):
        assert 0 <= fault["detected_seconds"] < fault["resumed_seconds"] < 300, fault
        assert 0 <= fault["steps_lost"] <= fault["at_step"], fault

    assert {name: tree(workdir) for name, workdir in workdirs.items()} == before
    doc = daemon.status(events=10_000)
    assert not [job for job in doc["jobs"] if job["run_id"] == report["run_id"]], doc["jobs"]
    assert not [e for e in doc["events"] if (e.get("data") or {}).get("run") == report["run_id"]]
    assert not (setup["root"] / "state" / "jobs" / report["run_id"]).exists()
    assert ranks_left(netns_cluster) == {}
