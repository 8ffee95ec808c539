"""The records coord's trainers append to ``$COORD_PROGRESS_FILE``, as ``rank_status`` passes them on."""

from __future__ import annotations

from typing import Literal, TypedDict


class _Timed(TypedDict, total=False):
    time: float  # seconds since the epoch, when it was written


class _TrainExtras(_Timed, total=False):
    samples_per_second: float  # examples (the global batch) trained per second, when the trainer knows it
    comm_seconds: float  # the mean time of a step's gradient exchange (``coord bench scaling``'s wait share)
    grad_norm: float  # the gradients' global norm, when the script reports it (NaN or inf: the run diverged)
    compute_seconds: float  # the step's time outside its collectives, on this rank (the watch of stragglers)


class TrainRecord(_TrainExtras):
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


class _HeartbeatRecord(_Timed):
    kind: Literal["heartbeat"]
    phase: str  # loading, compiling, training, saving, evaluating


class HeartbeatRecord(_HeartbeatRecord, total=False):
    """What a rank is doing, written every few seconds by a thread beside its training (every rank
    writes its own): coord's watch of hangs reads it (docs/script-contract.md)."""

    step: int  # the last step it finished (global)
    idle_s: float  # seconds without progress when written: since that step, or since the phase began
    collective: bool  # it waits inside a collective (an all_sum) now
    compute_s: float  # the mean compute time (outside collectives) of the steps since the beat before
    compute_steps: int  # how many steps that mean is of


class ComputeRecord(_Timed):
    """One step's compute time (outside its collectives), from ``coord_script.report(step,
    compute_seconds=...)`` on a rank that reports nothing else: what the watch of stragglers reads."""

    kind: Literal["compute"]
    step: int
    compute_seconds: float


ProgressRecord = TrainRecord | ValRecord | CheckpointRecord | FingerprintRecord | HeartbeatRecord | ComputeRecord
