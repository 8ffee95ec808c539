"""The state of a rank's processes: stopped (SIGSTOP), in uninterruptible sleep, or running.

Linux gives each process's state in ``/proc/PID/stat``; macOS has no /proc, so ``ps`` names the
states of every process with its group. The parsers are pure and take the text as it comes;
nothing here raises on odd input. Stdlib only: it runs with the node's Python.
"""

from __future__ import annotations

import os
import subprocess

STOPPED, UNINTERRUPTIBLE, RUNNING = "stopped", "uninterruptible", "running"


def parse_proc_stat(text: str) -> str | None:
    """The state letter of ``/proc/PID/stat`` (after the command name, which may hold spaces
    and parentheses), or None."""
    _, _, rest = text.rpartition(")")
    fields = rest.split()
    return fields[0] if fields and len(fields[0]) == 1 else None


def parse_ps_states(text: str, pgid: int) -> dict[int, str]:
    """pid -> the first letter of its state, for the processes of group ``pgid`` in the output
    of ``ps -A -o pid=,pgid=,stat=``."""
    states: dict[int, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or not parts[0].isdigit() or not parts[1].isdigit():
            continue
        if int(parts[1]) == pgid and parts[2]:
            states[int(parts[0])] = parts[2][0]
    return states


def summarize(states: dict[int, str]) -> str | None:
    """One word for a group: stopped when any process is (T; t is a debugger's stop, not a
    hang), uninterruptible when any is in D (or U, macOS's uninterruptible wait), else running;
    None for no live process (zombies do not count)."""
    live = {pid: s for pid, s in states.items() if s not in ("Z", "X")}
    if not live:
        return None
    letters = set(live.values())
    if "T" in letters:
        return STOPPED
    if letters & {"D", "U"}:
        return UNINTERRUPTIBLE
    return RUNNING


def group_states(pgid: int) -> dict[int, str]:
    """pid -> state letter of every process of the group, from /proc or, without it, ps."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return _ps_states(pgid)
    states: dict[int, str] = {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                state = parse_proc_stat(handle.read())
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
        if state:
            states[int(entry)] = state
    return states


def process_state(pid: int) -> str | None:
    """The state letter of one process, or None when it is gone or cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            return parse_proc_stat(handle.read())
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None  # Linux: the process is gone
    except OSError:
        return None
    try:
        out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout.strip()
    return text[0] if out.returncode == 0 and text else None


def _ps_states(pgid: int) -> dict[int, str]:
    try:
        out = subprocess.run(["ps", "-A", "-o", "pid=,pgid=,stat="], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_ps_states(out.stdout, pgid) if out.returncode == 0 else {}
