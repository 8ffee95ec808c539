"""How much of a long run's history is kept: pure rules over steps and times, no I/O.

**Run points** (train and validation, each series on its own): a run keeps every point up to
``RECENT_POINTS + OLDER_POINTS`` (2,000). Beyond that, the newest ``RECENT_POINTS`` (1,000)
are all kept, and the older ones one per bucket of ``stride`` steps (the first point of each
bucket ``step // stride``), ``stride`` being the smallest power of two that leaves at most
``OLDER_POINTS`` (1,000) older points. Buckets are aligned on absolute steps and strides only
double, so thinning again never needs a point an earlier pass dropped, and the curve's early
part gets coarser as the run grows while its recent part stays exact.

**Node samples** (one every ``NODE_SAMPLE_S``): every sample of the last hour, then the first
sample of each 5-minute bucket up to 7 days; nothing older.

**Resume** (TensorBoard's ``purge_step``): an attempt that resumes from the checkpoint of step
S drops every point of the run past S, whichever attempt wrote it, so the curve goes on from S.
"""

from __future__ import annotations

from collections.abc import Sequence

RECENT_POINTS = 1000
OLDER_POINTS = 1000
THIN_EVERY = 100  # points added to a run between two thinning passes

NODE_SAMPLE_S = 10.0
NODE_RECENT_S = 3600.0
NODE_BUCKET_S = 300.0
NODE_KEEP_S = 7 * 24 * 3600.0


def stride_for(steps: Sequence[int], budget: int = OLDER_POINTS) -> int:
    """The smallest power of two whose buckets over ``steps`` number at most ``budget``."""
    stride = 1
    while len({step // stride for step in steps}) > budget:
        stride *= 2
    return stride


def steps_to_drop(steps: Sequence[int], *, recent: int = RECENT_POINTS, older: int = OLDER_POINTS) -> list[int]:
    """The steps of one series (any order) that the rule above no longer keeps."""
    ordered = sorted(steps)
    if len(ordered) <= recent + older:
        return []
    old = ordered[:-recent]
    stride = stride_for(old, older)
    drop, seen = [], set()
    for step in old:
        bucket = step // stride
        if bucket in seen:
            drop.append(step)
        else:
            seen.add(bucket)
    return drop


def purge_after(start_step: int) -> int:
    """The first step a resumed attempt's points replace (TensorBoard's ``purge_step``)."""
    return start_step + 1
