"""What the store keeps of a run between daemon restarts: one typed record, to and from JSON.

The JSON is the store's (``runs.record``); its keys are the field names, so records written by
an older coord read back as they were (a key it did not write takes the field's default) and
a key this coord does not know is kept as it was (``extra``), never dropped."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, TypedDict

from coordinator.jobs.diagnosis import RunDiagnosis
from coordinator.jobs.fingerprints import ReplicaState, ReplicaSummary
from coordinator.jobs.policy import OutcomeEntry
from coordinator.jobs.straggler import StragglerEntry
from coordinator.launch.seam import LaunchLinks

# The record as the store keeps it: JSON, with whatever keys a newer coord added.
JsonObject = dict[str, Any]


class UnsoundEntry(TypedDict):
    """The step where the current attempt's training went wrong (training_health.Unsound), saved before
    its ranks are stopped, so that a daemon restarted meanwhile still rolls back from it."""

    kind: str  # policy.NON_FINITE or policy.LOSS_SPIKE
    step: int
    metric: str
    value: float
    detail: str


class Durability(TypedDict):
    """How far the run's checkpoints are in the checkpoint store (coordinator/jobs/durability.py)."""

    store: str  # the store's URL for this run (no credentials: there are none in it)
    durable_step: int | None  # the newest checkpoint committed there
    lag_steps: int  # the newest valid checkpoint's step over it
    lag_seconds: float  # how long the oldest checkpoint not yet there has waited
    bytes_per_s: float | None  # the last upload's speed
    error: str | None  # the last upload's failure, until one succeeds


class LastCheckpoint(TypedDict):
    """The newest valid checkpoint of the run, as coord status ages it."""

    step: int
    time: float  # when it was validated
    node: str


