"""The straggler rule (coordinator/jobs/straggler.py): named within the bound, cleared on recovery,
and no false alarm across checkpoints, evaluations, a first epoch, noise or tiny steps."""

from __future__ import annotations

import random

import pytest

from coordinator.jobs.straggler import StragglerDetector, StragglerRule

BEAT_S = 2.0
BOUND_S = 30.0


def run(detector: StragglerDetector, compute, *, ranks: int = 3, start: float = 0.0, until: float = 120.0,
        every: float = BEAT_S) -> list[tuple[float, str, int, float]]:
    """Every rank reports ``compute(rank, t)`` (None: nothing this beat) every ``every`` s; the
    detector is evaluated after each round, as after a poll. Returns the changes with their times."""
    changes = []
    t = start
    while t < until:
        for rank in range(ranks):
            value = compute(rank, t)
            if value is not None:
                detector.add(rank, t, value)
        changes += [(t, c.kind, c.rank, c.score) for c in detector.evaluate(t)]
        t += every
    return changes


def test_a_rank_that_turns_slow_is_named_with_its_score_within_the_bound_and_cleared_when_it_recovers():
    detector = StragglerDetector()

    def compute(rank, t):
        return 0.5 if rank == 2 and 60 <= t < 120 else 0.1

    changes = run(detector, compute, until=200)
    named = [c for c in changes if c[1] == "named"]
    cleared = [c for c in changes if c[1] == "cleared"]
    assert [c[2] for c in named] == [2] and [c[2] for c in cleared] == [2], changes
    assert 60 < named[0][0] <= 60 + BOUND_S, changes
    assert named[0][3] == pytest.approx(5.0)
    assert 120 < cleared[0][0] <= 120 + BOUND_S, changes
    assert detector.named == {}


def test_while_named_the_score_and_the_time_named_are_kept():
    detector = StragglerDetector()
    run(detector, lambda rank, t: 0.3 if rank == 0 and t >= 20 else 0.1, until=60)
    assert set(detector.named) == {0} and detector.named[0] == pytest.approx(3.0)
    assert detector.named_for(0, 58.0) > 10 and detector.named_for(1, 58.0) == 0.0


def test_no_false_alarm_across_checkpoints_evaluations_a_first_epoch_and_noise():
    detector = StragglerDetector()
    noise = random.Random(7)

    def compute(rank, t):
        if t < 10:
            return 2.0 if rank == 1 else 0.8  # a first epoch: cold caches, one rank colder than the rest
        if 100 <= t < 130:
            return None  # an evaluation between steps: no step, no compute time
        if rank == 0 and int(t) % 20 == 0:
            return 1.5  # a save inside the script's step on rank 0 every 20 s
        return 0.1 * noise.uniform(0.8, 1.25)

    assert run(detector, compute, until=400) == []


def test_tiny_steps_differing_by_a_millisecond_are_never_a_straggler():
    detector = StragglerDetector()
    assert run(detector, lambda rank, t: 0.0025 if rank == 2 else 0.001) == []


def test_with_two_ranks_the_slow_one_is_named_against_the_faster():
    detector = StragglerDetector()
    changes = run(detector, lambda rank, t: 0.4 if rank == 1 and t >= 30 else 0.1, ranks=2, until=90)
    assert [(c[1], c[2]) for c in changes] == [("named", 1)]
    assert changes[0][3] == pytest.approx(4.0)


def test_one_rank_alone_is_never_compared():
    detector = StragglerDetector()
    assert run(detector, lambda rank, t: 5.0 if t > 20 else 0.1, ranks=1) == []


def test_steps_slower_than_the_window_are_named_within_twenty_steps():
    detector = StragglerDetector()
    step_s = 12.0  # a step takes longer than the window: each beat carries at most one step

    def compute(rank, t):
        return (3 * step_s if rank == 0 and t >= 120 else step_s) if t % step_s < BEAT_S else None

    changes = run(detector, compute, until=400)
    named = [c for c in changes if c[1] == "named"]
    assert named and named[0][2] == 0
    assert named[0][0] - 120 <= max(BOUND_S, 20 * step_s), changes


def test_a_rule_that_would_flap_is_refused():
    with pytest.raises(ValueError, match="clear_factor <= factor"):
        StragglerRule(factor=1.5, clear_factor=1.6)
    with pytest.raises(ValueError, match="1 < clear_factor"):
        StragglerRule(factor=1.5, clear_factor=1.0)
