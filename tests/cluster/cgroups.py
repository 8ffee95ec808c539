"""A cgroup CPU quota for a rank's processes on the multi-host cluster (its nodes share this machine's
CPUs: a quota makes one node's rank slower than the others'). This machine's CPU controller may be
cgroup v1's (``cpu.cfs_quota_us``) or v2's (``cpu.max``); both are handled alike."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")


def cpu_controller() -> tuple[str, Path] | None:
    controllers = CGROUP_V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return "v2", CGROUP_V2
    if (CGROUP_V1 / "cpu.cfs_quota_us").exists():
        return "v1", CGROUP_V1
    return None


def rank_processes(pgid: int) -> list[int]:
    """The rank's processes: its process group (the rank's pid leads it)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 2 and int(fields[2]) == pgid:
            found.append(int(entry))
    return found


def show_cgroups_to(pid: int, version: str) -> None:
    """Mount the CPU controller where a Linux host has it, in the mount namespace of ``pid`` (a node's
    rank, so its agent's too): ``ip netns exec`` mounts a sysfs of its own for each node, without
    /sys/fs/cgroup, which a real node has."""
    if version == "v2":
        script = "mountpoint -q /sys/fs/cgroup || mount -t cgroup2 none /sys/fs/cgroup"
    else:
        script = ("mountpoint -q /sys/fs/cgroup/cpu || { mountpoint -q /sys/fs/cgroup || "
                  "mount -t tmpfs cgroup_root /sys/fs/cgroup; mkdir -p /sys/fs/cgroup/cpu && "
                  "mount -t cgroup -o cpu cgroup /sys/fs/cgroup/cpu; }")
    done = subprocess.run(["nsenter", "-t", str(pid), "-m", "--", "sh", "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def cgroup_of(pid: int, version: str) -> str:
    """The CPU cgroup ``pid`` is in, relative to the controller's root ("/" for the root)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (version == "v2" and controllers == "") or (version == "v1" and "cpu" in controllers.split(",")):
            return path
    return "/"


class Quota:
    """A cgroup with a CPU quota, the rank's processes moved in; lifted (the processes back where they
    were: left in a cgroup of their own, a rank's threads would share one entity's CPU time against
    every other process's, and stay slow), and removed at the end."""

    def __init__(self, cores: float) -> None:
        controller = cpu_controller()
        assert controller is not None
        self.version, root = controller
        self.path = root / f"coord-straggler-test-{os.getpid()}"
        self.root = root
        self.path.mkdir()
        self.origins: dict[int, str] = {}
        self.set(cores)

    def set(self, cores: float | None) -> None:
        if self.version == "v2":
            (self.path / "cpu.max").write_text("max 100000" if cores is None else f"{int(cores * 100000)} 100000")
        else:
            (self.path / "cpu.cfs_period_us").write_text("100000")
            (self.path / "cpu.cfs_quota_us").write_text("-1" if cores is None else str(int(cores * 100000)))

    def take(self, pids: list[int]) -> None:
        for pid in pids:
            self.origins[pid] = cgroup_of(pid, self.version)
            (self.path / "cgroup.procs").write_text(str(pid))

    def lift(self) -> None:
        """No quota, and the processes back in the cgroups they came from."""
        self.set(None)
        for pid in (self.path / "cgroup.procs").read_text().split():
            origin = self.root / self.origins.get(int(pid), "/").lstrip("/")
            with contextlib.suppress(OSError):  # gone meanwhile
                (origin / "cgroup.procs").write_text(pid)

    def remove(self) -> None:
        self.lift()
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


HOG = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def start_cpu_hog(directory: Path, cpu: int) -> subprocess.Popen:
    """A busy loop of another user (nobody) pinned to ``cpu``, ahead of the ranks there: nice -15, set as root
    before it drops to nobody, in a session (so a Linux autogroup) of its own whose weight is set too (a
    process's own nice does not change its autogroup's weight against the ranks' session). Its script is
    ``directory/straggler_hog.py``; the system's Python runs it (the tests' own may live where nobody may not
    go). Running when returned; the caller kills it."""
    script = directory / "straggler_hog.py"
    script.write_text(HOG)
    script.chmod(0o644)
    hog = subprocess.Popen(["nice", "-n", "-15", "setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                            "/usr/bin/python3", str(script), str(cpu)], start_new_session=True)
    autogroup = Path(f"/proc/{hog.pid}/autogroup")
    if autogroup.exists():
        autogroup.write_text("-15")
    time.sleep(1)
    assert hog.poll() is None, "the hog did not start"
    return hog
