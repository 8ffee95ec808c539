"""What may slow a rank down on its node, sampled over a second when coord has named it a straggler:
the CPU its processes used against the wall clock, the other processes busiest on the node (pid,
user, command), a CPU quota's throttling (the cgroup of the rank's process: v2 ``cpu.max`` and
``cpu.stat`` throttled_usec, or v1 ``cpu.cfs_quota_us`` and ``throttled_time``, its own group and
those above it), memory pressure and swap-ins, a Mac's thermal speed limit (``pmset -g therm``) and
the GPU's utilisation where a user may read it (``ioreg`` on a Mac, ``nvidia-smi`` on Linux).

Asked only for a rank coord names (``coordinator/jobs/straggler.py``), never for every rank on
every poll, so a healthy job pays nothing for it. What the numbers mean is decided on the head
(``coordinator/jobs/straggler_cause.py``). Stdlib only: it runs with the node's Python."""

from __future__ import annotations

import os
import platform
import pwd
import shutil
import time
from typing import TYPE_CHECKING

from agent import proc_cpu, proc_state, signal_parsers, usage_parsers
from agent.facts import read_text, run_command
from agent.ranks import rank_dir
from shared.text import clean_excerpt

if TYPE_CHECKING:
    from shared.agent_api.ranks import BusyProcess, CpuQuota, RankSignalsReply

SAMPLE_S = 1.0
TOP = 5
COMMAND_CHARS = 160
COMMAND_TIMEOUT_S = 5.0
_CGROUP = "/sys/fs/cgroup"


def rank_signals(workdir: str, job: str, attempt: int, rank: int, seconds: float = SAMPLE_S) -> RankSignalsReply:
    seconds = min(max(float(seconds), 0.2), 5.0)
    directory = rank_dir(workdir, job, attempt, rank)
    pid = _read_int(os.path.join(directory, "pid"))
    runner = _read_int(os.path.join(directory, "runner.pid"))
    members = sorted(proc_state.rank_processes(pid, runner if proc_state.alive(runner) else None)) if pid else []
    mine = set(members) | {os.getpid()}
    limit = _limit(_quota_group(pid)) if pid else None
    before = (time.monotonic(), proc_cpu.cpu_seconds(members), _all_ticks(), _throttled(limit), _swapins())
    time.sleep(seconds)
    after = (time.monotonic(), proc_cpu.cpu_seconds(members), _all_ticks(), _throttled(limit), _swapins())
    wall = after[0] - before[0]
    reply: RankSignalsReply = {
        "seconds": round(wall, 3), "rank_pids": members, "cores": os.cpu_count() or 1,
        "rank_cpu": (round((after[1] - before[1]) / wall, 3)
                     if after[1] is not None and before[1] is not None and wall > 0 else None),
        "others": _busiest(before[2], after[2], wall, mine),
        "quota": _quota(limit, before[3], after[3], wall),
        "speed_limit": _speed_limit(),
        "memory_pressure": signal_parsers.parse_psi_some_avg10(read_text("/proc/pressure/memory") or ""),
        "swapins_per_s": (round((after[4] - before[4]) / wall, 1)
                          if after[4] is not None and before[4] is not None and wall > 0 else None),
        "gpu_utilization": _gpu_utilization(),
    }
    return reply


def _read_int(path: str) -> int | None:
    text = read_text(path)
    return int(text.strip()) if text and text.strip().isdigit() else None


# --- other processes ------------------------------------------------------------------------

def _all_ticks() -> dict[int, tuple[int, int]] | dict[int, tuple[str, float, str]]:
    """Linux: pid -> (CPU ticks, uid) of every process; macOS: pid -> (user, %cpu, command) from ps."""
    if not os.path.isdir("/proc/self"):
        out = run_command(["ps", "-A", "-o", "pid=,user=,%cpu=,command="], COMMAND_TIMEOUT_S) or ""
        return {pid: (user, cpu, command) for pid, user, cpu, command in signal_parsers.parse_ps_top(out)}
    ticks: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                value = signal_parsers.parse_stat_own_ticks(handle.read())
            uid = os.stat(f"/proc/{entry}").st_uid
        except OSError:
            continue
        if value is not None:
            ticks[int(entry)] = (value, uid)
    return ticks


