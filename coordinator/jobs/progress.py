"""What a rank appended to ``$COORD_PROGRESS_FILE``, read for its supervisor (docs/script-contract.md).

The lines come as the rank wrote them: coord's trainers write every field of their records
(``shared.agent_api.ProgressRecord``), a script of one's own may write anything. Each record of a
kind coord reads is kept with the fields it needs, of the right type; one that lacks them is
skipped, like a line that is not JSON, so that a script's mistake never ends its job's
supervision. A value coord only shows (tokens per second) is kept when it is a finite number, and
left out otherwise. A value that says whether the training is sound (the loss, the gradient norm,
the validation loss) is kept when it is NaN or infinite too, as what it is: JSON's ``NaN`` and
``Infinity`` as Python writes them, or the strings ``"nan"``, ``"inf"`` and ``"-inf"`` that a
strict JSON writer can send instead. Pure, tested without processes.
"""

from __future__ import annotations

import math
from typing import cast

from shared.agent_api.common import JsonObject
from shared.agent_api.progress import (
    CheckpointRecord,
    ComputeRecord,
    HeartbeatRecord,
    ProgressRecord,
    TrainRecord,
    ValRecord,
)

# What a train record may carry beside its step, each shown as it was written when it is a number.
_TRAIN_VALUES = ("tokens_per_second", "learning_rate", "peak_memory_gb", "samples_per_second", "comm_seconds",
                 "compute_seconds")
# ... and those kept even when they are not finite: what they are is the news (training_health.py).
_HEALTH_VALUES = ("loss", "grad_norm")
_NON_FINITE_WORDS = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "infinity": math.inf,
                     "-inf": -math.inf, "-infinity": -math.inf}
_PHASE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz_-")


def read_record(raw: JsonObject) -> ProgressRecord | None:
    """The record, checked; None for a kind coord does not read, or one without what it needs."""
    kind = raw.get("kind")
    if kind == "heartbeat":
        return read_heartbeat(raw)
    step = _whole(raw.get("step"))
    if step is None or kind not in ("train", "val", "fingerprint", "checkpoint", "compute"):
        return None
    time = raw.get("time") if _is_number(raw.get("time")) else None
    if kind == "compute":
        return _read_compute(raw, step, time)
    if kind == "train":
        # A script's own train record may carry only its step: the rest is read with get.
        train = cast(TrainRecord, {"kind": "train", "step": step,
                                   **{key: raw[key] for key in _TRAIN_VALUES if _is_number(raw.get(key))},
                                   **{key: value for key in _HEALTH_VALUES
                                      if (value := health_value(raw.get(key))) is not None}})
        if train.get("compute_seconds", 0.0) < 0:
            del train["compute_seconds"]  # a time below 0 is no time: the rest of the record stands
        if time is not None:
            train["time"] = time
        return train
    if kind == "val":
        loss = health_value(raw.get("val_loss"))
        if loss is None:
            return None
        val: ValRecord = {"kind": "val", "step": step, "val_loss": loss}
        if time is not None:
            val["time"] = time
        return val
    if kind == "fingerprint":
        rank, sha256 = _whole(raw.get("rank")), raw.get("sha256")
        if rank is None or not isinstance(sha256, str):
            return None
        return {"kind": "fingerprint", "step": step, "rank": rank, "sha256": sha256}
    held, wrote = _real(raw.get("blocking_seconds")), _real(raw.get("write_seconds"))
    if held is None or wrote is None:
        return None
    # coord reads a checkpoint record's timings only (the file is found by listing the directory).
    return cast(CheckpointRecord, {"kind": "checkpoint", "step": step, "blocking_seconds": held,
                                   "write_seconds": wrote})


def read_heartbeat(raw: JsonObject) -> HeartbeatRecord | None:
    """A heartbeat needs its phase (a short lower-case word) and its time; its step, idle time
    and collective flag are kept when they are of the right type, its compute time when it is a
    finite number of seconds of at least 0 with the whole number of steps (at least 1) it is of."""
    phase, time = raw.get("phase"), _real(raw.get("time"))
    if not isinstance(phase, str) or not 0 < len(phase) <= 32 or not set(phase) <= _PHASE_CHARS or time is None:
        return None
    beat: HeartbeatRecord = {"kind": "heartbeat", "phase": phase, "time": time}
    step, idle = _whole(raw.get("step")), _real(raw.get("idle_s"))
    if step is not None:
        beat["step"] = step
    if idle is not None and idle >= 0:
        beat["idle_s"] = idle
    if isinstance(raw.get("collective"), bool):
        beat["collective"] = raw["collective"]
    compute, steps = _real(raw.get("compute_s")), raw.get("compute_steps")
    if compute is not None and compute >= 0 and _whole_count(steps):
        beat["compute_s"], beat["compute_steps"] = compute, int(steps)  # type: ignore[arg-type]
    return beat


def _read_compute(raw: JsonObject, step: int, time: object) -> ComputeRecord | None:
    """A step's compute time: a finite number of seconds, at least 0."""
    seconds = _real(raw.get("compute_seconds"))
    if seconds is None or seconds < 0:
        return None
    record: ComputeRecord = {"kind": "compute", "step": step, "compute_seconds": seconds}
    if isinstance(time, float | int):
        record["time"] = float(time)
    return record


def _whole_count(value: object) -> bool:
    """A count of steps: a whole number of at least 1 (not a bool, not a float)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def health_value(value: object) -> float | None:
    """A loss or gradient norm as a float, NaN and infinities included; None when it is no number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        return _NON_FINITE_WORDS.get(value.strip().lower())
    return None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _real(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and _is_number(value) else None


def _whole(value: object) -> int | None:
    """A step or a rank: a number, its fraction dropped (as ``int`` did before records were checked)."""
    return int(value) if isinstance(value, (int, float)) and _is_number(value) else None

