"""Paths that arrive over the wire, checked before anything touches the disk.

A relative path from the daemon names a file under a node's workdir. It is
refused when it is absolute, climbs out with ``..``, passes through a symlink
that leads outside the root, or names something that is not a regular file or
directory. The message names the path and why, so the daemon can report it.
"""

from __future__ import annotations

import os
import stat

MAX_PATH_BYTES = 4096


class UnsafePath(ValueError):
    def __init__(self, path: str, why: str):
        super().__init__(f"refused path {path!r}: {why}")
        self.path = path
        self.why = why


def check_relative(path: object) -> str:
    """Validate the form of a relative path (no filesystem access); returns it normalised."""
    if not isinstance(path, str):
        raise UnsafePath(repr(path), "not a string")
    if not path or path in (".", "./"):
        raise UnsafePath(path, "empty")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise UnsafePath(path[:80] + "...", "too long")
    if "\0" in path:
        raise UnsafePath(path, "contains a NUL byte")
    if path.startswith("/") or path.startswith("\\") or (len(path) > 1 and path[1] == ":"):
        raise UnsafePath(path, "absolute paths are not allowed")
    parts = path.split("/")
    if any(part == ".." for part in parts):
        raise UnsafePath(path, "'..' is not allowed")
    if any("\\" in part for part in parts):
        raise UnsafePath(path, "backslashes are not allowed")
    clean = [part for part in parts if part not in ("", ".")]
    if not clean:
        raise UnsafePath(path, "empty")
    return "/".join(clean)


class PathGuard:
    """``resolve_under`` for many paths under one root: a directory checked once is not
    checked again by the same guard (a sync batch touches each directory many times)."""

    def __init__(self, root: str):
        self.root = root
        self.real_root = os.path.realpath(root)
        self._safe_dirs: set[str] = set()

    def resolve(self, path: str, *, must_exist: bool = False) -> str:
        relative = check_relative(path)
        parent = relative.rpartition("/")[0]
        if parent and parent in self._safe_dirs:
            full = os.path.join(self.real_root, *relative.split("/"))
            _check_last(path, full, self.real_root, must_exist)
            return full
        full = resolve_under(self.root, relative, must_exist=must_exist, real_root=self.real_root)
        if parent and os.path.isdir(os.path.join(self.real_root, *parent.split("/"))):
            self._safe_dirs.add(parent)
        return full


def _check_last(path: str, full: str, real_root: str, must_exist: bool) -> bool:
    """Check one existing component of ``path``; False when it does not exist (yet)."""
    try:
        info = os.lstat(full)
    except FileNotFoundError:
        if must_exist:
            raise UnsafePath(path, "no such file") from None
        return False
    if stat.S_ISLNK(info.st_mode):
        target = os.path.realpath(full)
        if target != real_root and not target.startswith(real_root + os.sep):
            raise UnsafePath(path, "a symlink leads outside the workdir")
        info = os.stat(full)
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
        raise UnsafePath(path, "not a regular file or directory")
    return True


def resolve_under(root: str, path: str, *, must_exist: bool = False, real_root: str | None = None) -> str:
    """The absolute path of ``path`` under ``root``, refusing any way out of ``root``.

    Every existing component is checked: a symlink whose target is outside the
    root is refused, and so is a device, socket or FIFO.
    """
    relative = check_relative(path)
    real_root = real_root or os.path.realpath(root)
    full = os.path.join(real_root, *relative.split("/"))
    # Walk the existing prefix: realpath follows links, so an escape shows up here.
    current = real_root
    for part in relative.split("/"):
        current = os.path.join(current, part)
        if not _check_last(path, current, real_root, must_exist):
            break
    return full