def _busiest(before: dict, after: dict, wall: float, mine: set[int]) -> list[BusyProcess]:
    """The processes, not the rank's own nor the agent, that used the most CPU over the sample."""
    found: list[BusyProcess] = []
    hz = os.sysconf("SC_CLK_TCK") if os.path.isdir("/proc/self") else 100
    for pid, now in after.items():
        if pid in mine:
            continue
        if isinstance(now[0], str):  # macOS: ps's own average
            user, percent, command = now
            cores = percent / 100.0
        else:
            if pid not in before or wall <= 0:
                continue
            cores = max(0, now[0] - before[pid][0]) / hz / wall
            user, command = _user(now[1]), _command(pid)
        if cores >= 0.05:
            found.append({"pid": pid, "user": user, "cpu": round(cores, 3), "command": command})
    found.sort(key=lambda p: -p["cpu"])
    return found[:TOP]


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _command(pid: int) -> str:
    raw = read_text(f"/proc/{pid}/cmdline") or ""
    command = " ".join(part for part in raw.split("\0") if part) or (read_text(f"/proc/{pid}/comm") or "?")
    return clean_excerpt(command)[:COMMAND_CHARS]


# --- a CPU quota ----------------------------------------------------------------------------

def _quota_group(pid: int) -> tuple[str, list[str]] | None:
    """(source, the cgroup directories from the rank's own up to the root) of the rank's CPU controller."""
    paths = signal_parsers.parse_cgroup_paths(read_text(f"/proc/{pid}/cgroup") or "")
    if "" in paths and os.path.exists(os.path.join(_CGROUP, "cgroup.controllers")):
        return "cgroup v2", _chain(_CGROUP, paths[""])
    for controllers, path in paths.items():
        if "cpu" in controllers.split(","):
            for mount in (os.path.join(_CGROUP, controllers), os.path.join(_CGROUP, "cpu"),
                          os.path.join(_CGROUP, "cpu,cpuacct")):
                if os.path.exists(os.path.join(mount, "cpu.cfs_quota_us")):
                    return "cgroup v1", _chain(mount, path)
    return None


def _chain(mount: str, path: str) -> list[str]:
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    return [os.path.join(mount, *parts[:n]) for n in range(len(parts), -1, -1)]


def _limit(group: tuple[str, list[str]] | None) -> tuple[str, float | None, str] | None:
    """(source, cores, directory) of the tightest quota on the rank's cgroup or one above it; with
    no quota, its own group (whose cpu.stat still counts)."""
    if group is None:
        return None
    source, chain = group
    limits = []
    for directory in chain:
        if source == "cgroup v2":
            cores = signal_parsers.parse_cpu_max(read_text(os.path.join(directory, "cpu.max")) or "")
        else:
            cores = signal_parsers.parse_cfs_quota(read_text(os.path.join(directory, "cpu.cfs_quota_us")) or "",
                                                   read_text(os.path.join(directory, "cpu.cfs_period_us")) or "")
        if cores is not None:
            limits.append((cores, directory))
    if not limits:
        return source, None, chain[0]
    cores, directory = min(limits)
    return source, cores, directory


def _throttled(limit: tuple[str, float | None, str] | None) -> int | None:
    """Microseconds the quota's cgroup has been held by it, from its cpu.stat."""
    if limit is None:
        return None
    stat = read_text(os.path.join(limit[2], "cpu.stat")) or ""
    return signal_parsers.throttled_usec(signal_parsers.parse_cpu_stat(stat))


def _quota(limit: tuple[str, float | None, str] | None, before: int | None, after: int | None,
           wall: float) -> CpuQuota | None:
    if limit is None:
        return None
    held = (after - before) / 1e6 / wall if after is not None and before is not None and wall > 0 else None
    return {"source": limit[0], "cores": round(limit[1], 3) if limit[1] is not None else None, "group": limit[2],
            "throttled_share": round(min(1.0, max(0.0, held)), 3) if held is not None else None}


# --- memory, heat, GPU ----------------------------------------------------------------------

def _swapins() -> int | None:
    if os.path.isdir("/proc/self"):
        return signal_parsers.parse_vmstat_swapins(read_text("/proc/vmstat") or "")
    if platform.system() == "Darwin":
        return signal_parsers.parse_vmstat_swapins(run_command(["vm_stat"], COMMAND_TIMEOUT_S) or "")
    return None


def _speed_limit() -> int | None:
    if platform.system() != "Darwin":
        return None
    return signal_parsers.parse_pmset_therm(run_command(["pmset", "-g", "therm"], COMMAND_TIMEOUT_S)
                                            or "").get("CPU_Speed_Limit")


def _gpu_utilization() -> float | None:
    if platform.system() == "Darwin":
        gpu = usage_parsers.parse_gpu_statistics(
            run_command(["ioreg", "-r", "-d", "1", "-c", "IOAccelerator"], COMMAND_TIMEOUT_S) or "")
        return gpu["gpu_utilization"]
    if shutil.which("nvidia-smi"):
        return signal_parsers.parse_nvidia_utilization(run_command(
            ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"], COMMAND_TIMEOUT_S) or "")
    return None
