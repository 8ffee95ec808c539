"""The CPU time a rank's processes have used, together: what tells a rank that works (compiles,
loads) from one that is stuck, before its first step (``coordinator/jobs/hang.py``).

Each process counts with its children that have ended and been waited for (a compiler MLX ran,
a worker a launcher reaped): their time passes to their parent then, so the sum keeps growing
while the rank works, even through processes that live less than a poll. Linux reads
``/proc/PID/stat`` of each process (a few reads); macOS, which has no /proc, asks ``ps -S`` once.
The parsers are pure and take the text as it comes; nothing here raises on odd input. Stdlib
only: it runs with the node's Python.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable

# /proc/PID/stat after the command name: state is field 3, utime 14, stime 15, cutime 16, cstime 17.
_UTIME, _CSTIME = 14 - 3, 17 - 3


def parse_stat_ticks(text: str) -> int | None:
    """utime + stime + cutime + cstime of a ``/proc/PID/stat`` line, in clock ticks, or None."""
    _, _, rest = text.rpartition(")")
    fields = rest.split()
    if len(fields) <= _CSTIME:
        return None
    try:
        return sum(int(value) for value in fields[_UTIME:_CSTIME + 1])
    except ValueError:
        return None


def parse_cputime(text: str) -> float | None:
    """Seconds from ps's ``time`` column: ``[[dd-]hh:]mm:ss[.hh]`` (macOS writes minutes past 59,
    ``75:03.12``; procps writes ``01:15:03``; a locale may write a decimal comma), or None."""
    days, _, clock = text.strip().rpartition("-")
    parts = clock.replace(",", ".").split(":")
    if not days.isdigit() and days:
        return None
    if not 2 <= len(parts) <= 3:
        return None
    try:
        seconds = float(parts[-1])
        minutes = int(parts[-2])
        hours = int(parts[0]) if len(parts) == 3 else 0
    except ValueError:
        return None
    if seconds < 0 or minutes < 0 or hours < 0:
        return None
    return (int(days or 0) * 24 + hours) * 3600 + minutes * 60 + seconds


def parse_ps_times(text: str) -> dict[int, float]:
    """pid -> CPU seconds from ``ps -o pid=,time=`` (lines that do not parse are left out)."""
    times: dict[int, float] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        seconds = parse_cputime(parts[1])
        if seconds is not None:
            times[int(parts[0])] = seconds
    return times


def cpu_seconds(pids: Iterable[int]) -> float | None:
    """The CPU time (user and system, seconds) of ``pids`` together, each with its children that
    ended; None when none of them could be read (all gone, or neither /proc nor ps answers)."""
    wanted = sorted(set(pids))
    if not wanted:
        return None
    if os.path.isdir("/proc/self"):
        return _from_proc(wanted)
    return _from_ps(wanted)


def _from_proc(pids: list[int]) -> float | None:
    ticks, read = 0, False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
                value = parse_stat_ticks(handle.read())
        except OSError:
            continue  # gone meanwhile: its time is its parent's now, if the parent is ours
        if value is not None:
            ticks, read = ticks + value, True
    return ticks / os.sysconf("SC_CLK_TCK") if read else None


def _from_ps(pids: list[int]) -> float | None:
    try:
        # -S: each process with the time of its children that ended (BSD ps; macOS).
        out = subprocess.run(["ps", "-S", "-o", "pid=,time=", "-p", ",".join(map(str, pids))], capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    times = parse_ps_times(out.stdout)  # ps exits 1 when a pid is gone: the others are still right
    return sum(times.values()) if times else None
