"""The metrics history: the thinning and purge rules, the store over a real SQLite file, an older
database upgraded, and the TensorBoard event files read back with tensorboardX's protobuf classes."""

from __future__ import annotations

import itertools
import sqlite3
import struct
from pathlib import Path

import pytest

from coordinator.observe.metrics import thinning
from coordinator.observe.metrics.event_file import crc32c
from coordinator.observe.metrics.history import MetricsHistory
from coordinator.observe.metrics.tensorboard import TensorBoardScalars
from coordinator.store.state import SCHEMA_VERSION, StateStore

# --- the rules ------------------------------------------------------------------------------

def test_a_run_of_up_to_2000_points_keeps_every_point():
    assert thinning.steps_to_drop(range(1, 2001)) == []


def test_a_long_run_keeps_its_newest_points_and_a_decimated_past():
    steps = list(range(1, 10_001))
    kept = sorted(set(steps) - set(thinning.steps_to_drop(steps)))
    assert kept[-thinning.RECENT_POINTS:] == steps[-thinning.RECENT_POINTS:]
    older = kept[:-thinning.RECENT_POINTS]
    assert len(older) <= thinning.OLDER_POINTS
    # 9,000 older steps need buckets of 16 steps to fit in 1,000; the first step of each is kept
    assert thinning.stride_for(steps[:-thinning.RECENT_POINTS]) == 16
    assert older[:3] == [1, 16, 32] and all(b - a == 16 for a, b in itertools.pairwise(older[1:]))


def test_thinning_again_never_needs_a_point_an_earlier_pass_dropped():
    steps = list(range(0, 30_000, 10))  # reported every 10 steps, as mlx-lm does
    first = set(steps) - set(thinning.steps_to_drop(steps))
    grown = sorted(first | set(range(30_000, 45_000, 10)))
    second = set(grown) - set(thinning.steps_to_drop(grown))
    # what the second pass keeps of the old part is a subset of what the first kept
    assert {s for s in second if s < 30_000} <= first
    assert len(second) <= thinning.RECENT_POINTS + thinning.OLDER_POINTS


def test_odd_report_intervals_are_thinned_too():
    steps = list(range(5, 50_000, 10))  # 5, 15, 25...: no power of two divides them
    kept = set(steps) - set(thinning.steps_to_drop(steps))
    assert thinning.RECENT_POINTS < len(kept) <= thinning.RECENT_POINTS + thinning.OLDER_POINTS


def test_a_resume_from_step_s_replaces_the_points_after_s():
    assert thinning.purge_after(30) == 31


# --- the store ------------------------------------------------------------------------------

@pytest.fixture
def store(tmp_path):
    state = StateStore(tmp_path / "coord.db")
    yield state
    state.close()


def history_of(store, runs=(("r-1", "plain"),), nodes=()):
    return MetricsHistory(store.connection, runs_of=lambda run_id: list(runs), node_names=lambda: list(nodes))


def point(step: int, attempt: int, **fields):
    return {"step": step, "attempt": attempt, "time": 1000.0 + step, "loss": 10.0 / step, **fields}


def test_a_resumed_run_continues_the_same_curve_without_the_failed_attempts_later_points(store):
    history = history_of(store)
    history.start_attempt("r-1", 0, 0, ["a", "b"], None, now=1000.0)
    for step in range(1, 26):
        history.add_point("r-1", "train", point(step, 0, rank_memory_bytes={"0": 100 + step, "1": 200}))
    history.add_point("r-1", "val", point(20, 0))
    # attempt 0 died after step 25; attempt 1 resumes from the checkpoint of step 20
    dropped = history.start_attempt("r-1", 1, 20, ["a", "b"], "attempt 0: rank_failed: rank 1", now=1030.0)
    assert dropped == 5
    for step in range(21, 31):
        history.add_point("r-1", "train", point(step, 1))
    doc = history.document()
    run = doc["runs"][0]
    assert run["train"]["step"] == list(range(1, 31))
    assert run["train"]["attempt"] == [0] * 20 + [1] * 10
    assert run["train"]["rank_memory_bytes"]["0"][:2] == [101, 102] and run["train"]["rank_memory_bytes"]["0"][-1] is None
    assert run["val"]["step"] == [20]
    assert [(a["attempt"], a["start_step"], a["nodes"]) for a in run["attempts"]] == [(0, 0, ["a", "b"]),
                                                                                      (1, 20, ["a", "b"])]
    assert run["attempts"][1]["detail"].startswith("attempt 0")


