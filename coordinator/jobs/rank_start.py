"""An attempt's ranks on their nodes: each rank's script prepared by its node's agent (its command,
environment and files from the job's launcher, coord's ``COORD_*`` contract), and, for a launcher that
runs on every node, each rank started there."""

from __future__ import annotations

import posixpath

import anyio

from coordinator.jobs import core
from coordinator.jobs.effects import AgentCalls, LaunchError
from coordinator.jobs.run_context import RunContext
from coordinator.launch.batch import BatchSplit
from coordinator.launch.seam import Launcher, LaunchPlan, RankSlot
from shared.rpc import RemoteError

STANDBY_START_TIMEOUT_S = 180.0  # a start_rank that waits on a standby still importing (agent.standby: 120 s)


class RankStarter:
    def __init__(self, ctx: RunContext, launcher: Launcher):
        self.ctx = ctx
        self.fx: AgentCalls = ctx.fx
        self.launcher = launcher

    async def prepare(self, plan: LaunchPlan, attempt: int, order: list[str], resume_files: dict[str, str],
                      start_step: int, batch: BatchSplit | None, *, skip: int = 0) -> None:
        """Each rank's script on its node, all at once; a node that cannot take it is a LaunchError.
        ``skip``: the batches after the resume's checkpoint the ranks pass over (a rollback's)."""
        errors: dict[str, RemoteError] = {}

        async def prepare(rank: int, name: str) -> None:
            node = self.fx.node(name)
            adapter_path = posixpath.join(node.workdir, "checkpoints", self.ctx.run_id, f"attempt-{attempt}")
            slot = RankSlot(plan, rank, self.ctx.run_id, attempt)
            argv = self.launcher.rank_command(self.ctx.spec, slot, checkpoint_dir=adapter_path,
                                              resume_file=resume_files.get(name), start_step=start_step, batch=batch)
            env = {"COORD_JOB": self.ctx.spec.name, "COORD_RUN": self.ctx.run_id, "COORD_ATTEMPT": str(attempt),
                   "COORD_RANK": str(rank), "COORD_PROGRESS_FILE": "{rank_dir}/progress.jsonl",
                   "COORD_STEP_OFFSET": str(start_step), "COORD_CHECKPOINT_DIR": adapter_path,
                   "COORD_SAVE_EVERY": str(self.ctx.spec.save_every)}
            if self.ctx.spec.total_steps is not None:
                env["COORD_TOTAL_STEPS"] = str(self.ctx.spec.total_steps)
            if skip:
                env["COORD_SKIP_BATCHES"] = str(skip)
            if resume_files.get(name):
                # A checkpoint directory (0000040/) or file, as the script wrote it (docs/script-contract.md).
                is_dir = not posixpath.basename(resume_files[name]).endswith(".safetensors")
                env["COORD_RESUME_DIR" if is_dir else "COORD_RESUME_FILE"] = resume_files[name]
                env["COORD_RESUME_STEP"] = str(start_step)
            env.update(self.launcher.rank_env(self.ctx.spec, slot, batch))
            try:
                await self.fx.call(name, "prepare_rank", {
                    "job": self.ctx.run_id, "rank": rank, "attempt": attempt, "python": node.python, "argv": argv,
                    "env": env, "files": self.launcher.rank_files(self.ctx.spec, slot, batch),
                    "free_ports": self.launcher.rank_ports(self.ctx.spec, slot),
                    "pass_output": False},  # coord reads the output from the node
                    timeout=60)
            except RemoteError as exc:
                errors[name] = exc

        async with anyio.create_task_group() as tasks:
            for rank, name in enumerate(order):
                tasks.start_soon(prepare, rank, name)
        if errors:
            name, exc = sorted(errors.items())[0]
            raise LaunchError(f"rank {order.index(name)} could not be prepared on {name}: {exc.message}",
                              node=name if core.unreachable_error(exc.code) else None)

    async def start(self, attempt: int, order: list[str]) -> list[str]:
        """A launcher that runs on every node: each node's agent starts its prepared rank, all at once;
        a node that cannot is a LaunchError (the ranks started elsewhere are stopped with the attempt).
        The nodes whose rank a warm standby took (its launcher imported already: agent.standby), in order."""
        errors: dict[str, RemoteError] = {}
        warm: set[str] = set()

        async def start(rank: int, name: str) -> None:
            try:
                # A standby still importing finishes first; at worst it gives up after two minutes and
                # the rank starts cold.
                answer = await self.fx.call(name, "start_rank", {"job": self.ctx.run_id, "rank": rank,
                                                                     "attempt": attempt,
                                                                     "standby": self.launcher.capabilities.standby},
                                                timeout=STANDBY_START_TIMEOUT_S)
            except RemoteError as exc:
                errors[name] = exc
                return
            if answer.get("warm"):
                warm.add(name)
            if answer.get("cleared_locks"):
                self.ctx.event("stale_lock_cleared", f"{name}: removed a lock of torch's extension build that a "
                               f"killed process left (every rank would have waited on it for good): "
                               f"{', '.join(answer['cleared_locks'])}", node=name, paths=answer["cleared_locks"])

        async with anyio.create_task_group() as tasks:
            for rank, name in enumerate(order):
                tasks.start_soon(start, rank, name)
        if errors:
            name, exc = sorted(errors.items())[0]
            raise LaunchError(f"rank {order.index(name)} could not be started on {name}: {exc.message}",
                              node=name if core.unreachable_error(exc.code) else None)
        return [name for name in order if name in warm]

    async def retire_standbys(self, nodes: list[str]) -> None:
        """The job is over: its warm standbys go from every node that is up (one left on a node away
        goes by itself once the job's rank there has been gone a while)."""
        async def retire(name: str) -> None:
            if not self.fx.node(name).up:
                return
            try:
                await self.fx.call(name, "retire_standbys", {"job": self.ctx.run_id}, timeout=10)
            except RemoteError as exc:  # it goes by itself a while after the job's rank there
                self.ctx.log.warning("standbys not retired", node=name, error=exc.message)

        async with anyio.create_task_group() as tasks:
            for name in nodes:
                tasks.start_soon(retire, name)
