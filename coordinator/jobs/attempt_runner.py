"""One attempt of a run: started on its nodes, watched until it ends, and stopped everywhere.

``JobRunner`` (coordinator/jobs/supervisor.py) keeps the loop (what follows an attempt, the wait
for nodes, the re-attach after a daemon restart); this part does one attempt at a time. Starting:
the plan (pre-flight's, for the first), the nodes' trees checked, the resume chosen and placed, each
rank's script prepared and the ranks (or the head's launcher) started. Watching: every rank polled
through its node's agent until the attempt is over, its checkpoints found beside it, a resize asked
for honoured after the next checkpoint. Stopping: every rank on every node and the launcher, and
the ranks of nodes that were away stopped once they are back (``reap``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio

from coordinator.jobs import core
from coordinator.jobs.attempt import Attempt
from coordinator.jobs.checkpoints import CheckpointKeeper
from coordinator.jobs.effects import AttemptPorts, LaunchError
from coordinator.jobs.node_health import NodeHealth
from coordinator.jobs.node_wait import NodeWait
from coordinator.jobs.policy import LAUNCH_FAILED, RESIZED, STOPPED, SUCCEEDED, Outcome
from coordinator.jobs.rank_start import RankStarter
from coordinator.jobs.rank_watch import HOLD_S, MAX_REREADS, POLL_S, READ_AGAIN, RankWatcher
from coordinator.jobs.reboot_watch import RebootWatch
from coordinator.jobs.record import JobRecord
from coordinator.jobs.rollback import take_skip
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.spec import JobSpec
from coordinator.jobs.states import JobState
from coordinator.jobs.tree_check import restore_trees
from coordinator.launch.batch import BatchSplit
from coordinator.launch.seam import Launcher, LaunchPlan, RankSlot
from coordinator.store.state import CheckpointRow
from shared.rpc import RemoteError

OUTLIVE_MARGIN_S = 30.0  # beyond --node-timeout: the sessions' reconnect backoff, and a poll


@dataclasses.dataclass(frozen=True)
class StopResult:
    """An attempt's ranks stopped as its watch ended: whether none is left, and how long it took."""

    attempt: int
    everything: bool
    seconds: float


