"""Keep a Mac awake while its rank runs: ``caffeinate -i -s -w <rank pid>``.

``-i`` holds off idle sleep, ``-s`` system sleep (on AC power), and ``-w`` ties the
assertion to the rank: caffeinate lets go when that process exits, even if the rank runner
that started it was killed. Watching the rank rather than wrapping it (``caffeinate --
argv``) leaves the rank's pid (its process group, what ``stop_rank`` kills), its exit
status, its memory reading and its SIGUSR1 stack dumps exactly as they are without
caffeinate. caffeinate stays in the runner's process group, out of the rank's, so killing
the rank's group never counts it as a rank process left over.

Only on macOS with ``/usr/bin/caffeinate``; elsewhere nothing starts. Stdlib only: this runs
in the node's Python.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import IO

CAFFEINATE = "/usr/bin/caffeinate"
#: Read when ``hold_awake`` is called (not at import), so a test can stand in for macOS.
PLATFORM = sys.platform


def keep_awake_argv(platform: str, caffeinate: str | None, pid: int) -> list[str] | None:
    """The command that keeps this machine awake while ``pid`` lives, or None where none is needed.

    ``platform`` is ``sys.platform``; ``caffeinate`` the path of the caffeinate program if
    it is there, else None.
    """
    if platform != "darwin" or not caffeinate:
        return None
    return [caffeinate, "-i", "-s", "-w", str(pid)]


def find_caffeinate(path: str | None = None) -> str | None:
    path = path or CAFFEINATE
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def hold_awake(pid: int, log: IO[bytes] | None = None, *, platform: str | None = None,
               caffeinate: str | None = None) -> subprocess.Popen | None:
    """Start the power assertion for ``pid``; None where there is none to hold (or it cannot start,
    which ``log`` is told: a rank that may sleep is still a rank that runs)."""
    argv = keep_awake_argv(platform if platform is not None else PLATFORM, find_caffeinate(caffeinate), pid)
    if argv is None:
        return None
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=log if log is not None else subprocess.DEVNULL)
    except OSError as exc:
        if log is not None:
            log.write(f"coord: cannot keep this Mac awake ({argv[0]}): {exc}\n".encode())
        return None


def release(holder: subprocess.Popen | None) -> None:
    """End the assertion now that the rank is over, and reap caffeinate (no orphan left behind)."""
    if holder is None:
        return
    holder.terminate()
    try:
        holder.wait(timeout=5)
    except subprocess.TimeoutExpired:
        holder.kill()
        holder.wait()
