"""The node side of a sync's directories: make the source's (an empty one included) with its mode, and
remove the ones ``--delete`` names once they are empty.

The head sends every directory a node lacks, or holds with another mode, as [path, mode]; each is made
(its parents first: the list is in path order) and given exactly that mode, permission bits only. A
directory the sync must write into although its mode shuts its owner out (0o500, say) is first sent
with the owner's bits added and sent again, with its own mode, once everything has landed: the head
orders that (``coordinator.readiness.push``), this side does what each call says. Like ``put_files``
nothing is flushed here: ``sync_state`` makes the directory entries durable at the end.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import TYPE_CHECKING

from agent import sync as node_sync
from agent import sync_durable as durable
from shared import protocol as p
from shared.paths import PathGuard, UnsafePath
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from shared.agent_api.sync import DirRow, MakeDirsReply, RemoveDirsReply

LISTED = 50


def make_dirs(root: str, dirs: list[DirRow]) -> MakeDirsReply:
    """Make each directory that is missing and set each one's mode: [[rel, mode], ...], every path checked
    before any is made. A file or link where a directory is to be is refused, named (the head removes
    such an entry first: it never reaches here from a sync)."""
    root = node_sync._root(root, create=True)
    for item in dirs:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], int)):
            raise RemoteError(p.BAD_ARGS, "each directory must be [path, mode]")
    guard = PathGuard(root)
    try:
        places = [guard.resolve(rel) for rel, _ in dirs]
    except UnsafePath as exc:
        raise RemoteError(p.REFUSED, str(exc)) from None
    state = durable.pending(root)
    made = 0
    with state.writing:
        for (rel, mode), full in zip(dirs, places, strict=True):
            made += _make_one(rel, full, node_sync._mode(mode))
            parent = os.path.dirname(full)
            with state.lock:  # the new entry is durable once its parent directory is: flushed by sync_state
                state.dirs.add(parent)
                state.devices.setdefault(os.lstat(full).st_dev, parent)
    return {"made": made, "modes": len(dirs)}


def _make_one(rel: str, full: str, mode: int) -> int:
    """1 when the directory was made, 0 when it was there; either way it has ``mode`` now."""
    try:
        os.mkdir(full, mode)
        made = 1
    except FileExistsError:
        made = 0
    except FileNotFoundError:  # a parent the list did not hold (it is in path order, parents first)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        os.mkdir(full, mode)
        made = 1
    if not stat.S_ISDIR(os.lstat(full).st_mode):
        raise RemoteError(p.REFUSED, f"{rel}: a file or link stands where the source has a directory; "
                                     "move it away on this node")
    os.chmod(full, mode)  # mkdir's mode passes through the umask: set it as it is
    return made


def remove_dirs(root: str, paths: list[str]) -> RemoveDirsReply:
    """Remove each directory once it is empty, the deepest first (a link or file is not this method's: it
    is left alone). One that still holds something (files the sync ignores, such as ``__pycache__``) is
    kept, and named in the answer."""
    root = node_sync._root(root)
    targets = sorted(((rel, node_sync._safe_entry(root, rel)) for rel in paths), key=lambda item: item[0],
                     reverse=True)  # a directory's own entries sort after it: reversed, they go first
    state = durable.pending(root)
    removed, kept = 0, []
    for rel, full in targets:
        try:
            if not stat.S_ISDIR(os.lstat(full).st_mode):
                continue
            os.rmdir(full)
        except FileNotFoundError:
            continue
        except OSError:
            kept.append(rel)
            continue
        removed += 1
        parent = os.path.dirname(full)
        with state.lock, contextlib.suppress(OSError):
            state.dirs.add(parent)
            state.devices.setdefault(os.lstat(parent).st_dev, parent)
    return {"removed": removed, "kept": sorted(kept)[:LISTED], "kept_count": len(kept)}
