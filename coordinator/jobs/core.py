"""The supervisor's decisions, as pure functions over plain data.

The supervisor loop (``coordinator.jobs.supervisor``) gathers facts through its effects and
asks these functions what they mean: how the ranks' reports classify into an attempt's
outcome, whether a resize is due, what a run's identity is. The restart policy itself is
``coordinator.jobs.policy``; whether a run hangs, ``coordinator.jobs.hang``. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.jobs.policy import LAUNCH_FAILED, NODE_LOST, RANK_FAILED, SUCCEEDED

LAUNCH_GRACE_S = 30.0  # how long ranks may take to appear once the launcher has exited
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}-[0-9a-f]{8}$")


def new_run_id(name: str, taken: set[str] | frozenset[str] = frozenset(),
               token: Callable[[int], str] = secrets.token_hex) -> str:
    """A run id unique for the cluster's life: the job's name and 32 random bits. Random, not
    counted, so that a daemon with a new state dir never meets an earlier run's files on a node."""
    while True:
        run_id = f"{name}-{token(4)}"
        if run_id not in taken:
            return run_id


@dataclass(frozen=True)
class RankReport:
    """One rank as its node's agent reported it."""

    rank: int
    node: str
    state: str  # "starting" | "running" | "exited" | "vanished"
    exit: int | None = None
    detected_after: float | None = None  # the rank's exit to the poll that saw it, node clock
    worker_error: str | None = None  # what a torch launcher's worker said it died of (its error file)


@dataclass(frozen=True)
class Verdict:
    """How an attempt ended, before the supervisor adds the failing ranks' last words."""

    kind: str
    detail: str
    signature: str
    failures: tuple[RankReport, ...] = ()
    detected_after: float | None = None


def classify_ranks(reports: list[RankReport], *, ranks: int, step: int, total_steps: int | None,
                   launcher_exit: int | None, since_launch: float) -> Verdict | None:
    """The attempt's end from every rank's report (None: it is still running)."""
    vanished = next((r for r in reports if r.state == "vanished"), None)
    if vanished is not None:
        return Verdict(RANK_FAILED, f"rank {vanished.rank} on {vanished.node} disappeared without an exit status",
                       "vanished")
    failures = tuple(r for r in reports if r.state == "exited" and r.exit != 0)
    if failures:
        delays = [r.detected_after for r in failures if r.detected_after is not None]
        return Verdict(RANK_FAILED, "", "", failures, max(delays) if delays else None)
    exited = [r for r in reports if r.state == "exited"]
    if len(exited) == ranks:
        if total_steps is None or step >= total_steps:
            return Verdict(SUCCEEDED, "every rank finished", "")
        return Verdict(RANK_FAILED, f"every rank exited 0 at step {step} of {total_steps}", "early-exit")
    starting = [r for r in reports if r.state == "starting"]
    if starting and launcher_exit is not None and since_launch > LAUNCH_GRACE_S:
        # mlx.launch is gone and some ranks never started: nothing will start them now.
        names = ", ".join(f"{r.rank} on {r.node}" for r in starting)
        return Verdict(LAUNCH_FAILED, f"mlx.launch exited with status {launcher_exit} and rank {names} never "
                       "started", f"launcher-exit:{launcher_exit}")
    return None


def node_lost(rank: int, node: str, reason: str | None) -> Verdict:
    return Verdict(NODE_LOST, f"node {node} (rank {rank}) lost: {reason}", f"node:{node}")


@dataclass(frozen=True)
class ResizeVerdict:
    pending: bool  # still waiting for the next checkpoint
    reason: str | None  # relaunch now, for this reason
    skipped: str | None = None  # the request was dropped, and why


def resize_due(requested_after: int | None, up: list[str], order: list[str],
               last_checkpoint_step: int | None) -> ResizeVerdict:
    """coord resize relaunches on every node that is up, once a checkpoint newer than the request
    exists (so that nothing is redone)."""
    if requested_after is None:
        return ResizeVerdict(False, None)
    if set(up) == set(order):
        return ResizeVerdict(False, None, f"already running on every node that is up ({', '.join(up)})")
    if last_checkpoint_step is None or last_checkpoint_step <= requested_after:
        return ResizeVerdict(True, None)
    return ResizeVerdict(False, f"resize requested: relaunching on {', '.join(up)} from the checkpoint of step "
                         f"{last_checkpoint_step}")


def unreachable_error(code: str) -> bool:
    """A call that failed because the node could not be reached (not because it refused)."""
    return code in ("connection_lost", "timeout")


def describe_exception(exc: BaseException, where: str) -> str:
    """Words for a failure nobody expected: the component and the cause, never a bare class name
    of an exception group."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, BaseExceptionGroup):
        causes = "; ".join(describe_exception(e, where).split(": ", 1)[-1] for e in exc.exceptions[:3])
        return f"{where}: {causes}"
    text = str(exc) or exc.__class__.__name__
    return f"{where}: {text} ({exc.__class__.__name__})"