class AttemptRunner:
    def __init__(self, ctx: RunContext, launcher: Launcher, *, health: NodeHealth, checkpoints: CheckpointKeeper,
                 ranks: RankWatcher, nodes: NodeWait, reboots: RebootWatch, starter: RankStarter):
        self.ctx = ctx
        self.fx: AttemptPorts = ctx.fx
        self.launcher = launcher
        self.health = health
        self.checkpoints = checkpoints
        self.ranks = ranks
        self.nodes = nodes
        self.reboots = reboots
        self.starter = starter
        self.attempt: Attempt | None = None  # the attempt being launched or watched
        self.planned: LaunchPlan | None = None  # from pre-flight, for attempt 0
        self.synced = False  # the source was synced just before the next launch (the run's first)
        self.resize_requested: int | None = None  # the checkpoint step the resize waits to pass
        self.stopped: StopResult | None = None  # the watched attempt's ranks, stopped as it ended

    @property
    def record(self) -> JobRecord:
        return self.ctx.record

    @property
    def spec(self) -> JobSpec:
        return self.ctx.spec

    @property
    def run_id(self) -> str:
        return self.ctx.run_id

    @property
    def stop_requested(self) -> bool:
        return self.ctx.stop_requested

    def event(self, kind: str, message: str, **data: Any) -> None:
        self.ctx.event(kind, message, **data)

    def save(self) -> None:
        self.ctx.save()

    def set_state(self, state: str) -> None:
        self.ctx.set_state(state)

    def job_nodes(self) -> list[str]:
        return self.ctx.job_nodes()

    def last(self) -> Attempt | None:
        """The attempt launched last (read back from the record when this runner did not launch it:
        a run continued with --resume, or one a restarted daemon supervises again)."""
        if self.attempt is None and self.record.attempt >= 0:
            self.attempt = Attempt.resumed(self.record, self.fx, self.run_id)
        return self.attempt


    async def launch(self, nodes: list[str]) -> Outcome | None:
        """Start the next attempt on ``nodes``: None once its ranks are launched, else the
        attempt's outcome (LAUNCH_FAILED, or SUCCEEDED when nothing is left to run)."""
        started = self.fx.monotonic()
        if self.record.attempt >= 0:
            # A node that was away when the last attempt was stopped may still run its rank.
            await self.stop_everything(self.last())
        self.record.attempt += 1
        number = self.record.attempt
        self.attempt = Attempt.fresh(number, nodes, self.record)
        self.record.launcher_pid = None
        self.record.launched_at = self.fx.now()
        self.record.first_step_at = None
        self.record.last_progress = self.fx.now()
        self.set_state(JobState.STARTING)
        try:
            return await self._start_attempt(self.attempt, nodes, started)
        except LaunchError as exc:
            if exc.node is not None:
                self.health.mark_unreachable(exc.node)
            signature = f"node:{exc.node}" if exc.node else f"launch:{exc.message}"
            return self.ranks.ended(None, LAUNCH_FAILED, f"attempt {number} could not be launched: {exc.message}",
                                    signature)

    async def _plan(self, nodes: list[str]) -> LaunchPlan:
        """The launch plan for ``nodes``: the one pre-flight just made, for attempt 0."""
        if self.planned is not None and len(nodes) == len(self.fx.node_names()) and self.spec.nodes is None:
            planned, self.planned = self.planned, None
            return planned
        return await self.fx.plan_launch(nodes, self.spec)

    def _say_resized(self, previous: list[str], order: list[str], batch: BatchSplit | None) -> None:
        left, back = sorted(set(previous) - set(order)), sorted(set(order) - set(previous))
        self.event("resized", f"{len(previous)} → {len(order)} ranks"
                   + (f"; left out {', '.join(left)}" if left else "") + (f"; back {', '.join(back)}" if back else "")
                   + f"; {batch.describe() if batch else 'the job' + chr(39) + 's own batch'}; hostfile rewritten",
                   nodes=order, left_out=left, back=back)

    def _say_resume(self, resume: CheckpointRow, order: list[str], seconds: float) -> None:
        placed = self.checkpoints.last_placement or {"in_place": [], "copied_to": [], "bytes_copied": 0}
        copied = placed["copied_to"]
        # Name the copy the bytes came from only when some were sent: with nothing copied, every
        # rank read its own node's copy, whatever copy the catalog lists first.
        self.event("resume_from", f"resuming from the checkpoint of step {resume['step']}; "
                   + (f"{len(placed['in_place'])} of {len(order)} nodes from their own copy, "
                      f"copied from {resume['node']}:{resume['path']} to {', '.join(copied)}" if copied
                      else "every node from its own copy, nothing copied"),
                   step=resume["step"], attempt=resume["attempt"], in_place=placed["in_place"],
                   copied_to=copied, bytes_copied=placed["bytes_copied"], seconds=round(seconds, 3))

    async def _start_attempt(self, attempt: Attempt, nodes: list[str], started: float) -> Outcome | None:
        previous = list(self.record.order)
        plan = await self._plan(nodes)
        order = list(plan.order) or nodes
        if self.synced:
            self.synced = False  # pre-flight's sync just now is this attempt's
        else:
            await restore_trees(self.ctx, order)  # a relaunch: what a node lost is sent again, named
        batch = self.nodes.batch_for(order)
        self.record.batch = batch.describe() if batch else None
        if previous and set(previous) != set(order):
            self._say_resized(previous, order, batch)
        self.record.order = attempt.order = list(order)
        self.record.world_size = plan.world_size
        self.record.backend = plan.links
        self.save()  # before any rank can start: a daemon restarted from here knows whom to stop
        choose_started = self.fx.monotonic()
        if self.record.uncatalogued:
            await self.checkpoints.catalogue_left_behind()
        resume, resume_files = await self.checkpoints.choose_resume(order)
        start_step = resume["step"] if resume else 0
        self.record.start_step = attempt.start_step = start_step
        skip = take_skip(self.record, start_step)
        # This attempt's progress starts where it resumes: a step an earlier attempt reached is
        # not this one's (an attempt whose ranks all exit 0 must have reached the total itself).
        self.record.step = start_step
        if resume:
            self._say_resume(resume, order, self.fx.monotonic() - choose_started)
        if self.spec.total_steps is not None and start_step >= self.spec.total_steps:
            # The newest valid checkpoint of this run is the final step: there is nothing left to run. The
            # run stays starting (no rank runs): a daemon restarted before its end is saved finishes the
            # recovery, which finds the same, instead of watching ranks that never started.
            self.record.step = max(self.record.step, start_step)
            return self.ranks.ended(attempt, SUCCEEDED, f"the checkpoint of step {start_step} is the last step", "")
        if attempt.number == 0 or not self.record.diagnoses:
            command = self.launcher.rank_command(self.spec, RankSlot(plan, 0, self.run_id, attempt.number),
                                                 checkpoint_dir="", resume_file=None, start_step=0, batch=batch)
            self.ranks.diagnose_launch(order, plan.envs, command)
        # The history's curve goes on from start_step: what an earlier attempt reported past it is dropped.
        last = self.record.history[-1] if self.record.history else None
        self.fx.record_attempt(self.run_id, attempt.number, start_step, order,
                               f"attempt {last['attempt']}: {last['kind']}: {last['detail']}" if last else None)
        refused: list[LaunchError] = []  # raised past the task group, not inside an exception group
        async with anyio.create_task_group() as beside:
            beside.start_soon(self.reboots.baseline, attempt)  # each Mac's wired memory before the ranks
            try:
                await self.starter.prepare(plan, attempt.number, order, resume_files, start_step, batch,
                                           skip=skip)
            except LaunchError as exc:
                refused.append(exc)
        if refused:
            raise refused[0]
        # Saved before any rank starts: a daemon restarted while this attempt runs catalogues its
        # checkpoints from start_step (a file's name is its step within the attempt). Saved later,
        # a restart would read the previous attempt's start step and misnumber every checkpoint.
        self.save()
        warm: list[str] = []
        if self.launcher.capabilities.runs_on == "nodes":
            warm = await self.starter.start(attempt.number, order)
        else:
            # Its connections outlive a head cut off for --node-timeout (coordinator/jobs/outage.py).
            plan = dataclasses.replace(plan, outlive_silence_s=self.spec.node_timeout + OUTLIVE_MARGIN_S)
            self.record.launcher_pid = self.fx.start_launcher(self.run_id, attempt.number, plan)
        self.record.last_progress = self.fx.now()
        self.set_state(JobState.RUNNING)
        hangs = self.ranks.hangs
        watch = hangs.limits().describe() if hangs.watched() else "none until its ranks report progress"
        self.event("launched", f"attempt {attempt.number} launched on {', '.join(order)} from step {start_step} "
                   f"({plan.backend}){'; launcher warm on ' + ', '.join(warm) if warm else ''}; hang watch: {watch}",
                   attempt=attempt.number, start_step=start_step, seconds=round(self.fx.monotonic() - started, 3),
                   warm=warm)
        return None

    async def monitor(self, attempt: Attempt | None) -> Outcome:
        """Watch the attempt until it ends one way or another. Checkpoints are found and hashed
        in a task of their own: hashing a large one takes seconds, and a rank's exit must not
        wait for it."""
        assert attempt is not None, "an attempt is watched only once it was launched"
        async with anyio.create_task_group() as watchers:
            watchers.start_soon(self.checkpoints.watch, attempt)
            outcome = await self._watch(attempt)
            # Every rank stopped now, beside a checkpoint poll still under way (it is shielded, and
            # finishes), not after it: with a large checkpoint being hashed, or at a hundred nodes
            # with checkpoints coming faster than they were completed, that poll took tens of seconds
            # while the ranks of a stopped or failed attempt ran on.
            started = self.fx.monotonic()
            everything = await self.stop_everything(attempt)
            self.stopped = StopResult(attempt.number, everything, self.fx.monotonic() - started)
            watchers.cancel_scope.cancel()
        return outcome

    async def _watch(self, attempt: Attempt) -> Outcome:
        """Poll every rank through its node's agent until the attempt ends; between polls, ranks
        left behind on nodes that are back are stopped and a resize asked for is honoured."""
        ended = await self.ranks.diverged_before_restart(attempt)
        if ended is not None:
            return ended
        rereads = 0
        while True:
            if self.stop_requested:
                return self.ranks.ended(attempt, STOPPED, "stop requested", "")
            asked = self.fx.monotonic()
            polled = await self.ranks.poll(attempt, may_read_again=rereads < MAX_REREADS,
                                           wait_s=HOLD_S if not rereads else 0.0)
            if polled == READ_AGAIN:
                rereads += 1
                continue
            if isinstance(polled, Outcome):
                return polled
            if self.record.unstopped:
                await self.reap()
            resize = self._resize_due()
            if resize:
                return self.ranks.ended(attempt, RESIZED, resize, "resize")
            await self.ctx.pause(POLL_S - (self.fx.monotonic() - asked))  # a poll that waited is the pause

    def request_resize(self) -> str:
        """coord resize: relaunch on every node that is up, right after the next checkpoint (so that
        nothing is redone)."""
        last = self.record.last_checkpoint
        self.resize_requested = last["step"] if last else -1
        return self._resize_due() or "the job will be relaunched on every node that is up after its next checkpoint"

    def _resize_due(self) -> str | None:
        up = [n for n in self.job_nodes() if self.health.usable(n)]
        last = self.record.last_checkpoint
        verdict = core.resize_due(self.resize_requested, up, self.record.order, last["step"] if last else None)
        if not verdict.pending:
            self.resize_requested = None
        if verdict.skipped:
            self.event("resize_skipped", verdict.skipped)
        return verdict.reason

    async def stop_everything(self, attempt: Attempt | None) -> bool:
        """Stop every rank of the attempt on every node, and the launcher; True when none is left anywhere."""
        if attempt is None:
            return True
        number = attempt.number
        pid = self.record.launcher_pid
        if pid:
            await self.fx.stop_launcher(pid, final=False)
        results: dict[str, bool] = {}

        def left_running(rank: int, name: str) -> None:
            results[name] = False
            unstopped = self.record.unstopped
            if [name, number, rank] not in unstopped:
                unstopped.append([name, number, rank])

        async def stop(rank: int, name: str) -> None:
            if not self.fx.node(name).up:
                left_running(rank, name)
                return
            try:
                answer = await self.fx.call(name, "stop_rank", {"job": self.run_id, "attempt": number,
                                                                "rank": rank}, timeout=30)
                results[name] = answer["stopped"] or await self.reboots.survived(name, rank, number, answer)
            except RemoteError:
                left_running(rank, name)
                return
            if not results[name]:
                left_running(rank, name)  # stopped once the node is back from its reboot

        async with anyio.create_task_group() as tasks:
            for rank, name in enumerate(attempt.order):
                tasks.start_soon(stop, rank, name)
        if pid:
            await self.fx.stop_launcher(pid, final=True)
        await self.reboots.stranded(attempt, {name for name, stopped in results.items() if stopped})
        await self.ranks.pull_all_logs(attempt)
        self.save()
        return all(results.values())


    async def reap(self) -> None:
        """Stop the ranks of earlier attempts whose nodes were away when those attempts were stopped."""
        left = []
        for name, attempt, rank in self.record.unstopped:
            try:
                view = self.fx.node(name)
                if not view.up or view.needs_reboot:  # a stop there would wait on what cannot stop
                    raise RemoteError("connection_lost", "node away")
                answer = await self.fx.call(name, "stop_rank", {"job": self.run_id, "attempt": attempt,
                                                                "rank": rank}, timeout=30)
                if not answer["stopped"]:
                    raise RemoteError("refused", "not stopped")
                self.event("rank_reaped", f"rank {rank} of attempt {attempt} on {name} stopped now that {name} "
                           "is back")
            except RemoteError:
                left.append([name, attempt, rank])
        self.record.unstopped = left
        self.save()
