"""The metrics history: each run's curves and each node's use over time, in the daemon's SQLite.

Written by the supervisor's effects as reports arrive (a train or validation point, the start
of an attempt) and by the node sampler; read by ``coord status --history`` and the dashboard
through ``document``. The thinning and purge rules are ``coordinator.observe.metrics.thinning``.

``document(run_id=None, since=None)`` is plain JSON, columnar so a chart takes it as is. Without
``run_id`` it covers the runs ``coord status`` lists (each job's newest run and every run still
going); with one, that run (a job name means its newest run)::

    {"time": now, "since": since, "policy": {...the thinning numbers...},
     "runs": [{"run_id", "name",
               "train": {"step": [...], "attempt": [...], "time": [...], "loss": [...],
                         "learning_rate": [...], "tokens_per_second": [...], "peak_memory_bytes": [...],
                         "samples_per_second": [...], "comm_seconds": [...],
                         "rank_memory_bytes": {"0": [...], "1": [...]}},
               "val": {"step": [...], "attempt": [...], "time": [...], "loss": [...]},
               "attempts": [{"attempt", "start_step", "time", "nodes", "detail"}, ...]}],
     "nodes": [{"name", "time": [...], "memory_used_bytes": [...], "memory_total_bytes": [...],
                "gpu_utilization": [...], "gpu_memory_bytes": [...], "power_watts": [...],
                "temperature_c": [...], "sources": {...} or None}]}

Every list of a series has one entry per point, ``None`` where a value is unknown. With
``since``, a series holds only what is newer; ``attempts`` are always whole: an attempt with
``start_step`` S > 0 after the first is a restart, and a reader that kept older points drops
its points past S (the store already has).
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections.abc import Callable, Mapping
from typing import Any, Required, TypedDict

from coordinator.jobs.metric_point import MetricPoint
from coordinator.observe.metrics import thinning

TRAIN_FIELDS = ("loss", "learning_rate", "tokens_per_second", "peak_memory_bytes", "samples_per_second",
                "comm_seconds")
NODE_FIELDS = ("memory_used_bytes", "memory_total_bytes", "gpu_utilization", "gpu_memory_bytes", "power_watts",
               "temperature_c")


# run id or job name (None: the runs status lists) -> [(run id, job name)]
RunsOf = Callable[[str | None], list[tuple[str, str]]]


class UsageSample(TypedDict, total=False):
    """A node's ``usage`` answer (agent/usage.py): None where the node cannot tell."""

    time: Required[float]
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    gpu_utilization: float | None  # percent
    gpu_memory_bytes: int | None
    power_watts: float | None
    temperature_c: float | None
    sources: dict[str, str]  # where each value was read, or why it was not


class ThinningPolicy(TypedDict):
    recent_points: int
    older_points: int
    node_sample_s: float
    node_recent_s: float
    node_bucket_s: float
    node_keep_s: float


class TrainSeries(TypedDict):
    step: list[int]
    attempt: list[int]
    time: list[float]
    loss: list[float | None]
    learning_rate: list[float | None]
    tokens_per_second: list[float | None]
    peak_memory_bytes: list[int | None]
    samples_per_second: list[float | None]
    comm_seconds: list[float | None]  # a step's mean time in its gradient exchange, where the rank says
    rank_memory_bytes: dict[str, list[int | None]]  # rank -> a value per point


class ValSeries(TypedDict):
    step: list[int]
    attempt: list[int]
    time: list[float]
    loss: list[float | None]


class AttemptMark(TypedDict):
    attempt: int
    start_step: int  # 0: from the start; S > 0 after the first attempt: a restart from step S
    time: float
    nodes: list[str]  # rank by rank
    detail: str | None  # why the attempt before it ended


class RunHistory(TypedDict):
    run_id: str
    name: str
    train: TrainSeries
    val: ValSeries
    attempts: list[AttemptMark]


class NodeHistory(TypedDict):
    name: str
    time: list[float]
    memory_used_bytes: list[int | None]
    memory_total_bytes: list[int | None]
    gpu_utilization: list[float | None]
    gpu_memory_bytes: list[int | None]
    power_watts: list[float | None]
    temperature_c: list[float | None]
    sources: dict[str, str] | None  # the latest sample's


class HistoryDocument(TypedDict):
    """``MetricsHistory.document``, described above."""

    time: float
    since: float | None
    policy: ThinningPolicy
    runs: list[RunHistory]
    nodes: list[NodeHistory]


