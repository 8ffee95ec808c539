"""What a run needs to be called succeeded beyond its ranks' exit statuses: a finite last loss, and its
final checkpoint validated; and a failure after every step ran that counts as the work done. The rules
are pure functions, tested without processes; ``judge_success`` applies them to an attempt's outcome
and says what it changed (docs/recovery.md#success)."""

from __future__ import annotations

import math

from coordinator.jobs import catalog
from coordinator.jobs.attempt import Attempt
from coordinator.jobs.effects import RunStore
from coordinator.jobs.policy import NON_FINITE, RANK_FAILED, SUCCEEDED, Outcome, after_the_last_step
from coordinator.jobs.record import JobRecord
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.spec import reports_progress
from coordinator.store.state import CheckpointRow
from shared.json_values import value_text


def judge_success(ctx: RunContext, attempt: Attempt | None, outcome: Outcome) -> Outcome:
    """The attempt's outcome once its ranks are stopped and its last checkpoints catalogued: a NaN last
    loss is no success; a failure after the last step with its checkpoint valid is one (said); a
    success without a valid final checkpoint is a failure of the final save, or a warning."""
    outcome = unsound_success(ctx.record, outcome)
    store: RunStore = ctx.fx
    copies = store.checkpoints(ctx.run_id)
    if attempt is None or not attempt.ended_unread:  # nodes not read: their ranks' last words may say otherwise
        outcome = _after_the_last_step(ctx, outcome, copies)
    judged, warning = final_checkpoint_outcome(outcome, copies, total_steps=ctx.spec.total_steps,
                                               saves_last_step=reports_progress(ctx.spec))
    if warning:
        ctx.record.add_warning(warning)
    if judged is not outcome:
        ctx.event("final_checkpoint_invalid", judged.detail, step=ctx.spec.total_steps)
    return judged


def _after_the_last_step(ctx: RunContext, outcome: Outcome, copies: list[CheckpointRow]) -> Outcome:
    """A failure after every step ran and the final checkpoint was validated ends the job, said."""
    newest = catalog.newest_valid(copies)
    done = after_the_last_step(outcome, total_steps=ctx.spec.total_steps, step=ctx.record.step,
                               final_checkpoint=newest["step"] if newest else None)
    if done is not outcome:
        warning = f"after its last step: {outcome.detail}; nothing rerun (its final checkpoint is valid)"
        ctx.record.add_warning(warning)
        ctx.event("failed_after_last_step", f"attempt {ctx.record.attempt} {warning}", outcome=outcome.kind)
    return done


def unsound_success(record: JobRecord, outcome: Outcome) -> Outcome:
    """Success needs finite values: a run whose last loss is NaN did not train, whatever its ranks'
    exit statuses say (the poll that reads it ends the attempt first; this is the last guard)."""
    loss = record.loss
    if outcome.kind != SUCCEEDED or loss is None or math.isfinite(loss):
        return outcome
    detail = f"loss is {value_text(loss)} at step {record.step}"
    record.unsound = {"kind": NON_FINITE, "step": record.step, "metric": "loss", "value": loss, "detail": detail}
    return Outcome(NON_FINITE, detail, outcome.reached_first_step, f"{NON_FINITE}:{record.step}")


def final_checkpoint_outcome(outcome: Outcome, copies: list[CheckpointRow], *, total_steps: int | None,
                             saves_last_step: bool) -> tuple[Outcome, str | None]:
    """A success whose final checkpoint is not valid: ``saves_last_step`` (coord's trainers, which save
    the last step whatever --save-every says) makes it a failure of that save, rerun from the newest
    valid checkpoint; a script of one's own that did not save its last step succeeds with a warning
    (the second value) saying which step its newest valid checkpoint holds. A job that wrote no
    checkpoint at all is judged by its steps alone, as before."""
    if outcome.kind != SUCCEEDED or total_steps is None or not copies:
        return outcome, None
    newest = catalog.newest_valid(copies)
    if newest is not None and newest["step"] >= total_steps:
        return outcome, None
    last = [c for c in copies if c["step"] >= total_steps and not c["valid"]]
    why = (f"is not valid: {last[0]['detail']}" if last else "was not written")
    held = f"the newest valid one is of step {newest['step']}" if newest else "no checkpoint of it is valid"
    if saves_last_step:
        return Outcome(RANK_FAILED, f"every step ran, but the checkpoint of the last step ({total_steps}) {why}; "
                       f"{held}: the steps after it are run again", outcome.reached_first_step,
                       f"final-checkpoint:{total_steps}"), None
    return outcome, (f"its last step's checkpoint ({total_steps}) {why}; {held}: the weights of the last "
                     f"{total_steps - (newest['step'] if newest else 0)} steps are only where the script kept them")