def test_a_report_read_again_is_not_a_second_point(store):
    history = history_of(store)
    assert history.add_point("r-1", "train", point(3, 0)) is True
    assert history.add_point("r-1", "train", point(3, 0, loss=99.0)) is False
    assert history.document()["runs"][0]["train"]["loss"] == [10.0 / 3]


def test_since_gives_only_newer_points_but_every_attempt(store):
    history = history_of(store)
    history.start_attempt("r-1", 0, 0, ["a"], None, now=900.0)
    for step in range(1, 11):
        history.add_point("r-1", "train", point(step, 0))
    run = history.document(since=1005.0)["runs"][0]
    assert run["train"]["step"] == [6, 7, 8, 9, 10] and len(run["attempts"]) == 1


def test_a_long_run_is_thinned_as_it_grows(store):
    history = history_of(store)
    for step in range(1, 5001):
        history.add_point("r-1", "train", point(step, 0))
    steps = history.document()["runs"][0]["train"]["step"]
    assert len(steps) <= thinning.RECENT_POINTS + thinning.OLDER_POINTS + thinning.THIN_EVERY
    assert steps[-thinning.RECENT_POINTS:] == list(range(4001, 5001))
    assert steps[0] == 1


def test_node_samples_keep_the_last_hour_whole_then_one_per_five_minutes_for_a_week(store):
    history = history_of(store, runs=(), nodes=("a",))
    now = 10_000_000.0
    store.connection.execute("BEGIN")  # one transaction: the test's speed, not the rule's
    for i in range(8 * 24 * 360):  # eight days of samples every 10 s
        history.add_node_sample("a", {"time": now - i * 10.0, "memory_used_bytes": i, "memory_total_bytes": 100,
                                      "sources": {"memory": "test"}})
    store.connection.execute("COMMIT")
    history.thin_nodes(now)
    times = [row[0] for row in store.connection.execute("SELECT ts FROM node_samples ORDER BY ts")]
    recent = [t for t in times if t >= now - thinning.NODE_RECENT_S]
    older = [t for t in times if t < now - thinning.NODE_RECENT_S]
    assert len(recent) == 361  # every sample of the last hour, both ends included
    assert min(times) >= now - thinning.NODE_KEEP_S
    assert len({int(t // thinning.NODE_BUCKET_S) for t in older}) == len(older)  # one per bucket
    assert abs(len(older) - (thinning.NODE_KEEP_S - thinning.NODE_RECENT_S) / thinning.NODE_BUCKET_S) <= 2
    doc = history.document(now=now)["nodes"][0]
    assert len(doc["time"]) == 360 and doc["sources"] == {"memory": "test"}  # the last hour, after its start
    assert doc["memory_used_bytes"][-1] == 0 and doc["gpu_utilization"][-1] is None


def test_a_schema_3_database_gains_the_metrics_tables(tmp_path):
    path = tmp_path / "coord.db"
    StateStore(path).close()
    db = sqlite3.connect(path)
    db.executescript("DROP TABLE metric_points; DROP TABLE metric_attempts; DROP TABLE node_samples; "
                     "UPDATE meta SET value='3' WHERE key='schema';")
    db.close()
    state = StateStore(path)
    MetricsHistory(state.connection).add_point("r-1", "train", point(1, 0))
    assert state.connection.execute("SELECT value FROM meta WHERE key='schema'").fetchone()[0] == str(SCHEMA_VERSION)
    state.close()


# --- TensorBoard ----------------------------------------------------------------------------

def read_events(path: Path):
    """Each TFRecord checked with tensorboardX's own CRC-32C, parsed with TensorBoard's Event proto."""
    from tensorboardX.crc32c import crc32c as reference_crc
    from tensorboardX.proto.event_pb2 import Event

    def masked(data: bytes) -> int:
        crc = reference_crc(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    data, events, offset = path.read_bytes(), [], 0
    while offset < len(data):
        header = data[offset:offset + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[offset + 8:offset + 12])[0] == masked(header)
        record = data[offset + 12:offset + 12 + length]
        assert struct.unpack("<I", data[offset + 12 + length:offset + 16 + length])[0] == masked(record)
        events.append(Event.FromString(record))
        offset += 16 + length
    return events


def test_crc32c_matches_the_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283


def test_event_files_hold_the_scalars_and_a_resume_purges_as_tensorboardx_does(tmp_path):
    pytest.importorskip("tensorboardX")
    scalars = TensorBoardScalars(lambda run_id: tmp_path / run_id / "tensorboard")
    scalars.start_attempt("r-1", 0, 0, now=1000.0)
    for step in (1, 2, 3):
        scalars.add_point("r-1", "train", {**point(step, 0), "learning_rate": 1e-4, "rank_memory_bytes": {"1": 5}})
    scalars.start_attempt("r-1", 1, 2, now=1010.0)
    scalars.add_point("r-1", "train", point(3, 1))
    scalars.add_point("r-1", "val", point(3, 1))
    files = sorted((tmp_path / "r-1" / "tensorboard").iterdir())
    assert len(files) == 2 and all("tfevents" in f.name for f in files)
    first, second = (read_events(f) for f in files)
    assert first[0].file_version == "brain.Event:2"
    values = {(e.step, v.tag): v.simple_value for e in first for v in e.summary.value}
    assert values[(1, "train/loss")] == pytest.approx(10.0)
    assert values[(2, "train/learning_rate")] == pytest.approx(1e-4)
    assert values[(3, "rank_memory_bytes/rank_1")] == 5.0
    # the resumed attempt's file starts with tensorboardX's purge_step=3 events
    assert second[0].file_version == "brain.Event:2" and second[0].step == 3
    assert second[1].session_log.status == 1 and second[1].step == 3  # SessionLog.START
    assert [(e.step, [v.tag for v in e.summary.value]) for e in second[2:]] == [(3, ["train/loss"]),
                                                                                (3, ["val/loss"])]


def test_a_polls_points_go_in_one_transaction_and_one_append_and_a_report_read_again_is_dropped(store, tmp_path):
    """coordd writes what one poll read together (a fast run brings a hundred points a poll)."""
    from coordinator.observe.metrics.run_metrics import RunMetrics

    pytest.importorskip("tensorboardX")
    history = history_of(store)
    scalars = TensorBoardScalars(lambda run_id: tmp_path / run_id / "tensorboard")
    metrics = RunMetrics(history, scalars)
    metrics.record_attempt("r-1", 0, 0, ["a"], None)
    statements: list[str] = []
    store.connection.set_trace_callback(statements.append)
    metrics.record_points("r-1", [("train", point(step, 0)) for step in range(1, 51)] + [("val", point(50, 0))])
    store.connection.set_trace_callback(None)
    assert [s for s in statements if s in ("BEGIN", "COMMIT")] == ["BEGIN", "COMMIT"]
    metrics.record_points("r-1", [("train", point(50, 0)), ("train", point(51, 0))])  # 50 read again after a restart
    run = history.document()["runs"][0]
    assert run["train"]["step"] == list(range(1, 52)) and run["val"]["step"] == [50]
    (events,) = (read_events(f) for f in (tmp_path / "r-1" / "tensorboard").iterdir())
    steps = [e.step for e in events if e.summary.value]
    assert steps == [*range(1, 51), 50, 51]  # the val point of 50, then only the new train point
