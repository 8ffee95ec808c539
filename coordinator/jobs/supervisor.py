"""One run's life: launch an attempt, watch it through the agents, recover, finish.

The loop is small on purpose (after torch elastic's agent): launch, monitor until the
attempt ends, stop every rank everywhere, then ``policy.decide`` says succeed, restart or
fail. mlx.launch starts the ranks, but its exit code is not trusted: each node's agent
reports its rank (running, exit status, progress), and a node whose session drops counts
as lost. Whatever goes wrong while launching is an attempt outcome (``LAUNCH_FAILED``) like
any other, handled by the same policy, the wait for nodes and the elastic shrink.

The runner is made of parts with narrow interfaces, each given what it uses:
``RunContext`` (effects, spec, record, events, state), ``AttemptRunner`` (start, watch and stop one
attempt: coordinator/jobs/attempt_runner.py), ``NodeHealth`` (which node to trust),
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

from typing import Any

import anyio
import structlog

from coordinator.jobs import core
from coordinator.jobs.attempt import Attempt
from coordinator.jobs.attempt_runner import AttemptRunner
from coordinator.jobs.checkpoints import CHECKPOINT_POLL_S, CheckpointKeeper
from coordinator.jobs.durability import STOPPED_UPLOAD_TIMEOUT_S, DurabilityWatch
from coordinator.jobs.effects import JobEffects
from coordinator.jobs.node_health import NodeHealth
from coordinator.jobs.node_wait import NODE_WAIT_S, NodesAway, NodeWait, StopAsked
from coordinator.jobs.policy import (
    Decision,
    Outcome,
    Rollbacks,
    decide,
    outcome_entry,
    outcome_of,
)
from coordinator.jobs.rank_start import RankStarter
from coordinator.jobs.rank_watch import POLL_S, RankWatcher
from coordinator.jobs.reboot_watch import RebootWatch
from coordinator.jobs.record import JobRecord
from coordinator.jobs.replica import Replicator
from coordinator.jobs.rollback import roll_back
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.spec import REPLICA_NONE, JobSpec
from coordinator.jobs.states import ACTIVE, FINISHED, JobState
from coordinator.jobs.success import judge_success
from coordinator.jobs.view import RunView, run_view
from coordinator.launch.registry import launcher_named

__all__ = ["ACTIVE", "CHECKPOINT_POLL_S", "FINISHED", "NODE_WAIT_S", "POLL_S", "JobRunner", "JobState"]

log = structlog.get_logger("job")

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
        self.attempts = AttemptRunner(self.ctx, self.launcher, health=self.health, checkpoints=self.checkpoints,
                                      ranks=self.ranks, nodes=self.nodes, reboots=self.reboots, starter=self.starter)
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
            if self.launcher.capabilities.runs_on == "nodes" and self.state in FINISHED:
                nodes = sorted(set(self.job_nodes()) | set(self.record.order))
                self.fx.spawn(lambda: self.starter.retire_standbys(nodes), name=f"job:{self.run_id}:standbys")

    async def _fail_resumable(self, exc: BaseException) -> None:
        """A failure nobody foresaw: said in words, every rank stopped, the catalog kept, so that
        ``coord run --resume`` continues from the newest valid checkpoint."""
        reason = core.describe_exception(exc, "the job's supervisor stopped on an unexpected error")
        try:
            await self.attempts.stop_everything(self.attempts.last())
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
            await self.attempts.reap()

    async def _run(self, reattach: bool) -> None:
        if not reattach:
            if not await self._prepare() or self._stopped_before_launch():
                return
            outcome = await self.attempts.launch(self.job_nodes())
        elif self.state in (JobState.RECOVERING, JobState.STARTING):
            # The daemon stopped between two attempts, or while one was being started: that one
            # is over (its leftovers are stopped before the next launch), the restart counted.
            self.attempts.attempt = Attempt.resumed(self.record, self.fx, self.run_id)
            self.event("reattached", f"finishing the recovery after attempt {self.record.attempt} after a "
                       "daemon restart")
            nodes = await self._wait_for_nodes(elastic=True)
            if nodes is None:
                return
            # Whatever the old daemon had not done yet: every rank stopped, the attempt's last
            # checkpoints catalogued, so the resume is from the newest one.
            await self.attempts.stop_everything(self.attempts.attempt)
            await self.checkpoints.poll(self.attempts.attempt, attempt_over=True)
            if self._stopped_before_launch():  # a stop saved before the old daemon went
                return
            outcome = await self.attempts.launch(nodes)
        else:
            # The sessions of a daemon that just started are still connecting: a node that is
            # not up yet is not a lost node, for a while. One still away after that is lost, and
            # the monitor handles it like any lost node (every rank stopped, the restart policy).
            if await self._wait_for_nodes(self.record.order or None, give_up_after=REATTACH_GRACE_S) is None \
                    and self.state in FINISHED:
                return
            self.attempts.attempt = Attempt.resumed(self.record, self.fx, self.run_id)
            # The hang watch starts afresh: the time the daemon was away says nothing of the ranks.
            self.record.last_progress = self.fx.now()
            self.event("reattached", f"supervising attempt {self.record.attempt} again after a daemon restart")
            outcome = None
        while True:
            if outcome is None:
                outcome = await self.attempts.monitor(self.attempts.last())
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
            outcome = await self.attempts.launch(nodes)

    async def _end_attempt(self, outcome: Outcome) -> Decision:
        """Every rank stopped, the last checkpoints catalogued, and the policy's word on what follows."""
        attempt = self.attempts.last()
        early, self.attempts.stopped = self.attempts.stopped, None
        if early is not None and attempt is not None and early.attempt == attempt.number:
            stopped, seconds = early.everything, early.seconds  # as its watch ended
        else:
            stop_started = self.fx.monotonic()
            stopped = await self.attempts.stop_everything(attempt)
            seconds = self.fx.monotonic() - stop_started
        self.event("stopped_ranks", f"attempt {self.record.attempt}: every rank stopped"
                   if stopped else "some ranks could not be confirmed stopped", seconds=round(seconds, 3))
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
            self.attempts.synced = True
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
        # The first attempt uses the links pre-flight just read rather than asking every node again.
        self.attempts.planned = self.launcher.adopt(result, self.job_nodes())
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
            await self.attempts.stop_everything(self.attempts.last())
            self.set_state(JobState.STOPPED)
            self.event("stopped", "stopped on request while waiting for nodes")
            return None
        if isinstance(waited, NodesAway):
            await self.attempts.stop_everything(self.attempts.last())  # what runs of the last attempt on the nodes here
            self._fail_early(f"gave up waiting for nodes: not up within --node-wait {self.spec.node_wait:g} s: "
                             f"{waited.why}")
            return None
        return waited

    def request_resize(self) -> str:
        """coord resize: relaunch on every node that is up, right after the next checkpoint."""
        return self.attempts.request_resize()

    def view(self) -> RunView:
        """The run as coord status, the dashboard and the job commands show it."""
        return run_view(self.ctx, queue_position=self.queue_position)
