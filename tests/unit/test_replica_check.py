"""Replica consistency: the rank whose weights differ from the majority is named, at the step it happened."""

from __future__ import annotations

from coordinator.jobs.fingerprints import ReplicaCheck, comparison_summary


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


def test_the_jobs_summary_counts_compared_steps_across_attempts_and_names_divergent_nodes():
    order = ["n1", "n2", "n3"]
    check = ReplicaCheck(ranks=3)
    summary = None
    for step, prints in ((4, "aaa"), (8, "bxb")):
        for rank, fingerprint in enumerate(prints):
            found = check.add(step, rank, fingerprint)
        summary = comparison_summary(summary, check, 0, order, found)
    assert summary["steps_compared"] == 2 and summary["last_step"] == 8 and summary["last_agreed"] == 4
    assert summary["divergences"] == [{"attempt": 0, "step": 8, "nodes": ["n2"], "detail": found.describe()}]
    # the next attempt has a check of its own; the job's summary goes on counting
    check = ReplicaCheck(ranks=2)
    for rank in range(2):
        found = check.add(12, rank, "c")
    summary = comparison_summary(summary, check, 1, ["n1", "n3"], found)
    assert summary["steps_compared"] == 3 and summary["attempt"] == 1 and summary["ranks"] == 2
    assert summary["last_agreed"] == 12 and len(summary["divergences"]) == 1
