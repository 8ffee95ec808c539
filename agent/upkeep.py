"""The agent's checkpoint upkeep, in threads that yield to the ranks.

While a job trains, the agent lists and hashes its new checkpoints and sends and receives their
copies (to the other nodes through the relay, to the head over SSH). Nothing waits on that work
by the millisecond, but it comes in bursts, and on a node whose ranks train on its CPU cores a
burst on a rank's core holds that rank back, and every other rank with it at the next all-reduce:
measured with two ranks on two cores, training ran at 0.95x of bare torchrun with a checkpoint
every few seconds and at 1.01x with none (bench/README.md).

So that work runs in threads of its own at nice 10 on Linux, where a thread's nice value is its
own: a rank's thread goes first and the upkeep takes the moments the ranks leave idle (an
all-reduce's wait, a save). Not SCHED_IDLE: on a node whose ranks keep every core busy that may
never run, and a checkpoint nobody validated is one the job cannot resume from. macOS keeps one
priority per process for nice and would move a thread of a lower QoS class to the efficiency
cores, slowing a copy a recovery waits on: there the threads keep the agent's priority.

Never start a process from these threads: on Linux a child takes the nice value of the thread
that forked it, and a rank started at nice 10 would lose to every other process on its node.
Stdlib only: this runs in the node's Python.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

#: The upkeep threads' nice value on Linux: CFS gives a nice-0 rank about nine times their share of a busy core.
NICE = 10
#: Enough that a relay transfer's chunks are written while a large checkpoint is hashed beside it.
THREADS = 4

Result = TypeVar("Result")

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def lower_this_thread(nice: int = NICE) -> bool:
    """The calling thread, and only it, at the upkeep's nice value (Linux); False where it was not set."""
    if not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:  # never raised back up: that needs privileges
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        return False
    return True


def executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="coord-upkeep",
                                                          initializer=lower_this_thread)
        return _pool


def run(func: Callable[..., Result], *args: Any) -> asyncio.Future[Result]:
    """``func(*args)`` in an upkeep thread, awaited from the agent's event loop."""
    return asyncio.get_running_loop().run_in_executor(executor(), func, *args)


def in_upkeep(func: Callable[..., Result]) -> Callable[..., Awaitable[Result]]:
    """An RPC handler that runs ``func(**args)`` in an upkeep thread (heartbeats go on meanwhile)."""

    async def call(**args: Any) -> Result:
        return await run(functools.partial(func, **args))

    return call


def shutdown() -> None:
    """For tests: the threads go, a later call makes new ones."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        with contextlib.suppress(RuntimeError):
            pool.shutdown(wait=True)
