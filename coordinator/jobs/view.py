"""A run as coord shows it: ``coord status``'s job entries, the dashboard's runs, the job commands' answers."""

from __future__ import annotations

from typing import TypedDict

from coordinator.jobs.diagnosis import RunDiagnosis
from coordinator.jobs.record import Durability
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.spec import progress_note
from coordinator.jobs.states import FINISHED
from coordinator.jobs.straggler import StragglerEntry


class WaitingView(TypedDict):
    """What a run waits for before its next attempt: the nodes not up, each with why, for how long."""

    nodes: list[str]
    reasons: dict[str, str]  # node -> why it is not up
    why: str
    waited_s: float
    limit_s: float  # the job's --node-wait: it fails after this long


class RunView(TypedDict):
    """``JobRunner.view()``."""

    name: str
    run_id: str
    state: str
    step: int
    total_steps: int | None
    loss: float | None
    val_loss: float | None
    tokens_per_second: float | None
    eta_s: float | None  # while running, from the step time
    last_checkpoint_step: int | None
    last_checkpoint_age_s: float | None
    restarts: int
    max_restarts: int
    attempt: int  # the attempt launched last; -1 before the first launch
    error: str | None
    warning: str | None
    nodes: list[str]  # the current attempt's nodes, rank by rank
    batch: str | None  # the attempt's batch split, when a shrink changed it
    trainer: str
    replica: str
    min_nodes: int | None
    diagnoses: list[RunDiagnosis]
    resumes: int
    rank_memory_bytes: dict[str, int]  # rank -> its latest RSS, while running
    started: float
    command: list[str]
    job_nodes: list[str]  # the nodes the job holds
    priority: int
    queue_position: int | None  # while queued
    waiting: WaitingView | None  # while its nodes are waited for
    hang_watch: str | None  # why the run is not watched for hangs (its ranks never reported progress), and the fix
    note: str | None  # what coord waits out while the run goes on (head_disconnected: the head lost its path)
    rollbacks: int  # rollbacks after a divergence (NaN loss), beside restarts
    max_rollbacks: int
    stragglers: list[StragglerEntry]  # the ranks named stragglers now, while running
    rank_compute_seconds: dict[str, float]  # rank -> its compute time per step over the window, while running
    rank_scores: dict[str, float]  # rank -> that time over the ranks' median (1.5 names it, under 1.25 clears it)
    durability: Durability | None  # with a checkpoint store: durable up to which step, the lag, the speed


def run_view(ctx: RunContext, *, queue_position: int | None) -> RunView:
    record, spec, state = ctx.record, ctx.spec, ctx.state
    eta = None
    if record.step_seconds and spec.total_steps and state == "running":
        eta = record.step_seconds * max(0, spec.total_steps - record.step)
    last = record.last_checkpoint
    return {"name": spec.name, "run_id": ctx.run_id, "state": state, "step": record.step,
            "total_steps": spec.total_steps, "loss": record.loss, "val_loss": record.val_loss,
            "tokens_per_second": record.tokens_per_second, "eta_s": eta,
            "last_checkpoint_step": last["step"] if last else None,
            "last_checkpoint_age_s": ctx.fx.now() - last["time"] if last else None,
            "restarts": record.restarts, "max_restarts": spec.max_restarts,
            "attempt": record.attempt, "error": record.error, "warning": record.warning,
            "nodes": record.order, "batch": record.batch, "trainer": spec.trainer,
            "replica": spec.replica, "min_nodes": spec.min_nodes,
            "diagnoses": record.diagnoses, "resumes": record.resumes,
            "rank_memory_bytes": dict(record.rank_memory or {}) if state == "running" else {},
            "started": record.started, "command": spec.command,
            "job_nodes": ctx.job_nodes(), "priority": spec.priority,
            "queue_position": queue_position if state == "queued" else None,
            "waiting": _waiting(ctx),
            "hang_watch": progress_note(spec) if not record.progress_seen and state not in FINISHED else None,
            "note": record.note if state not in FINISHED else None,
            "rollbacks": record.rollbacks, "max_rollbacks": spec.max_rollbacks,
            "stragglers": [e.copy() for e in record.stragglers] if state == "running" else [],
            "rank_compute_seconds": dict(record.rank_compute) if state == "running" else {},
            "rank_scores": dict(record.rank_scores) if state == "running" else {},
            "durability": record.durability.copy() if record.durability else None}


def _waiting(ctx: RunContext) -> WaitingView | None:
    waiting = ctx.waiting
    if waiting is None:
        return None
    return {"nodes": waiting.nodes, "reasons": waiting.reasons, "why": waiting.why,
            "waited_s": max(0.0, ctx.fx.now() - waiting.since), "limit_s": waiting.limit_s}
