"""When an attempt counts as hung, and which ranks are named (coordinator/jobs/hang.py), with plain data."""

from __future__ import annotations

import pytest

from coordinator.jobs import hang
from coordinator.jobs.hang import Hang, JobSeen, RankSeen, hang_limits, hang_verdict

LIMITS = hang_limits(configured_hang=None)
WATCHED = JobSeen(watched=True, first_step_done=True, quiet_s=0.0)
BEFORE = JobSeen(watched=True, first_step_done=False, quiet_s=0.0)


def beating(rank: int, phase: str = "training", stuck: float = 1.0, **kw: object) -> RankSeen:
    return RankSeen(rank, f"n{rank}", phase=phase, stuck_s=stuck, silent_s=kw.pop("silent", 1.0), **kw)  # type: ignore[arg-type]


def test_the_first_step_limit_comes_from_the_option_the_previous_attempt_the_model_or_a_default():
    limits = hang.first_step_limits(configured=45, previous_s=10, model_bytes=10**9, read_bytes_per_s=None)
    assert limits[:2] == (45, 45)
    # A relaunch: three times the last attempt's time to its first step, never under the floor.
    assert hang.first_step_limits(configured=None, previous_s=20, model_bytes=None, read_bytes_per_s=None)[0] == 60
    assert hang.first_step_limits(configured=None, previous_s=2, model_bytes=None,
                                  read_bytes_per_s=None)[0] == hang.FIRST_STEP_FLOOR_S
    # A tiny model loads in no time: its loading allowance is the fixed part, not ten minutes.
    tiny, whole, why = hang.first_step_limits(configured=None, previous_s=None, model_bytes=10**6,
                                              read_bytes_per_s=None)
    assert tiny == pytest.approx(hang.LOAD_FIXED_S, abs=1) and whole == pytest.approx(tiny + hang.COMPILE_S)
    assert "assumed" in why
    # 16 GB at a measured 2 GB/s: four times the reading time, plus the fixed part.
    big = hang.first_step_limits(configured=None, previous_s=None, model_bytes=16 * 10**9, read_bytes_per_s=2e9)
    assert big[0] == pytest.approx(hang.LOAD_FIXED_S + 32) and "measured" in big[2]
    assert hang.first_step_limits(configured=None, previous_s=None, model_bytes=None,
                                  read_bytes_per_s=None)[0] == hang.FIRST_STEP_UNKNOWN_S


def test_the_hang_timeout_is_honoured_before_the_first_step_and_after_it():
    limits = hang_limits(configured_hang=8)
    assert limits.compiling == 8 and limits.training == 8
    assert limits.loading == hang.FIRST_STEP_UNKNOWN_S  # loading has the first-step limit
    assert limits.allowance("training", first_step_done=False) == 8
    assert limits.allowance("saving", first_step_done=True) == hang.SLOW_FLOOR_S
    assert hang_limits(configured_hang=900).slow == 900


def test_after_the_first_step_a_multiple_of_the_step_gap_with_a_floor():
    assert hang.training_allowance(None) == hang.GAP_UNKNOWN_S
    assert hang.training_allowance(0.5) == hang.HANG_FLOOR_S
    assert hang.training_allowance(10.0) == 40.0
    assert hang_limits(configured_hang=None, gap_s=10.0).slow == max(hang.SLOW_FLOOR_S, 300.0)
    assert hang.next_gap(None, 2.0) == 2.0 and hang.next_gap(10.0, 2.0) == 9.0 and hang.next_gap(2.0, 10.0) == 10.0


def test_a_relaunch_gets_a_short_limit_past_loading_too():
    limits = hang_limits(configured_hang=None, previous_first_step_s=12.0)
    assert limits.loading == limits.compiling == 36.0


def test_a_script_that_never_reported_is_never_called_hung():
    quiet = JobSeen(watched=False, first_step_done=False, quiet_s=10_000.0)
    assert hang_verdict([RankSeen(0, "a", process="stopped", stopped_s=100.0)], quiet, LIMITS) is None


def test_a_stopped_process_is_a_hang_within_seconds_and_is_named():
    ranks = [beating(0, collective=True), RankSeen(1, "n1", process="stopped", stopped_s=1.0)]
    assert hang_verdict(ranks, BEFORE, LIMITS) is None  # within the grace
    ranks[1] = RankSeen(1, "n1", process="stopped", stopped_s=hang.STOPPED_GRACE_S)
    verdict = hang_verdict(ranks, BEFORE, LIMITS)
    assert isinstance(verdict, Hang) and verdict.ranks == (1,)
    assert "rank 1 on n1 (its process is stopped: state T" in verdict.describe()


