"""Locks of torch's extension builds that a killed process left behind, cleared before a rank starts.

PyTorch builds a C++ extension (DeepSpeed's ops, among them the shared-memory op its CPU
accelerator builds in ``deepspeed.init_distributed``) under a ``lock`` file it creates with
O_EXCL and keeps open until the build is done, then removes. Every process that loads the op takes
it, even when there is nothing to build. A process killed while it holds it (by coord, stopping
an attempt whose other rank failed) leaves the file, and every later process waits on it for good
(``torch.utils.file_baton``): each relaunch would hang at init until its allowance ran out.

A lock is stale when no process holds it open (Linux: ``/proc/*/fd``; elsewhere ``lsof``) and it
is older than a minute (a build between its ``close`` and its ``remove`` is never touched).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

#: A lock younger than this is left alone, held open or not.
MIN_AGE_S = 60.0


def extension_roots() -> list[str]:
    """Where torch builds extensions for this user: $TORCH_EXTENSIONS_DIR, else its default cache."""
    roots = []
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        roots.append(os.environ["TORCH_EXTENSIONS_DIR"])
    home = os.path.expanduser("~")
    if sys.platform == "darwin":
        roots.append(os.path.join(home, "Library", "Caches", "torch_extensions"))
    else:
        roots.append(os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"),
                                  "torch_extensions"))
    return [root for root in dict.fromkeys(roots) if os.path.isdir(root)]


def _held_open_linux(paths: set[str]) -> set[str]:
    held = set()
    for fd_dir in glob.glob("/proc/[0-9]*/fd"):
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue  # gone, or another user's
        for name in names:
            try:
                target = os.readlink(os.path.join(fd_dir, name))
            except OSError:
                continue
            if target in paths:
                held.add(target)
    return held


def _held_open_lsof(paths: set[str]) -> set[str] | None:
    """The paths some process holds open; None when lsof cannot tell (then nothing is cleared)."""
    held = set()
    for path in paths:
        try:
            done = subprocess.run(["lsof", "-t", "--", path], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        if done.stdout.strip():
            held.add(path)
        elif done.returncode not in (0, 1):
            return None
    return held


def clear_stale_locks(now: float | None = None) -> list[str]:
    """Remove every stale build lock under the extension roots; the paths removed."""
    now = time.time() if now is None else now
    locks = set()
    for root in extension_roots():
        # <root>/<name>/lock, or <root>/<python and device tag>/<name>/lock
        for pattern in ("*/lock", "*/*/lock"):
            for path in glob.glob(os.path.join(root, pattern)):
                try:
                    if now - os.lstat(path).st_mtime >= MIN_AGE_S:
                        locks.add(os.path.realpath(path))
                except OSError:
                    continue
    if not locks:
        return []
    held = _held_open_linux(locks) if os.path.isdir("/proc/self/fd") else _held_open_lsof(locks)
    if held is None:
        return []
    removed = []
    for path in sorted(locks - held):
        try:
            os.remove(path)
        except OSError:
            continue
        removed.append(path)
    return removed
