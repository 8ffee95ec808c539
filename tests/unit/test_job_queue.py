"""The job queue's policy (coordinator/jobs/queue.py), with plain data."""

from __future__ import annotations

from coordinator.jobs.queue import Waiting, positions, startable


def job(run_id, nodes, priority=0, submitted=0.0):
    return Waiting(run_id, frozenset(nodes), priority, submitted)


def test_a_job_whose_nodes_are_busy_waits_and_starts_once_they_are_free():
    queued = [job("b", ["n1", "n2"], submitted=2)]
    assert startable(queued, busy={"n1", "n2"}) == []
    assert startable(queued, busy=set()) == ["b"]


def test_first_in_first_out_and_two_jobs_on_the_same_nodes_never_start_together():
    queued = [job("late", ["n1"], submitted=5), job("early", ["n1", "n2"], submitted=1)]
    assert startable(queued, busy=set()) == ["early"]
    assert positions(queued) == {"early": 1, "late": 2}


def test_a_higher_priority_goes_first():
    queued = [job("normal", ["n1"], submitted=1), job("urgent", ["n1"], priority=5, submitted=9)]
    assert startable(queued, busy=set()) == ["urgent"]


def test_disjoint_jobs_run_side_by_side_but_never_take_nodes_an_earlier_job_waits_for():
    queued = [job("first", ["n1", "n2"], submitted=1), job("other", ["n3"], submitted=2),
              job("sneaky", ["n2"], submitted=3)]
    # n1 is busy: "first" waits and keeps n2 for itself; "other" needs neither and starts.
    assert startable(queued, busy={"n1"}) == ["other"]
