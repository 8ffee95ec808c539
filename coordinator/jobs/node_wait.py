"""Which nodes the next attempt runs on, once they are up: the wait for nodes and the elastic choice.

Without ``elastic`` every node the job holds (or every one named) must be up. With it, and
--min-nodes, a node down for longer than --node-timeout is left out when the others can take its
share of the global batch (``coordinator.jobs.elastic`` chooses, the job's launcher says how the
batch splits); a node that is back takes part again. The supervisor decides what a wait that ran
out means (every rank stopped, the job failed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from coordinator.jobs.effects import NodePorts
from coordinator.jobs.elastic import choose_nodes
from coordinator.jobs.limits import NODE_WAIT_S
from coordinator.jobs.node_health import NodeHealth
from coordinator.jobs.run_context import RunContext, Waiting
from coordinator.launch.batch import BatchSplit, Undividable, rebatch
from coordinator.launch.mlx_lm_command import CommandError
from coordinator.launch.seam import Launcher

__all__ = ["NODE_WAIT_S", "NodeWait", "NodesAway", "StopAsked"]


@dataclass(frozen=True)
class NodesAway:
    """The nodes were not up within the job's --node-wait; ``why`` says which were waited for, and why
    each was not up."""

    why: str
    waited_s: float


@dataclass(frozen=True)
class StopAsked:
    """A stop came while the nodes were waited for: the supervisor stops what runs, then the run."""


class NodeWait:
    def __init__(self, ctx: RunContext, health: NodeHealth, launcher: Launcher):
        self.ctx = ctx
        self.fx: NodePorts = ctx.fx
        self.health = health
        self.launcher = launcher
        self._down_since: dict[str, float] = {}  # node -> when it was first seen down, until it is up

    async def wait(self, nodes: list[str] | None = None, *, elastic: bool = False,
                   give_up_after: float | None = None) -> list[str] | NodesAway | StopAsked | None:
        """The nodes the next attempt runs on, once they are up; StopAsked when a stop came
        meanwhile; None after ``give_up_after`` seconds; NodesAway after the job's --node-wait.
        While it waits, the run shows what for (``RunContext.waiting``: coord status, coord run)."""
        try:
            return await self._wait(nodes or self.ctx.job_nodes(), elastic, give_up_after)
        finally:
            self.ctx.waiting = None

    async def _wait(self, configured: list[str], elastic: bool,
                    give_up_after: float | None) -> list[str] | NodesAway | StopAsked | None:
        ctx, fx = self.ctx, self.fx
        limit = ctx.spec.node_wait
        started, since = fx.monotonic(), fx.now()
        delay = 0.5
        announced = None
        while True:
            chosen, why = self._choose(configured, elastic)
            if chosen is not None:
                if announced:
                    ctx.event("nodes_back", f"going on with {', '.join(chosen)} after "
                              f"{fx.monotonic() - started:.1f} s")
                return chosen
            if ctx.stop_requested:
                return StopAsked()
            waited = fx.monotonic() - started
            if give_up_after is not None and waited > give_up_after:
                return None
            away = {n: self._not_up_because(n) for n in configured if not self.health.up(n)}
            detail = why + "".join(f"; {n}: {reason}" for n, reason in away.items())
            if waited > limit:
                return NodesAway(detail, waited)
            ctx.waiting = Waiting(nodes=list(away), reasons=away, why=why, since=since, limit_s=limit)
            if detail != announced:
                ctx.event("waiting_for_nodes", f"{detail} (waited {waited:.0f} s of at most {limit:g} s, "
                          "--node-wait)", nodes=list(away))
                announced = detail
            await ctx.pause(min(delay, limit - waited + 0.01))  # the bound is kept to within a poll
            delay = min(delay * 2, 2.0 if elastic else 5.0)

    def _not_up_because(self, name: str) -> str:
        view = self.fx.node(name)
        if name in self.health.dropped:
            return "shrunk out of this run as a straggler (--straggler-policy drop)"
        if view.up:  # its session is up, but a call to it just failed: trusted once it reconnects
            return "a call to it failed; waiting for its session to notice and reconnect"
        return view.reason or "not up yet (connecting)"

    def _choose(self, configured: list[str], elastic: bool) -> tuple[list[str] | None, str]:
        """The nodes to go on with now (None: wait), and what is waited for."""
        now = self.fx.monotonic()
        up = [n for n in configured if self.health.usable(n)]
        for name in configured:
            if name in up:
                self._down_since.pop(name, None)
            else:
                self._down_since.setdefault(name, now)
        if elastic and self.ctx.spec.min_nodes is not None:
            # A node that waits for a reboot will not come back by itself: it is left out at once.
            # Nor does one shrunk out as a straggler (--straggler-policy drop).
            down_for = {n: math.inf if self.fx.node(n).needs_reboot or n in self.health.dropped else now - t
                        for n, t in self._down_since.items()}
            chosen, why = choose_nodes(configured, up, down_for, min_nodes=self.ctx.spec.min_nodes,
                                       node_timeout=self.ctx.spec.node_timeout)
            why += self._reboots([n for n in configured if n not in up])
            if chosen is not None:
                try:
                    self.batch_for(chosen)
                except Undividable as exc:
                    chosen, why = None, f"{exc}: waiting for {', '.join(n for n in configured if n not in up)}"
            return chosen, why
        down = [n for n in configured if n not in up]
        return (configured, "") if not down else (None, f"waiting for {', '.join(down)} to be up"
                                                  + self._reboots(down))

    def _reboots(self, nodes: list[str]) -> str:
        """What the nodes that wait for a reboot need, for the wait's event."""
        marked = [(n, reason) for n in nodes if (reason := self.fx.node(n).needs_reboot)]
        return "".join(f"; {n} needs a reboot: {reason}" for n, reason in marked)

    def batch_for(self, nodes: list[str]) -> BatchSplit | None:
        """The batch split for an attempt on ``nodes`` (None: the job's own options, unchanged);
        Undividable when the job's global batch cannot be kept on them."""
        configured = len(self.ctx.job_nodes())
        if len(nodes) == configured:
            return None
        try:
            original = self.launcher.batch(self.ctx.spec, configured)
        except CommandError as exc:  # the job's own batch is unknown: keeping it is not possible
            raise Undividable(f"the job's global batch cannot be read ({exc})") from None
        return rebatch(original, len(nodes)) if original is not None else None
