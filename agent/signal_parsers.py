"""Parsers for what may slow a rank down on its node: a CPU quota's throttling (cgroup v2 and v1), a
Mac's thermal speed limit (``pmset -g therm``), memory pressure and swapping, other processes'
CPU, the GPU's utilisation. Pure functions over the text as it comes; each returns None (or an
empty result) for what the text does not hold, and nothing here raises on odd input. Tested on
fixture files (``tests/fixtures/macos-synthetic/*.pmset-g-therm.*.txt``) and synthetic text.
Stdlib only: it runs with the node's Python."""

from __future__ import annotations

import re

_THERM_LINE = re.compile(r"^\s*(CPU_[A-Za-z_]+)\s*=\s*(\d+)\s*$")
_PSI_SOME = re.compile(r"^some\s.*?avg10=(\d+(?:\.\d+)?)")


def parse_pmset_therm(text: str) -> dict[str, int]:
    """``pmset -g therm``'s CPU power values, e.g. ``{"CPU_Speed_Limit": 60, "CPU_Scheduler_Limit":
    100, "CPU_Available_CPUs": 10}``; empty when the Mac has recorded none ("No CPU power status has
    been recorded") or the text is something else. CPU_Speed_Limit is the percentage of its top
    speed the CPU is held to now (100: not throttled)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        match = _THERM_LINE.match(line)
        if match:
            values[match.group(1)] = int(match.group(2))
    return values


def parse_cpu_max(text: str) -> float | None:
    """The cores a cgroup v2 ``cpu.max`` (``"QUOTA PERIOD"``, or ``"max PERIOD"``) allows; None for
    no quota or text that is not one."""
    parts = text.split()
    if len(parts) != 2 or not parts[1].isdigit() or int(parts[1]) <= 0 or not parts[0].isdigit():
        return None
    return int(parts[0]) / int(parts[1])


def parse_cfs_quota(quota: str, period: str) -> float | None:
    """The cores a cgroup v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` allows; None for -1
    (no quota) or text that is not a number."""
    quota, period = quota.strip(), period.strip()
    if not quota.isdigit() or not period.isdigit() or int(period) <= 0:
        return None
    return int(quota) / int(period)


def parse_cpu_stat(text: str) -> dict[str, int]:
    """A cgroup's ``cpu.stat`` as name -> number: v2 has ``nr_throttled`` and ``throttled_usec``,
    v1 ``nr_throttled`` and ``throttled_time`` (nanoseconds); read the throttled time as
    microseconds with :func:`throttled_usec`."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            values[parts[0]] = int(parts[1])
    return values


def throttled_usec(stat: dict[str, int]) -> int | None:
    """The time a cgroup was held by its quota, in microseconds, from either version's cpu.stat."""
    if "throttled_usec" in stat:
        return stat["throttled_usec"]
    if "throttled_time" in stat:
        return stat["throttled_time"] // 1000
    return None


def parse_cgroup_paths(text: str) -> dict[str, str]:
    """``/proc/PID/cgroup`` as hierarchy -> path: ``""`` for the unified (v2) one, else the v1
    controllers' names (``"cpu,cpuacct"``)."""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[2].startswith("/"):
            paths[parts[1]] = parts[2]
    return paths


def parse_psi_some_avg10(text: str) -> float | None:
    """The share of the last 10 s (percent) some task waited for memory, from ``/proc/pressure/memory``."""
    for line in text.splitlines():
        match = _PSI_SOME.match(line)
        if match:
            return float(match.group(1))
    return None


def parse_vmstat_swapins(text: str) -> int | None:
    """Pages swapped in since boot: Linux ``/proc/vmstat``'s ``pswpin``, or macOS ``vm_stat``'s
    ``Swapins:``."""
    for line in text.splitlines():
        parts = line.replace(":", " ").replace(".", " ").split()
        if len(parts) == 2 and parts[0] in ("pswpin", "Swapins") and parts[1].isdigit():
            return int(parts[1])
    return None


def parse_stat_own_ticks(text: str) -> int | None:
    """utime + stime of a ``/proc/PID/stat`` line (clock ticks): the process's own CPU, without the
    children it has reaped (whose time would land on it all at once when they end)."""
    fields = text.rpartition(")")[2].split()
    if len(fields) < 13 or not fields[11].isdigit() or not fields[12].isdigit():
        return None
    return int(fields[11]) + int(fields[12])


def parse_ps_top(text: str) -> list[tuple[int, str, float, str]]:
    """(pid, user, CPU percent of one core, command) from macOS ``ps -A -o pid=,user=,%cpu=,command=``
    (``%cpu`` is ps's decaying average); lines that do not parse are left out."""
    found = []
    for line in text.splitlines():
        parts = line.split(None, 3)
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        try:
            cpu = float(parts[2].replace(",", "."))
        except ValueError:
            continue
        found.append((int(parts[0]), parts[1], cpu, parts[3].strip()))
    return found


def parse_nvidia_utilization(text: str) -> float | None:
    """The highest GPU utilisation (percent) in ``nvidia-smi --query-gpu=utilization.gpu
    --format=csv,noheader,nounits``; None when no line is a number."""
    values = []
    for line in text.splitlines():
        try:
            values.append(float(line.strip()))
        except ValueError:
            continue
    return max(values) if values else None
