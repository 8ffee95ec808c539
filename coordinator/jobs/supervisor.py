"""One run's life: launch an attempt, watch it through the agents, recover, finish.

The loop is small on purpose (after torch elastic's agent): launch, monitor until the
attempt ends, stop every rank everywhere, then ``policy.decide`` says succeed, restart or
fail. mlx.launch starts the ranks, but its exit code is not trusted: each node's agent
reports its rank (running, exit status, progress), and a node whose session drops counts
as lost. Whatever goes wrong while launching is an attempt outcome (``LAUNCH_FAILED``) like
any other, handled by the same policy, the wait for nodes and the elastic shrink.

The runner is made of parts with narrow interfaces, each given what it uses:
``RunContext`` (effects, spec, record, events, state), ``NodeHealth`` (which node to trust),
``RankWatcher`` (is the attempt over, and how), ``CheckpointKeeper`` (find, validate,
catalogue, choose and place checkpoints) and ``Replicator`` (background copies). Each
attempt's own state is an ``Attempt``, made fresh for it.

The supervisor reaches the world only through ``JobEffects`` (``coordinator.jobs.effects``):
the daemon fills them with real sessions, mlx.launch and SQLite; the fault simulator fills
them with simulated nodes under a virtual clock. What the facts mean is decided by pure
functions in ``coordinator.jobs.core`` and ``coordinator.jobs.policy``.

Everything a run leaves, on the head and on the nodes, is keyed by its run id, never by
the job's name: a name run again is a new run that cannot read an earlier one's files.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import structlog

from coordinator.jobs import core
from coordinator.jobs.attempt import Attempt
from coordinator.jobs.checkpoints import CHECKPOINT_POLL_S, CheckpointKeeper
from coordinator.jobs.durability import STOPPED_UPLOAD_TIMEOUT_S, DurabilityWatch
from coordinator.jobs.effects import JobEffects, LaunchError
from coordinator.jobs.node_health import NodeHealth
from coordinator.jobs.node_wait import NODE_WAIT_S, NodesAway, NodeWait, StopAsked
from coordinator.jobs.policy import (
    LAUNCH_FAILED,
    RESIZED,
    STOPPED,
    SUCCEEDED,
    Decision,
    Outcome,
    Rollbacks,
    decide,
    outcome_entry,
    outcome_of,
)
from coordinator.jobs.rank_start import RankStarter
from coordinator.jobs.rank_watch import HOLD_S, MAX_REREADS, POLL_S, READ_AGAIN, RankWatcher
from coordinator.jobs.reboot_watch import RebootWatch
from coordinator.jobs.record import JobRecord
from coordinator.jobs.replica import Replicator
from coordinator.jobs.rollback import roll_back, take_skip
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.spec import REPLICA_NONE, JobSpec
from coordinator.jobs.states import ACTIVE, FINISHED, JobState
from coordinator.jobs.success import judge_success
from coordinator.jobs.tree_check import restore_trees
from coordinator.jobs.view import RunView, run_view
from coordinator.launch.batch import BatchSplit
from coordinator.launch.launcher import LaunchPlan, RankSlot
from coordinator.launch.registry import launcher_named
from coordinator.store.state import CheckpointRow
from shared.rpc import RemoteError

__all__ = ["ACTIVE", "CHECKPOINT_POLL_S", "FINISHED", "NODE_WAIT_S", "POLL_S", "JobRunner", "JobState"]

log = structlog.get_logger("job")

OUTLIVE_MARGIN_S = 30.0  # beyond --node-timeout: the sessions' reconnect backoff, and a poll
REATTACH_GRACE_S = 60.0  # a restarted daemon's sessions connect within this; a node still away is lost


class JobRunner:
    def __init__(self, fx: JobEffects, spec: JobSpec, *, run_id: str, record: JobRecord | None = None,
                 state: str = "pending"):
        self.ctx = RunContext(fx, spec, run_id=run_id, record=record, state=state)
        self.fx = fx
        self.spec = spec
        self.run_id = run_id
        self.log = self.ctx.log
        self.health = NodeHealth(fx)
        self.health.dropped = self.ctx.record.dropped
        self.launcher = launcher_named(spec.launcher)
        self.replicator = Replicator(self.ctx, self.health) if spec.replica != REPLICA_NONE else None
        self.checkpoints = CheckpointKeeper(self.ctx, self.health, self.replicator)
        store = fx.store_url(spec.checkpoint_store)
        self.durability = DurabilityWatch(self.ctx, store) if store else None
        self.checkpoints.durability = self.durability
        self.ranks = RankWatcher(self.ctx, self.health, self.checkpoints)
        self.nodes = NodeWait(self.ctx, self.health, self.launcher)
        self.ranks.stragglers.batch_for = self.nodes.batch_for  # a straggler is dropped only if the batch is kept
        self.reboots = RebootWatch(self.ctx)
        self.starter = RankStarter(self.ctx, self.launcher)
        self.attempt: Attempt | None = None  # the attempt being launched or watched
        self._planned: LaunchPlan | None = None  # from pre-flight, for attempt 0
        self._synced = False  # the source was synced just before the next launch (the run's first)
        self.resize_requested: int | None = None  # the checkpoint step the resize waits to pass
        self.queue_position: int | None = None  # set by the job manager's queue while the job waits
        self.done = anyio.Event()

    # --- what the rest of coord sees --------------------------------------------------------

    @property
    def record(self) -> JobRecord:
        return self.ctx.record

    @property
    def state(self) -> JobState:
        return self.ctx.state

    @property
    def stop_requested(self) -> bool:
        return self.ctx.stop_requested

    def save(self) -> None:
        self.ctx.save()

    def event(self, kind: str, message: str, **data: Any) -> None:
        self.ctx.event(kind, message, **data)

    def set_state(self, state: str) -> None:
        self.ctx.set_state(state)

    def job_nodes(self) -> list[str]:
        return self.ctx.job_nodes()

    def request_stop(self) -> None:
        self.ctx.request_stop()

    # --- the loop -------------------------------------------------------------------------

    async def run(self, *, reattach: bool = False) -> None:
        try:
            async with anyio.create_task_group() as background:
                if self.replicator is not None:
                    background.start_soon(self.replicator.run)
                    self.replicator.poke()  # after a daemon restart: what is not replicated yet
                if self.durability is not None:
                    background.start_soon(self.durability.run)
                    self.durability.poke()  # after a daemon restart: what is not in the store yet
                await self._run(reattach)
                background.cancel_scope.cancel()
        except Exception as exc:  # the edge: a bug ends this job's loop, never the daemon
            self.log.exception("job supervisor failed")
            with anyio.CancelScope(shield=True):
                await self._fail_resumable(exc)
        finally:
            self.done.set()
            if self.record.unstopped:
                self.fx.spawn(self.reap_when_back, name=f"job:{self.run_id}:reap")
            if self.launcher.runs_on == "nodes" and self.state in FINISHED:
                nodes = sorted(set(self.job_nodes()) | set(self.record.order))
                self.fx.spawn(lambda: self.starter.retire_standbys(nodes), name=f"job:{self.run_id}:standbys")

    async def _fail_resumable(self, exc: BaseException) -> None:
        """A failure nobody foresaw: said in words, every rank stopped, the catalog kept, so that
        ``coord run --resume`` continues from the newest valid checkpoint."""
        reason = core.describe_exception(exc, "the job's supervisor stopped on an unexpected error")
        try:
            await self._stop_everything(self._last_attempt())
        except Exception as stop_exc:  # noqa: BLE001 (the job is failing already; say both)
            reason += f"; stopping its ranks failed too: {core.describe_exception(stop_exc, 'stop')}"
        self.record.error = f"{reason}; resume with: coord run --resume {self.spec.name}"
        if self.state in FINISHED:  # it had ended already: the error is kept, the outcome stands
            self.save()
        else:
            self.set_state(JobState.FAILED)
        self.event("failed", self.record.error)

    async def reap_when_back(self) -> None:
        """After the job: ranks on nodes that were away when it stopped are stopped once those nodes
        are back, so that no rank is left running anywhere."""
        deadline = self.fx.monotonic() + NODE_WAIT_S
        while self.record.unstopped and self.fx.monotonic() < deadline:
            await anyio.sleep(2.0)
            await self.reap()

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

    async def _run(self, reattach: bool) -> None:
        if not reattach:
            if not await self._prepare() or self._stopped_before_launch():
                return
            outcome = await self._launch(self.job_nodes())
        elif self.state in (JobState.RECOVERING, JobState.STARTING):
            # The daemon stopped between two attempts, or while one was being started: that one
            # is over (its leftovers are stopped before the next launch), the restart counted.
            self.attempt = Attempt.resumed(self.record, self.fx, self.run_id)
            self.event("reattached", f"finishing the recovery after attempt {self.record.attempt} after a "
                       "daemon restart")
            nodes = await self._wait_for_nodes(elastic=True)
            if nodes is None:
                return
            # Whatever the old daemon had not done yet: every rank stopped, the attempt's last
            # checkpoints catalogued, so the resume is from the newest one.
            await self._stop_everything(self.attempt)
            await self.checkpoints.poll(self.attempt, attempt_over=True)
            if self._stopped_before_launch():  # a stop saved before the old daemon went
                return
            outcome = await self._launch(nodes)
        else:
            # The sessions of a daemon that just started are still connecting: a node that is
            # not up yet is not a lost node, for a while. One still away after that is lost, and
            # the monitor handles it like any lost node (every rank stopped, the restart policy).
            if await self._wait_for_nodes(self.record.order or None, give_up_after=REATTACH_GRACE_S) is None \
                    and self.state in FINISHED:
                return
            self.attempt = Attempt.resumed(self.record, self.fx, self.run_id)
            # The hang watch starts afresh: the time the daemon was away says nothing of the ranks.
            self.record.last_progress = self.fx.now()
            self.event("reattached", f"supervising attempt {self.record.attempt} again after a daemon restart")
            outcome = None
        while True:
            if outcome is None:
                outcome = await self._monitor(self._last_attempt())
            decision = await self._end_attempt(outcome)
            if await self._finish(decision, outcome):
                return
            if decision.counts:
                self.record.restarts += 1
            if decision.rollback:
                roll_back(self.ctx, decision.reason)
            self.set_state(JobState.RECOVERING)  # the outcome, the restart and the state in one save
            if decision.counts:
                when = f"in {decision.delay_s:g} s" if decision.delay_s else "now"
                self.event("restart", f"restart {self.record.restarts} of {self.spec.max_restarts} {when}: "
                           f"{decision.reason}", delay_s=decision.delay_s)
            await self.ctx.pause(decision.delay_s)
            nodes = await self._wait_for_nodes(elastic=True)
            if nodes is None or self._stopped_before_launch():
                return
            outcome = await self._launch(nodes)

    async def _end_attempt(self, outcome: Outcome) -> Decision:
        """Every rank stopped, the last checkpoints catalogued, and the policy's word on what follows."""
        attempt = self._last_attempt()
        stop_started = self.fx.monotonic()
        stopped = await self._stop_everything(attempt)
        self.event("stopped_ranks", f"attempt {self.record.attempt}: every rank stopped"
                   if stopped else "some ranks could not be confirmed stopped",
                   seconds=round(self.fx.monotonic() - stop_started, 3))
        # Checkpoints written up to the end count; with the ranks stopped nothing is still
        # being written, so a damaged one is judged now.
        await self.checkpoints.poll(attempt, attempt_over=True)
        outcome = judge_success(self.ctx, attempt, outcome)
        history = [outcome_of(h) for h in self.record.history]
        decision = decide(outcome, history, max_restarts=self.spec.max_restarts,
                          restarts_used=self.record.restarts,
                          rollbacks=Rollbacks(self.spec.on_divergence, self.record.rollbacks, self.spec.max_rollbacks))
        self.record.history.append(outcome_entry(outcome, attempt=self.record.attempt,
                                                 counted=decision.action == "restart" and decision.counts))
        return decision

    def _last_attempt(self) -> Attempt | None:
        """The attempt launched last (read back from the record when this runner did not launch it:
        a run continued with --resume, or one a restarted daemon supervises again)."""
        if self.attempt is None and self.record.attempt >= 0:
            self.attempt = Attempt.resumed(self.record, self.fx, self.run_id)
        return self.attempt

    async def _finish(self, decision: Decision, outcome: Outcome) -> bool:
        if decision.action != "restart":
            self.record.failed_at = None  # no recovery follows (a --resume later is not one)
        if decision.action == "succeed":
            await self.checkpoints.await_final_copy()
            if self.durability is not None:
                await self.durability.final_upload()
            self.set_state("succeeded")
            self.event("succeeded", f"finished at step {self.record.step} with {self.record.restarts} restarts"
                       + (f"; {self.record.warning}" if self.record.warning else ""))
            return True
        if decision.action in ("stop", "fail") and self.durability is not None:
            # A run stopped to move it to other machines, or failed for good, is resumed from the store:
            # its newest checkpoint goes up first, for a shorter while than a success waits.
            await self.durability.final_upload(STOPPED_UPLOAD_TIMEOUT_S)
        if decision.action == "stop":
            self.set_state("stopped")
            self.event("stopped", "stopped on request")
            return True
        if decision.action == "fail":
            self.record.error = decision.reason
            self.set_state("failed")
            self.event("failed", decision.reason)
            return True
        return False

    # --- before the first attempt ---------------------------------------------------------
    async def _prepare(self) -> bool:
        if self.spec.source:
            self.set_state("syncing")
            started = self.fx.monotonic()
            report = await self.fx.sync(self.spec.source, self.spec.nodes,
                                        follow_outside_links=self.spec.follow_outside_links)
            if report["status"] != "ok":
                return self._fail_early(f"sync failed: {report['detail']}")
            self.event("synced", f"code synced from {self.spec.source}",
                       seconds=round(self.fx.monotonic() - started, 3))
            self._synced = True
        if await self._wait_for_nodes() is None:
            return False
        self.set_state("preflight")
        result = await self.fx.preflight(backend=self.spec.backend, source=self.spec.source, nodes=self.spec.nodes,
                                         launcher=self.spec.launcher, checkpoint_store=self.spec.checkpoint_store)
        self.record.model_bytes = result.get("model_bytes")  # the first step's limit follows it
        failed = [c for c in result["checks"] if c["status"] == "fail"]
        if failed and not self.spec.force:
            reasons = "; ".join(f"{c['name']}: {c['detail']}" for c in failed[:5])
            return self._fail_early(f"pre-flight failed (use --force to launch anyway): {reasons}")
        if failed:
            self.event("preflight_forced", f"launching despite {len(failed)} failed pre-flight checks")
        else:
            self.event("preflight_passed", f"pre-flight {result['status']}", seconds=result["seconds"])
        if result["backend"] is not None and result["hostfile"] is not None:
            # The first attempt uses the links pre-flight just read rather than asking every node again.
            self._planned = self.launcher.adopt(result["backend"], result["hostfile"], self.job_nodes())
        return True

    def _stopped_before_launch(self) -> bool:
        """A stop asked for during sync, pre-flight or a restart's backoff: no attempt is launched."""
        if not self.stop_requested:
            return False
        self.set_state("stopped")
        self.event("stopped", "stopped on request before the next attempt was launched")
        return True

    def _fail_early(self, reason: str) -> bool:
        self.record.error = reason
        self.set_state("failed")
        self.event("failed", reason)
        return False

    async def _wait_for_nodes(self, nodes: list[str] | None = None, *, elastic: bool = False,
                              give_up_after: float | None = None) -> list[str] | None:
        """The nodes the next attempt runs on, once they are up (``NodeWait``); None when the job
        ended meanwhile: stopped, or failed because they were not up within the job's --node-wait."""
        waited = await self.nodes.wait(nodes, elastic=elastic, give_up_after=give_up_after)
        if isinstance(waited, StopAsked):
            # What runs of the last attempt on the nodes that are here is stopped (the others'
            # ranks are listed for the reaper): a stopped run leaves nothing running.
            await self._stop_everything(self._last_attempt())
            self.set_state(JobState.STOPPED)
            self.event("stopped", "stopped on request while waiting for nodes")
            return None
        if isinstance(waited, NodesAway):
            await self._stop_everything(self._last_attempt())  # what runs of the last attempt on the nodes here
            self._fail_early(f"gave up waiting for nodes: not up within --node-wait {self.spec.node_wait:g} s: "
                             f"{waited.why}")
            return None
        return waited

    # --- one attempt ------------------------------------------------------------------------

    async def _launch(self, nodes: list[str]) -> Outcome | None:
        """Start the next attempt on ``nodes``: None once its ranks are launched, else the
        attempt's outcome (LAUNCH_FAILED, or SUCCEEDED when nothing is left to run)."""
        started = self.fx.monotonic()
        if self.record.attempt >= 0:
            # A node that was away when the last attempt was stopped may still run its rank.
            await self._stop_everything(self._last_attempt())
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
        if self._planned is not None and len(nodes) == len(self.fx.node_names()) and self.spec.nodes is None:
            planned, self._planned = self._planned, None
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
        if self._synced:
            self._synced = False  # pre-flight's sync just now is this attempt's
        else:
            await restore_trees(self.ctx, order)  # a relaunch: what a node lost is sent again, named
        batch = self.nodes.batch_for(order)
        self.record.batch = batch.describe() if batch else None
        if previous and set(previous) != set(order):
            self._say_resized(previous, order, batch)
        self.record.order = attempt.order = list(order)
        self.record.world_size = plan.world_size
        self.record.backend = core.launch_links(plan.choice)
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
        if self.launcher.runs_on == "nodes":
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

    async def _monitor(self, attempt: Attempt | None) -> Outcome:
        """Watch the attempt until it ends one way or another. Checkpoints are found and hashed
        in a task of their own: hashing a large one takes seconds, and a rank's exit must not
        wait for it."""
        assert attempt is not None, "an attempt is watched only once it was launched"
        async with anyio.create_task_group() as watchers:
            watchers.start_soon(self.checkpoints.watch, attempt)
            outcome = await self._watch(attempt)
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

    async def _stop_everything(self, attempt: Attempt | None) -> bool:
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

    def view(self) -> RunView:
        """The run as coord status, the dashboard and the job commands show it."""
        return run_view(self.ctx, queue_position=self.queue_position)