class MetricsHistory:
    def __init__(self, db: sqlite3.Connection, *, runs_of: RunsOf = lambda run_id: [],
                 node_names: Callable[[], list[str]] = list) -> None:
        self._db = db
        self._runs_of = runs_of
        self._node_names = node_names
        self._added: dict[str, int] = {}  # run id -> points added since its last thinning
        self.latest: dict[str, UsageSample] = {}  # node -> its latest sample (sources included)

    # --- writing ----------------------------------------------------------------------------

    def add_points(self, run_id: str, points: list[tuple[str, MetricPoint]]) -> list[tuple[str, MetricPoint]]:
        """Keep several points in one transaction; returns those that were new."""
        if self._db.in_transaction:  # inside someone's transaction: part of it
            added = [(series, point) for series, point in points if self._insert(run_id, series, point)]
        else:
            self._db.execute("BEGIN")
            try:
                added = [(series, point) for series, point in points if self._insert(run_id, series, point)]
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        self._counted(run_id, len(added))
        return added

    def add_point(self, run_id: str, series: str, point: MetricPoint) -> bool:
        """Keep one train or val point (``step``, ``attempt``, ``time`` and the fields); False when
        the run already has that step (a report read again after a daemon restart)."""
        added = self._insert(run_id, series, point)
        self._counted(run_id, int(added))
        return added

    def _insert(self, run_id: str, series: str, point: MetricPoint) -> bool:
        ranks = point.get("rank_memory_bytes")
        cursor = self._db.execute(
            "INSERT OR IGNORE INTO metric_points (run_id, series, step, attempt, ts, loss, learning_rate, "
            "tokens_per_second, peak_memory_bytes, samples_per_second, comm_seconds, rank_memory) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            (run_id, series, int(point["step"]), int(point["attempt"]), float(point["time"]),
             _loss(point.get("loss")), *(_number(point.get(f)) for f in TRAIN_FIELDS[1:]),
             json.dumps(ranks) if ranks else None))
        return cursor.rowcount == 1

    def _counted(self, run_id: str, added: int) -> None:
        """Thin the run's points once enough new ones came in."""
        if added:
            self._added[run_id] = self._added.get(run_id, 0) + added
            if self._added[run_id] >= thinning.THIN_EVERY:
                self.thin_run(run_id)

    def start_attempt(self, run_id: str, attempt: int, start_step: int, nodes: list[str], detail: str | None,
                      *, now: float | None = None) -> int:
        """Mark an attempt's start; one that resumes from step S drops the run's points past S.
        Returns how many points were dropped."""
        now = time.time() if now is None else now
        dropped = self._db.execute("DELETE FROM metric_points WHERE run_id=? AND step>=?",
                                   (run_id, thinning.purge_after(start_step))).rowcount
        self._db.execute("INSERT OR REPLACE INTO metric_attempts (run_id, attempt, start_step, ts, nodes, detail) "
                         "VALUES (?,?,?,?,?,?)", (run_id, attempt, start_step, now, json.dumps(nodes), detail))
        return dropped

    def thin_run(self, run_id: str) -> int:
        """Apply the run-point rule to each of the run's series; how many points went."""
        self._added[run_id] = 0
        dropped = 0
        for series in ("train", "val"):
            steps = [row[0] for row in self._db.execute(
                "SELECT step FROM metric_points WHERE run_id=? AND series=?", (run_id, series))]
            drop = thinning.steps_to_drop(steps)
            if drop:
                self._db.executemany("DELETE FROM metric_points WHERE run_id=? AND series=? AND step=?",
                                     [(run_id, series, step) for step in drop])
                dropped += len(drop)
        return dropped

    def add_node_sample(self, node: str, sample: UsageSample) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO node_samples (node, ts, memory_used_bytes, memory_total_bytes, gpu_utilization, "
            "gpu_memory_bytes, power_watts, temperature_c) VALUES (?,?,?,?,?,?,?,?)",
            (node, float(sample["time"]), *(_number(sample.get(f)) for f in NODE_FIELDS)))
        self.latest[node] = sample.copy()

    def thin_nodes(self, now: float | None = None) -> int:
        """Apply the node-sample rule; how many samples went."""
        now = time.time() if now is None else now
        gone = self._db.execute("DELETE FROM node_samples WHERE ts < ?", (now - thinning.NODE_KEEP_S,)).rowcount
        cutoff = now - thinning.NODE_RECENT_S
        # A sample goes when its node has an earlier one in the same bucket: one index lookup each.
        gone += self._db.execute(
            "DELETE FROM node_samples AS s WHERE ts < :cutoff AND EXISTS (SELECT 1 FROM node_samples AS o "
            "WHERE o.node = s.node AND o.ts < s.ts AND o.ts >= CAST(s.ts / :bucket AS INTEGER) * :bucket)",
            {"cutoff": cutoff, "bucket": thinning.NODE_BUCKET_S}).rowcount
        return gone

    # --- reading ----------------------------------------------------------------------------

    def document(self, run_id: str | None = None, since: float | None = None, *,
                 now: float | None = None) -> HistoryDocument:
        """The history described above. Node samples: those after ``since``, else the last hour's."""
        now = time.time() if now is None else now
        runs, nodes = self._runs_of(run_id), self._node_names()
        return {
            "time": now, "since": since,
            "policy": {"recent_points": thinning.RECENT_POINTS, "older_points": thinning.OLDER_POINTS,
                       "node_sample_s": thinning.NODE_SAMPLE_S, "node_recent_s": thinning.NODE_RECENT_S,
                       "node_bucket_s": thinning.NODE_BUCKET_S, "node_keep_s": thinning.NODE_KEEP_S},
            "runs": [self._run_document(run_id, name, since) for run_id, name in runs],
            "nodes": [self._node_document(node, since if since is not None else now - thinning.NODE_RECENT_S)
                      for node in nodes],
        }

    def _run_document(self, run_id: str, name: str, since: float | None) -> RunHistory:
        rows = self._points(run_id, "train", since)
        train: TrainSeries = {
            "step": [r[0] for r in rows], "attempt": [r[1] for r in rows], "time": [r[2] for r in rows],
            "loss": [_read_loss(r[3]) for r in rows], "learning_rate": [r[4] for r in rows],
            "tokens_per_second": [r[5] for r in rows], "peak_memory_bytes": [_int(r[6]) for r in rows],
            "samples_per_second": [r[7] for r in rows], "comm_seconds": [r[8] for r in rows],
            "rank_memory_bytes": _rank_columns([json.loads(r[9]) if r[9] else {} for r in rows])}
        rows = self._points(run_id, "val", since)
        val: ValSeries = {"step": [r[0] for r in rows], "attempt": [r[1] for r in rows],
                          "time": [r[2] for r in rows], "loss": [_read_loss(r[3]) for r in rows]}
        attempts: list[AttemptMark] = [
            {"attempt": a, "start_step": s, "time": ts, "nodes": json.loads(n), "detail": d}
            for a, s, ts, n, d in self._db.execute(
                "SELECT attempt, start_step, ts, nodes, detail FROM metric_attempts WHERE run_id=? "
                "ORDER BY attempt", (run_id,))]
        return {"run_id": run_id, "name": name, "train": train, "val": val, "attempts": attempts}

    def _points(self, run_id: str, series: str, since: float | None) -> list[tuple[Any, ...]]:
        """A series' rows newer than ``since``, by step: step, attempt, time, the TRAIN_FIELDS, rank memory."""
        return self._db.execute(
            "SELECT step, attempt, ts, loss, learning_rate, tokens_per_second, peak_memory_bytes, "
            "samples_per_second, comm_seconds, rank_memory "
            "FROM metric_points WHERE run_id=? AND series=? AND ts>? ORDER BY step",
            (run_id, series, since if since is not None else float("-inf"))).fetchall()

    def _node_document(self, node: str, since: float) -> NodeHistory:
        rows = self._db.execute(f"SELECT ts, {', '.join(NODE_FIELDS)} FROM node_samples WHERE node=? AND ts>? "
                                "ORDER BY ts", (node, since)).fetchall()
        column = {field: [r[index] for r in rows] for index, field in enumerate(NODE_FIELDS, start=1)}
        return {"name": node, "time": [r[0] for r in rows],
                "memory_used_bytes": [_int(v) for v in column["memory_used_bytes"]],
                "memory_total_bytes": [_int(v) for v in column["memory_total_bytes"]],
                "gpu_utilization": column["gpu_utilization"],
                "gpu_memory_bytes": [_int(v) for v in column["gpu_memory_bytes"]],
                "power_watts": column["power_watts"], "temperature_c": column["temperature_c"],
                "sources": latest.get("sources") if (latest := self.latest.get(node)) else None}


def _number(value: object) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def _loss(value: object) -> float | int | str | None:
    """A loss as SQLite keeps it: a number, or ``"nan"`` (SQLite stores a NaN as NULL, and a diverged
    run's NaN loss is news, not a gap; infinities it keeps as they are)."""
    number = _number(value)
    return "nan" if isinstance(number, float) and math.isnan(number) else number


def _read_loss(value: Any) -> float | None:
    return math.nan if value == "nan" else value


def _int(value: Any) -> int | None:
    """A column SQLite holds as a number: an int, or None."""
    return None if value is None else int(value)


def _rank_columns(per_point: list[Mapping[str, int]]) -> dict[str, list[int | None]]:
    ranks = sorted({rank for point in per_point for rank in point}, key=int)
    return {rank: [point.get(rank) for point in per_point] for rank in ranks}
