"""The progress records a rank appends to $COORD_PROGRESS_FILE, as its supervisor reads them
(coordinator/jobs/progress.py): kept with the fields coord reads, or skipped, never fatal."""

from __future__ import annotations

from coordinator.jobs.attempt import Attempt
from coordinator.jobs.fingerprints import ReplicaCheck
from coordinator.jobs.progress import read_record
from coordinator.jobs.rank_watch import RankWatcher
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.spec import JobSpec


def test_coords_own_records_are_kept_as_written():
    train = {"kind": "train", "step": 12, "loss": 1.25, "tokens_per_second": 900, "learning_rate": 1e-5,
             "peak_memory_gb": 3.5, "samples_per_second": 48.0, "comm_seconds": 0.02, "time": 1700000000.5}
    assert read_record(train) == train
    assert read_record({"kind": "val", "step": 10, "val_loss": 2.0}) == {"kind": "val", "step": 10, "val_loss": 2.0}
    fingerprint = {"kind": "fingerprint", "step": 8, "rank": 1, "sha256": "a" * 64}
    assert read_record(fingerprint) == fingerprint
    assert read_record({"kind": "checkpoint", "step": 20, "file": "0000020_adapters.safetensors", "bytes": 10,
                        "blocking_seconds": 0.01, "write_seconds": 0.5}) == {
        "kind": "checkpoint", "step": 20, "blocking_seconds": 0.01, "write_seconds": 0.5}


def test_a_scripts_own_train_record_may_carry_its_step_alone_and_what_is_not_a_number_is_left_out():
    assert read_record({"kind": "train", "step": 3}) == {"kind": "train", "step": 3}
    assert read_record({"kind": "train", "step": 3.0, "loss": "low", "tokens_per_second": True, "time": "now"}) == {
        "kind": "train", "step": 3}


def test_records_without_what_coord_reads_are_skipped():
    for line in ({"kind": "train", "loss": 1.0}, {"kind": "train", "step": "3"}, {"kind": "train", "step": None},
                 {"kind": "train", "step": float("nan")}, {"kind": "train", "step": float("inf")},
                 {"kind": "val", "step": 3}, {"kind": "val", "step": 3, "val_loss": "x"},
                 {"kind": "fingerprint", "step": 3, "rank": 0}, {"kind": "fingerprint", "step": 3, "sha256": "a"},
                 {"kind": "checkpoint", "step": 3, "blocking_seconds": 0.1}, {"kind": "eval", "step": 3}, {},
                 {"kind": "heartbeat", "time": 1.0}, {"kind": "heartbeat", "phase": "training"},
                 {"kind": "heartbeat", "phase": "Training!", "time": 1.0},
                 {"kind": "heartbeat", "phase": "x" * 33, "time": 1.0}):
        assert read_record(line) is None, line


def test_a_heartbeat_keeps_its_phase_and_time_and_what_else_is_of_the_right_type():
    beat = {"kind": "heartbeat", "phase": "training", "time": 5.0, "step": 7, "idle_s": 0.5, "collective": True}
    assert read_record(beat) == beat
    assert read_record({"kind": "heartbeat", "phase": "saving", "time": 5, "step": "7", "idle_s": -1,
                        "collective": "yes"}) == {"kind": "heartbeat", "phase": "saving", "time": 5.0}


def test_heartbeats_make_a_run_watched_advance_its_step_and_count_its_first_step():
    fx = _Effects()
    ctx = RunContext(fx, JobSpec(name="j", command=["python", "train.py"]), run_id="j-00000000", record=None,
                     state="running")
    watcher = RankWatcher(ctx, health=None, checkpoints=None)
    attempt = Attempt(0, ["n1", "n2"], replica_check=ReplicaCheck(2))
    assert not watcher.hangs.watched()  # a script of one's own, not seen reporting
    watcher._on_progress(attempt, 1, {"kind": "heartbeat", "phase": "loading", "time": 1.0, "step": 0})
    assert watcher.hangs.watched() and ctx.record.first_step_at is None and fx.events == ["job.hang_watch"]
    watcher._on_progress(attempt, 1, {"kind": "heartbeat", "phase": "training", "time": 2.0, "step": 1})
    assert ctx.record.step == 1 and ctx.record.first_step_at is not None and "job.first_step" in fx.events
    assert attempt.beats[1]["phase"] == "training" and attempt.beat_changed[1][:2] == ("training", 1)


