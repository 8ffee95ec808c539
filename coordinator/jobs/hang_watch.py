"""One run's watch for hangs: what each poll says of each rank, kept on its attempt, and the
verdict of ``coordinator.jobs.hang`` (pure) over it.

The head's clock times what the head sees (the launch, a new step read); a rank's heartbeat is
timed on its own node's clock (its age is the node's time at the poll less the time the rank
wrote it), so clocks that differ between machines never make a rank look stuck."""

from __future__ import annotations

from coordinator.jobs import hang
from coordinator.jobs.attempt import Attempt
from coordinator.jobs.effects import Clock
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.spec import reports_progress
from shared.agent_api.progress import HeartbeatRecord
from shared.agent_api.ranks import RankStatusReply


class HangWatch:
    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.fx: Clock = ctx.fx

    def seen(self, attempt: Attempt, rank: int, status: RankStatusReply) -> None:
        """A rank's status reply: its node's clock and its processes' state."""
        attempt.node_time[rank] = status["time"]
        process = status.get("process") if status["state"] == "running" else None
        attempt.process[rank] = process
        if status["state"] in ("exited", "vanished"):
            attempt.exited.add(rank)
        if process == "stopped":
            attempt.stopped_since.setdefault(rank, self.fx.now())
        elif attempt.stopped_since.pop(rank, None) is not None:
            attempt.released_at = self.fx.now()
        cpu = status.get("cpu_s") if status["state"] == "running" else None
        if cpu is not None:
            self._cpu(attempt, rank, float(cpu), status["time"])

    @staticmethod
    def _cpu(attempt: Attempt, rank: int, cpu: float, at: float) -> None:
        """A reading of the CPU time of the rank's processes, at ``at`` on its node's clock: whether
        it worked since the reading before (``hang.worked``) is what tells a rank that compiles on a
        loaded machine from one that is stuck, before the first step."""
        before = attempt.cpu_read.get(rank)
        if before is None or at < before[1]:
            # The first reading, or its node's clock set back: counted from now.
            attempt.cpu_read[rank], attempt.worked_at[rank] = (cpu, at), at
            return
        if cpu < before[0]:
            # A process gone with its time (reaped outside the rank): compared from here on.
            attempt.cpu_read[rank] = (cpu, at)
            return
        busy = hang.worked(before, (cpu, at))
        if busy is None:
            return  # too soon after the last reading to tell
        attempt.cpu_read[rank] = (cpu, at)
        if busy:
            attempt.worked_at[rank] = at

    def heartbeat(self, attempt: Attempt, rank: int, beat: HeartbeatRecord) -> None:
        attempt.beats[rank] = beat
        key = (beat["phase"], beat.get("step"))
        changed = attempt.beat_changed.get(rank)
        if changed is None or changed[:2] != key:
            attempt.beat_changed[rank] = (*key, self.fx.now())
        if beat["phase"] in hang.SLOW_PHASES and rank in attempt.rank_steps:
            # A save or an evaluation is not time between steps: the next gap starts after it.
            attempt.rank_steps[rank] = (attempt.rank_steps[rank][0], beat["time"])

    def stepped(self, attempt: Attempt, rank: int, step: int, at: float) -> None:
        """A record of ``rank`` that says it finished ``step``, written at ``at`` (its own clock).
        The time between two of its steps past the attempt's start is what the training allowance
        follows (its own clock on both ends; the loading and the first step are not counted)."""
        last = attempt.rank_steps.get(rank)
        if last is not None and step <= last[0]:
            return
        if last is not None and last[0] > attempt.start_step and at > last[1]:
            self.ctx.record.step_gap = hang.next_gap(self.ctx.record.step_gap, at - last[1])
        attempt.rank_steps[rank] = (step, at)

    def after_poll(self, *, progressed: bool) -> None:
        """After every rank's reply was read: a new step is the job's progress (the head's clock)."""
        if progressed:
            self.ctx.record.last_progress = self.fx.now()

    def limits(self) -> hang.HangLimits:
        spec, record = self.ctx.spec, self.ctx.record
        return hang.hang_limits(configured_hang=spec.hang_timeout, configured_first_step=spec.first_step_timeout,
                                previous_first_step_s=record.first_step_seconds, model_bytes=record.model_bytes,
                                gap_s=record.step_gap)

    def watched(self) -> bool:
        return reports_progress(self.ctx.spec) or self.ctx.record.progress_seen

    def verdict(self, attempt: Attempt) -> hang.Hang | None:
        record, now = self.ctx.record, self.fx.now()
        quiet = now - (record.last_progress if record.last_progress is not None else now)
        job = hang.JobSeen(watched=self.watched(), first_step_done=record.first_step_at is not None,
                           quiet_s=self._since_released(attempt, quiet, now), finishing=bool(attempt.exited))
        ranks = [self._rank_seen(attempt, rank, name, now) for rank, name in enumerate(attempt.order)]
        return hang.hang_verdict(ranks, job, self.limits())

    def _rank_seen(self, attempt: Attempt, rank: int, name: str, now: float) -> hang.RankSeen:
        process = attempt.process.get(rank)
        stopped = now - attempt.stopped_since[rank] if rank in attempt.stopped_since else 0.0
        if rank in attempt.exited:
            return hang.RankSeen(rank, name, process=process, stopped_s=stopped)
        idle_cpu = None
        if rank in attempt.worked_at:
            idle_cpu = max(0.0, attempt.node_time.get(rank, attempt.worked_at[rank]) - attempt.worked_at[rank])
        beat = attempt.beats.get(rank)
        if beat is None:
            return hang.RankSeen(rank, name, process=process, stopped_s=stopped, idle_cpu_s=idle_cpu)
        silent = max(0.0, attempt.node_time.get(rank, beat["time"]) - beat["time"])
        idle = beat.get("idle_s")
        # Without its own idle time, a rank's progress is a new phase or step as the head saw it.
        stuck = idle + silent if idle is not None else now - attempt.beat_changed[rank][2]
        stuck = self._since_released(attempt, stuck, now)
        return hang.RankSeen(rank, name, phase=beat["phase"], step=beat.get("step"), stuck_s=stuck, silent_s=silent,
                             collective=bool(beat.get("collective")), process=process, stopped_s=stopped,
                             idle_cpu_s=idle_cpu)

    @staticmethod
    def _since_released(attempt: Attempt, quiet: float, now: float) -> float:
        """``quiet`` less the time a rank was held stopped (a hold ends when every rank is seen let go:
        the others waited for it in their collectives), which the stopped allowance alone judges."""
        if attempt.stopped_since:
            return quiet
        return quiet if attempt.released_at is None else min(quiet, now - attempt.released_at)
