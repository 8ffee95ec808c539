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

from coordinator.jobs.elastic import choose_nodes
from coordinator.jobs.node_health import NodeHealth
from coordinator.jobs.run_context import RunContext
from coordinator.launch.batch import BatchSplit, Undividable, rebatch
from coordinator.launch.launcher import Launcher
from coordinator.launch.mlx_lm_command import CommandError

NODE_WAIT_S = 600.0


@dataclass(frozen=True)
class NodesAway:
    """The nodes did not come back within NODE_WAIT_S; ``why`` says which were waited for."""

    why: str


@dataclass(frozen=True)
class StopAsked:
    """A stop came while the nodes were waited for: the supervisor stops what runs, then the run."""


class NodeWait:
    def __init__(self, ctx: RunContext, health: NodeHealth, launcher: Launcher):
        self.ctx = ctx
        self.fx = ctx.fx
        self.health = health
        self.launcher = launcher
        self._down_since: dict[str, float] = {}  # node -> when it was first seen down, until it is up

    async def wait(self, nodes: list[str] | None = None, *, elastic: bool = False,
                   give_up_after: float | None = None) -> list[str] | NodesAway | StopAsked | None:
        """The nodes the next attempt runs on, once they are up; StopAsked when a stop came
        meanwhile; None after ``give_up_after`` seconds; NodesAway after NODE_WAIT_S."""
        ctx, fx = self.ctx, self.fx
        configured = nodes or ctx.job_nodes()
        started = fx.monotonic()
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
            if give_up_after is not None and fx.monotonic() - started > give_up_after:
                return None
            if fx.monotonic() - started > NODE_WAIT_S:
                return NodesAway(why)
            if why != announced:
                ctx.event("waiting_for_nodes", why)
                announced = why
            await ctx.pause(delay)
            delay = min(delay * 2, 2.0 if elastic else 5.0)

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
            down_for = {n: math.inf if self.fx.node(n).needs_reboot else now - t for n, t in self._down_since.items()}
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
        return (configured, "") if not down else (None, f"waiting for {', '.join(down)} to come back"
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
