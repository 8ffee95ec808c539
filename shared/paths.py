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
#: The longest name (one part of a path) Linux and macOS filesystems take, in bytes.
MAX_NAME_BYTES = 255


class UnsafePath(ValueError):
    def __init__(self, path: str, why: str):
        super().__init__(f"refused path {path!r}: {why}")
        self.path = path
        self.why = why


def check_relative(path: object) -> str:
    """Validate the form of a relative path (no filesystem access); returns it normalised."""
    # The common case first, already in normal form (a sync sends tens of thousands): short enough
    # whatever its encoding, and nothing that needs the long look ("..", "." and "" parts included).
    if (type(path) is str and 0 < len(path) <= MAX_PATH_BYTES // 4 and path[0] != "/" and path[-1] not in "/."
            and "./" not in path and "//" not in path and "\\" not in path and "\0" not in path and ":" not in path):
        return path
    return _check_relative_fully(path)


def _check_relative_fully(path: object) -> str:
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


def is_utf8(name: str) -> bool:
    """Whether ``name`` (as ``os`` functions return it: bytes that are not UTF-8 kept as lone surrogates)
    is valid UTF-8, which the wire (msgpack strings) and a Mac's filesystem both need."""
    if name.isascii():
        return True
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def printable_name(path: str) -> str:
    """``path`` in a form every terminal and the wire can carry: a byte that is not UTF-8 as ``\\xNN``, a
    control character as Python writes it (``\\n``, ``\\x1b``) and a backslash doubled, so that the text
    names exactly one path (``ls -b`` does the same)."""
    if path.isprintable() and "\\" not in path:
        return path
    out = []
    for char in path:
        if "\udc80" <= char <= "\udcff":  # a byte the filesystem gave that is not UTF-8
            out.append(f"\\x{ord(char) - 0xDC00:02x}")
        elif char == "\\":
            out.append("\\\\")
        elif not char.isprintable():
            out.append(repr(char)[1:-1] if ord(char) < 0x10000 else char.encode("unicode_escape").decode("ascii"))
        else:
            out.append(char)
    return "".join(out)


def name_problem(path: str) -> str | None:
    """Why a node would refuse ``path`` (a relative path as a scan of a tree found it), or None.

    The same rules as every path from the wire (``check_relative``), plus what the wire itself
    cannot carry (a name that is not UTF-8) and what no node's filesystem takes (a name longer than
    255 bytes). The head checks each source path with this before it sends anything: such a file is
    not sent, and the sync names it, instead of every node refusing the batch it would be in.
    """
    if not path.isascii() and not is_utf8(path):  # the common case first: one call, in C
        return "not valid UTF-8 (names cross the wire as UTF-8, and a Mac's disk takes no other)"
    try:
        normal = check_relative(path)
    except UnsafePath as exc:
        return exc.why
    if normal != path:
        return f"not in normal form (a node would write it as {normal!r})"
    if len(path) > MAX_NAME_BYTES // 4 and any(len(part.encode("utf-8")) > MAX_NAME_BYTES
                                                 for part in path.split("/")):
        return f"a name longer than {MAX_NAME_BYTES} bytes (no filesystem takes it)"
    return None


def link_target_problem(path: str, target: object) -> str | None:
    """Why a symlink at ``path`` (relative to a tree's root) to ``target`` could point out of the tree
    by its text alone, or None when it cannot.

    A target must be relative, and every ``..`` in it must come first: past a symlink the system
    resolves ``..`` from where that link leads, not lexically, so a ``..`` after a name cannot be
    checked by counting. The leading ones must not climb above the root from the link's directory
    (``path``'s; the agent counts from that directory's real place on its disk).
    """
    if not isinstance(target, str) or not target:
        return "an empty target"
    try:
        encoded = target.encode("utf-8")
    except UnicodeEncodeError:
        return "its target is not valid UTF-8"
    if len(encoded) > MAX_PATH_BYTES or "\0" in target:
        return "its target is too long or holds a NUL byte"
    if target.startswith("/"):
        return "an absolute target"
    parts = [part for part in target.split("/") if part not in ("", ".")]
    climbs = 0
    while climbs < len(parts) and parts[climbs] == "..":
        climbs += 1
    if ".." in parts[climbs:]:
        return "'..' after a name in its target"
    depth = len(path.split("/")) - 1
    if climbs > depth:
        return f"its target climbs {climbs} directories up from a directory {depth} below the root"
    return None


class PathGuard:
    """``resolve_under`` for many paths under one root: a directory checked once is not
    checked again by the same guard (a sync batch touches each directory many times). A guard
    is for one batch, checked before anything of it is written: a directory missing when it was
    checked is taken to be missing still."""

    def __init__(self, root: str):
        self.root = root
        self.real_root = os.path.realpath(root)
        self._base = self.real_root.rstrip("/")  # "/" as a root: no "//" in what it resolves
        self._safe_dirs: set[str] = set()
        self._missing_dirs: set[str] = set()  # a new tree's directories, checked as far as they exist

    def resolve(self, path: str, *, must_exist: bool = False, replaced: bool = False) -> str:
        """``resolve_under`` for one path of the batch. ``replaced``: the caller puts a new entry at ``path``
        by a rename, which never follows what stands there (a link or a FIFO is replaced, not written
        through), so only the directories on the way are checked, not ``path`` itself: a sync's write of a
        file in a directory already checked costs no system call here."""
        relative = check_relative(path)
        parent = relative.rpartition("/")[0]
        if not parent or parent in self._safe_dirs:
            full = f"{self._base}/{relative}"
            if not replaced:
                _check_last(path, full, self.real_root, must_exist)
            return full
        if parent in self._missing_dirs:  # its existing part was checked; nothing in it exists yet
            if must_exist:
                raise UnsafePath(path, "no such file")
            return f"{self._base}/{relative}"
        full = _resolve_checked(path, relative, self.real_root, must_exist)
        if os.path.isdir(f"{self._base}/{parent}"):
            self._safe_dirs.add(parent)
        elif not os.path.lexists(f"{self._base}/{parent}"):
            self._missing_dirs.add(parent)
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
        try:
            info = os.stat(full)
        except FileNotFoundError:  # a link inside the tree to what is not there (yet): the link itself is
            return True            # the entry, replaced by whatever is written under its name
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
        raise UnsafePath(path, "not a regular file or directory")
    return True


def resolve_under(root: str, path: str, *, must_exist: bool = False, real_root: str | None = None) -> str:
    """The absolute path of ``path`` under ``root``, refusing any way out of ``root``.

    Every existing component is checked: a symlink whose target is outside the
    root is refused, and so is a device, socket or FIFO.
    """
    return _resolve_checked(path, check_relative(path), real_root or os.path.realpath(root), must_exist)


def _resolve_checked(path: str, relative: str, real_root: str, must_exist: bool) -> str:
    """resolve_under for a path whose form check_relative passed (``relative`` is its normal form)."""
    # Walk the existing prefix: realpath follows links, so an escape shows up here.
    base = current = real_root.rstrip("/")
    for part in relative.split("/"):
        current = f"{current}/{part}"
        if not _check_last(path, current, real_root, must_exist):
            break
    return f"{base}/{relative}"
