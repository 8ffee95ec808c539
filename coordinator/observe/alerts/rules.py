"""Which alerts the daemon's events and facts call for. Pure: plain data in, alerts out.

An event (``job.failed``, ``job.succeeded``, ``job.restart``) becomes at most one alert the
moment it is recorded. Two alerts are about time passing, not events: a job with no progress
for N minutes (``job_stalled``) and a node down for longer than N minutes (``node_down``).
Their timers are functions of the facts, a clock value and what was already alerted, so that
each stall and each down period is alerted once, and tests move the clock by hand.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from coordinator.config.cluster_file import AlertSettings

if TYPE_CHECKING:
    from coordinator.store.state import EventRecord

JOB_FAILED, JOB_SUCCEEDED, JOB_RESTARTED, JOB_STALLED, NODE_DOWN, DIVERGED, LOSS_SPIKE = (
    "job_failed", "job_succeeded", "job_restarted", "job_stalled", "node_down", "diverged", "loss_spike")
# A rank that holds the others back (job.straggler), and its resolve when it recovers
# (job.straggler_cleared): a destination that asks for ``straggler`` gets both.
STRAGGLER, STRAGGLER_RESOLVED = "straggler", "straggler_resolved"
DURABILITY_LAG = "durability_lag"  # checkpoints not reaching the store (job.durability_lag)
# The daemon's event kinds that are alerts in themselves. A job that gives up (no restarts
# left, or the same failure twice before its first step) records job.failed like any failed job.
# A rollback after a NaN (job.diverged) and a loss spike (job.loss_spike) say the training itself
# went wrong while every process was fine.
EVENT_ALERTS = {"job.failed": JOB_FAILED, "job.succeeded": JOB_SUCCEEDED, "job.restart": JOB_RESTARTED,
                "job.diverged": DIVERGED, "job.loss_spike": LOSS_SPIKE, "job.straggler": STRAGGLER,
                "job.straggler_cleared": STRAGGLER_RESOLVED, "job.durability_lag": DURABILITY_LAG}
_TITLES = {JOB_RESTARTED: "restarted", DIVERGED: "diverged and rolled back", LOSS_SPIKE: "had a loss spike",
           STRAGGLER: "has a straggler", STRAGGLER_RESOLVED: "straggler resolved",
           DURABILITY_LAG: "checkpoints are not reaching the store"}
# States in which a run is expected to make progress; a queued or finished run is not stalled.
PROGRESSING = ("starting", "running", "recovering")


@dataclass(frozen=True)
class RunFacts:
    """What an alert says about a run, taken from its supervisor."""

    run_id: str
    name: str
    state: str
    step: int = 0
    total_steps: int | None = None
    restarts: int = 0
    max_restarts: int = 0
    error: str | None = None
    last_progress: float | None = None  # wall-clock time of the newest step reported
    launched_at: float | None = None
    started: float | None = None


@dataclass(frozen=True)
class NodeFacts:
    name: str
    up: bool
    reason: str | None = None


class AlertDetails(TypedDict, total=False):
    """What an alert adds about its run (state, steps, restarts) or its node (since when it is down)."""

    state: str
    step: int
    total_steps: int | None
    restarts: int
    max_restarts: int
    last_progress: float  # job_stalled: the progress its alert is about
    down_since: float  # node_down


@dataclass(frozen=True)
class Alert:
    kind: str  # one of coordinator.config.cluster_file.ALERT_EVENTS
    title: str
    message: str
    cluster: str
    time: float
    job: str | None = None
    run_id: str | None = None
    node: str | None = None
    reason: str | None = None
    details: AlertDetails = field(default_factory=AlertDetails)


def wants(settings: AlertSettings, kind: str) -> bool:
    """Whether a destination takes ``kind``: a straggler's resolve goes where the straggler went."""
    return kind in settings.on or (kind == STRAGGLER_RESOLVED and STRAGGLER in settings.on)


def alert_for_event(event: EventRecord, run: RunFacts | None, cluster: str) -> Alert | None:
    """The alert one recorded event is, if any. ``run`` is the event's run as it is now."""
    kind = EVENT_ALERTS.get(event.get("kind", ""))
    if kind is None:
        return None
    data = event.get("data") or {}
    name = run.name if run else None
    said = _without_prefix(event.get("message", ""), name)
    run_id = run.run_id if run else data.get("run")
    details = _run_details(run) if run else AlertDetails()
    job = name or run_id or "?"
    if kind == JOB_FAILED:
        reason = (run.error if run and run.error else None) or said
        return Alert(JOB_FAILED, f"{cluster}: job {job} failed", f"run {run_id} failed{_where(run)}: {reason}",
                     cluster, event["ts"], name, run_id, reason=reason, details=details)
    if kind == JOB_SUCCEEDED:
        return Alert(JOB_SUCCEEDED, f"{cluster}: job {job} succeeded", f"run {run_id} {said}", cluster, event["ts"],
                     name, run_id, reason=None, details=details)
    return Alert(kind, f"{cluster}: job {job} {_TITLES[kind]}", f"run {run_id}: {said}", cluster, event["ts"],
                 name, run_id, reason=said, details=details)


