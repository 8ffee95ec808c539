"""Checkpoints and fingerprints: host copies on the training thread, files and hashes in the background.

Saving must not stall training. The training thread only copies the step's
arrays to host memory (numpy); one background thread writes the file (see
``safetensors_file``) or hashes the copy, and never calls MLX. When the
previous save is still being written as the next one begins, the training
thread waits for it, and that wait counts as blocking time.

A checkpoint holds the trainable parameters under their model names (what
mlx-lm's adapters files hold, so ``mlx_lm lora --resume-adapter-file`` and
``model.load_weights(..., strict=False)`` still load it), the optimizer state
under ``state.OPTIMIZER_PREFIX`` (not a model name, so those loaders skip it),
and the trainer state in the metadata.
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path

from agent.trainer.progress import append_record
from agent.trainer.safetensors_file import HostTensor, write_atomic
from agent.trainer.state import OPTIMIZER_PREFIX

if TYPE_CHECKING:
    import mlx.nn as nn
    import mlx.optimizers as optim

_CODES = {mx.bool_: "BOOL", mx.uint8: "U8", mx.int8: "I8", mx.uint16: "U16", mx.int16: "I16",
          mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32", mx.int32: "I32", mx.float32: "F32",
          mx.uint64: "U64", mx.int64: "I64", mx.float64: "F64"}


def host_copy(arrays: dict[str, mx.array]) -> dict[str, HostTensor]:
    """Copy evaluated arrays into host memory that MLX no longer owns."""
    out = {}
    for name, array in arrays.items():
        code = _CODES.get(array.dtype)
        if code is None:
            raise TypeError(f"{name}: dtype {array.dtype} cannot be stored in safetensors")
        # numpy has no bfloat16: keep the same 16 bits as uint16, tagged BF16 in the header.
        source = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
        out[name] = HostTensor(code, tuple(array.shape), np.array(source, order="C"))
    return out


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not fit this model or optimizer."""


def flatten(tree: Any) -> list[tuple[str, Any]]:
    """``tree_flatten``'s (dotted name, leaf) pairs, typed as the list it returns without a destination."""
    flat = tree_flatten(tree)
    if not isinstance(flat, list):  # pragma: no cover - only with a dict as destination
        raise TypeError("tree_flatten returned a dict")
    return flat


def trainable_arrays(model: nn.Module) -> dict[str, mx.array]:
    return dict(flatten(model.trainable_parameters()))


def optimizer_arrays(optimizer: optim.Optimizer) -> dict[str, mx.array]:
    flat = flatten(optimizer.state)
    for name, value in flat:
        if not isinstance(value, mx.array):
            raise TypeError(f"optimizer state {name!r} is a {type(value).__name__}, not an array")
    return {OPTIMIZER_PREFIX + name: value for name, value in flat}


