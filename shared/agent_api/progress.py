"""The records coord's trainers append to ``$COORD_PROGRESS_FILE``, as ``rank_status`` passes them on."""

from __future__ import annotations

from typing import Literal, TypedDict


class _Timed(TypedDict, total=False):
    time: float  # seconds since the epoch, when it was written


class TrainRecord(_Timed):
    kind: Literal["train"]
    step: int
    loss: float
    tokens_per_second: float
    learning_rate: float
    peak_memory_gb: float


class ValRecord(_Timed):
    kind: Literal["val"]
    step: int
    val_loss: float


class CheckpointRecord(_Timed):
    kind: Literal["checkpoint"]
    step: int
    file: str
    bytes: int
    blocking_seconds: float  # training held while the arrays were copied
    write_seconds: float


class FingerprintRecord(_Timed):
    kind: Literal["fingerprint"]
    step: int
    rank: int
    sha256: str  # of the rank's trainable weights


ProgressRecord = TrainRecord | ValRecord | CheckpointRecord | FingerprintRecord
