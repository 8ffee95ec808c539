"""When a job's attempt ends: succeed, restart (with backoff) or fail. Pure, tested without processes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NotRequired, TypedDict

from shared.text import clean_excerpt

MAX_BACKOFF_S = 30.0
# 1 s, 2 s, 4 s ... capped at 30 s, like the node sessions' reconnects; those retry with tenacity,
# but the restart loop stays in the supervisor, because between attempts it has more to do than
# call a function again (stop ranks, choose a checkpoint), so only the delay is computed here.
# The exponent is capped too: 2 ** 5 already passes the cap, and a huge n must not build a huge int.
_MAX_EXPONENT = 16


SUCCEEDED, RANK_FAILED, NODE_LOST, HUNG, LAUNCH_FAILED, STOPPED, RESIZED, DIVERGED = (
    "succeeded", "rank_failed", "node_lost", "hung", "launch_failed", "stopped", "resized", "diverged")
# The training itself went wrong (coordinator/jobs/training_health.py): a loss or gradient norm that is
# NaN or infinite, or a loss spike the job asked to roll back from. Rolled back, not restarted.
NON_FINITE, LOSS_SPIKE = "non_finite", "loss_spike"
UNSOUND = (NON_FINITE, LOSS_SPIKE)


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended, as facts."""

    kind: str
    detail: str
    reached_first_step: bool
    signature: str = ""  # what failed, to tell "the same failure again" from a new one


class OutcomeEntry(TypedDict):
    """One attempt's outcome as the run's record keeps it (``JobRecord.history``, oldest first)."""

    kind: str
    detail: str
    reached_first_step: bool
    signature: NotRequired[str]  # absent from records written before outcomes had one
    attempt: int
    counted: bool  # its restart used up one of --max-restarts


def outcome_entry(outcome: Outcome, *, attempt: int, counted: bool) -> OutcomeEntry:
    return {"kind": outcome.kind, "detail": outcome.detail, "reached_first_step": outcome.reached_first_step,
            "signature": outcome.signature, "attempt": attempt, "counted": counted}


def outcome_of(entry: OutcomeEntry) -> Outcome:
    return Outcome(entry["kind"], entry["detail"], entry["reached_first_step"], entry.get("signature", ""))


@dataclass(frozen=True)
class Decision:
    action: str  # "succeed" | "restart" | "fail" | "stop"
    reason: str
    delay_s: float = 0.0
    counts: bool = True  # a restart the user asked for (coord resize) does not use up --max-restarts
    rollback: bool = False  # a restart from before a divergence: it uses up one of --max-rollbacks instead


@dataclass(frozen=True)
class Rollbacks:
    """A job's divergence policy and how much of it is used."""

    on_divergence: str = "rollback"  # or "stop" (training_health.ON_DIVERGENCE)
    used: int = 0
    limit: int = 3  # --max-rollbacks


def decide_unsound(outcome: Outcome, rollbacks: Rollbacks) -> Decision:
    """A run whose training went wrong (NaN, a spike asked to roll back from): back to the checkpoint
    before it, until --max-rollbacks are used; with --on-divergence stop, failed at once. Either way
    the detail names the step and the value."""
    if rollbacks.on_divergence == "stop":
        return Decision("fail", f"{outcome.detail} (--on-divergence stop)")
    if rollbacks.used >= rollbacks.limit:
        return Decision("fail", f"{outcome.detail}; gave up after {rollbacks.used} rollbacks "
                        f"(--max-rollbacks {rollbacks.limit})")
    return Decision("restart", outcome.detail, 0.0, counts=False, rollback=True)


def backoff(restarts_used: int) -> float:
    """``min(2 ** restarts_used, 30)`` seconds."""
    return min(2.0 ** min(restarts_used, _MAX_EXPONENT), MAX_BACKOFF_S)


def restart_delay(restarts_used: int) -> float:
    """The wait before a run's next attempt: none before its first restart, then 1 s doubling to 30 s.

    A single failure (a killed rank, a node that dropped out) is relaunched at once: that relaunch is
    the whole of a recovery's critical path, and a wait protects nothing there. A failure that keeps
    coming back backs off from the second restart on, so a loop of quick crashes does not spin."""
    return 0.0 if restarts_used <= 0 else backoff(restarts_used - 1)


def decide(outcome: Outcome, history: list[Outcome], *, max_restarts: int, restarts_used: int,
           rollbacks: Rollbacks | None = None) -> Decision:
    """``history`` holds the earlier attempts' outcomes, oldest first (not this one)."""
    if outcome.kind in UNSOUND:
        return decide_unsound(outcome, rollbacks or Rollbacks())
    if outcome.kind == SUCCEEDED:
        return Decision("succeed", outcome.detail)
    if outcome.kind == STOPPED:
        return Decision("stop", outcome.detail)
    if outcome.kind == RESIZED:
        return Decision("restart", outcome.detail, 0.0, counts=False)
    previous = history[-1] if history else None
    # A node that is away is waited for, not a deterministic error: it may fail a launch again
    # before the session notices it is gone (signature "node:NAME").
    if (not outcome.reached_first_step and previous is not None and not previous.reached_first_step
            and previous.kind == outcome.kind and previous.signature == outcome.signature
            and not outcome.signature.startswith("node:")):
        return Decision("fail", f"failed twice in a row before its first step with the same error: {outcome.detail}")
    if restarts_used >= max_restarts:
        return Decision("fail", f"{outcome.detail}; no restarts left ({restarts_used} of {max_restarts} used)")
    return Decision("restart", outcome.detail, restart_delay(restarts_used))


