"""One run's watch for nodes that need a reboot: ranks that outlive SIGKILL, and on a Mac wired
memory that stays far above its level before the attempt once the ranks are gone. What counts
is decided by ``coordinator.jobs.reboot`` (pure); a node found so is marked through the effects
(``mark_needs_reboot``) and leaves every job's placement until it comes back from a reboot."""

from __future__ import annotations

import anyio

from coordinator.jobs import reboot
from coordinator.jobs.attempt import Attempt
from coordinator.jobs.effects import AgentCalls
from coordinator.jobs.run_context import RunContext
from shared.agent_api.ranks import StopRankReply
from shared.rpc import RemoteError


class RebootWatch:
    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.fx: AgentCalls = ctx.fx

    def _on_mac(self, name: str) -> bool:
        facts = self.fx.node(name).facts or {}
        return str(facts.get("os") or "").lower().startswith("mac")

    async def _wired(self, name: str) -> tuple[int | None, int | None]:
        """(wired bytes, the machine's memory) now, or Nones when the node cannot say."""
        try:
            sample = await self.fx.call(name, "usage", {}, timeout=15)
        except RemoteError:
            return None, None
        return sample.get("wired_bytes"), sample.get("memory_total_bytes")

    async def baseline(self, attempt: Attempt) -> None:
        """Each Mac's wired memory before the attempt's ranks start."""
        async def one(name: str) -> None:
            wired, _ = await self._wired(name)
            if wired is not None:
                attempt.wired_baseline[name] = wired

        async with anyio.create_task_group() as tasks:
            for name in set(attempt.order):
                if self._on_mac(name):
                    tasks.start_soon(one, name)

    async def survived(self, name: str, rank: int, number: int, answer: StopRankReply) -> bool:
        """A stop that left processes behind: asked again after a while (a process with much memory
        takes a moment to go); still there, the node needs a reboot. True when they are gone."""
        await anyio.sleep(reboot.SURVIVOR_RECHECK_S)
        try:
            again = await self.fx.call(name, "stop_rank", {"job": self.ctx.run_id, "attempt": number, "rank": rank},
                                       timeout=30)
        except RemoteError:
            return False
        if again["stopped"]:
            return True
        reason = reboot.survivors(rank, again["left"] or answer["left"], list(again.get("states") or []))
        self._mark(name, f"{reason} (run {self.ctx.run_id}, attempt {number})")
        return False

    async def stranded(self, attempt: Attempt, stopped: set[str]) -> None:
        """After the attempt's ranks are gone from ``stopped``: each Mac whose wired memory stays far
        above its baseline, looked at a few times (the kernel lets go a little after the exit)."""
        async def one(name: str, baseline: int) -> None:
            why = None
            for look in range(reboot.WIRED_LOOKS):
                if look:
                    await anyio.sleep(reboot.WIRED_SETTLE_S)
                wired, total = await self._wired(name)
                why = reboot.wired_stranded(baseline, wired, total)
                if why is None:
                    return
            self._mark(name, f"{why} (run {self.ctx.run_id}, attempt {attempt.number})")

        async with anyio.create_task_group() as tasks:
            for name in [n for n in attempt.wired_baseline if n in stopped]:
                tasks.start_soon(one, name, attempt.wired_baseline.pop(name))  # looked at once per attempt

    def _mark(self, name: str, reason: str) -> None:
        self.ctx.event("node_needs_reboot", f"{name} needs a reboot: {reason}", node=name)
        self.fx.mark_needs_reboot(name, reason)
