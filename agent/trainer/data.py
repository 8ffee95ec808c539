"""Which examples each optimizer step consumes, and the micro-batches one rank trains on.

One optimizer step consumes one global batch of G = batch_size × grad_accumulation_steps
examples. The examples of step s are a pure function of (seed, epoch, G, data set
size): each epoch is a fresh shuffle of all example indices, cut into
len // G global batches (the remainder is skipped, as mlx-lm does). How a
global batch is split (into micro-batches, across ranks) does not change
which examples it holds, so a job relaunched on fewer ranks with the batch
size and accumulation recomputed for the same G trains on the same data in
the same order.

The shuffle uses Python's ``random.Random`` seeded with a string (hashed with
SHA-512): its output is the same on every platform and Python version, so
ranks whose numpy versions differ still agree on the order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

#: mlx-lm pads a batch to one more than a multiple of this (the targets are the inputs shifted by one).
PAD_MULTIPLE = 32


class BatchError(ValueError):
    """Batch options that cannot work with this many ranks or this data set."""


@dataclass(frozen=True)
class Split:
    """How one global batch is divided: micro-batches of batch_size, each shared by the ranks."""

    world_size: int
    rank: int
    batch_size: int
    accumulation: int

    def __post_init__(self) -> None:
        if self.accumulation < 1:
            raise BatchError("--grad-accumulation-steps must be at least 1")
        if self.batch_size < self.world_size or self.batch_size % self.world_size:
            raise BatchError(f"--batch-size {self.batch_size} must be a multiple of the number of ranks "
                             f"({self.world_size}): it is the batch across all ranks")

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.accumulation

    @property
    def per_rank(self) -> int:
        return self.batch_size // self.world_size

    def micro_batches(self, examples: list[int]) -> list[list[int]]:
        """This rank's share of each micro-batch: contiguous slices of the global batch."""
        if len(examples) != self.global_batch:
            raise ValueError(f"a global batch has {self.global_batch} examples, got {len(examples)}")
        out = []
        for micro in range(self.accumulation):
            start = micro * self.batch_size + self.rank * self.per_rank
            out.append(examples[start:start + self.per_rank])
        return out


class GlobalOrder:
    """The examples of every optimizer step, for a data set size, a global batch and a seed."""

    def __init__(self, size: int, global_batch: int, seed: int, skipped: int = 0):
        if size < global_batch:
            raise BatchError(f"the training set has {size} examples, fewer than one global batch "
                             f"({global_batch} = batch size × gradient accumulation steps)")
        self.size = size
        self.global_batch = global_batch
        self.seed = seed
        self.batches_per_epoch = size // global_batch
        # Global batches passed over without training on them: the data after a checkpoint that a run
        # rolled back from skips (coord run --skip-on-rollback), kept in every later checkpoint.
        self.skipped = skipped
        self._epoch: int | None = None
        self._order: list[int] = []

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, index in epoch) of the global batch that step ``step`` + 1 consumes."""
        return divmod(step + self.skipped, self.batches_per_epoch)

    def examples(self, step: int) -> list[int]:
        """The example indices optimizer step ``step`` (counted from 1) consumes."""
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        epoch, index = self.position(step - 1)
        order = self._epoch_order(epoch)
        return order[index * self.global_batch:(index + 1) * self.global_batch]

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            order = list(range(self.size))
            random.Random(f"coord-train-order:{self.seed}:{epoch}").shuffle(order)
            self._epoch, self._order = epoch, order
        return self._order


def pad_batch(items: list[tuple[list[int], int]], max_seq_length: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """Token lists with their prompt offsets as mlx-lm batches them: (tokens [n, T] int32, lengths [n, 2]).

    ``lengths`` holds (offset, length) per row: the loss counts target positions
    from the offset to the (truncated) length, as mlx-lm's default loss does.
    Returns the arrays and whether any sequence was truncated.
    """
    import numpy as np

    lengths = [len(tokens) for tokens, _ in items]
    width = min(1 + PAD_MULTIPLE * ((max(lengths) + PAD_MULTIPLE - 1) // PAD_MULTIPLE), max_seq_length)
    batch = np.zeros((len(items), width), np.int32)
    spans = np.zeros((len(items), 2), np.int32)
    for row, (tokens, offset) in enumerate(items):
        kept = min(len(tokens), max_seq_length)
        batch[row, :kept] = tokens[:kept]
        spans[row] = (offset, kept)
    return batch, spans, max(lengths) > max_seq_length


def as_item(processed: Any) -> tuple[list[int], int]:
    """A processed data set entry as (tokens, prompt offset); mlx-lm datasets give one or the other."""
    if isinstance(processed, tuple) and len(processed) == 2:
        return list(processed[0]), int(processed[1])
    return list(processed), 0