def after_the_last_step(outcome: Outcome, *, total_steps: int | None, step: int,
                        final_checkpoint: int | None) -> Outcome:
    """A rank that failed or hung only after the work was done counts as the work done.

    Gloo can abort a worker at interpreter exit ("terminate called without an active exception",
    SIGABRT) after its last step and the final save; a restart would only find that the newest valid
    checkpoint is the last step and succeed at once, one restart later. So when every step ran
    (``step``: the run's reported progress) and a checkpoint of the last step is valid (written by
    every rank it needs, validated where it lies), the attempt succeeded, and its detail says what
    failed after. Without such a checkpoint the restart stands: what the script does after its last
    step (the final save) may be what failed, and only a rerun redoes it."""
    if (outcome.kind not in (RANK_FAILED, HUNG) or total_steps is None or step < total_steps
            or final_checkpoint is None or final_checkpoint < total_steps):
        return outcome
    return Outcome(SUCCEEDED, f"every step ran ({total_steps} of {total_steps}) and the checkpoint of step "
                   f"{final_checkpoint} is valid; then {outcome.detail}", outcome.reached_first_step,
                   outcome.signature)


#: What a rank prints when it fails only because a peer went away first: never the root cause
#: while a rank that failed on its own is known.
PEER_LOST_MARKERS = ("connection to a peer was lost", "was closed by the peer", "Connection reset by peer",
                     "Broken pipe", "Connection closed by peer")  # the last: Gloo's


def peer_lost(text: str) -> bool:
    """Whether a rank's last words say it lost a peer (it did not fail on its own)."""
    return any(marker in text for marker in PEER_LOST_MARKERS)


#: How long the ranks that failed only because they lost a peer wait for the rank that failed on its
#: own to end and say why: its launcher may still be taking its other workers down.
PEER_LOST_GRACE_S = 3.0


def awaits_root_cause(cause: str, others_running: bool, waited_s: float) -> bool:
    """Whether an attempt whose failed ranks (``cause``: the best of their last words) only lost a peer
    waits a moment longer for a rank still running to fail with its own error."""
    return others_running and peer_lost(cause) and waited_s < PEER_LOST_GRACE_S
#: Exit statuses of a rank stopped by the launcher or a hung-up ssh (SIGTERM, SIGHUP).
STOPPED_FROM_OUTSIDE = (143, 129)


#: The longest excerpt of a rank's output an outcome, an event or an alert carries.
EXCERPT_CHARS = 300


@dataclass(frozen=True)
class RankFailure:
    rank: int
    node: str
    status: int
    last_line: str = ""  # the last line of its output, as ``last_line`` cuts it


def last_line(output: str) -> str:
    """The last line of a rank's output with anything on it, as coord shows it in an event, an alert,
    the dashboard and coord status: without the terminal's escape sequences and control characters
    (cleaned before it is cut, so that they take no room), at most EXCERPT_CHARS long."""
    lines = [line for line in map(clean_excerpt, output.splitlines()) if line]
    return lines[-1][:EXCERPT_CHARS] if lines else ""


def clean_line(text: str) -> str:
    """One line of text from a rank (its first), as an excerpt: cleaned, at most EXCERPT_CHARS long."""
    return last_line(text.strip().splitlines()[0] if text.strip() else "")


_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):\n(?P<block>.*?)(?:\n=+|\Z)", re.S)


def launcher_root_cause(output: str) -> str | None:
    """The first failure a torch launcher names in its summary (torchrun's ``ChildFailedError``: the
    worker's rank, its exit code and the last line of its traceback), as one line; None without one.
    The launcher's own last line is its separator, which says nothing."""
    found = _ROOT_CAUSE.findall(output)
    if not found:
        return None
    block = found[-1]
    fields: dict[str, str] = {}
    key = None
    for line in block.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("rank", "exitcode", "error_file", "traceback", "host", "time"):
            key = name.strip()
            fields[key] = value.strip()
        elif key == "traceback" and line.strip():
            fields["traceback"] = line.strip()  # its last line: the exception
    rank = fields.get("rank", "?").split(" (")[0]
    said = fields.get("traceback") or f"exitcode {fields.get('exitcode', '?')}"
    if said.startswith("Traceback") or said.startswith("To enable traceback"):
        said = f"exitcode {fields.get('exitcode', '?')}"
    return clean_line(f"worker rank {rank} failed: {said}")


def root_cause(failures: list[RankFailure]) -> RankFailure:
    """The rank that died on its own, not the peers that lost it or that were stopped after it:
    a rank whose last words are a lost peer, or that was SIGTERMed/SIGHUPed, comes last; then
    the lowest rank."""
    return min(failures, key=lambda f: (peer_lost(f.last_line),
                                        f.status in STOPPED_FROM_OUTSIDE, f.rank))
