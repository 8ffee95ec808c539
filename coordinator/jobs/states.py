"""A run's states, and which changes between them are allowed.

One table, after supervisor's ``states.py``: every change of a run's state goes through
``check_transition``, and a change the table does not list raises ``IllegalTransition`` (a
bug: the supervisor's edge turns it into a failed run that says so, and the fault simulator
fails on it). The values are the strings the store, the wire and ``coord status`` have always
used, so a ``JobState`` compares equal to its name.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "queued"  # waits for its nodes (another job holds them)
    PENDING = "pending"  # its nodes are free: about to sync and check
    SYNCING = "syncing"
    PREFLIGHT = "preflight"
    STARTING = "starting"  # an attempt is being launched
    RUNNING = "running"
    RECOVERING = "recovering"  # between two attempts
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


ACTIVE: tuple[JobState, ...] = (JobState.QUEUED, JobState.PENDING, JobState.PREFLIGHT, JobState.SYNCING,
                                JobState.STARTING, JobState.RUNNING, JobState.RECOVERING)
FINISHED: tuple[JobState, ...] = (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)

_S = JobState
# Any state a run is active in may end as failed (an error nobody foresaw) or stopped (coord stop).
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _S.QUEUED: frozenset({_S.PENDING, _S.STOPPED, _S.FAILED}),
    _S.PENDING: frozenset({_S.SYNCING, _S.PREFLIGHT, _S.STOPPED, _S.FAILED}),
    _S.SYNCING: frozenset({_S.PREFLIGHT, _S.STOPPED, _S.FAILED}),
    _S.PREFLIGHT: frozenset({_S.STARTING, _S.STOPPED, _S.FAILED}),
    # An attempt that could not be launched is recovered from like any other; one whose checkpoint
    # is already the last step is running (and then succeeded) at once.
    _S.STARTING: frozenset({_S.RUNNING, _S.RECOVERING, _S.SUCCEEDED, _S.STOPPED, _S.FAILED}),
    _S.RUNNING: frozenset({_S.RECOVERING, _S.SUCCEEDED, _S.STOPPED, _S.FAILED}),
    _S.RECOVERING: frozenset({_S.STARTING, _S.SUCCEEDED, _S.STOPPED, _S.FAILED}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.STOPPED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


def check_transition(current: str, new: str) -> JobState:
    """``new`` as a JobState, when a run in ``current`` may go there (staying is always allowed: a save)."""
    try:
        target, source = JobState(new), JobState(current)
    except ValueError as exc:
        raise IllegalTransition(f"unknown job state: {exc}") from None
    if target != source and target not in TRANSITIONS[source]:
        raise IllegalTransition(f"a run cannot go from {source} to {target}")
    return target
