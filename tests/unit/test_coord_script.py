"""coord_script, the helpers a training script imports: its progress records are what the daemon reads
(coordinator/jobs/progress.py), its checkpoint directories are named as the contract says, it is
silent outside coord, it refuses bad input by name, and it ships in the agent bundle."""

from __future__ import annotations

import io
import json
import math
import zipfile

import pytest

import coord_script
from coordinator.jobs.progress import read_record
from coordinator.nodes.agent_bundle import build_bundle


@pytest.fixture
def contract(tmp_path, monkeypatch):
    for name in ("COORD_PROGRESS_FILE", "COORD_CHECKPOINT_DIR", "COORD_RESUME_DIR", "COORD_STEP_OFFSET"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path, monkeypatch


def test_report_appends_one_train_record_per_call_that_the_daemon_reads(contract):
    root, env = contract
    progress = root / "progress.jsonl"
    env.setenv("COORD_PROGRESS_FILE", str(progress))
    assert coord_script.report(1, loss=2.5, tokens_per_second=1000, learning_rate=1e-4)
    assert coord_script.report(2, loss=2.25)
    lines = progress.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 3  # whole lines, each ended
    first = json.loads(lines[0])
    assert read_record(first) == {"kind": "train", "step": 1, "loss": 2.5, "tokens_per_second": 1000.0,
                                  "learning_rate": 1e-4, "time": first["time"]}
    assert read_record(json.loads(lines[1]))["loss"] == 2.25


def test_a_nan_loss_is_reported_as_nan_another_value_not_finite_is_left_out_and_text_is_refused(contract):
    root, env = contract
    env.setenv("COORD_PROGRESS_FILE", str(root / "progress.jsonl"))
    coord_script.report(3, loss=math.nan, tokens_per_second=5.0, grad_norm=math.inf, learning_rate=math.inf)
    record = json.loads((root / "progress.jsonl").read_text())
    assert math.isnan(record["loss"]) and record["grad_norm"] == math.inf and "learning_rate" not in record
    read = read_record(record)  # what the daemon takes: the NaN as a NaN, never dropped
    assert math.isnan(read["loss"]) and read["grad_norm"] == math.inf and read["tokens_per_second"] == 5.0
    with pytest.raises(TypeError, match="loss must be a number, got str"):
        coord_script.report(4, loss="0.5")  # type: ignore[arg-type]
    for step in (-1, 1.5, True):
        with pytest.raises(ValueError, match="step must be a whole number"):
            coord_script.report(step)  # type: ignore[arg-type]


def test_batches_to_skip_after_a_rollback_come_from_the_environment(contract):
    _, env = contract
    env.delenv("COORD_SKIP_BATCHES", raising=False)
    assert coord_script.skip_batches() == 0
    env.setenv("COORD_SKIP_BATCHES", "25")
    assert coord_script.skip_batches() == 25
    for bad in ("many", "-3"):
        env.setenv("COORD_SKIP_BATCHES", bad)
        with pytest.raises(ValueError, match="COORD_SKIP_BATCHES must be"):
            coord_script.skip_batches()


def test_outside_coord_nothing_is_written_and_there_is_nothing_to_resume(contract):
    assert coord_script.report(1, loss=1.0) is False
    assert coord_script.resume_dir() is None and coord_script.step_offset() == 0
    with pytest.raises(RuntimeError, match="COORD_CHECKPOINT_DIR is not set"):
        coord_script.checkpoint_dir(1)


def test_checkpoint_dirs_are_the_step_in_seven_digits_and_created(contract):
    root, env = contract
    env.setenv("COORD_CHECKPOINT_DIR", str(root / "checkpoints" / "run" / "attempt-1"))
    path = coord_script.checkpoint_dir(12)
    assert path == str(root / "checkpoints" / "run" / "attempt-1" / "0000012") and (root / path).is_dir()
    assert coord_script.checkpoint_dir(12) == path  # again: the same directory, no error
    for step in (-1, 10**7, 2.0):
        with pytest.raises(ValueError, match="from 0 to 9999999"):
            coord_script.checkpoint_dir(step)  # type: ignore[arg-type]


def test_a_resume_is_read_from_the_environment(contract):
    _, env = contract
    env.setenv("COORD_RESUME_DIR", "/w/checkpoints/run/attempt-0/0000040")
    env.setenv("COORD_STEP_OFFSET", "40")
    assert coord_script.resume_dir() == "/w/checkpoints/run/attempt-0/0000040"
    assert coord_script.step_offset() == 40
    env.setenv("COORD_STEP_OFFSET", "forty")
    with pytest.raises(ValueError, match="COORD_STEP_OFFSET must be a whole number"):
        coord_script.step_offset()


def test_a_plans_deepspeed_json_is_found_from_the_environment(contract):
    _, env = contract
    env.delenv("COORD_DEEPSPEED_CONFIG", raising=False)
    assert coord_script.deepspeed_config() is None
    env.setenv("COORD_DEEPSPEED_CONFIG", "/w/.coord/jobs/r/attempt-1/rank-0/ds_config.json")
    assert coord_script.deepspeed_config() == "/w/.coord/jobs/r/attempt-1/rank-0/ds_config.json"


def test_it_ships_in_the_agent_bundle():
    names = zipfile.ZipFile(io.BytesIO(build_bundle().data)).namelist()
    assert "coord_script/__init__.py" in names


def test_every_rank_reports_its_compute_time_and_a_bad_one_is_refused(contract):
    root, env = contract
    progress = root / "progress.jsonl"
    env.setenv("COORD_PROGRESS_FILE", str(progress))
    assert coord_script.report(5, compute_seconds=0.25)  # a rank that reports nothing else
    assert coord_script.report(5, loss=1.5, compute_seconds=0.5)  # the first rank, with its loss
    first, second = (json.loads(line) for line in progress.read_text().splitlines())
    assert read_record(first) == {"kind": "compute", "step": 5, "compute_seconds": 0.25, "time": first["time"]}
    assert read_record(second)["kind"] == "train" and read_record(second)["compute_seconds"] == 0.5
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="compute_seconds must be a finite number of at least 0"):
            coord_script.report(6, compute_seconds=bad)
    with pytest.raises(TypeError, match="compute_seconds must be a number"):
        coord_script.report(6, compute_seconds="0.1")
    assert len(progress.read_text().splitlines()) == 2  # nothing written for a refused call
