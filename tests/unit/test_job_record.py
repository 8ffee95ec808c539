"""A run's record (coordinator/jobs/record.py) to JSON and back, as the store keeps it."""

from __future__ import annotations

import json

from coordinator.jobs.record import JobRecord


def test_a_record_survives_the_store_as_it_was():
    record = JobRecord(run_id="j-1", attempt=2, step=40, order=["a", "b"], progress_offsets={0: 10, 1: 12},
                       last_checkpoint={"step": 40, "time": 5.0, "node": "a"}, unstopped=[["b", 1, 1]])
    again = JobRecord.from_json(json.loads(json.dumps(record.to_json())))
    assert again == record
    assert again.progress_offsets == {0: 10, 1: 12}  # JSON keys are strings; ranks are ints again


def test_an_older_record_reads_with_defaults_and_a_newer_ones_keys_are_kept():
    older = {"run_id": "j-1", "attempt": 0, "restarts": 1, "step": 7, "history": None, "order": ["a"],
             "progress_offsets": {"0": 3}, "error": None}
    record = JobRecord.from_json(older)
    assert (record.attempt, record.restarts, record.step, record.history, record.unstopped) == (0, 1, 7, [], [])
    assert record.progress_offsets == {0: 3} and record.diverged_after is None
    newer = {**record.to_json(), "something_new": {"x": 1}}
    assert JobRecord.from_json(newer).to_json()["something_new"] == {"x": 1}


def test_a_run_continued_with_resume_keeps_its_progress_and_what_is_left_on_nodes_but_not_its_failures():
    record = JobRecord(run_id="j-1", attempt=3, restarts=2, step=50, error="rank 1 exited", history=[{"kind": "x"}],
                       order=["a", "b"], unstopped=[["b", 3, 1]], uncatalogued=[["b", 3, 40]], resumes=1,
                       last_checkpoint={"step": 50, "time": 1.0, "node": "a"}, started=9.0)
    continued = record.continued(total_steps=100)
    assert (continued.attempt, continued.step, continued.order, continued.started) == (3, 50, ["a", "b"], 9.0)
    assert continued.unstopped == [["b", 3, 1]] and continued.uncatalogued == [["b", 3, 40]]
    assert (continued.restarts, continued.error, continued.history, continued.resumes) == (0, None, [], 2)
    assert continued.total_steps == 100 and continued.last_checkpoint == record.last_checkpoint
