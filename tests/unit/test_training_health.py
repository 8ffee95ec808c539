"""The training's health, as pure policy: a NaN or infinite value is what it is and a divergence, a
loss spike is measured against its window by the stated rule, a divergence rolls back until
--max-rollbacks (or stops at once), the batches a rollback skips belong to the step it resumes from,
and success needs finite values."""

from __future__ import annotations

import json
import math

import pytest

from coordinator.commands.status import sparkline
from coordinator.jobs.policy import NON_FINITE, RANK_FAILED, SUCCEEDED, Outcome, Rollbacks, decide
from coordinator.jobs.progress import read_record
from coordinator.jobs.record import JobRecord
from coordinator.jobs.rollback import take_skip
from coordinator.jobs.success import final_checkpoint_outcome, unsound_success
from coordinator.jobs.training_health import SPIKE_MIN_POINTS, LossWindow, non_finite, spike_threshold
from shared.json_values import strict, value_text


def test_a_nan_or_infinite_loss_or_gradient_norm_is_kept_as_what_it_is():
    for raw, expected in ((math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf"), ("NaN", "nan"),
                          ("Infinity", "inf"), ("-inf", "-inf")):
        record = read_record({"kind": "train", "step": 5, "loss": raw, "grad_norm": raw})
        assert value_text(record["loss"]) == expected and value_text(record["grad_norm"]) == expected, raw
    val = read_record({"kind": "val", "step": 5, "val_loss": "nan"})
    assert math.isnan(val["val_loss"])
    # what coord only shows is still left out when it is not finite, and words that are not numbers too
    assert read_record({"kind": "train", "step": 5, "tokens_per_second": math.inf, "loss": "low"}) == {
        "kind": "train", "step": 5}


def test_the_first_non_finite_value_names_its_metric_and_step():
    assert non_finite(7, {"loss": 2.0, "grad_norm": 1.0}) is None
    found = non_finite(7, {"loss": 2.0, "grad_norm": math.inf})
    assert (found.kind, found.metric, found.step, found.detail) == ("non_finite", "grad_norm", 7, "grad_norm is inf "
                                                                                                  "at step 7")
    assert non_finite(8, {"loss": math.nan}).detail == "loss is nan at step 8"


def test_a_spike_is_a_loss_above_one_and_a_half_times_the_median_and_above_the_windows_highest():
    window = LossWindow()
    losses = [2.0 + 0.01 * (i % 5) for i in range(SPIKE_MIN_POINTS - 1)]
    for step, loss in enumerate(losses, start=1):
        assert window.add(step, loss) is None
    assert window.add(10, 9.0) is None  # nine losses are too few to judge: it enters the window
    window = LossWindow()
    for step, loss in enumerate(losses + [2.02], start=1):
        window.add(step, loss)
    threshold = spike_threshold(list(window.losses))
    assert threshold == pytest.approx(3.03)  # 1.5 x the median (2.02); the highest (2.04) is below that
    assert window.add(11, 3.0) is None  # below the bar: an ordinary bad step
    spike = window.add(12, 6.5)
    assert spike is not None and spike.step == 12 and "loss spike at step 12: 6.5" in spike.describe()
    assert window.add(13, 7.0) is None  # the same spike goes on: said once
    assert window.add(14, 2.0) is None and window.add(15, 6.0) is not None  # over, then a new one


def test_a_noisy_curve_raises_the_bar_to_its_highest_and_nan_never_enters_the_window():
    window = LossWindow()
    for step, loss in enumerate([1.0, 3.0] * 10, start=1):
        assert window.add(step, loss) is None  # a swing as high as the window's own is no spike
    assert spike_threshold(list(window.losses)) == pytest.approx(3.0)
    assert window.add(21, math.nan) is None and len(window.losses) == 20
    # a loss that is negative (some objectives) measures the ratio from the median's size
    assert spike_threshold([-2.0] * SPIKE_MIN_POINTS) == pytest.approx(-1.0)


def test_a_divergence_rolls_back_until_max_rollbacks_or_stops_at_once_and_never_uses_a_restart():
    nan = Outcome(NON_FINITE, "loss is nan at step 26", True, "non_finite:26")
    rollback = decide(nan, [], max_restarts=0, restarts_used=0, rollbacks=Rollbacks("rollback", 0, 3))
    assert (rollback.action, rollback.counts, rollback.rollback, rollback.delay_s) == ("restart", False, True, 0.0)
    spent = decide(nan, [], max_restarts=3, restarts_used=0, rollbacks=Rollbacks("rollback", 3, 3))
    assert spent.action == "fail" and spent.reason == ("loss is nan at step 26; gave up after 3 rollbacks "
                                                       "(--max-rollbacks 3)")
    stop = decide(nan, [], max_restarts=3, restarts_used=0, rollbacks=Rollbacks("stop", 0, 3))
    assert stop.action == "fail" and stop.reason == "loss is nan at step 26 (--on-divergence stop)"
    failed = decide(Outcome(RANK_FAILED, "x", True), [], max_restarts=3, restarts_used=0,
                    rollbacks=Rollbacks("rollback", 3, 3))
    assert failed.action == "restart" and failed.counts and not failed.rollback


def test_a_rollbacks_skip_belongs_to_the_step_it_resumes_from_and_adds_up():
    record = JobRecord("r-00000000")
    assert take_skip(record, 20) == 0
    record.skip_owed = 3
    assert take_skip(record, 20) == 3 and record.skip_owed == 0
    assert take_skip(record, 20) == 3  # a later resume from the same checkpoint skips the same batches
    assert take_skip(record, 30) == 0
    record.skip_owed = 3
    assert take_skip(record, 20) == 6  # rolled back to it again: the same ones again would meet the same trouble
    assert JobRecord.from_json(json.loads(json.dumps(record.to_json()))).skips == {"20": 6}


def test_success_needs_a_finite_last_loss():
    record = JobRecord("r-00000000", step=60, loss=math.nan)
    done = Outcome(SUCCEEDED, "every rank finished", True)
    turned = unsound_success(record, done)
    assert turned.kind == NON_FINITE and turned.detail == "loss is nan at step 60" and record.unsound["step"] == 60
    record.loss = 0.5
    assert unsound_success(record, done) is done
    record.loss = None  # a script that reports no loss is judged by its exits, as before
    assert unsound_success(record, done) is done


def test_documents_say_nan_as_a_word_json_can_hold():
    document = {"loss": math.nan, "losses": [1.0, math.inf, -math.inf], "n": 3, "name": "nan"}
    assert json.dumps(strict(document), allow_nan=False) == ('{"loss": "nan", "losses": [1.0, "inf", "-inf"], '
                                                             '"n": 3, "name": "nan"}')
    assert sparkline([3.0, 2.0, math.nan, 1.0], width=4) == "█▅!▁"
    assert sparkline([math.nan, math.nan], width=2) == "!!"


def test_a_record_keeps_a_nan_loss_through_the_store():
    record = JobRecord("r-00000000", loss=math.nan, unsound={"kind": NON_FINITE, "step": 3, "metric": "loss",
                                                             "value": math.nan, "detail": "loss is nan at step 3"})
    again = JobRecord.from_json(json.loads(json.dumps(record.to_json())))  # the store's JSON, as Python writes it
    assert math.isnan(again.loss) and math.isnan(again.unsound["value"])


def _copy(step: int, valid: bool = True, detail: str = "ok") -> dict:
    return {"step": step, "attempt": 0, "node": "n1", "path": f"/w/{step:07d}_adapters.safetensors", "sha256": "a",
            "size": 1, "valid": valid, "detail": detail, "created": 0.0, "role": "primary"}


def test_success_needs_the_final_checkpoint_validated_when_the_trainer_saves_the_last_step():
    done = Outcome(SUCCEEDED, "every rank finished", True)
    assert final_checkpoint_outcome(done, [_copy(1400), _copy(1500)], total_steps=1500, saves_last_step=True) == (
        done, None)
    assert final_checkpoint_outcome(done, [], total_steps=1500, saves_last_step=True) == (done, None)  # none written
    judged, warning = final_checkpoint_outcome(done, [_copy(1400), _copy(1500, False, "tensor 'w' holds NaN")],
                                               total_steps=1500, saves_last_step=True)
    assert judged.kind == RANK_FAILED and warning is None
    assert judged.detail == ("every step ran, but the checkpoint of the last step (1500) is not valid: tensor 'w' "
                             "holds NaN; the newest valid one is of step 1400: the steps after it are run again")
    # a script of one's own that saves every 200 steps of 1500: done, and said
    judged, warning = final_checkpoint_outcome(done, [_copy(1400)], total_steps=1500, saves_last_step=False)
    assert judged is done and warning == ("its last step's checkpoint (1500) was not written; the newest valid one "
                                          "is of step 1400: the weights of the last 100 steps are only where the "
                                          "script kept them")
