"""A real, small filesystem for tests of a full disk: a tmpfs of a given size mounted at a directory.

A full disk cannot be faked convincingly above the system calls (short writes, then ENOSPC, on data
and on metadata alike), so these tests fill a real one. Mounting needs Linux and root (or
CAP_SYS_ADMIN); elsewhere the test is skipped and says why.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """``path`` (created) with a tmpfs of ``size`` (mount's syntax: 1m, 512k) on it, unmounted after."""
    if not sys.platform.startswith("linux"):
        pytest.skip("a small real filesystem for the full-disk case is a tmpfs mount: Linux only")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs at {path} for the full-disk case (needs root or "
                    f"CAP_SYS_ADMIN): {done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def open_under(pid: int, directory: Path) -> list[str]:
    """The files process ``pid`` holds open under ``directory`` (from /proc/PID/fd)."""
    found = []
    base = str(directory)
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target == base or target.startswith(base + "/"):
                found.append(target)
    return found


def temporaries(directory: Path) -> list[str]:
    """coord's temporaries under ``directory`` (the sync's and the relay's)."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if ".coord-" in p.name)
