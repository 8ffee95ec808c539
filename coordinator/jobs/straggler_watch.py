"""One run's watch of stragglers: each rank's compute time fed to the rule
(``coordinator/jobs/straggler.py``, pure) as its progress is read, and after each poll the ranks
named or cleared. A rank named is asked of its node's agent for what may slow it
(``rank_signals``: one second's sample), and its cause said (``straggler_cause.py``, pure) in a
``straggler`` event, which is an alert too; its recovery is a ``straggler_cleared`` event.
``coord status`` shows the ranks named now (``record.stragglers``), ``/metrics`` each rank's
compute time and score (``record.rank_compute``).

The rule times reports on the head's monotonic clock (when they were read), never a node's."""

from __future__ import annotations

from collections.abc import Callable

from coordinator.jobs.attempt import Attempt
from coordinator.jobs.effects import NodePorts
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.straggler import Change, StragglerEntry
from coordinator.jobs.straggler_cause import cause_kind, straggler_cause
from coordinator.launch.batch import Undividable
from shared.agent_api.ranks import RankSignalsReply
from shared.rpc import RemoteError

SIGNALS_TIMEOUT_S = 15.0
HEAT_COLUMNS = 60  # the heatmap's steps: about two minutes of polls


class StragglerWatch:
    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.fx: NodePorts = ctx.fx
        self._kept: set[str] = set()  # stragglers said to be kept (the job cannot go on without them)
        # Whether the job's global batch can be kept on these nodes (raises Undividable when not): the
        # supervisor's NodeWait.batch_for; None: not asked.
        self.batch_for: Callable[[list[str]], object] | None = None

    def compute(self, attempt: Attempt, rank: int, seconds: float) -> None:
        """A compute time of ``rank`` read now (a step's, or the mean of a heartbeat's steps)."""
        attempt.stragglers.add(rank, self.fx.monotonic(), seconds)

    async def after_poll(self, attempt: Attempt) -> str | None:
        """The ranks compared after a poll; with --straggler-policy drop, why the attempt must end
        to shrink a straggler's node out (None: it goes on)."""
        detector, record = attempt.stragglers, self.ctx.record
        now = self.fx.monotonic()
        changes = detector.evaluate(now)
        record.rank_compute = {str(rank): round(value, 6) for rank in range(len(attempt.order))
                               if (value := detector.value(rank, now)) is not None}
        record.rank_scores = {str(rank): round(score, 3) for rank, score in detector.scores.items()}
        self._heat(attempt, record.rank_compute)
        for change in changes:
            if change.kind == "named":
                await self._named(attempt, change)
            else:
                self._cleared(attempt, change)
        # Those the rule no longer names (a daemon restarted: its rule starts afresh and names them again
        # once their slowness shows) go; the others' scores follow the ranks.
        record.stragglers = [e for e in record.stragglers if e["rank"] in detector.named]
        for entry in record.stragglers:
            entry["score"] = round(detector.scores.get(entry["rank"], entry["score"]), 2)
        return self._drop_due(attempt, now)

    def _drop_due(self, attempt: Attempt, now: float) -> str | None:
        """With --straggler-policy drop: the reason to relaunch without a straggler's node, once it has
        been one for --straggler-grace seconds and the job may go on without it (--min-nodes)."""
        spec = self.ctx.spec
        if spec.straggler_policy != "drop" or spec.min_nodes is None:
            return None
        for rank in sorted(attempt.stragglers.named):
            lasted = attempt.stragglers.named_for(rank, now)
            node = attempt.order[rank]
            if lasted < spec.straggler_grace or node in self.ctx.record.dropped:
                continue
            why_not = self._cannot_go_without(attempt, node)
            if why_not is not None:
                if node not in self._kept:
                    self._kept.add(node)
                    self.ctx.event("straggler_kept", f"rank {rank} on {node} has been a straggler for {lasted:.0f} s, "
                                   f"but {why_not}: kept", rank=rank, node=node)
                continue
            self.ctx.record.dropped.append(node)
            detail = (f"rank {rank} on {node} has been a straggler for {lasted:.0f} s (--straggler-grace "
                      f"{spec.straggler_grace:g}): relaunching without {node} (--straggler-policy drop)")
            self.ctx.event("straggler_dropped", detail, rank=rank, node=node)
            return detail
        return None

    def _cannot_go_without(self, attempt: Attempt, node: str) -> str | None:
        rest = [n for n in attempt.order if n != node]
        if len(rest) < (self.ctx.spec.min_nodes or 0):
            return f"the job would go below --min-nodes {self.ctx.spec.min_nodes} without it"
        try:
            if self.batch_for is not None:
                self.batch_for(rest)
        except Undividable as exc:
            return f"without it {exc}"
        return None

    def _heat(self, attempt: Attempt, values: dict[str, float]) -> None:
        """One column of the rank x step heatmap per new step seen, each rank's compute time in it."""
        heat, step = self.ctx.record.compute_heat, self.ctx.record.step
        if not values or (heat and heat[-1][0] >= step):
            return
        heat.append([step, [values.get(str(rank)) for rank in range(len(attempt.order))]])
        del heat[:-HEAT_COLUMNS]

    def link_cause(self, node: str) -> str | None:
        """What ``coord doctor`` last found wrong with ``node``'s links, or None."""
        found = self.fx.slow_links(node)
        return "; ".join(found) if found else None

    async def _named(self, attempt: Attempt, change: Change) -> None:
        node = attempt.order[change.rank]
        signals = await self._signals(attempt, change.rank, node)
        link = self.link_cause(node)
        cause, kind = straggler_cause(signals, link_cause=link), cause_kind(signals, link_cause=link)
        entry: StragglerEntry = {"rank": change.rank, "node": node, "score": round(change.score, 2), "cause": cause,
                                 "cause_kind": kind, "since": self.fx.now()}
        record = self.ctx.record
        record.stragglers = [e for e in record.stragglers if e["rank"] != change.rank] + [entry]
        self.ctx.event("straggler", f"rank {change.rank} on {node} is a straggler: its compute time is "
                       f"{change.score:.1f}x the ranks' median; likely cause: {cause}",
                       rank=change.rank, node=node, score=round(change.score, 3), cause=cause, cause_kind=kind)

    def _cleared(self, attempt: Attempt, change: Change) -> None:
        node = attempt.order[change.rank]
        record = self.ctx.record
        record.stragglers = [e for e in record.stragglers if e["rank"] != change.rank]
        self.ctx.event("straggler_cleared", f"rank {change.rank} on {node} is no longer a straggler: its compute "
                       f"time is {change.score:.1f}x the ranks' median", rank=change.rank, node=node,
                       score=round(change.score, 3))

    async def _signals(self, attempt: Attempt, rank: int, node: str) -> RankSignalsReply | None:
        if not self.fx.node(node).up:
            return None
        try:
            return await self.fx.call(node, "rank_signals", {"job": self.ctx.run_id, "attempt": attempt.number,
                                                             "rank": rank, "seconds": 1.0}, timeout=SIGNALS_TIMEOUT_S)
        except RemoteError as exc:
            self.ctx.log.warning("straggler_signals", node=node, rank=rank, error=exc.message)
            return None
