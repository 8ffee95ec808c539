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


# --- Before the first step, a rank that works is not hung (its processes' CPU time, read by its agent) ---

RELAUNCH = hang_limits(configured_hang=None, previous_first_step_s=10.0)  # 30 s to compile: the allowance


def test_before_the_first_step_a_rank_using_cpu_is_not_hung_however_long_its_compile_takes():
    """The issue: a relaunch allowed 30 s (three times the last attempt's 10 s); at a load of 8 the
    ranks were still busy in mx.eval after it. Working is progress; only idle time counts."""
    assert RELAUNCH.compiling == 30
    busy = [beating(0, "compiling", stuck=200.0, idle_cpu_s=1.0), beating(1, "compiling", stuck=200.0, idle_cpu_s=2.0)]
    assert hang_verdict(busy, BEFORE, RELAUNCH) is None
    # The same ranks without a CPU measurement (an older agent): wall time decides, as before.
    unmeasured = [beating(0, "compiling", stuck=200.0), beating(1, "compiling", stuck=200.0)]
    assert hang_verdict(unmeasured, BEFORE, RELAUNCH) is not None


def test_before_the_first_step_a_rank_that_uses_no_cpu_is_still_hung_and_named():
    ranks = [beating(0, "compiling", stuck=40.0, idle_cpu_s=1.0), beating(1, "compiling", stuck=40.0, idle_cpu_s=31.0)]
    verdict = hang_verdict(ranks, BEFORE, RELAUNCH)
    assert isinstance(verdict, Hang) and verdict.ranks == (1,)
    assert "no progress for 31 s while compiling, its processes using no CPU (allowance 30 s, before the first step)" \
        in verdict.reason
    # The idle time counts only since its last progress: a new phase 10 s ago is 10 s without progress.
    assert hang_verdict([beating(0, "compiling", stuck=10.0, idle_cpu_s=100.0)], BEFORE, RELAUNCH) is None


def test_after_the_first_step_cpu_is_not_progress():
    assert hang_verdict([beating(0, "training", stuck=100.0, idle_cpu_s=0.0)], WATCHED, LIMITS) is not None


def test_a_rank_waiting_in_a_collective_works_while_a_rank_outside_it_does():
    # Rank 1 compiled first and waits in the first step's all_sum, blocked (no CPU), for rank 0 still compiling.
    waiting = [beating(0, "compiling", stuck=200.0, idle_cpu_s=0.5),
               beating(1, "compiling", stuck=200.0, idle_cpu_s=150.0, collective=True)]
    assert hang_verdict(waiting, BEFORE, RELAUNCH) is None
    # Rank 0 sleeps outside the collective; rank 1 spins in it (MLX's ring backend does): its CPU is no
    # progress of the attempt's. Rank 0 is named.
    sleeping = [beating(0, "compiling", stuck=60.0, idle_cpu_s=60.0),
                beating(1, "compiling", stuck=60.0, idle_cpu_s=0.5, collective=True)]
    verdict = hang_verdict(sleeping, BEFORE, RELAUNCH)
    assert isinstance(verdict, Hang) and verdict.ranks == (0,)
    assert "not in the collective that rank 1 waits in" in verdict.named
    # Every rank inside the collective (the first update compiles there): each by its own CPU.
    inside = [beating(0, "compiling", stuck=200.0, idle_cpu_s=0.5, collective=True),
              beating(1, "compiling", stuck=200.0, idle_cpu_s=1.5, collective=True)]
    assert hang_verdict(inside, BEFORE, RELAUNCH) is None
    inside[1] = beating(1, "compiling", stuck=200.0, idle_cpu_s=45.0, collective=True)
    verdict = hang_verdict(inside, BEFORE, RELAUNCH)
    assert isinstance(verdict, Hang) and verdict.ranks == (1,)


