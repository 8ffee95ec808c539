"""The live processes a test's nodes run, read from /proc (Linux)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from agent.proc_state import parse_proc_stat


class Process(NamedTuple):
    pid: int
    words: list[bytes]  # its command line
    cwd: str


def running_under(root: Path) -> list[Process]:
    """Every live (not zombie) process whose working directory is under ``root``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(entry / "cwd")
            state = parse_proc_stat((entry / "stat").read_text())
        except OSError:
            continue
        if state != "Z" and cwd.startswith(str(root)):
            found.append(Process(int(entry.name), words, cwd))
    return found