@dataclass
class JobRecord:
    run_id: str
    attempt: int = -1  # the attempt launched last; -1 before the first launch
    restarts: int = 0
    step: int = 0
    total_steps: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    tokens_per_second: float | None = None
    peak_memory_gb: float | None = None
    history: list[OutcomeEntry] = field(default_factory=list)  # each attempt's Outcome, oldest first
    order: list[str] = field(default_factory=list)  # the nodes of the current attempt, rank by rank
    world_size: int | None = None  # the current attempt's processes (a torch launcher runs several per node)
    backend: LaunchLinks | None = None  # the current attempt's backend, transport and links
    start_step: int = 0
    launcher_pid: int | None = None
    error: str | None = None
    warning: str | None = None
    started: float = 0.0
    submitted: float | None = None
    step_seconds: float | None = None
    last_progress: float | None = None
    first_step_at: float | None = None
    launched_at: float | None = None
    last_checkpoint: LastCheckpoint | None = None
    progress_offsets: dict[int, int] = field(default_factory=dict)  # rank -> bytes of its progress read
    rank_memory: dict[str, int] = field(default_factory=dict)  # rank -> its latest RSS
    unstopped: list[list[Any]] = field(default_factory=list)  # [node, attempt, rank] left on nodes that were away
    uncatalogued: list[list[Any]] = field(default_factory=list)  # [node, attempt, start step(, role)] to list later
    diverged_after: int | None = None  # the attempt's replicas diverged after this step: later checkpoints are invalid
    replica_state: ReplicaState | None = None  # the attempt's fingerprint comparison so far
    replica_check: ReplicaSummary | None = None  # what the comparisons found, for the plan
    batch: str | None = None  # the attempt's batch split, when a shrink changed it
    diagnoses: list[RunDiagnosis] = field(default_factory=list)
    resumes: int = 0  # how many times coord run --resume continued this run
    stop_requested: bool = False
    failed_at: float | None = None  # when the first failed attempt since the last step ended (a recovery is under way)
    recoveries: list[float] = field(default_factory=list)  # seconds from a failure to the next first step
    # The hang watch (coordinator/jobs/hang.py): whether the run's ranks were seen writing progress
    # (a script that never does is never called hung), the last attempt's launch to first step, the
    # time between new steps as the head sees them, and the model's size (from pre-flight).
    progress_seen: bool = False
    first_step_seconds: float | None = None
    step_gap: float | None = None
    model_bytes: int | None = None
    # The training's health (coordinator/jobs/training_health.py): the current attempt's divergence,
    # the rollbacks used, batches to skip when resuming from a step (its checkpoint step -> batches,
    # after rollbacks to it), and the skip the next launch owes.
    unsound: UnsoundEntry | None = None
    rollbacks: int = 0
    skips: dict[str, int] = field(default_factory=dict)
    skip_owed: int = 0
    # The watch of stragglers (coordinator/jobs/straggler.py): the ranks named now, and each rank's
    # compute time per step over the window (rank -> seconds) and its score (over the ranks' median),
    # for coord status and /metrics.
    stragglers: list[StragglerEntry] = field(default_factory=list)
    rank_compute: dict[str, float] = field(default_factory=dict)
    rank_scores: dict[str, float] = field(default_factory=dict)
    # The dashboard's rank x step heatmap: [step, [each rank's compute time or None]], the newest last.
    compute_heat: list[list[Any]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # nodes shrunk out as stragglers (--straggler-policy drop)
    durability: Durability | None = None  # with a checkpoint store: how far behind it is
    # What coord cannot see now but waits out, said beside the state (coord status): the head's lost path.
    note: str | None = None
    extra: JsonObject = field(default_factory=dict)  # keys of a newer coord, kept as they were

    def add_warning(self, text: str) -> None:
        """A warning beside any the run has already (a missing replica, a rank failed after its last step)."""
        self.warning = f"{self.warning}; {text}" if self.warning else text

    def to_json(self) -> JsonObject:
        # Every field holds JSON data (TypedDicts, lists, numbers), so a copy of the containers is
        # all dataclasses.asdict would do, at a fraction of its cost: the record is saved on every poll.
        data = {name: _copied(getattr(self, name)) for name in _SAVED}
        data["progress_offsets"] = {str(rank): offset for rank, offset in self.progress_offsets.items()}
        return {**_copied(self.extra), **data}

    @classmethod
    def from_json(cls, data: JsonObject) -> JobRecord:
        known = {f.name for f in fields(cls)} - {"extra"}
        # A null where the field cannot be null (an older record's gap) takes the field's default.
        values = {key: value for key, value in data.items()
                  if key in known and (value is not None or key in _NULLABLE)}
        values["progress_offsets"] = {int(rank): int(offset)
                                      for rank, offset in (data.get("progress_offsets") or {}).items()}
        for key in ("unstopped", "uncatalogued", "history", "diagnoses", "recoveries", "order", "dropped"):
            values[key] = list(data.get(key) or [])
        values["rank_memory"] = dict(data.get("rank_memory") or {})
        values["stragglers"] = list(data.get("stragglers") or [])
        values["rank_compute"] = dict(data.get("rank_compute") or {})
        values["rank_scores"] = dict(data.get("rank_scores") or {})
        values["compute_heat"] = list(data.get("compute_heat") or [])
        values["skips"] = dict(data.get("skips") or {})
        return cls(**values, extra={key: value for key, value in data.items() if key not in known})

    def continued(self, total_steps: int | None) -> JobRecord:
        """The record of a run continued with coord run --resume: its attempts, checkpoints and
        progress stay; its restarts, outcomes and error start afresh (the new attempts get their
        own budget)."""
        return JobRecord(run_id=self.run_id, attempt=self.attempt, step=self.step, loss=self.loss,
                         tokens_per_second=self.tokens_per_second, started=self.started,
                         last_checkpoint=self.last_checkpoint, replica_check=self.replica_check,
                         diagnoses=list(self.diagnoses), order=list(self.order), unstopped=list(self.unstopped),
                         uncatalogued=list(self.uncatalogued), total_steps=total_steps, resumes=self.resumes + 1,
                         progress_seen=self.progress_seen, first_step_seconds=self.first_step_seconds,
                         step_gap=self.step_gap, model_bytes=self.model_bytes, skips=dict(self.skips))


_NULLABLE = {f.name for f in fields(JobRecord) if f.default is None}
_SAVED = tuple(f.name for f in fields(JobRecord) if f.name != "extra")


def _copied(value: Any) -> Any:
    """A copy of JSON data down to its leaves, so a saved record never shares a list with the live one."""
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copied(item) for item in value]
    return value
