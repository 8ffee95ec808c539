"""What a run's supervisor hands the metrics history for each train or validation point: its type
lives here, with the jobs that make it, so that the history above can read it."""

from __future__ import annotations

from typing import Required, TypedDict


class MetricPoint(TypedDict, total=False):
    """A train or validation point as the supervisor hands it over (validation points: ``loss`` only)."""

    step: Required[int]  # the run's global step
    attempt: Required[int]
    time: Required[float]
    loss: float | None
    learning_rate: float | None
    tokens_per_second: float | None
    samples_per_second: float | None
    comm_seconds: float | None  # a step's mean time in its gradient exchange, as the rank measured it
    peak_memory_bytes: int | None  # rank 0's MLX peak
    rank_memory_bytes: dict[str, int]  # rank -> its largest RSS since the point before