def test_phases_have_their_own_allowances():
    assert hang_verdict([beating(0, "saving", stuck=200.0)], WATCHED, LIMITS) is None
    assert hang_verdict([beating(0, "training", stuck=200.0)], WATCHED, LIMITS) is not None
    # Loading before the first step: the first-step limit, not the hang timeout.
    limits = hang_limits(configured_hang=5)
    assert hang_verdict([beating(0, "loading", stuck=100.0)], BEFORE, limits) is None
    verdict = hang_verdict([beating(0, "compiling", stuck=6.0)], BEFORE, limits)
    assert verdict is not None and "before the first step" in verdict.reason and verdict.ranks == (0,)


def test_the_ranks_waiting_for_a_rank_that_saves_or_loads_get_its_allowance():
    saving = [beating(0, "saving", stuck=100.0), beating(1, "training", stuck=100.0, collective=True)]
    assert hang_verdict(saving, WATCHED, LIMITS) is None
    loading = [beating(0, "loading", stuck=300.0), beating(1, "compiling", stuck=290.0, collective=True)]
    assert hang_verdict(loading, BEFORE, LIMITS) is None
    saving[0] = beating(0, "saving", stuck=hang.SLOW_FLOOR_S + 1)
    verdict = hang_verdict(saving, WATCHED, LIMITS)
    assert verdict is not None and verdict.ranks == (0,) and "while saving" in verdict.reason


def test_a_job_whose_ranks_say_nothing_of_their_phase_is_judged_as_a_whole():
    ranks = [RankSeen(0, "a"), RankSeen(1, "b")]
    assert hang_verdict(ranks, JobSeen(True, False, 500.0), LIMITS) is None
    verdict = hang_verdict(ranks, JobSeen(True, False, hang.FIRST_STEP_UNKNOWN_S + 1), LIMITS)
    assert verdict is not None and "no first step within 600 s" in verdict.reason
    assert hang_verdict(ranks, JobSeen(True, True, 59.0), LIMITS) is None
    assert "hang timeout 60" in hang_verdict(ranks, JobSeen(True, True, 61.0), LIMITS).reason  # type: ignore[union-attr]


def test_the_rank_outside_the_collective_is_named_not_the_peers_waiting_for_it():
    ranks = [beating(0, stuck=100.0, collective=True, step=7), beating(1, stuck=100.0, step=7),
             beating(2, stuck=100.0, collective=True, step=7)]
    verdict = hang_verdict(ranks, WATCHED, LIMITS)
    assert verdict is not None and verdict.ranks == (1,)
    assert "not in the collective that ranks 0, 2 wait in" in verdict.named


def test_a_silent_rank_and_a_rank_behind_are_named():
    silent = [beating(0, stuck=100.0, silent=1.0), beating(1, stuck=100.0, silent=60.0)]
    assert hang_verdict(silent, WATCHED, LIMITS).ranks == (1,)  # type: ignore[union-attr]
    behind = [beating(0, stuck=100.0, step=9), beating(1, stuck=100.0, step=8), beating(2, stuck=100.0, step=9)]
    verdict = hang_verdict(behind, WATCHED, LIMITS)
    assert verdict is not None and verdict.ranks == (1,) and "at step 8 while others reached 9" in verdict.named


def test_when_nothing_singles_a_rank_out_every_rank_past_its_allowance_is_named():
    ranks = [beating(0, stuck=100.0, step=5, collective=True), beating(1, stuck=100.0, step=5, collective=True)]
    verdict = hang_verdict(ranks, WATCHED, LIMITS)
    assert verdict is not None and verdict.ranks == (0, 1) and "in a collective" in verdict.named
    stuck = [RankSeen(0, "a", process="uninterruptible"), RankSeen(1, "b")]
    assert hang.stalled_ranks(stuck)[0][1] == "in uninterruptible sleep (state D)"


def test_the_bound_covers_every_allowance():
    assert hang.hang_bound(None) >= hang.FIRST_STEP_UNKNOWN_S + hang.COMPILE_S
    assert hang.hang_bound(None, 5000) > 5000 and hang.hang_bound(7000) > 7000


def test_a_stopped_process_waits_out_the_hang_timeout_when_one_is_given():
    # A user may SIGSTOP a rank on purpose (to lend its machine a while): --hang-timeout says how long.
    limits = hang_limits(configured_hang=300)
    ranks = [beating(0, collective=True), RankSeen(1, "n1", process="stopped", stopped_s=60.0)]
    assert hang_verdict(ranks, BEFORE, limits) is None
    ranks[1] = RankSeen(1, "n1", process="stopped", stopped_s=300.0)
    verdict = hang_verdict(ranks, BEFORE, limits)
    assert isinstance(verdict, Hang) and verdict.ranks == (1,)


