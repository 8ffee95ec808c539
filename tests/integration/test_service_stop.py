"""coordd stopped and started again the way its service managers do it, with a job running.

systemd (``systemctl --user restart coordd``) and launchd (``launchctl kickstart -k``, or
``bootout`` and ``bootstrap``) are not running here, so each is done by hand, exactly as the
manager does it for the shipped unit file and plist: the daemon is started as the manager starts
it (a session of its own; for systemd, in a cgroup of its own, as the unit's), stopped with the
signals the manager sends to the processes it sends them to, and started again. The job's
ranks must run on through it, and the next daemon re-attach to them and see the job to its end
without a restart.
"""

from __future__ import annotations

import contextlib
import json
import os
import plistlib
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.daemon_harness import REPO, DaemonProcess, all_up, coord, environment, short_tempdir
from tests.integration.test_jobs_local import CLUSTER, PLAIN

UNIT = REPO / "deploy" / "systemd" / "coordd.service"
PLIST = REPO / "deploy" / "launchd" / "com.coord.coordd.plist"
STEPS = 100  # 0.1 s each: the job outlives a stop and a start of the daemon
JOB = "survivor"


# --- what the service files say --------------------------------------------------


def unit_service_settings() -> dict[str, str]:
    settings: dict[str, str] = {}
    section = None
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line:
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


def unit_kill_mode() -> str:
    return unit_service_settings().get("KillMode", "control-group")  # systemd's default


def unit_stop_timeout() -> float:
    value = unit_service_settings().get("TimeoutStopSec", "90")
    return float(value.removesuffix("s"))


def plist_exit_timeout() -> float:
    return float(plistlib.loads(PLIST.read_bytes()).get("ExitTimeOut", 20))


# --- a cgroup of the unit's own ----------------------------------------------------


def cgroup2_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (the whole /sys/fs/cgroup, or the "unified" one of a
    hybrid set-up), when this process may make cgroups in it."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and fields[2] == "cgroup2" and os.access(fields[1], os.W_OK):
                return Path(fields[1])
    return None


class UnitCgroup:
    """A child cgroup standing for coordd.service's: every process the daemon starts is in it, as it
    is in the unit's, whatever session or process group it makes for itself."""

    def __init__(self, parent: Path):
        self.path = parent / f"coord-test-{os.getpid()}-{uuid.uuid4().hex[:8]}.service"
        self.path.mkdir()

    def pids(self) -> list[int]:
        return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]

    def enter_prefix(self) -> list[str]:
        """An argv prefix that moves the process into this cgroup before it execs the rest, as systemd
        moves a unit's process before its exec."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs")]

    def signal_all(self, sig: int) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill_all(self, deadline_s: float = 10) -> None:
        """SIGKILL to everything in it until it is empty, as systemd's kill of a control group (a process
        may fork while it is read)."""
        deadline = time.monotonic() + deadline_s
        while self.pids() and time.monotonic() < deadline:
            self.signal_all(signal.SIGKILL)
            time.sleep(0.1)

    def remove(self) -> None:
        self.kill_all()
        with contextlib.suppress(OSError):
            self.path.rmdir()


# --- the managers' stops -------------------------------------------------------------


def systemd_stop(daemon: DaemonProcess, cgroup: UnitCgroup, kill_mode: str, timeout: float) -> None:
    """``systemctl stop`` of a unit of this KillMode (systemd's service_enter_signal): SIGTERM to the
    main process (with control-group, to every process of the unit), up to TimeoutStopSec for it to
    exit, then SIGKILL: with process to the main process only (if it is still there), with mixed and
    control-group to every process still in the unit's cgroup."""
    assert daemon.proc is not None
    if kill_mode == "none":
        return
    if kill_mode == "control-group":
        cgroup.signal_all(signal.SIGTERM)
        cgroup.signal_all(signal.SIGCONT)
    else:
        daemon.proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        daemon.proc.wait(timeout)
    if kill_mode == "process":
        if daemon.proc.poll() is None:
            daemon.proc.kill()
    else:
        cgroup.kill_all()
    daemon.proc.wait(10)


def launchd_stop(daemon: DaemonProcess, exit_timeout: float) -> None:
    """``launchctl bootout`` (or the stop half of ``kickstart -k``): SIGTERM to the job's process, SIGKILL
    after ExitTimeOut, and once it has exited, SIGKILL to whatever is left in its process group, as
    launchd does unless the plist sets AbandonProcessGroup (done here whatever the plist says: a
    plist without the key must not cost the job either)."""
    assert daemon.proc is not None
    pgid = daemon.proc.pid  # launchd starts a job as the leader of a session of its own
    daemon.proc.send_signal(signal.SIGTERM)
    try:
        daemon.proc.wait(exit_timeout)
    except subprocess.TimeoutExpired:
        daemon.proc.kill()
        daemon.proc.wait(10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


# --- the job ------------------------------------------------------------------------


@pytest.fixture
def job_root() -> Iterator[Path]:
    root = short_tempdir()
    (root / "project").mkdir()
    (root / "project" / "plain.py").write_text(PLAIN)
    for node in ("a", "b"):
        (root / node).mkdir()
    (root / "cluster.toml").write_text(CLUSTER.format(root=root))
    yield root
    for pid in _rank_groups(root):  # a rank a failed test left behind (only one of this test's own)
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(root)):
                os.killpg(pid, signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def unit_cgroup() -> Iterator[UnitCgroup]:
    mount = cgroup2_mount()
    if mount is None:
        pytest.skip("no writable cgroup v2 hierarchy here (needs root, or a delegated cgroup)")
    cgroup = UnitCgroup(mount)
    yield cgroup
    cgroup.remove()


def _rank_groups(root: Path) -> list[int]:
    """Each rank's process group (its pid file), of every run and attempt under root."""
    return [int(path.read_text()) for path in root.glob("*/.coord/jobs/*/attempt-*/rank-*/pid")]


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait a while for its reaper here)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _progress_step(root: Path, node: str, run_id: str) -> int:
    path = root / node / ".coord" / "jobs" / run_id / "attempt-0" / "rank-0" / "progress.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


def _agents(pids: list[int]) -> list[int]:
    """Which of pids are node agents (``python -m agent``)."""
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[-3:-1] == [b"-m", b"agent"]:
                found.append(pid)
    return found


def _job(daemon: DaemonProcess) -> dict:
    return next(j for j in daemon.status()["jobs"] if j["name"] == JOB)


def stop_and_reattach(daemon: DaemonProcess, root: Path, stop: Callable[[], None],
                      start_again: Callable[[], None]) -> None:
    """Start the job, stop the daemon with ``stop`` mid-run, check the ranks run on alone, start a daemon
    again and check it carries the same attempt to the end."""
    daemon.wait_for(all_up, 30, "all nodes up")
    submitted = coord("run", "--config", str(daemon.config), "--name", JOB, "--source", str(root / "project"),
                      "--save-every", "5", "--detach", "--", "python", "plain.py", "--steps", str(STEPS),
                      "--sleep", "0.1", env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    daemon.wait_for(lambda d: any(j["name"] == JOB and j["step"] >= 5 for j in d["jobs"]), 300, "step 5")
    job = _job(daemon)
    ranks = _rank_groups(root)
    assert len(ranks) == 2 and all(map(_running, ranks)), ranks

    stop()
    assert daemon.proc is not None and daemon.proc.poll() is not None, "the daemon is still running"
    before = _progress_step(root, job["nodes"][0], job["run_id"])
    time.sleep(2)  # no daemon at all: the ranks train on
    gone = [pid for pid in ranks if not _running(pid)]
    assert not gone, f"ranks {gone} died with the daemon\n{daemon.log_tail()}"
    after = _progress_step(root, job["nodes"][0], job["run_id"])
    assert after > before, f"no step was trained without the daemon ({before} -> {after})"
    assert after < STEPS, "the job ended before the daemon was started again: nothing was re-attached"

    start_again()
    daemon.wait_for(all_up, 30, "all nodes up under the next daemon")
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), JOB, env=daemon.env, timeout=300)
    assert waited.stdout, waited.stderr
    final = json.loads(waited.stdout)
    events = json.loads(coord("status", "--json", "--events", "200", "--config", str(daemon.config),
                              env=daemon.env).stdout)["events"]
    story = "\n".join(e["message"] for e in events if e["message"].startswith(JOB + ":"))
    assert waited.returncode == 0 and final["state"] == "succeeded", story
    assert final["attempt"] == 0 and final["restarts"] == 0 and final["step"] == STEPS, story
    assert "supervising attempt 0 again" in story, story


