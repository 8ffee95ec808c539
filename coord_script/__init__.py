"""coord's script helpers: what a training script of one's own (PyTorch, MLX, anything) calls to be
supervised by coord, without knowing the file formats (docs/script-contract.md).

    import coord_script

    start = coord_script.step_offset()            # the global step this attempt starts from
    if coord_script.resume_dir():                 # a resume: load what the previous attempt saved
        ...
    batches = skip(batches, coord_script.skip_batches())  # after a rollback: the data that diverged
    for step in range(start + 1, total + 1):
        loss = train_one_step()
        coord_script.report(step, loss=loss, tokens_per_second=tps)  # a NaN loss is reported as NaN
        if step % save_every == 0:
            save_to(coord_script.checkpoint_dir(step - start))

It ships in coord's agent bundle, which every rank finds on its ``PYTHONPATH``, so a script
imports it with nothing installed. Standard library only, no torch, nothing of coord imported: it
runs with whatever Python the node's ranks use (3.10 or later). Outside coord (no ``COORD_*``
environment) ``report`` does nothing and ``resume_dir`` is None, so the same script runs alone.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

__all__ = ["accelerate_tracker", "checkpoint_dir", "deepspeed_config", "hf_callback", "jax_distributed", "report",
           "resume_dir", "skip_batches", "step_offset"]

#: Checkpoint names carry the step in seven digits (docs/script-contract.md).
STEP_DIGITS = 7
#: The values written even when they are NaN or infinite: they say the run diverged.
_HEALTH_VALUES = ("loss", "grad_norm")


def report(step: int, loss: float | None = None, **metrics: float) -> bool:
    """Append a ``train`` progress record for global ``step`` to ``$COORD_PROGRESS_FILE``.

    ``metrics`` are numbers coord shows beside the loss: ``tokens_per_second``, ``learning_rate``,
    ``peak_memory_gb`` (bytes / 1e9), ``grad_norm`` (the gradients' global norm), and for ``coord
    bench scaling`` ``samples_per_second`` and ``comm_seconds`` (the step's time waiting on the other
    ranks: its all-reduce), and ``compute_seconds``, the step's time outside its collectives on this
    rank, which coord compares across ranks to name a straggler (docs/observe.md#stragglers): call
    ``report(step, compute_seconds=...)`` on EVERY rank, not only the first (a call with nothing
    else writes a small ``compute`` record, not a train record); others are kept in the line and
    ignored by coord. A loss or gradient norm
    that is NaN or infinite is written as it is (``NaN``, ``Infinity``): coord takes it for a
    divergence and, by default, rolls the run back to the checkpoint before it (docs/recovery.md).
    Another value that is not finite is left out. The record is one JSON line written whole with one
    ``write`` to a file opened for appending, so ranks that share the file never interleave. Returns
    False when there is no progress file (not run by coord).
    """
    if not _whole(step) or step < 0:
        raise ValueError(f"coord_script.report: step must be a whole number of at least 0, got {step!r}")
    values = {"loss": loss, **metrics} if loss is not None else dict(metrics)
    for name, value in values.items():
        if not _number(value):
            raise TypeError(f"coord_script.report: {name} must be a number, got {type(value).__name__} {value!r}")
    compute = values.get("compute_seconds")
    if compute is not None and not (math.isfinite(compute) and compute >= 0):
        raise ValueError(f"coord_script.report: compute_seconds must be a finite number of at least 0, got {compute!r}")
    path = os.environ.get("COORD_PROGRESS_FILE")
    if not path:
        return False
    # A rank that reports only its compute time writes the small record the watch of stragglers reads.
    kind = "compute" if compute is not None and len(values) == 1 else "train"
    record = {"kind": kind, "step": step, "time": time.time(),
              **{name: float(value) for name, value in values.items()
                 if math.isfinite(value) or name in _HEALTH_VALUES}}
    line = (json.dumps(record) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return True


def resume_dir() -> str | None:
    """The checkpoint directory this attempt resumes from (``$COORD_RESUME_DIR``), or None on a
    first attempt or outside coord."""
    return os.environ.get("COORD_RESUME_DIR") or None


def deepspeed_config() -> str | None:
    """The DeepSpeed JSON of ``coord run --plan DIR`` for this attempt (``$COORD_DEEPSPEED_CONFIG``: the
    plan's ZeRO stage, precision and offload, with this attempt's batch, which a shrink changes), or None
    without a plan: ``deepspeed.initialize(..., config=coord_script.deepspeed_config() or "ds.json")``."""
    return os.environ.get("COORD_DEEPSPEED_CONFIG") or None


def jax_distributed() -> dict[str, str | int]:
    """The arguments of ``jax.distributed.initialize`` for this process of a ``coord run --launcher command
    --env-style jax`` job: ``jax.distributed.initialize(**coord_script.jax_distributed())``. JAX reads the
    coordinator's address from ``JAX_COORDINATOR_ADDRESS`` itself, but not the number of processes or this
    one's id outside the clusters it detects (Slurm, Open MPI, Kubernetes, TPUs): coord sets them as
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``. RuntimeError when they are not set."""
    try:
        return {"coordinator_address": os.environ["JAX_COORDINATOR_ADDRESS"],
                "num_processes": int(os.environ["JAX_NUM_PROCESSES"]),
                "process_id": int(os.environ["JAX_PROCESS_ID"])}
    except (KeyError, ValueError) as exc:
        raise RuntimeError(f"coord_script.jax_distributed: {exc} is not set as a number or an address (the job is "
                           "not run by coord run --launcher command --env-style jax)") from None


def skip_batches() -> int:
    """How many batches to skip before the first step of this attempt (``$COORD_SKIP_BATCHES``; 0
    unless the run was rolled back after a divergence with ``--skip-on-rollback N``): the data that
    followed the checkpoint, where the loss went NaN or spiked. Skip them where the data order is
    resumed, e.g. ``itertools.islice(batches, coord_script.skip_batches(), None)``."""
    text = os.environ.get("COORD_SKIP_BATCHES") or "0"
    try:
        count = int(text)
    except ValueError:
        raise ValueError(f"COORD_SKIP_BATCHES must be a whole number, got {text!r}") from None
    if count < 0:
        raise ValueError(f"COORD_SKIP_BATCHES must be at least 0, got {count}")
    return count


def step_offset() -> int:
    """The global step this attempt starts from (``$COORD_STEP_OFFSET``; 0 on a first attempt)."""
    text = os.environ.get("COORD_STEP_OFFSET") or "0"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"COORD_STEP_OFFSET must be a whole number, got {text!r}") from None


def checkpoint_dir(step: int) -> str:
    """``$COORD_CHECKPOINT_DIR/NNNNNNN`` for ``step`` (the step within this attempt, as checkpoint
    names count it: the global step less :func:`step_offset`), created if it is not there yet."""
    if not _whole(step) or not 0 <= step < 10**STEP_DIGITS:
        raise ValueError(f"coord_script.checkpoint_dir: step must be a whole number from 0 to "
                         f"{10**STEP_DIGITS - 1}, got {step!r}")
    root = os.environ.get("COORD_CHECKPOINT_DIR")
    if not root:
        raise RuntimeError("coord_script.checkpoint_dir: COORD_CHECKPOINT_DIR is not set (the script is not run "
                           "by coord run); save where you would without coord")
    path = os.path.join(root, f"{step:0{STEP_DIGITS}d}")
    os.makedirs(path, exist_ok=True)
    return path


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def hf_callback() -> Any:
    """A ``transformers.TrainerCallback`` that reports Hugging Face Trainer's steps to coord: every
    optimizer step (so the hang watch sees the training move) and, at each of its logging steps, the
    loss and learning rate it logs. ``Trainer(..., callbacks=[coord_script.hf_callback()])``; only the
    main process reports. Imports transformers when called (this module itself imports nothing)."""
    from transformers import TrainerCallback

    class CoordCallback(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.is_world_process_zero:
                report(int(state.global_step))

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kwargs: Any) -> None:
            if state.is_world_process_zero and logs:
                report(int(state.global_step), **_numbers(logs, {"loss": "loss", "learning_rate": "learning_rate",
                                                                 "eval_loss": "val_loss"}))

    return CoordCallback()


def accelerate_tracker() -> Any:
    """An Accelerate tracker that reports what the script logs to coord: ``Accelerator(log_with=
    [coord_script.accelerate_tracker()])`` and ``accelerator.init_trackers("name")``, then
    ``accelerator.log({"loss": loss}, step=step)`` reports that step with its loss (and any other
    number). Only the main process reports. Imports accelerate when called."""
    from accelerate.tracking import GeneralTracker

    class CoordTracker(GeneralTracker):
        name = "coord"
        requires_logging_directory = False

        def __init__(self) -> None:
            super().__init__()

        @property
        def tracker(self) -> None:
            return None

        def store_init_configuration(self, values: dict[str, Any]) -> None:
            return None

        def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
            if step is None or os.environ.get("RANK", "0") != "0":
                return
            report(int(step), **_numbers(values, {name: name for name in values}))

    return CoordTracker()


def _numbers(values: dict[str, Any], names: dict[str, str]) -> dict[str, float]:
    """The values that are numbers, under coord's names for them (``loss`` is report's own argument)."""
    return {ours: float(values[theirs]) for theirs, ours in names.items()
            if theirs in values and _number(values[theirs])}
