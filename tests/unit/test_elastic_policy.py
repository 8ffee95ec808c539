"""Elastic shrink policy: the global batch is kept, the per-rank batch never grows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.jobs.elastic import choose_nodes
from coordinator.launch.batch import BatchSplit, Undividable, rebatch


def test_three_ranks_to_two_keeps_the_global_batch_with_more_accumulation():
    shrunk = rebatch(BatchSplit(batch_size=12, accumulation=1, ranks=3), 2)
    assert shrunk == BatchSplit(batch_size=6, accumulation=2, ranks=2)
    assert shrunk.global_batch == 12 and shrunk.per_rank == 3


def test_the_same_ranks_keep_the_original_split():
    original = BatchSplit(batch_size=6, accumulation=2, ranks=3)
    assert rebatch(original, 3) is original


def test_a_batch_that_cannot_be_divided_says_so():
    with pytest.raises(Undividable, match="global batch of 3 cannot be split evenly over 2 ranks"):
        rebatch(BatchSplit(batch_size=3, accumulation=1, ranks=3), 2)
    with pytest.raises(Undividable, match="no rank left"):
        rebatch(BatchSplit(batch_size=4, accumulation=1, ranks=2), 0)


@given(per_rank=st.integers(1, 8), accumulation=st.integers(1, 4), ranks=st.integers(1, 16),
       new_ranks=st.integers(1, 16))
def test_any_split_found_keeps_the_global_batch_and_the_per_rank_memory(per_rank, accumulation, ranks, new_ranks):
    original = BatchSplit(per_rank * ranks, accumulation, ranks)
    try:
        split = rebatch(original, new_ranks)
    except Undividable:
        return
    assert split.global_batch == original.global_batch
    assert split.batch_size % new_ranks == 0 and split.per_rank <= original.per_rank


def test_nodes_are_waited_for_until_the_node_timeout_then_left_out():
    configured = ["a", "b", "c"]
    chosen, why = choose_nodes(configured, ["b", "c"], {"a": 5.0}, min_nodes=2, node_timeout=30)
    assert chosen is None and "waiting for a" in why
    chosen, why = choose_nodes(configured, ["b", "c"], {"a": 31.0}, min_nodes=2, node_timeout=30)
    assert chosen == ["b", "c"] and "leaving out a" in why


def test_min_nodes_keeps_the_job_waiting():
    chosen, why = choose_nodes(["a", "b", "c"], ["c"], {"a": 99.0, "b": 99.0}, min_nodes=2, node_timeout=30)
    assert chosen is None and "--min-nodes is 2" in why


def test_a_node_back_up_rejoins():
    assert choose_nodes(["a", "b"], ["a", "b"], {}, min_nodes=1, node_timeout=30)[0] == ["a", "b"]
