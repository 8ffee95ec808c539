"""The state of a rank's processes: stopped (SIGSTOP), in uninterruptible sleep, or running.

Linux gives each process's state in ``/proc/PID/stat``; macOS has no /proc, so ``ps`` names the
states of every process with its group. The parsers are pure and take the text as it comes;
nothing here raises on odd input. Stdlib only: it runs with the node's Python.
"""

from __future__ import annotations

import os
import subprocess
from typing import TypeGuard

STOPPED, UNINTERRUPTIBLE, RUNNING = "stopped", "uninterruptible", "running"


def parse_proc_stat(text: str) -> str | None:
    """The state letter of ``/proc/PID/stat`` (after the command name, which may hold spaces
    and parentheses), or None."""
    _, _, rest = text.rpartition(")")
    fields = rest.split()
    return fields[0] if fields and len(fields[0]) == 1 else None


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


def parse_stat_fields(text: str) -> tuple[str, int, int] | None:
    """(state letter, parent pid, process group) of a ``/proc/PID/stat`` line, or None."""
    _, _, rest = text.rpartition(")")
    fields = rest.split()
    if len(fields) < 3 or len(fields[0]) != 1 or not fields[1].isdigit() or not fields[2].lstrip("-").isdigit():
        return None
    return fields[0], int(fields[1]), int(fields[2])


def parse_ps_table(text: str) -> dict[int, tuple[str, int, int]]:
    """pid -> (state letter, parent pid, process group) from ``ps -A -o pid=,ppid=,pgid=,stat=``."""
    table: dict[int, tuple[str, int, int]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4 or not all(part.isdigit() for part in parts[:3]) or not parts[3]:
            continue
        table[int(parts[0])] = (parts[3][0], int(parts[1]), int(parts[2]))
    return table


def process_table() -> dict[int, tuple[str, int, int]]:
    """pid -> (state letter, parent pid, process group) of every process this user may see: from
    /proc, or where there is none (macOS) from ps."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        try:
            out = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,pgid=,stat="], capture_output=True, text=True,
                                 timeout=5)
        except (OSError, subprocess.SubprocessError):
            return {}
        return parse_ps_table(out.stdout) if out.returncode == 0 else {}
    table: dict[int, tuple[str, int, int]] = {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                fields = parse_stat_fields(handle.read())
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if fields:
            table[int(entry)] = fields
    return table


def descendants_in(table: dict[int, tuple[str, int, int]], root: int) -> list[int]:
    """Every process below ``root`` in ``table`` (its children, theirs, ...), ``root`` left out."""
    children: dict[int, list[int]] = {}
    for pid, (_, parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in found or pid == root:
            continue
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def rank_processes(pgid: int, runner: int | None,
                   table: dict[int, tuple[str, int, int]] | None = None) -> dict[int, str]:
    """pid -> state letter of a rank's processes: its process group, and everything below its runner
    (a launcher such as torchrun starts each worker in a session of its own, outside the group)."""
    table = process_table() if table is None else table
    pids = {pid for pid, (_, _, group) in table.items() if group == pgid}
    if runner and runner in table:
        # The runner's own helpers (caffeinate on a Mac) stay in the runner's group: not the rank's.
        own = table[runner][2]
        pids.update(pid for pid in descendants_in(table, runner) if table[pid][2] != own)
    return {pid: table[pid][0] for pid in pids if pid in table}



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


def alive(pid: int | None) -> TypeGuard[int]:
    """Whether ``pid`` names a live process (not a zombie, where /proc says); never for no pid."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's, and there
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            return parse_proc_stat(handle.read()) != "Z"
    except OSError:
        return True  # no /proc (macOS): kill(0) is the answer