def test_a_rank_held_stopped_is_judged_by_the_stopped_allowance_alone_not_the_first_step_limit():
    # A relaunch whose ranks were stopped as they started: a minute past the launch, no first step,
    # yet the user's --hang-timeout 300 says they may be held five minutes.
    limits = hang_limits(configured_hang=300, previous_first_step_s=5.0)
    assert limits.first_step == hang.FIRST_STEP_FLOOR_S
    held_a_minute = JobSeen(watched=True, first_step_done=False, quiet_s=60.0)
    ranks = [RankSeen(0, "n0", process="stopped", stopped_s=59.0), RankSeen(1, "n1", process="stopped", stopped_s=59.0)]
    assert hang_verdict(ranks, held_a_minute, limits) is None
    # Let go, the first-step limit counts again.
    running = [RankSeen(0, "n0", process="running"), RankSeen(1, "n1", process="running")]
    verdict = hang_verdict(running, held_a_minute, limits)
    assert isinstance(verdict, Hang) and "no first step within 30 s" in verdict.reason
    # Without --hang-timeout a stopped rank is a hang within seconds, as before.
    grace = hang_limits(configured_hang=None, previous_first_step_s=5.0)
    assert hang_verdict([RankSeen(0, "n0", process="stopped", stopped_s=hang.STOPPED_GRACE_S)], held_a_minute,
                        grace) is not None


def test_ranks_tearing_down_after_another_finished_get_a_finishing_allowance_not_the_hang_timeout():
    """A rank exited 0: the others are past their last step (a final save, a barrier, a process group torn
    down), and no step is owed. A short --hang-timeout called that a hang on a busy machine."""
    limits = hang_limits(configured_hang=6)
    tearing = JobSeen(watched=True, first_step_done=True, quiet_s=20.0, finishing=True)
    assert hang_verdict([RankSeen(1, "n1")], tearing, limits) is None
    assert hang_verdict([beating(1, stuck=20.0)], tearing, limits) is None
    late = JobSeen(watched=True, first_step_done=True, quiet_s=hang.FINISHING_S + 1, finishing=True)
    verdict = hang_verdict([RankSeen(1, "n1")], late, limits)
    assert isinstance(verdict, Hang) and "after a rank finished" in verdict.reason
    # A stopped process is named as before, finishing or not.
    stopped = [RankSeen(1, "n1", process="stopped", stopped_s=10.0)]
    assert hang_verdict(stopped, tearing, limits) is not None
    assert hang_verdict([RankSeen(1, "n1")], JobSeen(watched=True, first_step_done=True, quiet_s=20.0), limits)


def test_the_time_ranks_were_held_stopped_is_not_counted_as_time_without_progress_once_they_are_let_go():
    """A relaunch's ranks stopped as they started and let go a minute later: the first-step limit
    (30 s) counts from when they were let go, not from the launch."""
    from coordinator.jobs.attempt import Attempt
    from coordinator.jobs.fingerprints import ReplicaCheck
    from coordinator.jobs.hang_watch import HangWatch
    from coordinator.jobs.run_context import RunContext
    from coordinator.jobs.spec import JobSpec

    class Clock:
        t = 1000.0

        def now(self) -> float:
            return self.t

    clock = Clock()
    ctx = RunContext(clock, JobSpec(name="j", command=["python", "-m", "coord_trainer"], hang_timeout=300),  # type: ignore[arg-type]
                     run_id="j-00000000", record=None, state="running")
    ctx.record.first_step_seconds, ctx.record.last_progress = 5.0, clock.t  # launched now
    ctx.record.progress_seen = True
    watch = HangWatch(ctx)
    attempt = Attempt(1, ["n1", "n2"], replica_check=ReplicaCheck(2))

    def poll(process: str) -> Hang | None:
        for rank in (0, 1):
            watch.seen(attempt, rank, {"state": "running", "time": clock.t, "process": process})  # type: ignore[typeddict-item]
        return watch.verdict(attempt)

    assert poll("stopped") is None
    clock.t += 60
    assert poll("stopped") is None  # held, within --hang-timeout
    assert poll("running") is None  # let go: the hold is not counted
    clock.t += 20
    assert poll("running") is None
    clock.t += 11
    verdict = poll("running")
    assert isinstance(verdict, Hang) and "no first step within 30 s" in verdict.reason
