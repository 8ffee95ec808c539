"""The node side of a sync's symlinks: create the links of the source tree, never one that leads out.

The head sends only links that point inside the tree, as relative targets whose ``..`` all come
first (``shared.paths.link_target_problem``); the agent checks that again, from where the link's
directory really is on its disk (a directory reached through an in-tree link of its own is
counted where it lies), before it creates anything. A link is made under a temporary name beside
its place and renamed into it, like a file: a node never holds a half-made entry. Like ``put_files``
nothing is flushed here: ``sync_state`` makes the directories durable at the end.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import TYPE_CHECKING

from agent import sync as node_sync
from agent import sync_durable as durable
from agent.write_errors import write_failed
from shared import protocol as p
from shared.paths import PathGuard, UnsafePath, link_target_problem
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from shared.agent_api.sync import LinkRow, PutLinksReply


def _checked(root: str, real_root: str, guard: PathGuard, rel: str, target: str) -> str:
    """Where the link ``rel`` goes, after every check: its path, and its target from its real directory."""
    problem = link_target_problem(rel, target)
    if problem is not None:
        raise RemoteError(p.REFUSED, f"refused link {rel!r} -> {target!r}: {problem}")
    try:
        full = guard.resolve(rel)
    except UnsafePath as exc:
        raise RemoteError(p.REFUSED, str(exc)) from None
    directory = os.path.realpath(os.path.dirname(full))  # the nearest existing part is what counts
    if directory != real_root and not directory.startswith(real_root + "/"):
        raise RemoteError(p.REFUSED, f"refused link {rel!r}: its directory is outside the workdir")
    depth = 0 if directory == real_root else directory[len(real_root) + 1:].count("/") + 1
    climbs = target.split("/").count("..")  # all of them lead (link_target_problem): each climbs one
    if climbs > depth:
        raise RemoteError(p.REFUSED, f"refused link {rel!r} -> {target!r}: from {directory} it would lead out "
                                     f"of the workdir {root}")
    return full


def put_links(root: str, links: list[LinkRow]) -> PutLinksReply:
    """Create symlinks: [[rel, target], ...], every one checked before any is made. Each replaces what
    stands at its place: a file or a link, or an empty directory; never a directory with files in it."""
    root = node_sync._root(root, create=True)
    for item in links:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], str)):
            raise RemoteError(p.BAD_ARGS, "each link must be [path, target]")
    real_root = os.path.realpath(root)
    guard = PathGuard(root)
    places = [_checked(root, real_root, guard, rel, target) for rel, target in links]
    state = durable.pending(root)
    with state.writing:
        for (rel, target), full in zip(links, places, strict=True):
            directory = os.path.dirname(full)
            _make_link(rel, target, full)
            with state.lock:  # the rename is durable once its directory is: flushed by sync_state
                state.dirs.add(directory)
                state.devices.setdefault(os.lstat(directory).st_dev, directory)
    return {"links": len(links)}


def _make_link(rel: str, target: str, full: str) -> None:
    directory, _, name = full.rpartition("/")
    tmp = f"{directory}/.{name}.coord-{os.getpid()}-{next(node_sync._upload_ids)}"
    try:
        os.makedirs(directory, exist_ok=True)
        os.symlink(target, tmp)
    except OSError as exc:
        raise write_failed(exc, full, len(target)) or exc from None
    try:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.lstat(full).st_mode):
                try:
                    os.rmdir(full)  # an empty directory where the source has a link: the link wins
                except OSError:
                    raise RemoteError(p.REFUSED, f"{rel}: a directory with files in it stands where the source "
                                                 f"has a link (to {target}); move it away on this node") from None
        os.replace(tmp, full)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
