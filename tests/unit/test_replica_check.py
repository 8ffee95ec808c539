"""Replica consistency: the rank whose weights differ from the majority is named, at the step it happened."""

from __future__ import annotations

from coordinator.jobs.fingerprints import ReplicaCheck


def test_a_step_is_judged_once_every_rank_reported_it():
    check = ReplicaCheck(ranks=3)
    assert check.add(4, 0, "a") is None and check.add(4, 2, "a") is None
    assert check.add(4, 1, "a") is None and check.last_agreed == 4


def test_the_rank_that_differs_from_the_majority_is_named_with_the_last_agreed_step():
    check = ReplicaCheck(ranks=3)
    for rank in range(3):
        check.add(4, rank, "a")
    check.add(8, 0, "b")
    check.add(8, 1, "x")
    found = check.add(8, 2, "b")
    assert found.ranks == [1] and found.majority == "b" and found.last_agreed == 4 and found.step == 8
    assert "rank 1 diverged" in found.describe()


def test_two_ranks_that_disagree_have_no_majority():
    check = ReplicaCheck(ranks=2)
    check.add(2, 0, "a")
    found = check.add(2, 1, "b")
    assert found.majority is None and found.ranks == [0, 1] and found.last_agreed is None
    assert "no majority" in found.describe()
