"""An attempt's nodes the head cannot reach, for its supervisor: judged at each poll
(``coordinator.jobs.outage``, pure), waited out with the run still ``running`` and a note beside
it, and, once they are reached again, the attempt watched on as after a daemon restart: what its
ranks wrote meanwhile is read, its checkpoints catalogued, the hang watch started afresh."""

from __future__ import annotations

import anyio

from coordinator.jobs import core
from coordinator.jobs.attempt import Attempt
from coordinator.jobs.effects import NodePorts
from coordinator.jobs.node_health import NodeHealth
from coordinator.jobs.outage import ALIVE, HEAD, SETTLE_S, OutageFacts, OutageVerdict, judge_outage
from coordinator.jobs.run_context import RunContext

AT_ONCE_S = 5.0  # nodes whose sessions went down within this of each other were lost at once
ROUTE_EVERY_S = 2.0  # the head's route is asked again at most this often while nodes are away


class OutageWatch:
    def __init__(self, ctx: RunContext, health: NodeHealth):
        self.ctx = ctx
        self.fx: NodePorts = ctx.fx
        self.health = health
        self.since: float | None = None  # wall clock: when the first node of this outage was lost
        self.step_at_loss = 0  # the job's step when it began
        self.settled_step: int | None = None  # the job's step SETTLE_S after it began: steps count from there
        self.cause: str | None = None  # what the run waits on, once said (outage.HEAD or ALIVE)
        # Once the head, cut off, reaches some of the nodes again: when (wall clock), and the job's step
        # SETTLE_S after that, from which the steps of the ranks that answer count.
        self.back_at: float | None = None
        self.back_step: int | None = None
        self._route: str | None = None
        self._route_asked: float | None = None  # monotonic

    @property
    def on(self) -> bool:
        return self.since is not None

    async def judge(self, attempt: Attempt, away: dict[int, tuple[str, str]]) -> core.Verdict | None:
        """``away``: rank -> (node, why) for the attempt's nodes the head cannot reach now. None while
        the attempt waits for them; the node loss once it must not."""
        record, fx = self.ctx.record, self.fx
        lost = sorted({name for name, _ in away.values()})
        now = fx.now()
        downs = [fx.node(name).down_since or now for name in lost]
        if self.since is None:
            self.since, self.step_at_loss = min(downs), record.step
        if self.settled_step is None and now - self.since >= SETTLE_S:
            self.settled_step = record.step
        reached = [name for name in attempt.order if name not in lost]
        if self.cause == HEAD and reached:
            if self.back_at is None:
                self.back_at = now
            if self.back_step is None and now - self.back_at >= SETTLE_S:
                self.back_step = record.step
        else:
            self.back_at = self.back_step = None
        if self.back_at is not None:
            steps_since = record.step - self.back_step if self.back_step is not None else 0
        else:
            steps_since = record.step - self.settled_step if self.settled_step is not None else 0
        remote = [name for name in fx.node_names() if not fx.on_head_machine(name)]
        facts = OutageFacts(
            lost=tuple(lost), reached=tuple(reached), remote_up=sum(1 for n in remote if self.health.up(n)),
            remote_nodes=len(remote), head_route=await self._head_route(lost),
            lost_at_once=max(downs) - min(downs) <= AT_ONCE_S, waited_s=max(0.0, now - self.since),
            steps_since=steps_since, stuck_s=self._stuck(attempt, lost),
            # The train records' own average first: the heartbeats' gap is measured at their 2 s grain and is
            # raised at once by one slow step (the hang watch wants that; a judgement of seconds does not).
            step_seconds=record.step_seconds or record.step_gap, first_step_done=record.first_step_at is not None,
            node_timeout=self.ctx.spec.node_timeout, judged=self.cause,
            back_s=now - self.back_at if self.back_at is not None else None,
            reached_report_steps=any(attempt.order[rank] in reached for rank in attempt.rank_steps
                                     if rank < len(attempt.order)))
        verdict = judge_outage(facts)
        if not verdict.wait:
            self.ctx.log.info("outage_judged", cause=verdict.cause, reason=verdict.reason)
            self._clear()
            rank = min(away)
            return core.node_lost(rank, away[rank][0], verdict.reason)
        self._say(verdict, facts)
        return None

    def back(self) -> None:
        """Every node of the attempt answers again: the wait is over, said, and the hang watch starts
        afresh (the time the head was cut off says nothing of the ranks)."""
        if self.since is None:
            return
        record = self.ctx.record
        if self.cause is not None:
            away_s = max(0.0, self.fx.now() - self.since)
            kind = "head_reconnected" if self.cause == HEAD else "node_reached_again"
            self.ctx.event(kind, f"the head reaches every node of attempt {record.attempt} again after {away_s:.0f} s; "
                           f"its ranks trained on (step {self.step_at_loss} then, {record.step} now): no restart, "
                           "what they wrote meanwhile is read", seconds=round(away_s, 3),
                           step_then=self.step_at_loss, step_now=record.step)
            record.last_progress = self.fx.now()
        record.note = None
        self._clear()
        self.ctx.save()

    def _clear(self) -> None:
        self.since, self.cause, self._route, self._route_asked = None, None, None, None
        self.settled_step = None
        self.back_at = self.back_step = None
        self.ctx.record.note = None

    def _say(self, verdict: OutageVerdict, facts: OutageFacts) -> None:
        """Said once per cause: an event, and the note coord status shows beside ``running``."""
        if verdict.cause not in (HEAD, ALIVE) or verdict.cause == self.cause:
            return
        self.cause = verdict.cause
        limit = (f"waiting up to --node-timeout {facts.node_timeout:g} s for them to be reached again; nothing is "
                 "relaunched meanwhile")
        if verdict.cause == HEAD:
            note = f"head_disconnected: {verdict.reason}"
            self.ctx.event("head_disconnected", f"{verdict.reason}; the ranks train on without the head: {limit}",
                           nodes=list(facts.lost))
        else:
            note = f"node_unreachable: {verdict.reason}"
            self.ctx.event("node_unreachable", f"{verdict.reason}: {limit}", nodes=list(facts.lost))
        self.ctx.record.note = f"{note} ({limit})"
        self.ctx.save()

    async def _head_route(self, lost: list[str]) -> str | None:
        now = self.fx.monotonic()
        if self._route_asked is None or now - self._route_asked >= ROUTE_EVERY_S:
            self._route_asked = now
            with anyio.move_on_after(10):
                self._route = await self.fx.head_route_down(lost)
        return self._route

    def _stuck(self, attempt: Attempt, lost: list[str]) -> float | None:
        """How long the least idle of the ranks that answer has gone without progress (its own
        heartbeat: its idle time, and the time since it wrote it, on its node's clock); None when
        none of them says."""
        idle = []
        for rank, name in enumerate(attempt.order):
            beat = attempt.beats.get(rank)
            if name in lost or beat is None or beat.get("idle_s") is None or rank in attempt.exited:
                continue
            silent = max(0.0, attempt.node_time.get(rank, beat["time"]) - beat["time"])
            idle.append(float(beat.get("idle_s") or 0.0) + silent)
        return min(idle) if idle else None
