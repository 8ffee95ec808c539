"""A rank's heartbeat (agent/heartbeat.py) and how mlx-lm's loop tells it of each step
(agent/mlx_lm_train.py), with a fake clock and a real file."""

from __future__ import annotations

import json
from pathlib import Path

from agent.heartbeat import Heartbeat, silent
from agent.mlx_lm_train import beating_batches, during, save_final_checkpoint
from coordinator.jobs.progress import read_record


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_phase_is_written_at_once_and_a_step_with_the_next_beat(tmp_path):
    clock, path = Clock(), tmp_path / "progress.jsonl"
    beat = Heartbeat(str(path), step=10, clock=clock)
    beat.beat()
    clock.now += 5
    beat.phase("compiling")
    clock.now += 7
    beat.beat()
    first, second, third = lines(path)
    assert (first["phase"], first["step"], first["idle_s"]) == ("loading", 10, 0.0)
    assert (second["phase"], second["idle_s"]) == ("compiling", 0.0)
    assert third["idle_s"] == 7.0 and "collective" not in third
    beat.step(11)
    with beat.collective():
        clock.now += 3
        beat.beat()
    waiting = lines(path)[-1]
    assert waiting["step"] == 11 and waiting["idle_s"] == 3.0 and waiting["collective"] is True
    assert all(read_record(line) == line for line in lines(path))  # what coord reads, whole


def test_during_restores_the_phase_before_and_a_heartbeat_without_a_file_writes_nothing(tmp_path):
    path = tmp_path / "progress.jsonl"
    beat = Heartbeat(str(path), clock=Clock())
    beat.phase("training")
    with beat.during("saving"):
        pass
    assert [line["phase"] for line in lines(path)] == ["training", "saving", "training"]
    quiet = silent()
    quiet.phase("training")
    quiet.step(3)
    assert quiet.start() is quiet and quiet.record()["step"] == 3


def test_a_beat_that_cannot_be_written_costs_the_beat_only(tmp_path):
    Heartbeat(str(tmp_path / "missing" / "progress.jsonl")).beat()


def test_the_thread_beats_until_stopped(tmp_path):
    path = tmp_path / "progress.jsonl"
    beat = Heartbeat(str(path), every=0.01).start()
    import time
    deadline = time.monotonic() + 5
    while len(path.read_text().splitlines()) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    beat.stop()
    assert len(lines(path)) >= 3


def test_mlx_lms_loop_reports_a_step_when_it_asks_for_the_next_batch(tmp_path):
    path = tmp_path / "progress.jsonl"
    beat = Heartbeat(str(path), step=20, clock=Clock())
    seen = []

    def iterate(*, dataset, loop=False, **_):
        yield from dataset

    batches = beating_batches(iterate, beat, 20)
    for batch in batches(dataset=["b1", "b2", "b3"], loop=True):
        seen.append((batch, beat.record()["step"], beat.record()["phase"]))
    assert seen == [("b1", 20, "loading"), ("b2", 21, "training"), ("b3", 22, "training")]
    assert list(batches(dataset=["v1"])) == ["v1"] and beat.record()["step"] == 22  # evaluation batches
    evaluated = during("evaluating", lambda: beat.record()["phase"], beat)
    assert evaluated() == "evaluating" and beat.record()["phase"] == "training"


def test_after_a_rollback_mlx_lms_loop_skips_the_batches_it_is_told_and_still_counts_its_steps(tmp_path):
    beat = Heartbeat(str(tmp_path / "progress.jsonl"), step=20, clock=Clock())

    def iterate(*, dataset, loop=False, **_):
        yield from dataset

    batches = beating_batches(iterate, beat, 20, skip=2)
    assert list(batches(dataset=["b1", "b2", "b3", "b4"], loop=True)) == ["b3", "b4"]
    assert beat.record()["step"] == 21  # step 21 trained on b3: the skipped batches are no steps
    assert list(batches(dataset=["v1", "v2"])) == ["v1", "v2"]  # evaluation batches are never skipped


def test_mlx_lms_final_weights_become_the_last_steps_checkpoint_when_no_save_fell_on_it(tmp_path):
    env = {"COORD_CHECKPOINT_DIR": str(tmp_path), "COORD_TOTAL_STEPS": "1500", "COORD_STEP_OFFSET": "1200"}
    (tmp_path / "adapters.safetensors").write_bytes(b"final weights")
    (tmp_path / "0000200_adapters.safetensors").write_bytes(b"step 1400")
    final = save_final_checkpoint(env)
    assert final == str(tmp_path / "0000300_adapters.safetensors") and Path(final).read_bytes() == b"final weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000200_adapters.safetensors",
                                                          "0000300_adapters.safetensors", "adapters.safetensors"]
    assert save_final_checkpoint(env) is None  # there already (a save fell on the last step): left as it is
    assert save_final_checkpoint({"COORD_CHECKPOINT_DIR": str(tmp_path)}) is None  # no total: nothing known


def test_a_beat_carries_the_mean_compute_time_of_the_steps_since_the_last_one_not_the_compile(tmp_path):
    clock, path = Clock(), tmp_path / "progress.jsonl"
    beat = Heartbeat(str(path), clock=clock)
    beat.phase("compiling")
    beat.step(1, compute_s=30.0)  # the first step compiles: not a compute time
    beat.phase("training")
    beat.step(2, compute_s=0.1)
    beat.step(3, compute_s=0.3)
    beat.beat()
    beat.beat()  # no step since: no compute time
    beat.step(4, compute_s=0.5)
    beat.beat()
    records = [r for r in lines(path) if r["phase"] == "training"][1:]  # after the beat of the phase change
    assert (records[0]["compute_s"], records[0]["compute_steps"]) == (0.2, 2)
    assert "compute_s" not in records[1] and "compute_steps" not in records[1]
    assert (records[2]["compute_s"], records[2]["compute_steps"]) == (0.5, 1)
    assert read_record(records[0])["compute_s"] == 0.2