def test_a_rank_busy_past_the_ceiling_without_a_first_step_is_hung_all_the_same():
    # One spinning on a peer that will never answer looks busy: ten times its allowance, at least 780 s.
    assert hang.busy_ceiling(30.0) == hang.BUSY_CEILING_FLOOR_S == 780.0
    assert hang.busy_ceiling(600.0) == 6000.0
    ranks = [beating(0, "compiling", stuck=780.0, idle_cpu_s=0.0)]
    assert hang_verdict(ranks, BEFORE, RELAUNCH) is None
    ranks = [beating(0, "compiling", stuck=781.0, idle_cpu_s=0.0)]
    verdict = hang_verdict(ranks, BEFORE, RELAUNCH)
    assert isinstance(verdict, Hang) and verdict.ranks == (0,)
    assert "no first step after 781 s while compiling, though its processes kept using CPU" in verdict.reason


def test_ranks_that_say_nothing_of_their_phase_are_judged_by_their_cpu_before_the_first_step():
    late = JobSeen(watched=True, first_step_done=False, quiet_s=40.0)
    busy = [RankSeen(0, "a", idle_cpu_s=1.0), RankSeen(1, "b", idle_cpu_s=3.0)]
    assert hang_verdict(busy, late, RELAUNCH) is None
    idle = [RankSeen(0, "a", idle_cpu_s=1.0), RankSeen(1, "b", idle_cpu_s=35.0)]
    verdict = hang_verdict(idle, late, RELAUNCH)
    assert isinstance(verdict, Hang) and verdict.ranks == (1,)
    assert "no first step within 30 s of the launch" in verdict.reason
    assert "a rank used no CPU for 35 s" in verdict.reason
    assert "rank 1 on b (its processes used no CPU for 35 s)" in verdict.named
    past = JobSeen(watched=True, first_step_done=False, quiet_s=hang.BUSY_CEILING_FLOOR_S + 1)
    verdict = hang_verdict(busy, past, RELAUNCH)
    assert isinstance(verdict, Hang) and "though its ranks kept using CPU" in verdict.reason


def test_a_rank_works_when_its_processes_used_a_twentieth_of_a_core_between_two_readings():
    assert hang.worked((10.0, 100.0), (10.11, 102.0)) is True  # over 5 % of a core over 2 s
    assert hang.worked((10.0, 100.0), (10.09, 102.0)) is False  # a heartbeat thread, a launcher's monitor loop
    assert hang.worked((10.0, 100.0), (10.5, 100.5)) is None  # too close to tell: /proc counts 10 ms ticks
    assert hang.worked((10.0, 100.0), (12.0, 99.0)) is None  # the node's clock went back


def test_the_watch_counts_a_compile_on_a_loaded_machine_as_progress_and_an_idle_rank_as_stuck():
    """HangWatch over a rank's replies: CPU time that grows, then stops growing."""
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
    ctx = RunContext(clock, JobSpec(name="j", command=["python", "-m", "coord_trainer"]),  # type: ignore[arg-type]
                     run_id="j-00000000", record=None, state="running")
    ctx.record.first_step_seconds, ctx.record.last_progress = 10.0, clock.t  # a relaunch: 30 s to compile
    ctx.record.progress_seen = True
    watch = HangWatch(ctx)
    attempt = Attempt(1, ["n1"], replica_check=ReplicaCheck(1))
    began, cpu = clock.t, 3.0

    def poll(cpu_per_poll: float) -> Hang | None:
        nonlocal cpu
        clock.t += 2
        cpu += cpu_per_poll
        watch.heartbeat(attempt, 0, {"kind": "heartbeat", "phase": "compiling", "time": clock.t,
                                     "idle_s": clock.t - began})
        watch.seen(attempt, 0, {"state": "running", "time": clock.t, "process": "running",  # type: ignore[typeddict-item]
                                "cpu_s": cpu})
        return watch.verdict(attempt)

    for _ in range(60):  # two minutes of compiling at a quarter of a core (a load of 8 on 2 cores)
        assert poll(0.5) is None
    for _ in range(15):  # then idle for 30 s: within the allowance
        assert poll(0.01) is None
    verdict = poll(0.01)
    assert isinstance(verdict, Hang) and "its processes using no CPU (allowance 30 s" in verdict.reason
