"""coordd stopped and started again by its service manager while a job runs on the multi-host cluster.

The local test (tests/integration/test_service_stop.py) shows the managers' kill semantics on
ranks that are the daemon's own machine's processes. Here the ranks are on other hosts: mlx.launch
on the head holds one ssh session per node, and each node's rank lives under that session's
sshd. A stop that took the launcher or its ssh clients with it would hang those sessions up and
the ranks with them (the rank runner stops its rank on SIGHUP). So the daemon is started in the
head's namespace as each manager starts it (systemd: in a cgroup of the unit's own; launchd: a
session of its own), stopped exactly as the manager stops it with the shipped unit file or plist,
and started again: every node's rank must train on with no daemon at all, and the next daemon
re-attach to the same attempt and finish it without a restart.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.cluster.jobs import events, job_of
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir
from tests.integration.test_jobs_local import PLAIN
from tests.integration.test_service_stop import (
    UnitCgroup,
    cgroup2_mount,
    launchd_stop,
    plist_exit_timeout,
    systemd_stop,
    unit_kill_mode,
    unit_stop_timeout,
)

pytestmark = pytest.mark.cluster

STEPS = 150  # 0.1 s each: the job outlives a stop and a start of the daemon
JOB = "survivor-mh"


@pytest.fixture
def project_root(netns_cluster) -> Iterator[Path]:
    root = short_tempdir()
    root.chmod(0o755)
    project = root / "project"
    project.mkdir(mode=0o755)
    (project / "plain.py").write_text(PLAIN)
    (project / "plain.py").chmod(0o644)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def unit_cgroup() -> Iterator[UnitCgroup]:
    mount = cgroup2_mount()
    if mount is None:
        pytest.fail("no writable cgroup v2 hierarchy here: the multi-host cluster runs as root, which has one")
    cgroup = UnitCgroup(mount)
    yield cgroup
    cgroup.remove()


def _rank_file(netns_cluster, job: dict, rank: int, name: str) -> Path:
    node = netns_cluster.node(job["nodes"][rank])
    return Path(node.workdir) / ".coord" / "jobs" / job["run_id"] / "attempt-0" / f"rank-{rank}" / name


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _step(netns_cluster, job: dict) -> int:
    lines = _rank_file(netns_cluster, job, 0, "progress.jsonl").read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else 0


def _stop_and_reattach(netns_cluster, daemon: DaemonProcess, root: Path, stop: Callable[[], None],
                       start_again: Callable[[], None]) -> None:
    daemon.wait_for(all_up, 60, "all nodes up")
    submitted = coord("run", "--config", str(daemon.config), "--name", JOB, "--source", str(root / "project"),
                      "--save-every", "10", "--detach", "--", "python", "plain.py", "--steps", str(STEPS),
                      "--sleep", "0.1", env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    doc = daemon.wait_for(lambda d: job_of(d, JOB)["step"] >= 10, 300, "step 10")
    job = job_of(doc, JOB)
    assert len(job["nodes"]) == 3, job
    ranks = [int(_rank_file(netns_cluster, job, rank, "pid").read_text()) for rank in range(3)]
    assert all(map(_running, ranks)), ranks

    stop()
    assert daemon.proc is not None and daemon.proc.poll() is not None, "the daemon is still running"
    before = _step(netns_cluster, job)
    time.sleep(3)  # no daemon at all: every node's rank trains on, over the launcher's ssh sessions
    gone = {job["nodes"][rank]: pid for rank, pid in enumerate(ranks) if not _running(pid)}
    assert not gone, f"ranks died with the daemon: {gone}\n{daemon.log_tail()}"
    after = _step(netns_cluster, job)
    assert after > before, f"no step was trained without the daemon ({before} -> {after})"
    assert after < STEPS, "the job ended before the daemon was started again: nothing was re-attached"

    start_again()
    daemon.wait_for(all_up, 60, "all nodes up under the next daemon")
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), JOB, env=daemon.env, timeout=300)
    assert waited.stdout, waited.stderr
    final = json.loads(waited.stdout)
    story = "\n".join(e["message"] for e in events(daemon, JOB))
    assert waited.returncode == 0 and final["state"] == "succeeded", story
    assert final["attempt"] == 0 and final["restarts"] == 0 and final["step"] == STEPS, story
    assert "supervising attempt 0 again" in story, story


def test_systemctl_restart_on_the_head_leaves_every_nodes_rank_running(netns_cluster, project_root, unit_cgroup):
    """``systemctl restart coordd`` on the head, as the shipped unit's KillMode says: with KillMode=mixed
    the launcher and its ssh clients were SIGKILLed with the unit's other processes once coordd had
    exited, and every node's rank was hung up on."""
    config = netns_cluster.write_cluster_toml(project_root / "cluster.toml", state_dir=project_root / "state")
    prefix = [*unit_cgroup.enter_prefix(), "ip", "netns", "exec", netns_cluster.head_ns]
    daemon = DaemonProcess(config, env=environment(), prefix=prefix, own_session=True)
    kill_mode, timeout = unit_kill_mode(), unit_stop_timeout()

    def start_in_unit() -> None:
        daemon.start()
        assert daemon.proc is not None
        deadline = time.monotonic() + 10
        while daemon.proc.pid not in unit_cgroup.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemon.proc.pid in unit_cgroup.pids(), "the daemon did not enter the unit's cgroup"

    try:
        start_in_unit()
        _stop_and_reattach(netns_cluster, daemon, project_root,
                           lambda: systemd_stop(daemon, unit_cgroup, kill_mode, timeout), start_in_unit)
    finally:
        daemon.stop()


def test_launchctl_kickstart_k_on_the_head_leaves_every_nodes_rank_running(netns_cluster, project_root):
    """``launchctl kickstart -k``: SIGTERM to coordd, then SIGKILL to what is left of its process group;
    the launcher's session of its own keeps it and its ssh clients out of that group."""
    config = netns_cluster.write_cluster_toml(project_root / "cluster.toml", state_dir=project_root / "state")
    daemon = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", netns_cluster.head_ns],
                           own_session=True)
    try:
        daemon.start()
        _stop_and_reattach(netns_cluster, daemon, project_root,
                           lambda: launchd_stop(daemon, plist_exit_timeout()), daemon.start)
    finally:
        daemon.stop()
