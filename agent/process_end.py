"""Waiting for a process that is not our child to end, without polling it.

A rank's runner is started by mlx.launch, not by the agent, so the agent cannot wait() for it.
Looking ten times a second whether it is still there cost the agent most of its CPU while a job
trained (about half a percent of a core per node). The kernel can say it instead: a pidfd on
Linux (5.3 and later) and a kqueue process filter on macOS both become readable when the process
exits, for any process of the same user. Stdlib only: it runs with the node's Python."""

from __future__ import annotations

import asyncio
import os
import select
import sys
from collections.abc import Callable


def _open_watch(pid: int) -> tuple[int, Callable[[], None]] | None:
    """A readable-on-exit descriptor for ``pid`` and how to close it; None where the OS has none.
    Raises ProcessLookupError when the process is already gone."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is not None:
        try:
            fd = pidfd_open(pid)
        except OSError as exc:
            if isinstance(exc, ProcessLookupError):
                raise
            return None  # an older kernel (ENOSYS) or a sandbox that refuses it
        return fd, lambda: os.close(fd)
    if sys.platform == "darwin" or sys.platform.startswith("freebsd"):
        queue = select.kqueue()
        try:
            queue.control([select.kevent(pid, filter=select.KQ_FILTER_PROC, flags=select.KQ_EV_ADD,
                                         fflags=select.KQ_NOTE_EXIT)], 0, 0)
        except OSError as exc:
            queue.close()
            if isinstance(exc, ProcessLookupError):
                raise
            return None
        return queue.fileno(), queue.close
    return None


def _settle(ended: asyncio.Future[bool]) -> None:
    if not ended.done():
        ended.set_result(True)


async def wait_exit(pid: int, timeout: float) -> bool | None:
    """Wait up to ``timeout`` seconds for ``pid`` to end. True: it has ended (or was gone already);
    False: the time ran out first; None: this OS gives no way to watch it (poll instead)."""
    try:
        watch = _open_watch(pid)
    except ProcessLookupError:
        return True
    if watch is None:
        return None
    fd, close = watch
    loop = asyncio.get_running_loop()
    ended = loop.create_future()
    try:
        loop.add_reader(fd, _settle, ended)
    except (OSError, NotImplementedError, ValueError):
        close()
        return None
    try:
        done, _ = await asyncio.wait({ended}, timeout=timeout)
        return bool(done)
    finally:
        loop.remove_reader(fd)
        close()
