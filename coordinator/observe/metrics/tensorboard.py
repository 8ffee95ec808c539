"""Each run's scalars as TensorBoard event files on the head, under ``<state_dir>/jobs/RUN/tensorboard``,
so that ``tensorboard --logdir <state_dir>/jobs`` shows every run.

Each attempt (and each daemon that writes for it) appends to a file of its own. An attempt that
resumes from the checkpoint of step S starts its file as tensorboardX's ``purge_step=S+1`` does:
a ``file_version`` event and a ``SessionLog.START`` event at step S+1, on which TensorBoard drops
what the failed attempt wrote past S. Writes are a few hundred bytes per report: each is an
append to a file opened for it, so nothing stays open between reports.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.observe.metrics import event_file
from coordinator.observe.metrics.thinning import purge_after

if TYPE_CHECKING:
    from coordinator.jobs.metric_point import MetricPoint

# series -> {point field: TensorBoard tag}
TAGS = {
    "train": {"loss": "train/loss", "learning_rate": "train/learning_rate",
              "tokens_per_second": "train/tokens_per_second", "peak_memory_bytes": "train/peak_memory_bytes"},
    "val": {"loss": "val/loss"},
}


class TensorBoardScalars:
    def __init__(self, directory_of: Callable[[str], Path]) -> None:
        self._directory_of = directory_of
        self._files: dict[str, Path] = {}  # run id -> the file this daemon appends to

    def start_attempt(self, run_id: str, attempt: int, start_step: int, *, now: float | None = None) -> None:
        """A new file for the attempt; one that resumes purges what came after its step."""
        now = time.time() if now is None else now
        path = self._new_file(run_id, attempt, now)
        records = event_file.frame(event_file.event(wall_time=now, step=0, file_version=event_file.FILE_VERSION))
        if attempt > 0:
            purge = purge_after(start_step)
            records = (event_file.frame(event_file.event(wall_time=now, step=purge,
                                                         file_version=event_file.FILE_VERSION))
                       + event_file.frame(event_file.event(wall_time=now, step=purge, session_start=True)))
        self._append(path, records)

    def add_points(self, run_id: str, points: list[tuple[str, MetricPoint]]) -> None:
        """Several points in one append (one open and one write, not one of each per point)."""
        frames = b"".join(self._frames(run_id, series, point) for series, point in points)
        path = self._files.get(run_id)
        if frames and path is not None:
            self._append(path, frames)

    def add_point(self, run_id: str, series: str, point: MetricPoint) -> None:
        self.add_points(run_id, [(series, point)])

    def _frames(self, run_id: str, series: str, point: MetricPoint) -> bytes:
        """The point's event (after the file's version record, when it starts a file); b"" when it has no value."""
        scalars = {tag: float(value) for field, tag in TAGS.get(series, {}).items()
                   if isinstance(value := point.get(field), (int, float))}
        for rank, value in sorted((point.get("rank_memory_bytes") or {}).items()):
            scalars[f"rank_memory_bytes/rank_{rank}"] = float(value)
        if not scalars:
            return b""
        head = b""
        if self._files.get(run_id) is None:  # a daemon restarted during the attempt: a file of its own, nothing purged
            self._new_file(run_id, int(point.get("attempt", 0)), float(point["time"]))
            head = event_file.frame(event_file.event(wall_time=float(point["time"]), step=0,
                                                     file_version=event_file.FILE_VERSION))
        return head + event_file.frame(event_file.event(wall_time=float(point["time"]), step=int(point["step"]),
                                                        scalars=scalars))

    def _new_file(self, run_id: str, attempt: int, now: float) -> Path:
        directory = self._directory_of(run_id)
        # TensorBoard reads a directory's files in name order: the time first keeps them in order.
        path = directory / f"events.out.tfevents.{now:017.6f}.{socket.gethostname()}.{os.getpid()}.{attempt}"
        self._files[run_id] = path
        return path

    @staticmethod
    def _append(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(path, "ab") as handle:
            handle.write(data)
