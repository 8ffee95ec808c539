"""Robust scores: Krum-style outliers over numbers and vectors, majorities over fingerprints."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.jobs.robust import (default_faulty, krum_scores, majority_fingerprint, neighbour_count,
                                     outliers)

WEIGHTS = [0.12, -0.40, 0.93, 0.05]


def test_one_corrupted_rank_among_three_is_the_outlier():
    values = {0: WEIGHTS, 1: WEIGHTS, 2: [w + 5.0 for w in WEIGHTS]}
    assert outliers(values) == [2]


def test_one_corrupted_rank_among_five_is_the_outlier_with_f_one():
    values = {rank: [w + 0.001 * rank for w in WEIGHTS] for rank in range(5)}
    values[3] = [w * -7 for w in WEIGHTS]
    assert outliers(values, f=1) == [3]
    assert outliers(values) == [3]  # the default f for five items is one


def test_identical_values_have_no_outliers():
    assert outliers({rank: WEIGHTS for rank in range(4)}) == []
    assert outliers({"a": 3.1, "b": 3.1, "c": 3.1}) == []


def test_calibration_rates_with_one_slow_node_name_that_node():
    rates = {"studio-a": 5210.0, "studio-b": 5180.0, "studio-c": 5240.0, "mini-d": 1890.0}
    assert outliers(rates) == ["mini-d"]


def test_rates_that_differ_by_less_than_the_tolerance_are_noise():
    assert outliers({"a": 100.0, "b": 95.0, "c": 105.0, "d": 102.0}) == []
    one_off = {"a": 100.0, "b": 100.0, "c": 100.0, "d": 95.0}
    assert outliers(one_off) == []
    assert outliers(one_off, tolerance=0.0) == ["d"]  # with no tolerance, 5% off an exact majority stands out


def test_two_against_two_has_no_majority_so_no_outlier():
    assert outliers({"a": 100.0, "b": 100.0, "c": 50.0, "d": 50.0}) == []


@pytest.mark.parametrize("values", [{}, {"a": 1.0}, {"a": 1.0, "b": 100.0}])
def test_fewer_than_three_items_have_no_majority_to_stand_outside_of(values):
    assert outliers(values) == []


def test_krum_score_sums_squared_distances_to_the_n_minus_f_minus_2_nearest():
    scores = krum_scores({"a": 0.0, "b": 1.0, "c": 2.0, "d": 3.0, "e": 10.0}, f=1)  # k = 2
    assert scores == {"a": 1 + 4, "b": 1 + 1, "c": 1 + 1, "d": 1 + 4, "e": 49 + 64}


def test_small_clusters_use_at_least_one_neighbour():
    assert default_faulty(3) == 0 and neighbour_count(3, 0) == 1
    assert default_faulty(5) == 1 and neighbour_count(5, 1) == 2
    assert neighbour_count(3, 5) == 1  # an f too large for n is clamped, not an error


@pytest.mark.parametrize("values, message", [
    ({"a": 1.0, "b": math.nan, "c": 1.0}, "b: nan is not a finite number"),
    ({"a": [1.0, 2.0], "b": [1.0], "c": [1.0, 2.0]}, "different lengths"),
    ({"a": True, "b": 1.0, "c": 1.0}, "a: True is not a finite number"),
])
def test_unusable_values_are_refused_naming_the_item(values, message):
    with pytest.raises(ValueError, match=message):
        krum_scores(values)


def test_majority_fingerprint_names_the_divergent_rank():
    assert majority_fingerprint({0: "aa", 1: "aa", 2: "bb"}) == ("aa", [2])
    assert majority_fingerprint({0: "aa", 1: "aa", 2: "aa"}) == ("aa", [])


def test_majority_fingerprint_without_a_strict_majority_is_none_and_everyone_diverges():
    assert majority_fingerprint({0: "aa", 1: "bb"}) == (None, [0, 1])
    assert majority_fingerprint({0: "aa", 1: "aa", 2: "bb", 3: "bb"}) == (None, [0, 1, 2, 3])


def test_a_missing_fingerprint_is_divergent_and_never_a_majority():
    assert majority_fingerprint({0: "aa", 1: None, 2: "aa"}) == ("aa", [1])
    assert majority_fingerprint({0: None, 1: None}) == (None, [0, 1])


@settings(max_examples=50, deadline=None)
@given(base=st.floats(min_value=1.0, max_value=1e4), n=st.integers(min_value=3, max_value=9),
       jitter=st.lists(st.floats(min_value=-0.02, max_value=0.02), min_size=9, max_size=9),
       factor=st.floats(min_value=2.0, max_value=50.0))
def test_one_far_item_among_close_ones_is_always_the_only_outlier(base, n, jitter, factor):
    values = {i: base * (1 + jitter[i]) for i in range(n)}
    values[n - 1] = base * factor
    assert outliers(values) == [n - 1]
