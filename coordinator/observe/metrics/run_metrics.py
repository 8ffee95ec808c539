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

    def record_point(self, run_id: str, series: str, point: MetricPoint) -> None:
        try:
            if self.history.add_point(run_id, series, point):  # not a report read again
                self.tensorboard.add_point(run_id, series, point)
        except (OSError, sqlite3.Error) as exc:
            log.warning("metrics history not written", run=run_id, error=str(exc))
