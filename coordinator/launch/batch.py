"""How a global batch splits over ranks, and how a shrink keeps it: pure arithmetic.

mlx-lm's ``--batch-size`` is the batch of one micro-step across all ranks (each rank takes
``batch_size / ranks``), and one optimizer step is ``batch_size × grad_accumulation_steps``
examples: the global batch. When a node is left out, the global batch stays, so the run keeps
its learning dynamics; the micro-step batch and the accumulation are recomputed so that no
rank takes more examples per micro-step than it did before (its memory was sized for that).
A launcher says how its jobs state their batch (coordinator/launch/seam.py); this is the
arithmetic they share.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSplit:
    batch_size: int  # one micro-step, across all ranks (mlx-lm's --batch-size)
    accumulation: int  # micro-steps per optimizer step (--grad-accumulation-steps)
    ranks: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.accumulation

    @property
    def per_rank(self) -> int:
        return self.batch_size // self.ranks

    def describe(self) -> str:
        return (f"{self.ranks} ranks × {self.per_rank} examples × {self.accumulation} accumulation steps = "
                f"global batch {self.global_batch}")


class Undividable(ValueError):
    """The global batch cannot be split over the remaining ranks; the job waits for the node instead."""


def rebatch(original: BatchSplit, ranks: int) -> BatchSplit:
    """The split of ``original``'s global batch over ``ranks`` ranks with the fewest accumulation steps
    whose per-rank micro-batch is no larger than the original's."""
    if ranks < 1:
        raise Undividable("no rank left to run on")
    if ranks == original.ranks:
        return original
    total = original.global_batch
    for accumulation in range(1, total + 1):
        if total % accumulation:
            continue
        batch_size = total // accumulation
        if batch_size % ranks == 0 and batch_size // ranks <= original.per_rank:
            return BatchSplit(batch_size, accumulation, ranks)
    raise Undividable(f"the global batch of {total} cannot be split evenly over {ranks} ranks with at most "
                      f"{original.per_rank} examples per rank")
