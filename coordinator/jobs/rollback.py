"""A run whose training went wrong (a NaN loss, a spike it rolls back from): the rollback counted and
said, and the batches it skips owed to the next launch (docs/recovery.md). The decision itself is
``policy.decide_unsound``; finding it, ``RankWatcher``; what success needs, ``coordinator.jobs.success``."""

from __future__ import annotations

from coordinator.jobs import catalog
from coordinator.jobs.effects import RunStore
from coordinator.jobs.record import JobRecord
from coordinator.jobs.run_context import RunContext
from shared.json_values import value_text


def roll_back(ctx: RunContext, reason: str) -> None:
    """A rollback is counted, owes the next launch the batches to skip, and is said (an event and an
    alert: ``job.diverged``)."""
    record, spec = ctx.record, ctx.spec
    record.rollbacks += 1
    record.skip_owed = spec.skip_on_rollback
    unsound = record.unsound
    store: RunStore = ctx.fx
    newest = catalog.newest_valid(store.checkpoints(ctx.run_id))
    target = (f"the checkpoint of step {newest['step']}" if newest is not None
              else "step 0 (no valid checkpoint before it)")
    skip = f", skipping the {spec.skip_on_rollback} batches after it" if spec.skip_on_rollback else ""
    ctx.event("diverged", f"{reason}: rolling back to {target}{skip} (rollback {record.rollbacks} of "
              f"{spec.max_rollbacks}, --on-divergence rollback)",
              step=unsound["step"] if unsound else None, metric=unsound["metric"] if unsound else None,
              value=value_text(unsound["value"]) if unsound else None, rollback=record.rollbacks,
              resume_step=newest["step"] if newest else 0, good_until=record.diverged_after,
              skip_batches=spec.skip_on_rollback)


def take_skip(record: JobRecord, start_step: int) -> int:
    """The batches the attempt that resumes from ``start_step`` skips. A rollback's skip belongs to the
    step it resumes from: a later resume from the same checkpoint skips the same batches, and one more
    rollback to it skips more of them (the same ones again would meet the same trouble)."""
    key = str(start_step)
    if record.skip_owed:
        record.skips[key] = record.skips.get(key, 0) + record.skip_owed
        record.skip_owed = 0
    return record.skips.get(key, 0)
