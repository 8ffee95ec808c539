"""A run's curves, as the supervisor hands them over: into the metrics history and TensorBoard.

A chart is not worth a job: a write that fails is logged and dropped, never raised."""

from __future__ import annotations

import sqlite3

import structlog

from coordinator.jobs.metric_point import MetricPoint
from coordinator.observe.metrics.history import MetricsHistory
from coordinator.observe.metrics.tensorboard import TensorBoardScalars

log = structlog.get_logger("job")


class RunMetrics:
    def __init__(self, history: MetricsHistory, tensorboard: TensorBoardScalars) -> None:
        self.history = history
        self.tensorboard = tensorboard

    def record_attempt(self, run_id: str, attempt: int, start_step: int, nodes: list[str],
                       detail: str | None) -> None:
        try:
            self.history.start_attempt(run_id, attempt, start_step, nodes, detail)
            self.tensorboard.start_attempt(run_id, attempt, start_step)
        except (OSError, sqlite3.Error) as exc:
            log.warning("metrics history not written", run=run_id, error=str(exc))

    def record_points(self, run_id: str, points: list[tuple[str, MetricPoint]]) -> None:
        """A poll's points: one SQLite transaction, one append to the TensorBoard file (a poll reads
        up to a hundred points of a fast run; a write each cost the daemon most of its CPU)."""
        if not points:
            return
        try:
            added = self.history.add_points(run_id, points)  # not the reports read again
            self.tensorboard.add_points(run_id, added)
        except (OSError, sqlite3.Error) as exc:
            log.warning("metrics history not written", run=run_id, error=str(exc))