class _Effects:
    def __init__(self) -> None:
        self.points: list[tuple[str, dict]] = []
        self.events: list[str] = []

    def now(self) -> float:
        return 1700000000.0

    def node_names(self) -> list[str]:
        return ["n1", "n2"]

    def save_run(self, *args: object) -> None:
        pass

    def event(self, kind: str, message: str, data: object) -> None:
        self.events.append(kind)

    def record_points(self, run_id: str, points: list) -> None:
        self.points.extend(points)


def test_a_malformed_record_is_skipped_and_the_watch_goes_on():
    fx = _Effects()
    ctx = RunContext(fx, JobSpec(name="j", command=["python", "train.py"]), run_id="j-00000000", record=None,
                     state="running")
    watcher = RankWatcher(ctx, health=None, checkpoints=None)
    attempt = Attempt(0, ["n1", "n2"], replica_check=ReplicaCheck(2))
    # Each of these ended the job's supervision (a KeyError or ValueError out of the poll).
    for line in ({"kind": "train", "loss": 0.5}, {"kind": "train", "step": "x"},
                 {"kind": "fingerprint", "step": 4, "rank": 0}, {"kind": "train", "step": 2, "time": "soon"}):
        watcher._on_progress(attempt, 0, line)
    watcher._on_progress(attempt, 0, {"kind": "train", "step": 5, "loss": "0.25", "tokens_per_second": 100})
    assert ctx.record.step == 5 and ctx.record.loss is None and ctx.record.tokens_per_second == 100
    points = watcher._points  # written together at the end of the poll
    assert [series for series, _ in points] == ["train", "train"]
    assert points[-1][1]["step"] == 5 and points[-1][1]["loss"] is None


def test_the_time_between_steps_is_each_ranks_own_and_skips_loading_and_saves():
    fx = _Effects()
    ctx = RunContext(fx, JobSpec(name="j", command=["python", "train.py"]), run_id="j-00000000", record=None,
                     state="running")
    watcher = RankWatcher(ctx, health=None, checkpoints=None)
    attempt = Attempt(0, ["n1", "n2"], replica_check=ReplicaCheck(2))

    def beat(rank: int, phase: str, step: int, time: float) -> None:
        watcher._on_progress(attempt, rank, {"kind": "heartbeat", "phase": phase, "step": step, "time": time})

    beat(0, "loading", 0, 100.0)
    beat(0, "training", 1, 160.0)  # the load and the first step are not a gap
    assert ctx.record.step_gap is None
    beat(0, "training", 2, 162.0)
    assert ctx.record.step_gap == 2.0
    beat(1, "training", 2, 5000.0)  # another rank on another clock: its first record is no gap
    assert ctx.record.step_gap == 2.0
    for time in (163.0, 200.0, 262.0):  # a hundred seconds of saving, beating as it goes
        beat(0, "saving", 2, time)
    beat(0, "training", 3, 263.0)  # the step after it took a second: the save is not counted
    assert ctx.record.step_gap == 1.8  # a quicker step lowers the estimate by a tenth at a time
    beat(0, "training", 4, 293.0)
    assert ctx.record.step_gap == 30.0  # a slower one raises it at once


def test_compute_times_are_read_only_when_they_are_seconds_of_the_right_type():
    from coordinator.jobs.progress import read_record as read

    beat = {"kind": "heartbeat", "phase": "training", "time": 5.0, "step": 3}
    assert read({**beat, "compute_s": 0.2, "compute_steps": 4})["compute_s"] == 0.2
    for bad in ({"compute_s": -0.1, "compute_steps": 1}, {"compute_s": "0.2", "compute_steps": 1},
                {"compute_s": float("nan"), "compute_steps": 1}, {"compute_s": 0.2, "compute_steps": 0},
                {"compute_s": 0.2, "compute_steps": 1.5}, {"compute_s": 0.2, "compute_steps": True},
                {"compute_s": 0.2}):
        kept = read({**beat, **bad})
        assert kept is not None and "compute_s" not in kept and "compute_steps" not in kept, bad
    assert read({"kind": "compute", "step": 2, "compute_seconds": 0.5}) == {"kind": "compute", "step": 2,
                                                                           "compute_seconds": 0.5}
    for bad_value in (-1, "1", None, float("inf"), True):
        assert read({"kind": "compute", "step": 2, "compute_seconds": bad_value}) is None, bad_value
    train = read({"kind": "train", "step": 2, "loss": 1.0, "compute_seconds": -3})
    assert train is not None and "compute_seconds" not in train and train["loss"] == 1.0
