"""One run's watch for hangs: what each poll says of each rank, kept on its attempt, and the
verdict of ``coordinator.jobs.hang`` (pure) over it.

The head's clock times what the head sees (the launch, a new step read); a rank's heartbeat is
timed on its own node's clock (its age is the node's time at the poll less the time the rank
wrote it), so clocks that differ between machines never make a rank look stuck."""

from __future__ import annotations

from coordinator.jobs import hang
from coordinator.jobs.attempt import Attempt
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.spec import reports_progress
from shared.agent_api.progress import HeartbeatRecord
from shared.agent_api.ranks import RankStatusReply


class HangWatch:
    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.fx = ctx.fx

    def seen(self, attempt: Attempt, rank: int, status: RankStatusReply) -> None:
        """A rank's status reply: its node's clock and its processes' state."""
        attempt.node_time[rank] = status["time"]
        process = status.get("process") if status["state"] == "running" else None
        attempt.process[rank] = process
        if status["state"] in ("exited", "vanished"):
            attempt.exited.add(rank)
        if process == "stopped":
            attempt.stopped_since.setdefault(rank, self.fx.now())
        else:
            attempt.stopped_since.pop(rank, None)

    def heartbeat(self, attempt: Attempt, rank: int, beat: HeartbeatRecord) -> None:
        attempt.beats[rank] = beat
        key = (beat["phase"], beat.get("step"))
        changed = attempt.beat_changed.get(rank)
        if changed is None or changed[:2] != key:
            attempt.beat_changed[rank] = (*key, self.fx.now())

    def after_poll(self, attempt: Attempt, *, progressed: bool, had_first_step: bool) -> None:
        """After every rank's reply was read: a new step is the job's progress, and the time since
        the one before (less any time a rank spent saving or evaluating) is what the training
        allowance follows."""
        now = self.fx.now()
        record = self.ctx.record
        if any(b["phase"] in hang.SLOW_PHASES for r, b in attempt.beats.items() if r not in attempt.exited):
            attempt.slow_seen_at = now
        if not progressed:
            return
        if had_first_step and record.last_progress is not None:
            since = max(record.last_progress, attempt.slow_seen_at or 0.0)
            if now > since:
                record.step_gap = hang.next_gap(record.step_gap, now - since)
        record.last_progress = now

    def limits(self) -> hang.HangLimits:
        spec, record = self.ctx.spec, self.ctx.record
        return hang.hang_limits(configured_hang=spec.hang_timeout, configured_first_step=spec.first_step_timeout,
                                previous_first_step_s=record.first_step_seconds, model_bytes=record.model_bytes,
                                gap_s=record.step_gap)

    def watched(self) -> bool:
        return reports_progress(self.ctx.spec) or self.ctx.record.progress_seen

    def verdict(self, attempt: Attempt) -> hang.Hang | None:
        record, now = self.ctx.record, self.fx.now()
        job = hang.JobSeen(watched=self.watched(), first_step_done=record.first_step_at is not None,
                           quiet_s=now - (record.last_progress if record.last_progress is not None else now))
        ranks = [self._rank_seen(attempt, rank, name, now) for rank, name in enumerate(attempt.order)]
        return hang.hang_verdict(ranks, job, self.limits())

    def _rank_seen(self, attempt: Attempt, rank: int, name: str, now: float) -> hang.RankSeen:
        process = attempt.process.get(rank)
        stopped = now - attempt.stopped_since[rank] if rank in attempt.stopped_since else 0.0
        beat = attempt.beats.get(rank)
        if beat is None or rank in attempt.exited:
            return hang.RankSeen(rank, name, process=process, stopped_s=stopped)
        silent = max(0.0, attempt.node_time.get(rank, beat["time"]) - beat["time"])
        idle = beat.get("idle_s")
        # Without its own idle time, a rank's progress is a new phase or step as the head saw it.
        stuck = idle + silent if idle is not None else now - attempt.beat_changed[rank][2]
        return hang.RankSeen(rank, name, phase=beat["phase"], step=beat.get("step"), stuck_s=stuck, silent_s=silent,
                             collective=bool(beat.get("collective")), process=process, stopped_s=stopped)
