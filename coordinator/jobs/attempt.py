"""One attempt's own state, made fresh for each attempt (or read back after a daemon restart).

What is saved with the run's record (how far each rank's progress was read, the fingerprint
comparison, the step after which the replicas diverged) is the record's own object, so that
saving the record saves it; the rest lives only as long as the attempt."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field

from coordinator.jobs import catalog
from coordinator.jobs.effects import RunStore
from coordinator.jobs.fingerprints import Divergence, ReplicaCheck
from coordinator.jobs.record import JobRecord
from coordinator.jobs.straggler import StragglerDetector
from coordinator.jobs.training_health import LossWindow, Unsound
from shared.agent_api.progress import HeartbeatRecord


@dataclass
class Attempt:
    number: int
    order: list[str]
    start_step: int = 0
    progress_offsets: dict[int, int] = field(default_factory=dict)  # rank -> bytes of its progress read
    log_offsets: dict[int, int] = field(default_factory=dict)  # rank -> bytes of its output on the head
    known_checkpoints: dict[str, set[str]] = field(default_factory=dict)  # node -> names catalogued there
    dirs_seen: dict[str, str] = field(default_factory=dict)  # checkpoint directory -> its digest at the last poll
    # Each node's checkpoints' mark, as its ranks last reported it, and the marks, the head's time and
    # whether something was left unsettled at the last listing (catalog.listing_due): not saved, so a
    # restarted daemon lists at once.
    checkpoint_marks: dict[str, str] = field(default_factory=dict)
    listed_marks: dict[str, str] | None = None
    listed_at: float = 0.0
    listing_pending: bool = True
    replica_check: ReplicaCheck = field(default_factory=lambda: ReplicaCheck(0))
    divergence: Divergence | None = None  # the first divergence seen, which the attempt is stopped for
    diverged_after: int | None = None  # checkpoints of this attempt after this step are not valid
    rank_peaks: dict[str, int] = field(default_factory=dict)  # rank -> its RSS at the last poll, for its train points
    # The hang watch's view of each rank (not saved: a restarted daemon watches afresh).
    beats: dict[int, HeartbeatRecord] = field(default_factory=dict)  # rank -> its newest heartbeat
    beat_changed: dict[int, tuple[str, int | None, float]] = field(default_factory=dict)  # (phase, step, head time)
    node_time: dict[int, float] = field(default_factory=dict)  # rank -> its node's clock at the last poll
    process: dict[int, str | None] = field(default_factory=dict)  # rank -> its processes' state
    stopped_since: dict[int, float] = field(default_factory=dict)  # rank -> when it was first seen stopped
    # When a rank held stopped was last seen let go (head time): the hold is not time without progress.
    released_at: float | None = None
    # rank -> (CPU seconds of its processes, its node's time) of the reading the next is compared with
    cpu_read: dict[int, tuple[float, float]] = field(default_factory=dict)
    worked_at: dict[int, float] = field(default_factory=dict)  # rank -> when it was last seen working (its clock)
    rank_steps: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank -> its newest step, when (its clock)
    exited: set[int] = field(default_factory=set)  # ranks seen ended: their silence is no hang
    last_train: tuple[int, float] | None = None  # the newest train record's step and its own time
    # When the ranks that had failed were first seen to say only that they lost a peer (head clock).
    peer_lost_seen_at: float | None = None
    wired_baseline: dict[str, int] = field(default_factory=dict)  # Mac -> its wired memory before the ranks
    # The training's health: the first step whose values went wrong (the attempt is stopped for it),
    # the recent losses a spike is measured against, and whether a finite loss was seen yet.
    unsound: Unsound | None = None
    losses: LossWindow = field(default_factory=LossWindow)
    stragglers: StragglerDetector = field(default_factory=StragglerDetector)  # each rank's compute time, compared
    finite_loss_seen: bool = False
    ended_unread: bool = False  # it ended while some of its nodes could not be reached: what they hold is unread

    @classmethod
    def fresh(cls, number: int, order: list[str], record: JobRecord) -> Attempt:
        """A new attempt: its per-attempt fields in the record start afresh too."""
        attempt = cls(number, list(order), replica_check=ReplicaCheck(len(order)))
        record.progress_offsets = attempt.progress_offsets  # saved with the record
        record.rank_memory = {}
        record.stragglers, record.rank_compute, record.rank_scores, record.compute_heat = [], {}, {}, []
        record.replica_state = None
        record.diverged_after = None
        record.unsound = None
        return attempt

    @classmethod
    def resumed(cls, record: JobRecord, fx: RunStore, run_id: str) -> Attempt:
        """After a daemon restart: the head already holds the start of each rank's log, the
        record says how far the progress was read, and the catalog holds the attempt's
        checkpoints; none of them is fetched or judged again."""
        order = list(record.order)
        number = record.attempt
        offsets = record.progress_offsets  # the record's own: saving the record saves them
        known: dict[str, set[str]] = {}
        for c in fx.checkpoints(run_id):
            if c["attempt"] == number and catalog.role(c) != catalog.REPLICA:
                known.setdefault(c["node"], set()).add(posixpath.basename(c["path"]))
        return cls(number, order, record.start_step, progress_offsets=offsets,
                   log_offsets={rank: fx.log_size(run_id, number, rank) for rank in range(len(order))},
                   known_checkpoints=known,
                   replica_check=ReplicaCheck.from_state(len(order), record.replica_state),
                   diverged_after=record.diverged_after)