def test_systemctl_restart_under_the_units_kill_mode_leaves_the_job_running(job_root, unit_cgroup):
    """``systemctl --user restart coordd``: stop as the unit's KillMode says, then a new main process in
    the same cgroup. With KillMode=mixed (as shipped before) the launcher, its ssh connections and the
    local ranks are SIGKILLed with the unit's other processes once coordd has exited."""
    kill_mode, timeout = unit_kill_mode(), unit_stop_timeout()
    daemon = DaemonProcess(job_root / "cluster.toml", env=environment(), prefix=unit_cgroup.enter_prefix(),
                           own_session=True)

    def stop() -> None:
        systemd_stop(daemon, unit_cgroup, kill_mode, timeout)
        # What is left in the unit are the job's processes; the old daemon's local agents leave by
        # themselves once its end of their pipes has closed.
        deadline = time.monotonic() + 15
        while _agents(unit_cgroup.pids()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _agents(unit_cgroup.pids()), "the old daemon's agents stayed in the unit"

    def start_in_unit() -> None:
        daemon.start()
        assert daemon.proc is not None
        deadline = time.monotonic() + 10
        while daemon.proc.pid not in unit_cgroup.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemon.proc.pid in unit_cgroup.pids(), "the daemon did not enter the unit's cgroup"

    try:
        start_in_unit()
        stop_and_reattach(daemon, job_root, stop, start_in_unit)
    finally:
        daemon.stop()


def test_launchctl_kickstart_k_with_the_process_group_kill_leaves_the_job_running(job_root):
    """``launchctl kickstart -k``: SIGTERM to coordd, then (without AbandonProcessGroup) SIGKILL to its
    process group, then a new coordd. The launcher's own session keeps it, and the ranks under it, out
    of that group."""
    timeout = plist_exit_timeout()
    daemon = DaemonProcess(job_root / "cluster.toml", env=environment(), own_session=True)
    try:
        daemon.start()
        stop_and_reattach(daemon, job_root, lambda: launchd_stop(daemon, timeout), daemon.start)
    finally:
        daemon.stop()