def fingerprint(tensors: dict[str, HostTensor]) -> str:
    """SHA256 of the tensors' bytes in sorted name order (equal on ranks holding equal weights)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(memoryview(tensors[name].data))
    return digest.hexdigest()


class BackgroundWriter:
    """One worker thread for checkpoint files and fingerprints, at most one of each in flight.

    Every rank saves its own copy of each checkpoint in its own node's checkpoint dir (the
    ranks of a data parallel job hold the same weights, optimizer state, step and RNG key, so
    the files are byte-identical; each is still validated by its own SHA256 on its node).
    Records go to ``progress_file``: a checkpoint record per save (rank 0's only, one per
    checkpoint), a fingerprint record per fingerprint (every rank).
    """

    def __init__(self, progress_file: str | None, rank: int):
        self.progress_file = progress_file
        self.rank = rank
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coord-trainer-io")
        self._save: Future | None = None
        self._fingerprint: Future | None = None

    def save(self, path: str, step: int, arrays: dict[str, mx.array], metadata: dict[str, str]) -> float:
        """Start writing a checkpoint; returns the seconds the training thread was held."""
        started = time.perf_counter()
        _result(self._save)  # the previous write must finish first (and must not have failed)
        tensors = host_copy(arrays)
        blocking = time.perf_counter() - started
        self._save = self._pool.submit(self._write, path, step, tensors, metadata, blocking)
        return blocking

    def fingerprint(self, step: int, arrays: dict[str, mx.array]) -> None:
        _result(self._fingerprint)
        self._fingerprint = self._pool.submit(self._hash, step, host_copy(arrays))

    def write_now(self, path: str, arrays: dict[str, mx.array]) -> int:
        """Write a file on the calling thread, after any save in flight (the final adapters)."""
        _result(self._save)
        return write_atomic(path, host_copy(arrays))

    def close(self) -> None:
        """Wait for everything in flight; a failed write is raised here."""
        try:
            _result(self._save)
            _result(self._fingerprint)
        finally:
            self._pool.shutdown(wait=True)

    def _write(self, path: str, step: int, tensors: dict[str, HostTensor], metadata: dict[str, str],
               blocking: float) -> None:
        started = time.perf_counter()
        size = write_atomic(path, tensors, metadata)
        if self.rank != 0:
            return
        append_record(self.progress_file, {"kind": "checkpoint", "step": step, "file": path, "bytes": size,
                                           "blocking_seconds": blocking,
                                           "write_seconds": time.perf_counter() - started})

    def _hash(self, step: int, tensors: dict[str, HostTensor]) -> None:
        append_record(self.progress_file, {"kind": "fingerprint", "step": step, "rank": self.rank,
                                           "sha256": fingerprint(tensors)})


def _result(future: Future | None) -> None:
    if future is not None:
        future.result()


def split_checkpoint(tensors: dict[str, mx.array]) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """(model parameters, optimizer state without its prefix) of a loaded checkpoint."""
    weights = {k: v for k, v in tensors.items() if not k.startswith(OPTIMIZER_PREFIX)}
    optimizer = {k[len(OPTIMIZER_PREFIX):]: v for k, v in tensors.items() if k.startswith(OPTIMIZER_PREFIX)}
    return weights, optimizer


def restore_weights(model: nn.Module, weights: dict[str, mx.array], path: str, *, complete: bool) -> None:
    """Load trainable parameters; ``complete`` demands every one of them (coord checkpoints)."""
    trainable = trainable_arrays(model)
    problems = [f"{name}: not a trainable parameter of this model" for name in sorted(set(weights) - set(trainable))]
    if complete:
        problems += [f"{name}: missing" for name in sorted(set(trainable) - set(weights))]
    problems += [f"{name}: shape {tuple(weights[name].shape)}, the model has {tuple(trainable[name].shape)}"
                 for name in sorted(set(weights) & set(trainable)) if weights[name].shape != trainable[name].shape]
    if problems:
        raise CheckpointError(f"{path} does not fit this model's trainable parameters "
                         f"(same model, --fine-tune-type and --num-layers?):\n  " + "\n  ".join(problems[:20]))
    model.load_weights(list(weights.items()), strict=False)


def restore_optimizer(optimizer: optim.Optimizer, model: nn.Module, saved: dict[str, mx.array], path: str) -> None:
    """Put a saved optimizer state in place of a freshly initialised one of the same shape."""
    optimizer.init(model.trainable_parameters())
    expected = dict(tree_flatten(optimizer.state))
    problems = [f"{name}: missing" for name in sorted(set(expected) - set(saved))]
    problems += [f"{name}: not in this optimizer's state" for name in sorted(set(saved) - set(expected))]
    problems += [f"{name}: {saved[name].dtype}{tuple(saved[name].shape)}, expected "
                 f"{expected[name].dtype}{tuple(expected[name].shape)}"
                 for name in sorted(set(saved) & set(expected))
                 if saved[name].shape != expected[name].shape or saved[name].dtype != expected[name].dtype]
    if problems:
        raise CheckpointError(f"{path}: the optimizer state does not fit this optimizer (same --optimizer?):\n  "
                              + "\n  ".join(problems[:20]))
    optimizer.state = tree_map_with_path(lambda name, _: saved[name], optimizer.state)
    # Setting the state marks the optimizer uninitialised; init keeps every entry that exists.
    optimizer.init(model.trainable_parameters())


def mlx_key() -> list[int]:
    # mx.random.state is made when mlx.core.random is imported; its stub types it as object.
    state: Any = mx.random.state
    return [int(k) for k in state[0].tolist()]


def set_mlx_key(key: list[int]) -> None:
    # mx.random.seed(s) sets the key to the two 32-bit halves of s, so any saved key can be restored.
    mx.random.seed((key[0] << 32) | key[1])
