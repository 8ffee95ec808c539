"""What the trainer tells people and coord: stdout lines and ``$COORD_PROGRESS_FILE`` records.

Rank 0 prints mlx-lm-like lines ("Iter 10: Train loss ...") and appends train,
val and checkpoint records; with fingerprints on, every rank appends its own.
Ranks of one host may share the file, so each record is one ``write`` to a
descriptor opened with O_APPEND: the kernel appends it whole.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlx_lm.tuner.callbacks import TrainingCallback

    from shared.agent_api.progress import ProgressRecord, TrainRecord


def append_record(path: str | None, record: ProgressRecord) -> None:
    if not path:
        return
    line = (json.dumps({"time": time.time(), **record}) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class Reporter:
    """Rank 0's reports, to stdout, the progress file and any mlx-lm reporting callback (--report-to)."""

    def __init__(self, *, rank: int, progress_file: str | None, callback: TrainingCallback | None = None) -> None:
        self.rank = rank
        self.progress_file = progress_file
        self.callback = callback

    @property
    def active(self) -> bool:
        return self.rank == 0

    def say(self, text: str) -> None:
        if self.active:
            print(text, flush=True)

    def train(self, *, step: int, loss: float, learning_rate: float, steps_per_second: float,
              tokens_per_second: float, trained_tokens: int, peak_memory_gb: float,
              samples_per_second: float | None = None, comm_seconds: float | None = None) -> None:
        if not self.active:
            return
        self.say(f"Iter {step}: Train loss {loss:.3f}, Learning Rate {learning_rate:.3e}, "
                 f"It/sec {steps_per_second:.3f}, Tokens/sec {tokens_per_second:.3f}, "
                 f"Trained Tokens {trained_tokens}, Peak mem {peak_memory_gb:.3f} GB")
        record: TrainRecord = {"kind": "train", "step": step, "loss": loss,
                                     "tokens_per_second": tokens_per_second, "learning_rate": learning_rate,
                                     "peak_memory_gb": peak_memory_gb}
        if samples_per_second is not None:
            record["samples_per_second"] = samples_per_second
        if comm_seconds is not None:
            record["comm_seconds"] = comm_seconds
        append_record(self.progress_file, record)
        if self.callback is not None:
            self.callback.on_train_loss_report({
                "iteration": step, "train_loss": loss, "learning_rate": learning_rate,
                "iterations_per_second": steps_per_second, "tokens_per_second": tokens_per_second,
                "trained_tokens": trained_tokens, "peak_memory": peak_memory_gb})

    def val(self, *, step: int, val_loss: float, seconds: float) -> None:
        if not self.active:
            return
        self.say(f"Iter {step}: Val loss {val_loss:.3f}, Val took {seconds:.3f}s")
        append_record(self.progress_file, {"kind": "val", "step": step, "val_loss": val_loss})
        if self.callback is not None:
            self.callback.on_val_loss_report({"iteration": step, "val_loss": val_loss, "val_time": seconds})