def track_down_since(down_since: Mapping[str, float], nodes: Iterable[NodeFacts], now: float) -> dict[str, float]:
    """Since when each node has not been up (connecting and installing count: it is not usable).
    A node that is up is dropped; one seen not up for the first time starts at ``now``."""
    return {node.name: down_since.get(node.name, now) for node in nodes if not node.up}


def note_node_state(down_since: Mapping[str, float], node: str, up: bool, at: float) -> dict[str, float]:
    """A node's state change as it happens (its ``node.STATE`` event), so that an outage that
    begins or ends between two looks at the facts is timed from its real start."""
    changed = {name: since for name, since in down_since.items() if name != node}
    if not up:
        changed[node] = down_since.get(node, at)
    return changed


def node_down_alerts(nodes: Iterable[NodeFacts], down_since: Mapping[str, float], now: float, *,
                     threshold_s: float, alerted: Mapping[str, float], cluster: str
                     ) -> tuple[list[Alert], dict[str, float]]:
    """Nodes down for longer than ``threshold_s`` and not yet alerted in this outage; and what is
    alerted now (node -> the start of the outage alerted), so that the next outage of a node that
    came back is alerted again."""
    alerts: list[Alert] = []
    seen: dict[str, float] = {}
    for node in nodes:
        since = down_since.get(node.name)
        if since is None:
            continue
        if alerted.get(node.name) == since:
            seen[node.name] = since
            continue
        if now - since <= threshold_s:
            continue
        why = f": {node.reason}" if node.reason else ""
        alerts.append(Alert(NODE_DOWN, f"{cluster}: node {node.name} is down",
                            f"{node.name} has been down for {_duration(now - since)}{why}", cluster, now,
                            node=node.name, reason=node.reason, details={"down_since": since}))
        seen[node.name] = since
    return alerts, seen


def stall_reference(run: RunFacts) -> float | None:
    """When the run last moved: its newest step, else its launch, else its start."""
    return run.last_progress or run.launched_at or run.started


def stalled_alerts(runs: Iterable[RunFacts], now: float, *, threshold_s: float, alerted: Mapping[str, float],
                   cluster: str) -> tuple[list[Alert], dict[str, float]]:
    """Runs that should progress and have not for longer than ``threshold_s``, each alerted once per
    stall: ``alerted`` maps a run to the progress time its alert was about, so that a run that moves
    again and then stalls again is alerted again."""
    alerts: list[Alert] = []
    seen: dict[str, float] = {}
    for run in runs:
        since = stall_reference(run)
        if run.state not in PROGRESSING or since is None:
            continue
        if alerted.get(run.run_id) == since:
            seen[run.run_id] = since
            continue
        if now - since <= threshold_s:
            continue
        where = f" (at step {run.step}" + (f" of {run.total_steps}" if run.total_steps else "") + ")"
        alerts.append(Alert(JOB_STALLED, f"{cluster}: job {run.name} stalled",
                            f"run {run.run_id} has made no progress for {_duration(now - since)}{where}, "
                            f"state {run.state}", cluster, now, run.name, run.run_id,
                            reason=f"no progress for {_duration(now - since)}",
                            details={**_run_details(run), "last_progress": since}))
        seen[run.run_id] = since
    return alerts, seen


def _run_details(run: RunFacts) -> AlertDetails:
    return {"state": run.state, "step": run.step, "total_steps": run.total_steps, "restarts": run.restarts,
            "max_restarts": run.max_restarts}


def _where(run: RunFacts | None) -> str:
    if run is None:
        return ""
    step = f" at step {run.step}" + (f" of {run.total_steps}" if run.total_steps else "")
    restarts = f" after {run.restarts} restart{'s' if run.restarts != 1 else ''}"
    return step + restarts


def _without_prefix(message: str, name: str | None) -> str:
    """Job events read "NAME: what happened"; an alert names the job on its own."""
    prefix = f"{name}: " if name else None
    return message[len(prefix):] if prefix and message.startswith(prefix) else message


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes = seconds / 60
    return f"{minutes:.0f} minutes" if minutes < 120 else f"{minutes / 60:.1f} hours"
