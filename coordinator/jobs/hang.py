"""When an attempt counts as hung, and which ranks stopped it. Pure, tested without processes.

Each rank may say what it is doing: a ``heartbeat`` record in its progress file (every 2 s from
coord's trainers) with its phase (loading, compiling, training, saving, evaluating), the last step
it finished, how long it has gone without progress (``idle_s``: since that step, or since it
entered the phase) and whether it waits inside a collective. Its node's agent adds the state of
its processes (stopped, in uninterruptible sleep). Only time in a phase that should make progress
counts toward a hang, and each phase has its own allowance (``HangLimits``; the ranks wait for
each other, so while one rank loads or saves every rank gets that phase's allowance):

- loading: the first-step limit (``--first-step-timeout``; else from the previous attempt's time
  to its first step; else from the model's size (pre-flight) and a disk read rate, measured where
  known (no measurement exists yet: an assumed 200 MB/s); else 600 s);
- compiling, and training before the first step: ``--hang-timeout``, else as loading after a
  previous attempt was timed, else ``COMPILE_S`` (the first step compiles the graph);
- training: ``--hang-timeout``, else ``max(HANG_FLOOR_S, HANG_GAP_MULTIPLE x`` the measured
  time between steps);
- saving and evaluating: a longer allowance of their own.

A job whose ranks say nothing of their phase (a script of one's own that writes only ``train``
records) is judged as a whole, as before: the first-step limit from the launch, then the training
allowance from its last new step. A job whose ranks have never written a progress record gets no
watchdog at all: coord cannot tell such a script's steady work from a hang, so it never kills it
as hung (``watched`` False).

Before the first step a rank that works is not hung, however long it takes (a loaded machine
compiles slowly): the agent reads the CPU time of the rank's processes with each status, and a
rank whose processes used at least ``BUSY_SHARE`` of a core since the last reading made progress
then; wall time alone does not decide. A rank whose heartbeat says it waits in a collective works
while a rank outside it does (MLX's ring and JACCL backends spin while they wait, so its own CPU
says nothing of its peers), or by its own CPU when every rank is inside. A rank busy with no first
step for ``busy_ceiling`` (ten times its allowance, at least 780 s) is hung all the same: one
spinning on a peer that will never answer looks busy too. After the first step the CPU counts for
nothing (a step is the progress there). Where the agent measured no CPU time, wall time decides, as
before.

A rank whose process is stopped (state T: SIGSTOP, a terminal's Ctrl-Z) is hung after
``STOPPED_GRACE_S`` (or ``--hang-timeout``, when given), whatever its phase; until then no other
allowance runs (the others wait for it), and the time it was held is not counted once it is let
go (``HangWatch``). The ranks named
as the ones that stopped are, in this order: stopped processes; ranks whose heartbeat went
silent while others' did not; ranks outside a collective their peers wait in; the ranks at the
lowest step while others are ahead; else every rank over its allowance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LOADING, COMPILING, TRAINING, SAVING, EVALUATING = "loading", "compiling", "training", "saving", "evaluating"
PHASES = (LOADING, COMPILING, TRAINING, SAVING, EVALUATING)
SLOW_PHASES = (SAVING, EVALUATING)

# After the first step: four times the measured time between steps, and never less than 15 s. The
# goal is a hang caught and resumed within max(20 s, 5 x the step time) plus the relaunch; the
# watch sees a step at most a poll (2 s) late, and four gaps leave room for a step that is slow
# now and then (a garbage collection, a page-in) without calling it a hang. Below 15 s a busy
# machine's stalls (swap, another job's compile) would be called hangs.
HANG_FLOOR_S = 15.0
HANG_GAP_MULTIPLE = 4.0
GAP_UNKNOWN_S = 60.0  # after the first step, until the time between two steps is measured
# The first step compiles the graph (MLX's CPU backend compiles its kernels with the C++ compiler:
# tens of seconds on a small CPU); nothing measured says how long that takes on a first attempt.
COMPILE_S = 180.0
FIRST_STEP_FLOOR_S = 30.0  # no attempt gets less from its launch: imports alone take seconds
FIRST_STEP_UNKNOWN_S = 600.0  # nothing known of the model, the disk or an earlier attempt
PREVIOUS_MULTIPLE = 3.0  # a relaunch reads a warm page cache: three times the last one is ample
LOAD_FIXED_S = 60.0  # imports, tokenizer and data set, beside the weights
LOAD_READ_MULTIPLE = 4.0  # the weights read at a quarter of the measured rate, at the worst
ASSUMED_READ_BYTES_PER_S = 200e6  # a slow external disk, when the node's rate was not measured
SLOW_FLOOR_S = 300.0  # a checkpoint save or an evaluation
# Once a rank has exited 0, the others are past their last step: a final save, a barrier, a process
# group torn down, a launcher waiting on its workers. No step comes, and none is owed: this long.
FINISHING_S = 60.0
SLOW_GAP_MULTIPLE = 30.0
STOPPED_GRACE_S = 3.0  # a stopped process (SIGSTOP) for this long is a hang, whatever its phase
SILENT_S = 10.0  # a heartbeat this old (they come every 2 s) names a rank that went silent
# Before the first step a rank whose processes used this share of one core since the last reading is
# working. A rank idle in a blocking wait uses next to none (a heartbeat thread, a launcher's monitor
# loop: well under 1 %); one compiling on a machine at a load of 8 over 2 cores still gets about 25 %.
BUSY_SHARE = 0.05
BUSY_WINDOW_S = 1.0  # readings closer than this are not compared: /proc counts CPU in 10 ms ticks
# A rank busy this long before its first step is hung all the same (it may spin on a peer that is
# gone): ten times its allowance, and never less than the most a first attempt waits with nothing
# known (FIRST_STEP_UNKNOWN_S + COMPILE_S), so a loaded machine is never the reason.
BUSY_CEILING_MULTIPLE = 10.0
BUSY_CEILING_FLOOR_S = FIRST_STEP_UNKNOWN_S + COMPILE_S


@dataclass(frozen=True)
class HangLimits:
    """How long a rank may go without progress in each phase, and where the first-step numbers came from."""

    loading: float  # a rank loading, or one that said nothing yet, before the first step
    compiling: float  # a rank past loading before the first step
    training: float  # no new step after the first one
    slow: float  # saving, evaluating
    first_step: float  # launch to first step, for a job whose ranks say nothing of their phase
    source: str
    # A stopped process (state T) for this long is a hang: STOPPED_GRACE_S, or --hang-timeout when
    # given (a user may SIGSTOP a rank on purpose, to lend its machine a while; the option says how long).
    stopped: float = STOPPED_GRACE_S

    def allowance(self, phase: str | None, *, first_step_done: bool) -> float:
        """The allowance of a rank in ``phase`` (a phase coord does not know counts as training)."""
        if phase in SLOW_PHASES:
            return self.slow
        if phase == LOADING or phase is None:
            return self.loading
        if phase == COMPILING or not first_step_done:
            return self.compiling
        return self.training

    def describe(self) -> str:
        return (f"loading {self.loading:.0f} s ({self.source}), compiling and the first step {self.compiling:.0f} s, "
                f"then {self.training:.0f} s without a step, saving and evaluating {self.slow:.0f} s")


def first_step_limits(*, configured: float | None, previous_s: float | None, model_bytes: int | None,
                      read_bytes_per_s: float | None) -> tuple[float, float, str]:
    """(loading allowance, whole launch-to-first-step allowance, where they came from), before
    ``--hang-timeout`` is applied to compiling."""
    if configured is not None:
        return configured, configured, "--first-step-timeout"
    if previous_s is not None:
        limit = max(FIRST_STEP_FLOOR_S, PREVIOUS_MULTIPLE * previous_s)
        return limit, limit, f"{PREVIOUS_MULTIPLE:g} x the previous attempt's {previous_s:.1f} s to its first step"
    if model_bytes:
        rate = read_bytes_per_s or ASSUMED_READ_BYTES_PER_S
        load = max(FIRST_STEP_FLOOR_S, LOAD_FIXED_S + LOAD_READ_MULTIPLE * model_bytes / rate)
        measured = "measured" if read_bytes_per_s else "assumed"
        return load, load + COMPILE_S, (f"{model_bytes / 1e9:.2f} GB of model at {rate / 1e6:.0f} MB/s ({measured}), "
                                        f"{LOAD_READ_MULTIPLE:g} x, plus {LOAD_FIXED_S:g} s")
    return FIRST_STEP_UNKNOWN_S, FIRST_STEP_UNKNOWN_S, "nothing measured yet"


def hang_limits(*, configured_hang: float | None, configured_first_step: float | None = None,
                previous_first_step_s: float | None = None, model_bytes: int | None = None,
                read_bytes_per_s: float | None = None, gap_s: float | None = None) -> HangLimits:
    """Every allowance from what coord knows now. ``--hang-timeout`` is honoured in every phase
    that should make progress, before the first step too; loading has the first-step limit."""
    loading, first_step, source = first_step_limits(configured=configured_first_step, previous_s=previous_first_step_s,
                                                    model_bytes=model_bytes, read_bytes_per_s=read_bytes_per_s)
    if configured_hang is not None:
        compiling = configured_hang
    elif configured_first_step is not None or previous_first_step_s is not None:
        compiling = loading
    else:
        compiling = COMPILE_S
    training = configured_hang if configured_hang is not None else training_allowance(gap_s)
    slow = max(SLOW_FLOOR_S, SLOW_GAP_MULTIPLE * (gap_s or 0.0), configured_hang or 0.0)
    stopped = configured_hang if configured_hang is not None else STOPPED_GRACE_S
    return HangLimits(loading, compiling, training, slow, first_step, source, stopped)


def training_allowance(gap_s: float | None) -> float:
    """Without --hang-timeout: four times the time between steps, at least 15 s."""
    return max(HANG_FLOOR_S, HANG_GAP_MULTIPLE * gap_s) if gap_s else GAP_UNKNOWN_S


def hang_bound(configured_hang: float | None, configured_first_step: float | None = None) -> float:
    """The longest an attempt can go without progress before it is called hung, whatever was
    measured (for bounds, such as the simulator's on a run's length). A rank that keeps using CPU
    before its first step is not without progress: it may go on to ``busy_ceiling``."""
    return max(FIRST_STEP_UNKNOWN_S + COMPILE_S, configured_first_step or 0.0, configured_hang or 0.0,
               SLOW_FLOOR_S, GAP_UNKNOWN_S) + STOPPED_GRACE_S


def busy_ceiling(allowance: float) -> float:
    """How long a rank that keeps using CPU may go without its first step (see BUSY_CEILING_MULTIPLE)."""
    return max(BUSY_CEILING_FLOOR_S, BUSY_CEILING_MULTIPLE * allowance)


def worked(before: tuple[float, float], after: tuple[float, float]) -> bool | None:
    """Whether a rank's processes worked between two readings of (their CPU seconds, their node's
    time): at least BUSY_SHARE of a core. None when the readings are too close to tell (or the
    node's clock went back): the earlier one stays the one to compare with."""
    (cpu_before, at_before), (cpu_after, at_after) = before, after
    if at_after - at_before < BUSY_WINDOW_S:
        return None
    return cpu_after - cpu_before >= BUSY_SHARE * (at_after - at_before)


def next_gap(previous: float | None, gap: float) -> float:
    """The time between steps the training allowance follows: the newest gap, or the earlier
    estimate decayed by a tenth when that is longer (one quick step does not shrink the
    allowance at once; a slow one raises it at once)."""
    return gap if previous is None else max(gap, 0.9 * previous)


@dataclass(frozen=True)
class RankSeen:
    """One rank as the last poll saw it."""

    rank: int
    node: str
    phase: str | None = None  # its latest heartbeat's phase; None: it writes no heartbeat
    step: int | None = None  # the last step it finished, by its heartbeat
    stuck_s: float | None = None  # since its last progress (a step, a new phase), on its node's clock
    silent_s: float | None = None  # since its latest heartbeat was written
    collective: bool = False  # its latest heartbeat says it waits inside a collective
    process: str | None = None  # its processes: "stopped", "uninterruptible", "running", None (not known)
    stopped_s: float = 0.0  # how long its process has been seen stopped
    # Since its processes were last seen working (using CPU, see ``worked``), on its node's clock;
    # None: its agent measured no CPU time.
    idle_cpu_s: float | None = None


@dataclass(frozen=True)
class JobSeen:
    """The attempt as a whole."""

    watched: bool  # its ranks report progress (coord's trainers, or a script seen writing records)
    first_step_done: bool
    quiet_s: float  # since the last new step of any rank; before the first one, since the launch
    finishing: bool = False  # a rank has exited 0: the others are past their last step, tearing down


@dataclass(frozen=True)
class Hang:
    """An attempt called hung: why, and the ranks named as the ones that stopped."""

    reason: str
    ranks: tuple[int, ...]
    named: str  # "rank 1 on b (its process is stopped: state T)"

    def describe(self) -> str:
        return f"{self.reason}; the ranks that stopped: {self.named}" if self.named else self.reason


def hang_verdict(ranks: Sequence[RankSeen], job: JobSeen, limits: HangLimits) -> Hang | None:
    """The attempt's hang, or None while it may still be making progress."""
    if not job.watched:
        return None
    held = [r for r in ranks if r.process == "stopped"]
    stopped = [r for r in held if r.stopped_s >= limits.stopped]
    if stopped:
        return _named(f"{_plural(stopped)} stopped (process state T) for {max(r.stopped_s for r in stopped):.0f} s",
                      ranks, stopped)
    if held:
        # A rank stopped on purpose (SIGSTOP, to lend its machine a while) holds the others in their
        # collectives, and holds back the first step: the stopped allowance alone says how long. The
        # first-step limit of a relaunch (30 s) called a rank held for a minute after its launch hung.
        return None
    phased = [r for r in ranks if r.phase is not None and r.stuck_s is not None]
    if phased:
        return _phase_verdict(phased, ranks, job, limits)
    if not job.first_step_done:
        return _first_step_verdict(ranks, job, limits)
    limit = max(limits.training, FINISHING_S) if job.finishing else limits.training
    if job.quiet_s <= limit:
        return None
    if job.finishing:
        return _named(f"no end for {job.quiet_s:.0f} s after a rank finished (allowance {limit:g} s)", ranks, [])
    return _named(f"no progress for {job.quiet_s:.0f} s (hang timeout {limit:g} s)", ranks, [])


def _phase_verdict(phased: Sequence[RankSeen], ranks: Sequence[RankSeen], job: JobSeen,
                   limits: HangLimits) -> Hang | None:
    """Ranks that say their phase: each against the longest allowance of the phases now."""
    # The ranks wait for each other in their collectives: while one loads or saves, the others'
    # waits are that phase's too. So every rank gets the longest allowance of the phases now.
    pacing = max(phased, key=lambda r: limits.allowance(r.phase, first_step_done=job.first_step_done))
    limit = limits.allowance(pacing.phase, first_step_done=job.first_step_done)
    if job.finishing:
        limit = max(limit, FINISHING_S)
    waited = {r.rank: since_progress(r, ranks, job, limit) for r in phased}
    over = [r for r in phased if waited[r.rank] > limit]
    if not over:
        return None
    worst = max(over, key=lambda r: waited[r.rank])
    paced = f"; rank {pacing.rank} is {pacing.phase}" if pacing.phase != worst.phase else ""
    stuck = worst.stuck_s or 0.0
    if not job.first_step_done and idle_cpu(worst, ranks) is not None and stuck > busy_ceiling(limit):
        return _named(f"no first step after {stuck:.0f} s while {worst.phase}, though its processes kept using CPU "
                      f"(at most {busy_ceiling(limit):g} s busy before the first step{paced})", ranks, over)
    reason = (f"no progress for {waited[worst.rank]:.0f} s while {worst.phase}{_idle_words(worst, ranks, job)} "
              f"(allowance {limit:g} s{_before(job)}{paced})")
    return _named(reason, ranks, over)


def _first_step_verdict(ranks: Sequence[RankSeen], job: JobSeen, limits: HangLimits) -> Hang | None:
    """Ranks that say nothing of their phase, before the first step: the first-step limit from the
    launch, counted for each rank while its processes use no CPU, where the agent measured it."""
    if job.quiet_s <= limits.first_step:
        return None
    limit = f"no first step within {limits.first_step:g} s of the launch ({limits.source})"
    measured = [r for r in ranks if r.idle_cpu_s is not None]
    if not measured:
        return _named(limit, ranks, [])
    ceiling = busy_ceiling(limits.first_step)
    if job.quiet_s > ceiling:
        return _named(f"no first step after {job.quiet_s:.0f} s, though its ranks kept using CPU "
                      f"(at most {ceiling:g} s busy before the first step)", ranks, [])
    idle = [r for r in measured if (r.idle_cpu_s or 0.0) > limits.first_step]
    if not idle:
        return None  # working: compiling or loading on a loaded machine
    longest = max(r.idle_cpu_s or 0.0 for r in idle)
    who = "a rank" if len(idle) == 1 else f"{len(idle)} ranks"
    return _named(f"{limit}; {who} used no CPU for {longest:.0f} s", ranks, idle)


def since_progress(rank: RankSeen, ranks: Sequence[RankSeen], job: JobSeen, allowance: float) -> float:
    """How long ``rank`` has gone without progress: since its last step or new phase, and before
    the first step, since it last worked (``idle_cpu``), unless it has been busy past the ceiling."""
    stuck = rank.stuck_s or 0.0
    idle = None if job.first_step_done else idle_cpu(rank, ranks)
    if idle is None or stuck > busy_ceiling(allowance):
        return stuck
    return min(stuck, idle)


def idle_cpu(rank: RankSeen, ranks: Sequence[RankSeen]) -> float | None:
    """Since ``rank`` was last seen working. One that waits in a collective works while a rank
    outside it does (the least idle of them: its own CPU may be a spin on its peers); when every
    rank is inside, or none outside was measured, by its own CPU. None: not measured."""
    if rank.collective:
        outside = [r.idle_cpu_s for r in ranks if not r.collective and r.idle_cpu_s is not None]
        if outside:
            return min(outside)
    return rank.idle_cpu_s


def _idle_words(rank: RankSeen, ranks: Sequence[RankSeen], job: JobSeen) -> str:
    """What the CPU said, before the first step: the rank's own processes, or the ranks it waits for."""
    if job.first_step_done or idle_cpu(rank, ranks) is None:
        return ""
    if rank.collective and any(not r.collective and r.idle_cpu_s is not None for r in ranks):
        return ", in a collective, the ranks outside it using no CPU"
    return ", its processes using no CPU"


def _before(job: JobSeen) -> str:
    return "" if job.first_step_done else ", before the first step"


def _plural(ranks: Sequence[RankSeen]) -> str:
    return "a rank's process is" if len(ranks) == 1 else f"{len(ranks)} ranks' processes are"


def _named(reason: str, ranks: Sequence[RankSeen], over: Sequence[RankSeen]) -> Hang:
    culprits = stalled_ranks(ranks, over)
    return Hang(reason, tuple(r.rank for r, _ in culprits),
                "; ".join(f"rank {r.rank} on {r.node} ({why})" for r, why in culprits))


def stalled_ranks(ranks: Sequence[RankSeen], over: Sequence[RankSeen] = ()) -> list[tuple[RankSeen, str]]:
    """The ranks that stopped the others, each with why it is named (see the module's words for
    the order); ``over``, the ranks past their allowance, when nothing singles one out."""
    stopped = [(r, f"its process is stopped: state T for {r.stopped_s:.0f} s") for r in ranks
               if r.process == "stopped"]
    if stopped:
        return stopped
    beating = [r for r in ranks if r.silent_s is not None]
    fresh = [r for r in beating if (r.silent_s or 0.0) <= SILENT_S]
    silent = [(r, f"no heartbeat for {r.silent_s:.0f} s" + (", in uninterruptible sleep (state D)"
                                                            if r.process == "uninterruptible" else ""))
              for r in beating if (r.silent_s or 0.0) > SILENT_S]
    if silent and fresh:
        return silent
    waiting = [r for r in ranks if r.collective]
    outside = [r for r in ranks if not r.collective and r.phase is not None]
    if waiting and outside:
        who = ", ".join(str(r.rank) for r in waiting)
        return [(r, f"not in the collective that rank{'s' if len(waiting) > 1 else ''} {who} wait"
                 f"{'' if len(waiting) > 1 else 's'} in" + (f", at step {r.step}" if r.step is not None else ""))
                for r in outside]
    stepped = [r for r in ranks if r.step is not None]
    if stepped:
        low, high = min(r.step or 0 for r in stepped), max(r.step or 0 for r in stepped)
        if low < high:
            return [(r, f"at step {low} while others reached {high}") for r in stepped if r.step == low]
    if silent:
        return silent
    uninterruptible = [(r, "in uninterruptible sleep (state D)") for r in ranks if r.process == "uninterruptible"]
    if uninterruptible:
        return uninterruptible
    return [(r, _over_words(r)) for r in over]


def _over_words(rank: RankSeen) -> str:
    if rank.stuck_s is not None:
        inside = ", in a collective" if rank.collective else ""
        return f"no progress for {rank.stuck_s:.0f} s while {rank.phase}{inside}"
    if rank.idle_cpu_s is not None:
        return f"its processes used no CPU for {rank.idle_cpu_s:.0f} s"
    return "no word of its progress"
