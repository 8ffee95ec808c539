"""One job's life: launch an attempt, watch it through the agents, recover, finish.

The loop is small on purpose (after torch elastic's agent): launch, monitor until
the attempt ends, stop every rank everywhere, then ``policy.decide`` says
succeed, restart or fail. mlx.launch starts the ranks, but its exit code is not
trusted: each node's agent reports its rank (running, exit status, progress),
and a node whose session drops counts as lost.
"""

from __future__ import annotations

import os
import posixpath
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from agent.launch import rank_command
from coordinator.services.launch_plan import node_topologies, plan_backend, write_launch_files
from coordinator.jobs import catalog
from coordinator.jobs.elastic import Undividable, choose_nodes, rebatch
from coordinator.jobs.fingerprints import Divergence, ReplicaCheck, comparison_summary
from coordinator.jobs.launcher import launcher_argv
from coordinator.jobs.policy import (DIVERGED, HUNG, NODE_LOST, RANK_FAILED, RESIZED, STOPPED, SUCCEEDED, Decision,
                                     Outcome, RankFailure, decide, hang_timeout, root_cause)
from coordinator.jobs.replica import HEAD, Replicator
from coordinator.jobs.spec import (REPLICA_NONE, JobSpec, JobSpecError, attempt_command, batch_split,
                                  is_mlx_lm)
from coordinator.jobs.transfer import CheckpointDamaged, HeadSource, NodeSink, NodeSource, copy_verified
from coordinator.node_session import UP
from coordinator.plan import diagnosis
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.daemon import Daemon

log = structlog.get_logger("job")

POLL_S = 0.5
CHECKPOINT_POLL_S = 2.0
NODE_WAIT_S = 600.0
FIRST_STEP_TIMEOUT_S = 600.0
LOG_DIAGNOSIS_BYTES = 256 << 10  # the end of a rank's log, where the error that stopped it is
ACTIVE = ("pending", "preflight", "syncing", "starting", "running", "recovering")


class JobRunner:
    def __init__(self, daemon: "Daemon", spec: JobSpec, record: dict[str, Any] | None = None):
        self.daemon = daemon
        self.spec = spec
        self.record = record or {"attempt": -1, "restarts": 0, "step": 0, "total_steps": spec.total_steps,
                                 "loss": None, "tokens_per_second": None, "history": [], "order": [],
                                 "start_step": 0, "launcher_pid": None, "error": None, "started": time.time(),
                                 "step_seconds": None, "last_progress": None, "first_step_at": None}
        self.state = "pending"
        self.stop_requested = False
        self.log = log.bind(job=spec.name)
        self._progress_offsets: dict[int, int] = {}
        self._log_offsets: dict[int, int] = {}
        self._known_checkpoints: set[str] = set()
        self._diverged_after: int | None = None  # checkpoints of this attempt after this step are not valid
        self._checkpoint_poll = anyio.Lock()  # the background watcher and the end of an attempt take turns
        self._planned: tuple[dict[str, Any], dict[str, Any]] | None = None  # from pre-flight, for attempt 0
        self._down_since: dict[str, float] = {}
        self._replica_check = ReplicaCheck(0)
        self._divergence: Divergence | None = None
        self.resize_requested: int | None = None  # the checkpoint step the resize waits to pass
        self.replicator = Replicator(self) if spec.replica != REPLICA_NONE else None
        self.done = anyio.Event()
        self._stop_asked = anyio.Event()  # wakes a restart's backoff or a wait for nodes at once

    def request_stop(self) -> None:
        self.stop_requested = True
        self._stop_asked.set()

    async def _pause(self, seconds: float) -> None:
        """Sleep between attempts or polls, cut short by a stop."""
        with anyio.move_on_after(seconds):
            await self._stop_asked.wait()

    # --- persistence and events ---------------------------------------------------------

    def save(self) -> None:
        self.daemon.state.save_job(self.spec.name, self.spec.as_dict(), self.state, self.record)

    def event(self, kind: str, message: str, **data: Any) -> None:
        self.log.info(kind, message=message, **data)
        self.daemon.cluster.record_event(f"job.{kind}", f"{self.spec.name}: {message}", data=data or None)

    def set_state(self, state: str) -> None:
        self.state = state
        self.save()

    def attempt_dir(self, attempt: int | None = None) -> Path:
        attempt = self.record["attempt"] if attempt is None else attempt
        return self.daemon.config.state_dir / "jobs" / self.spec.name / f"attempt-{attempt}"

    # --- the loop -------------------------------------------------------------------------

    async def run(self, *, reattach: bool = False) -> None:
        try:
            async with anyio.create_task_group() as background:
                if self.replicator is not None:
                    background.start_soon(self.replicator.run)
                    self.replicator.poke()  # after a daemon restart: what is not replicated yet
                await self._run(reattach)
                background.cancel_scope.cancel()
        except Exception as exc:  # the edge: a bug fails this job, never the daemon
            self.log.exception("job supervisor failed")
            self.record["error"] = f"internal error: {exc.__class__.__name__}: {exc}"
            await self._stop_everything()
            self.set_state("failed")
            self.event("failed", self.record["error"])
        finally:
            self.done.set()
            if self.record.get("unstopped"):
                self.daemon.start_task(self._reap_when_back, name=f"job:{self.spec.name}:reap")

    async def _reap_when_back(self) -> None:
        """After the job: ranks on nodes that were away when it stopped are stopped once those nodes
        are back, so that no rank is left running anywhere."""
        deadline = time.monotonic() + NODE_WAIT_S
        while self.record.get("unstopped") and time.monotonic() < deadline:
            await anyio.sleep(2.0)
            await self._reap()

    async def _reap(self) -> None:
        """Stop the ranks of earlier attempts whose nodes were away when those attempts were stopped."""
        left = []
        for name, attempt, rank in self.record.get("unstopped", []):
            session = self.daemon.cluster.sessions.get(name)
            try:
                if session is None or session.state != UP:
                    raise RemoteError("unavailable", "node away")
                answer = await session.call("stop_rank", {"workdir": session.node.workdir, "job": self.spec.name,
                                                          "attempt": attempt, "rank": rank}, timeout=30)
                if not answer["stopped"]:
                    raise RemoteError("unavailable", "not stopped")
                self.event("rank_reaped", f"rank {rank} of attempt {attempt} on {name} stopped now that {name} "
                           "is back")
            except RemoteError:
                left.append([name, attempt, rank])
        self.record["unstopped"] = left
        self.save()

    async def _run(self, reattach: bool) -> None:
        if not reattach:
            if not await self._prepare() or self._stopped_before_launch():
                return
            await self._launch([n.name for n in self.daemon.config.nodes])
        elif self.state in ("recovering", "starting"):
            # The daemon stopped between two attempts, or while one was being started: that one
            # is over (its leftovers are stopped before the next launch), the restart counted.
            self._resume_bookkeeping()
            self.event("reattached", f"finishing the recovery after attempt {self.record['attempt']} after a "
                       "daemon restart")
            nodes = await self._wait_for_nodes(elastic=True)
            if nodes is None:
                return
            # Whatever the old daemon had not done yet: every rank stopped, the attempt's last
            # checkpoints catalogued, so the resume is from the newest one.
            await self._stop_everything()
            await self._poll_checkpoints(attempt_over=True)
            await self._launch(nodes)
        else:
            # The sessions of a daemon that just started are still connecting: a node that is
            # not up yet is not a lost node.
            if not await self._wait_for_nodes(self.record["order"] or None):
                return
            self._resume_bookkeeping()
            self.event("reattached", f"supervising attempt {self.record['attempt']} again after a daemon restart")
        while True:
            outcome = await self._monitor()
            stop_started = time.monotonic()
            stopped = await self._stop_everything()
            self.event("stopped_ranks", f"attempt {self.record['attempt']}: every rank stopped"
                       if stopped else "some ranks could not be confirmed stopped",
                       seconds=round(time.monotonic() - stop_started, 3))
            # Checkpoints written up to the end count; with the ranks stopped nothing is still
            # being written, so a damaged one is judged now.
            await self._poll_checkpoints(attempt_over=True)
            self.record["history"].append(outcome.__dict__)
            history = [Outcome(**h) for h in self.record["history"][:-1]]
            decision = decide(outcome, history, max_restarts=self.spec.max_restarts,
                              restarts_used=self.record["restarts"])
            if await self._finish(decision, outcome):
                return
            self.set_state("recovering")
            if decision.counts:
                self.record["restarts"] += 1
                self.event("restart", f"restart {self.record['restarts']} of {self.spec.max_restarts} in "
                           f"{decision.delay_s:g} s: {decision.reason}", delay_s=decision.delay_s)
            await self._pause(decision.delay_s)
            nodes = await self._wait_for_nodes(elastic=True)
            if nodes is None or self._stopped_before_launch():
                return
            await self._launch(nodes)

    async def _finish(self, decision: Decision, outcome: Outcome) -> bool:
        if decision.action == "succeed":
            self.set_state("succeeded")
            self.event("succeeded", f"finished at step {self.record['step']} with {self.record['restarts']} restarts")
            return True
        if decision.action == "stop":
            self.set_state("stopped")
            self.event("stopped", "stopped on request")
            return True
        if decision.action == "fail":
            self.record["error"] = decision.reason
            self.set_state("failed")
            self.event("failed", decision.reason)
            return True
        return False

    # --- before the first attempt ---------------------------------------------------------

    async def _prepare(self) -> bool:
        from coordinator.services.preflight import run_preflight
        from coordinator.services.sync import serve_sync

        async def quiet(_event) -> None:
            return None

        if self.spec.source:
            self.set_state("syncing")
            started = time.monotonic()
            report = await serve_sync(self.daemon, quiet, source=self.spec.source)
            if report["status"] != "ok":
                return self._fail_early(f"sync failed: {report['detail']}")
            self.event("synced", f"code synced from {self.spec.source}", seconds=round(time.monotonic() - started, 3))
        if await self._wait_for_nodes() is None:
            return False
        self.set_state("preflight")
        result = await run_preflight(self.daemon, quiet, backend=self.spec.backend, source=self.spec.source)
        failed = [c for c in result["checks"] if c["status"] == "fail"]
        if failed and not self.spec.force:
            reasons = "; ".join(f"{c['name']}: {c['detail']}" for c in failed[:5])
            return self._fail_early(f"pre-flight failed (use --force to launch anyway): {reasons}")
        if failed:
            self.event("preflight_forced", f"launching despite {len(failed)} failed pre-flight checks")
        else:
            self.event("preflight_passed", f"pre-flight {result['status']}", seconds=result["seconds"])
        if result["hostfile"] is not None:
            # The first attempt uses the links pre-flight just read rather than asking every node again.
            self._planned = (result["backend"], result["hostfile"])
        return True

    def _stopped_before_launch(self) -> bool:
        """A stop asked for during sync, pre-flight or a restart's backoff: no attempt is launched."""
        if not self.stop_requested:
            return False
        self.set_state("stopped")
        self.event("stopped", "stopped on request before the next attempt was launched")
        return True

    def _resume_bookkeeping(self) -> None:
        """After a daemon restart: the head already holds the start of each rank's log, the
        record says how far the progress was read, and the catalog holds the attempt's
        checkpoints; none of them is fetched or judged again."""
        self._progress_offsets = self.record["progress_offsets"] = {
            int(rank): offset for rank, offset in (self.record.get("progress_offsets") or {}).items()}
        self._replica_check = ReplicaCheck(len(self.record.get("order", [])))
        self._log_offsets = {}
        for rank in range(len(self.record.get("order", []))):
            try:
                self._log_offsets[rank] = (self.attempt_dir() / f"rank-{rank}.log").stat().st_size
            except OSError:
                pass
        self._known_checkpoints = {posixpath.basename(c["path"]) for c in self.daemon.state.checkpoints(self.spec.name)
                                   if c["attempt"] == self.record["attempt"] and c.get("role") != catalog.REPLICA}

    def _fail_early(self, reason: str) -> bool:
        self.record["error"] = reason
        self.set_state("failed")
        self.event("failed", reason)
        return False

    async def _wait_for_nodes(self, nodes: list[str] | None = None, *, elastic: bool = False) -> list[str] | None:
        """The nodes the next attempt runs on, once they are up; None when the job ended meanwhile.

        Without ``elastic`` every node (or every one of ``nodes``) must be up. With it, and
        --min-nodes, a node down for longer than the node timeout is left out when the others
        can take its share of the global batch; a node that is back takes part again.
        """
        configured = nodes or [n.name for n in self.daemon.config.nodes]
        started = time.monotonic()
        delay = 0.5
        announced = None
        while True:
            now = time.monotonic()
            sessions = self.daemon.cluster.sessions
            up = [n for n in configured if sessions[n].state == UP]
            for name in configured:
                if name in up:
                    self._down_since.pop(name, None)
                else:
                    self._down_since.setdefault(name, now)
            if elastic and self.spec.min_nodes is not None:
                chosen, why = choose_nodes(configured, up, {n: now - t for n, t in self._down_since.items()},
                                           min_nodes=self.spec.min_nodes, node_timeout=self.spec.node_timeout)
                if chosen is not None:
                    try:
                        self._batch_for(chosen)
                    except Undividable as exc:
                        chosen, why = None, f"{exc}: waiting for {', '.join(n for n in configured if n not in up)}"
            else:
                down = [n for n in configured if n not in up]
                chosen, why = (configured, "") if not down else (None, f"waiting for {', '.join(down)} to come back")
            if chosen is not None:
                if announced:
                    self.event("nodes_back", f"going on with {', '.join(chosen)} after "
                               f"{time.monotonic() - started:.1f} s")
                return chosen
            if self.stop_requested:
                self.set_state("stopped")
                self.event("stopped", "stopped on request while waiting for nodes")
                return None
            if time.monotonic() - started > NODE_WAIT_S:
                self._fail_early(f"nodes did not come back within {NODE_WAIT_S:g} s: {why}")
                return None
            if why != announced:
                self.event("waiting_for_nodes", why)
                announced = why
            await self._pause(delay)
            delay = min(delay * 2, 2.0 if elastic else 5.0)

    def _batch_for(self, nodes: list[str]):
        """The batch split for an attempt on ``nodes`` (None: the job's own options, unchanged)."""
        configured = len(self.daemon.config.nodes)
        if len(nodes) == configured or not is_mlx_lm(self.spec.command):
            return None
        try:
            original = batch_split(self.spec, configured)
        except JobSpecError as exc:  # the job's own batch is unknown: keeping it is not possible
            raise Undividable(f"the job's global batch cannot be read ({exc})") from None
        return rebatch(original, len(nodes))

    # --- one attempt ------------------------------------------------------------------------

    async def _launch(self, nodes: list[str]) -> None:
        started = time.monotonic()
        if self.record["attempt"] >= 0:
            # A node that was away when the last attempt was stopped may still run its rank.
            await self._stop_everything()
        self.record["attempt"] += 1
        attempt = self.record["attempt"]
        self.set_state("starting")
        self._progress_offsets = self.record["progress_offsets"] = {}  # saved with the record
        self.record["rank_memory"] = {}
        self._log_offsets.clear()
        self._replica_check = ReplicaCheck(len(nodes))
        self._divergence = None
        self._known_checkpoints.clear()
        self._diverged_after = None
        previous = list(self.record["order"])
        if self._planned is not None and len(nodes) == len(self.daemon.config.nodes):
            (choice, document), self._planned = self._planned, None
        else:
            topologies = await node_topologies(self.daemon)
            choice, document, error = plan_backend(self.daemon, topologies, forced=self.spec.backend, nodes=nodes)
            if document is None:
                raise RemoteError("refused", f"no hostfile: {error}")
        order = choice.get("order") or nodes
        batch = self._batch_for(order)
        self.record["batch"] = batch.describe() if batch else None
        if previous and set(previous) != set(order):
            left, back = sorted(set(previous) - set(order)), sorted(set(order) - set(previous))
            self.event("resized", f"{len(previous)} → {len(order)} ranks"
                       + (f"; left out {', '.join(left)}" if left else "") + (f"; back {', '.join(back)}" if back else "")
                       + f"; {batch.describe() if batch else 'the job' + chr(39) + 's own batch'}; hostfile rewritten",
                       nodes=order, left_out=left, back=back)
        choose_started = time.monotonic()
        resume, resume_files = await self._choose_resume(order)
        start_step = resume["step"] if resume else 0
        self.record["start_step"] = start_step
        self.record["first_step_at"] = None
        self.record["last_progress"] = time.time()
        if resume:
            self.event("resume_from", f"resuming from the checkpoint of step {resume['step']} "
                       f"({resume['node']}:{resume['path']})", step=resume["step"],
                       seconds=round(time.monotonic() - choose_started, 3))
        if self.spec.total_steps is not None and start_step >= self.spec.total_steps:
            # The last checkpoint is the final step: there is nothing left to run.
            self.record["order"] = order
            self.record["step"] = start_step
            self._nothing_left = True
            self.set_state("running")
            return
        self.record["order"] = order
        sessions = self.daemon.cluster.sessions
        directory = self.attempt_dir()
        files = write_launch_files(directory, self.daemon.config, document)

        if attempt == 0:
            versions = [v for v in ((sessions[n].view.facts or {}).get("mlx_lm_version") for n in order) if v]
            oldest = min(versions, key=_version_key) if versions else None
            self._diagnose(diagnosis.diagnose_job(attempt_command(self.spec, adapter_path="", resume_file=None,
                                                                  start_step=0, batch=batch),
                                                  dict(env.split("=", 1) for env in document.get("envs", [])
                                                       if "=" in env), oldest), "the job's command")
            facts = {n: sessions[n].view.facts for n in order if sessions[n].view.facts}
            self._diagnose(diagnosis.diagnose_cluster(facts), "the job's nodes")

        async def prepare(rank: int, name: str) -> None:
            node = sessions[name].node
            adapter_path = posixpath.join(node.workdir, "checkpoints", self.spec.name, f"attempt-{attempt}")
            argv = attempt_command(self.spec, adapter_path=adapter_path, resume_file=resume_files.get(name),
                                   start_step=start_step, batch=batch)
            env = {"COORD_JOB": self.spec.name, "COORD_ATTEMPT": str(attempt), "COORD_RANK": str(rank),
                   "COORD_PROGRESS_FILE": "{rank_dir}/progress.jsonl", "COORD_STEP_OFFSET": str(start_step),
                   "COORD_CHECKPOINT_DIR": adapter_path, "COORD_SAVE_EVERY": str(self.spec.save_every)}
            if self.spec.total_steps is not None:
                env["COORD_TOTAL_STEPS"] = str(self.spec.total_steps)
            if resume_files.get(name):
                env["COORD_RESUME_FILE"] = resume_files[name]
                env["COORD_RESUME_STEP"] = str(start_step)
            await sessions[name].call("prepare_rank", {"job": self.spec.name, "rank": rank, "attempt": attempt,
                                                       "workdir": node.workdir, "python": node.python,
                                                       "argv": argv, "env": env}, timeout=60)

        async with anyio.create_task_group() as tasks:
            for rank, name in enumerate(order):
                tasks.start_soon(prepare, rank, name)
        launcher = [*launcher_argv(), "--hostfile", files["hostfile"], "--", *rank_command(self.spec.name)]
        env = dict(os.environ, PATH=files["path_prefix"] + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"))
        with open(directory / "launcher.log", "ab") as output:
            proc = subprocess.Popen(launcher, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True, cwd=str(directory))
        self._launcher = proc
        self.record["launcher_pid"] = proc.pid
        self.set_state("running")
        self.event("launched", f"attempt {attempt} launched on {', '.join(order)} from step {start_step} "
                   f"({choice['backend']})", attempt=attempt, seconds=round(time.monotonic() - started, 3))

    async def _choose_resume(self, order: list[str]) -> tuple[dict[str, Any] | None, dict[str, str]]:
        """The newest checkpoint with a copy that still verifies, placed on every node of ``order``.

        Copies are tried primary first, then the replica (the primary's machine may be the one
        that was lost); a copy whose bytes no longer match its SHA256 is marked invalid and
        never used again, and the next copy or the checkpoint before is tried."""
        sessions = self.daemon.cluster.sessions
        for copies in catalog.resume_candidates(self.daemon.state.checkpoints(self.spec.name)):
            for copy in copies:
                if copy["node"] != HEAD and (copy["node"] not in sessions or sessions[copy["node"]].state != UP):
                    continue
                try:
                    return copy, await self._place_resume_file(copy, order)
                except (RemoteError, CheckpointDamaged) as exc:
                    reason = exc.message if isinstance(exc, RemoteError) else str(exc)
                    self.daemon.state.add_checkpoint(self.spec.name, {**copy, "valid": False, "detail": reason})
                    kind = "replica_rejected" if copy.get("role") == catalog.REPLICA else "checkpoint_rejected"
                    self.event(kind, f"{copy.get('role', 'primary')} copy of the checkpoint of step {copy['step']} "
                               f"({copy['node']}) cannot be resumed from: {reason}", step=copy["step"])
        return None, {}

    async def _place_resume_file(self, checkpoint: dict[str, Any], order: list[str]) -> dict[str, str]:
        """Every rank's node needs the checkpoint to resume from: stream it from where it is to all
        of them at once, its SHA256 checked against the catalog's."""
        sessions = self.daemon.cluster.sessions
        started = time.monotonic()
        name = posixpath.basename(checkpoint["path"])
        placed = {checkpoint["node"]: checkpoint["path"]} if checkpoint["node"] in order else {}
        if checkpoint["node"] == HEAD:
            source = HeadSource(Path(checkpoint["path"]))
        else:
            source = NodeSource(sessions[checkpoint["node"]], checkpoint["path"])
        sinks = [NodeSink(sessions[node], f"checkpoints/{self.spec.name}/resume/{name}")
                 for node in order if node not in placed]
        if not checkpoint.get("sha256"):
            raise CheckpointDamaged("no SHA256 was recorded for it")
        paths = await copy_verified(source, sinks, size=checkpoint["size"], sha256=checkpoint["sha256"])
        for node, path in zip([n for n in order if n not in placed], paths):
            placed[node] = path
        self.event("checkpoint_placed", f"checkpoint of step {checkpoint['step']} from {source.where} placed on "
                   f"{len(order)} nodes", seconds=round(time.monotonic() - started, 3))
        return placed

    async def _monitor(self) -> Outcome:
        """Watch the attempt until it ends one way or another. Checkpoints are found and hashed
        in a task of their own: hashing a large one takes seconds, and a rank's exit must not
        wait for it."""
        if getattr(self, "_nothing_left", False):
            self._nothing_left = False
            return self._outcome(SUCCEEDED, f"the checkpoint of step {self.record['step']} is the last step", "")
        async with anyio.create_task_group() as watchers:
            watchers.start_soon(self._watch_checkpoints)
            outcome = await self._watch_ranks()
            watchers.cancel_scope.cancel()
        return outcome

    async def _watch_checkpoints(self) -> None:
        while True:
            await anyio.sleep(CHECKPOINT_POLL_S)
            started = time.monotonic()
            with anyio.CancelScope(shield=True):  # a poll half done would leave the catalog behind the disk
                await self._poll_checkpoints()
            if time.monotonic() - started > 5 * CHECKPOINT_POLL_S:
                self.log.warning("slow checkpoint poll", seconds=round(time.monotonic() - started, 1))

    async def _watch_ranks(self) -> Outcome:
        """Poll every rank through its node's agent until the attempt ends one way or another."""
        attempt = self.record["attempt"]
        order = self.record["order"]
        sessions = self.daemon.cluster.sessions
        exited: dict[int, int] = {}
        detected_after: list[float] = []
        while True:
            if self.stop_requested:
                return self._outcome(STOPPED, "stop requested", "")
            failures: list[tuple[int, str, int]] = []
            for rank, name in enumerate(order):
                session = sessions[name]
                if session.state != UP:
                    return self._outcome(NODE_LOST, f"node {name} (rank {rank}) lost: {session.view.reason}",
                                             f"node:{name}")
                try:
                    status = await session.call("rank_status", {
                        "workdir": session.node.workdir, "job": self.spec.name, "attempt": attempt, "rank": rank,
                        "progress_offset": self._progress_offsets.get(rank, 0)}, timeout=10)
                except RemoteError as exc:
                    return self._outcome(NODE_LOST, f"node {name} (rank {rank}) did not answer: {exc.message}",
                                             f"node:{name}")
                self._progress_offsets[rank] = status["progress_offset"]
                if status.get("rss_bytes"):
                    self.record.setdefault("rank_memory", {})[str(rank)] = status["rss_bytes"]
                for record in status["progress"]:
                    self._on_progress(record)
                await self._pull_log(rank, name, status["log_size"])
                if status["state"] == "exited":
                    exited[rank] = status["exit"]
                    if status["exit"] != 0:
                        failures.append((rank, name, status["exit"]))
                        if status.get("exited_at"):  # both times from the node's clock
                            detected_after.append(max(0.0, status["time"] - status["exited_at"]))
                elif status["state"] == "vanished":
                    return self._outcome(RANK_FAILED, f"rank {rank} on {name} disappeared without an exit "
                                             "status", "vanished")
            if failures:
                cause = root_cause([RankFailure(rank, name, code, await self._log_tail(rank))
                                    for rank, name, code in failures])
                code, tail = cause.status, cause.last_line
                return self._outcome(RANK_FAILED, f"rank {cause.rank} on {cause.node} exited with status {code}"
                                     + (f" ({_signal_name(code)})" if _signal_name(code) else "")
                                     + (f": {tail}" if tail else ""), f"exit:{code}:{tail}",
                                     detected_after=max(detected_after) if detected_after else None)
            if len(exited) == len(order):
                done = self.spec.total_steps is None or self.record["step"] >= self.spec.total_steps
                if done:
                    return self._outcome(SUCCEEDED, "every rank finished", "")
                return self._outcome(RANK_FAILED, f"every rank exited 0 at step {self.record['step']} of "
                                         f"{self.spec.total_steps}", "early-exit")
            hung = self._hung()
            if hung:
                await self._capture_stacks()
                return self._outcome(HUNG, hung, "hang")
            if self.record.get("unstopped"):
                await self._reap()
            if self._divergence is not None:
                return await self._diverged(self._divergence)
            resize = self._resize_due()
            if resize:
                return self._outcome(RESIZED, resize, "resize")
            await self._pause(POLL_S)

    def _outcome(self, kind: str, detail: str, signature: str, detected_after: float | None = None) -> Outcome:
        """The attempt is over; ``detected_after`` is how long its end went unseen (a rank's exit
        to the poll that saw it), when known."""
        extra = {"seconds": round(detected_after, 3)} if detected_after is not None else {}
        self.event("attempt_ended", f"attempt {self.record['attempt']}: {kind}: {detail}"
                   + (f" (seen {detected_after:.2f} s after)" if detected_after is not None else ""),
                   outcome=kind, **extra)
        if kind in (RANK_FAILED, HUNG):
            self._diagnose_logs()
        return Outcome(kind, detail, self.record["first_step_at"] is not None, signature[:300])

    def _diagnose(self, found: list[dict[str, Any]], where: str) -> None:
        """Known failure modes, each named once per job with its fix (coord status shows them)."""
        known = self.record.setdefault("diagnoses", [])
        for item in found:
            if any(d["id"] == item["id"] for d in known):
                continue
            known.append({"id": item["id"], "title": item["title"], "detail": f"{where}: {item['detail']}",
                          "fix": item["fix"], "line": item.get("line")})
            self.event("diagnosis", f"{item['title']} ({where}); fix: {item['fix']}", id=item["id"])

    def _diagnose_logs(self) -> None:
        for rank in range(len(self.record["order"])):
            path = self.attempt_dir() / f"rank-{rank}.log"
            try:
                with open(path, "rb") as handle:
                    handle.seek(max(0, path.stat().st_size - LOG_DIAGNOSIS_BYTES))
                    text = handle.read().decode("utf-8", "replace")
            except OSError:
                continue
            self._diagnose(diagnosis.diagnose_log(text), f"rank {rank}'s log, attempt {self.record['attempt']}")

    def request_resize(self) -> str:
        """coord resize: relaunch on every node that is up, right after the next checkpoint (so that
        nothing is redone)."""
        last = self.record.get("last_checkpoint")
        self.resize_requested = last["step"] if last else -1
        return self._resize_due() or "the job will be relaunched on every node that is up after its next checkpoint"

    def _resize_due(self) -> str | None:
        if self.resize_requested is None:
            return None
        sessions = self.daemon.cluster.sessions
        up = [n.name for n in self.daemon.config.nodes if sessions[n.name].state == UP]
        if set(up) == set(self.record["order"]):
            self.resize_requested = None
            self.event("resize_skipped", f"already running on every node that is up ({', '.join(up)})")
            return None
        last = self.record.get("last_checkpoint")
        if last is None or last["step"] <= self.resize_requested:
            return None
        self.resize_requested = None
        return f"resize requested: relaunching on {', '.join(up)} from the checkpoint of step {last['step']}"

    def _hung(self) -> str | None:
        last = self.record.get("last_progress") or time.time()
        quiet = time.time() - last
        if self.record["first_step_at"] is None:
            limit = max(FIRST_STEP_TIMEOUT_S, self.spec.hang_timeout or 0)
            return f"no first step within {limit:g} s of the launch" if quiet > limit else None
        limit = hang_timeout(self.spec.hang_timeout, self.record.get("step_seconds"))
        return f"no progress for {quiet:.0f} s (hang timeout {limit:g} s)" if quiet > limit else None

    async def _diverged(self, found: Divergence) -> Outcome:
        """Replicas that no longer agree: stop, and resume from a checkpoint taken before it happened."""
        order = self.record["order"]
        named = ", ".join(f"{r} on {order[r]}" for r in found.ranks if r < len(order))
        self.event("replica_diverged", f"{found.describe()} (rank {named})", step=found.step, ranks=found.ranks)
        outcome = self._outcome(DIVERGED, found.describe(), f"diverged:{found.step}")
        good_until = found.last_agreed if found.last_agreed is not None else self.record["start_step"]
        self._diverged_after = good_until  # and checkpoints still to be found, when the ranks are stopped
        async with self._checkpoint_poll:
            for copy in self.daemon.state.checkpoints(self.spec.name):
                if copy["valid"] and copy["attempt"] == self.record["attempt"] and copy["step"] > good_until:
                    self.daemon.state.add_checkpoint(self.spec.name, {**copy, "valid": False,
                                                                      "detail": self._diverged_detail()})
        return outcome

    def _diverged_detail(self) -> str:
        return f"taken after the replicas diverged (last agreed at step {self._diverged_after})"

    def _on_progress(self, record: dict[str, Any]) -> None:
        if record.get("kind") == "fingerprint":
            check = self._replica_check
            compared = check.compared
            found = check.add(int(record["step"]), int(record["rank"]), str(record["sha256"]))
            first = found if self._divergence is None else None  # the one the attempt is stopped for
            self._divergence = self._divergence or found
            if check.compared != compared:  # every rank reported this step: kept for the plan
                self.record["replica_check"] = comparison_summary(self.record.get("replica_check"), check,
                                                                  self.record["attempt"], self.record["order"], first)
            return
        if record.get("kind") == "checkpoint":
            self._on_checkpoint_written(record)
            return
        if record.get("kind") != "train":
            return
        now = float(record.get("time") or time.time())
        step = int(record["step"])
        if self.record["first_step_at"] is None:
            self.record["first_step_at"] = now
            self.event("first_step", f"attempt {self.record['attempt']} reached step {step}",
                       seconds=round(now - (self.record.get("last_progress") or now), 3), step=step)
        previous_step = self.record["step"]
        previous_time = self.record.get("last_progress")
        if step > previous_step and previous_time and self.record["first_step_at"] != now:
            per_step = (now - previous_time) / max(1, step - previous_step)
            self.record["step_seconds"] = per_step
        self.record["step"] = max(step, self.record["step"])
        self.record["loss"] = record.get("loss")
        self.record["tokens_per_second"] = record.get("tokens_per_second")
        self.record["peak_memory_gb"] = record.get("peak_memory_gb")
        self.record["last_progress"] = now
        self.save()

    def _on_checkpoint_written(self, record: dict[str, Any]) -> None:
        """coord's trainer says how long a save held training and how long the write took
        off the training thread; kept with the step time so the plan can state the overhead."""
        try:
            held, wrote = float(record["blocking_seconds"]), float(record["write_seconds"])
            step = int(record["step"])  # the trainer counts global steps
        except (KeyError, TypeError, ValueError):
            return
        self.event("checkpoint_saved", f"checkpoint of step {step} saved: training held "
                   f"{held:.3f} s, written in {wrote:.2f} s off the training thread",
                   step=step, blocking_seconds=round(held, 6),
                   write_seconds=round(wrote, 4), step_seconds=self.record.get("step_seconds"))

    async def _pull_log(self, rank: int, name: str, size: int) -> None:
        """Keep each rank's output on the head, per attempt and per rank."""
        offset = self._log_offsets.get(rank, 0)
        if size <= offset:
            return
        session = self.daemon.cluster.sessions[name]
        try:
            piece = await session.call("read_log", {"workdir": session.node.workdir, "job": self.spec.name,
                                                    "attempt": self.record["attempt"], "rank": rank,
                                                    "offset": offset}, timeout=30)
        except RemoteError:
            return
        directory = self.attempt_dir()
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / f"rank-{rank}.log", "ab") as handle:
            handle.write(piece["data"])
        self._log_offsets[rank] = piece["offset"]

    async def _log_tail(self, rank: int) -> str:
        name = self.record["order"][rank]
        session = self.daemon.cluster.sessions[name]
        if session.state == UP:
            status_size = 1 << 62
            await self._pull_log(rank, name, status_size)
        try:
            text = (self.attempt_dir() / f"rank-{rank}.log").read_bytes()[-2000:].decode("utf-8", "replace")
        except OSError:
            return ""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1][:300] if lines else ""

    async def _capture_stacks(self) -> None:
        for rank, name in enumerate(self.record["order"]):
            session = self.daemon.cluster.sessions[name]
            if session.state != UP:
                continue
            try:
                result = await session.call("dump_stacks", {"workdir": session.node.workdir, "job": self.spec.name,
                                                            "attempt": self.record["attempt"], "rank": rank},
                                            timeout=10)
                self.event("stacks", f"rank {rank} on {name}: {result['detail']}")
            except RemoteError:
                pass
        await anyio.sleep(1.0)  # let the ranks print their stacks before the logs are pulled
        for rank, name in enumerate(self.record["order"]):
            await self._pull_log(rank, name, 1 << 62)

    async def _poll_checkpoints(self, *, attempt_over: bool = False) -> None:
        """Find new checkpoints on rank 0's node, validate them, enter them in the catalog, apply retention.

        ``attempt_over``: the ranks are stopped, so a checkpoint that fails validation is damaged,
        not still being written."""
        async with self._checkpoint_poll:
            await self._poll_checkpoints_now(attempt_over)

    async def _poll_checkpoints_now(self, attempt_over: bool) -> None:
        if not self.record["order"] or self.record["attempt"] < 0:
            return
        name = self.record["order"][0]
        session = self.daemon.cluster.sessions[name]
        if session.state != UP:
            return
        attempt = self.record["attempt"]
        try:
            found = await session.call("list_checkpoints", {"workdir": session.node.workdir, "job": self.spec.name,
                                                            "attempt": attempt,
                                                            "known": sorted(self._known_checkpoints)}, timeout=60)
        except RemoteError as exc:
            self.log.warning("checkpoints not listed", node=name, reason=exc.message)
            return
        for entry in catalog.settled(found["checkpoints"], attempt_over=attempt_over):
            self._known_checkpoints.add(entry["name"])
            step = self.record["start_step"] + entry["iteration"]
            if entry["valid"] and self._diverged_after is not None and step > self._diverged_after:
                entry = {**entry, "valid": False, "detail": self._diverged_detail()}
            self.daemon.state.add_checkpoint(self.spec.name, {
                "step": step, "attempt": attempt, "node": name, "path": entry["path"], "sha256": entry["sha256"],
                "size": entry["size"], "valid": entry["valid"], "detail": entry["detail"]})
            if entry["valid"]:
                self.record["last_checkpoint"] = {"step": step, "time": time.time(), "node": name}
                self.event("checkpoint", f"checkpoint of step {step} validated ({entry['detail']})", step=step)
                if self.replicator is not None:
                    self.replicator.poke()
            else:
                self.event("checkpoint_invalid", f"checkpoint of step {step} is not valid: {entry['detail']}",
                           step=step)
        await self._retain()
        self.save()

    async def _retain(self) -> None:
        for old in catalog.to_remove(self.daemon.state.checkpoints(self.spec.name), self.spec.keep):
            if old["node"] == HEAD:
                Path(old["path"]).unlink(missing_ok=True)
                self.daemon.state.remove_checkpoint(self.spec.name, old["attempt"], old["node"], old["path"])
                continue
            session = self.daemon.cluster.sessions.get(old["node"])
            if session is None or session.state != UP:
                continue
            try:
                await session.call("remove_checkpoints", {"workdir": session.node.workdir, "job": self.spec.name,
                                                          "attempt": old["attempt"],
                                                          "names": [posixpath.basename(old["path"])],
                                                          "replica": old.get("role") == catalog.REPLICA}, timeout=60)
                self.daemon.state.remove_checkpoint(self.spec.name, old["attempt"], old["node"], old["path"])
            except RemoteError:
                continue

    async def _stop_everything(self) -> bool:
        """Stop every rank on every node, and the launcher; True when none is left anywhere."""
        attempt = self.record["attempt"]
        if attempt < 0:
            return True
        pid = self.record.get("launcher_pid")
        if pid:
            try:
                os.killpg(pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        results: dict[str, bool] = {}

        async def stop(rank: int, name: str) -> None:
            session = self.daemon.cluster.sessions[name]
            if session.state != UP:
                results[name] = False
                unstopped = self.record.setdefault("unstopped", [])
                if [name, attempt, rank] not in unstopped:
                    unstopped.append([name, attempt, rank])
                return
            try:
                answer = await session.call("stop_rank", {"workdir": session.node.workdir, "job": self.spec.name,
                                                          "attempt": attempt, "rank": rank}, timeout=30)
                results[name] = answer["stopped"]
            except RemoteError:
                results[name] = False

        async with anyio.create_task_group() as tasks:
            for rank, name in enumerate(self.record.get("order", [])):
                tasks.start_soon(stop, rank, name)
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            launcher = getattr(self, "_launcher", None)
            if launcher is not None:
                with anyio.move_on_after(5):
                    while launcher.poll() is None:
                        await anyio.sleep(0.05)
        for rank in range(len(self.record.get("order", []))):
            await self._pull_log(rank, self.record["order"][rank], 1 << 62)
        return all(results.values())

    def view(self) -> dict[str, Any]:
        record = self.record
        eta = None
        if record.get("step_seconds") and self.spec.total_steps and self.state == "running":
            eta = record["step_seconds"] * max(0, self.spec.total_steps - record["step"])
        last = record.get("last_checkpoint")
        return {"name": self.spec.name, "state": self.state, "step": record["step"],
                "total_steps": self.spec.total_steps, "loss": record.get("loss"),
                "tokens_per_second": record.get("tokens_per_second"), "eta_s": eta,
                "last_checkpoint_step": last["step"] if last else None,
                "last_checkpoint_age_s": time.time() - last["time"] if last else None,
                "restarts": record["restarts"], "max_restarts": self.spec.max_restarts,
                "attempt": record["attempt"], "error": record.get("error"), "nodes": record.get("order", []),
                "batch": record.get("batch"), "trainer": self.spec.trainer, "replica": self.spec.replica,
                "min_nodes": self.spec.min_nodes, "diagnoses": record.get("diagnoses", []),
                "rank_memory_bytes": dict(record.get("rank_memory") or {}) if self.state == "running" else {},
                "command": self.spec.command}


def _signal_name(status: int) -> str | None:
    if status > 128:
        try:
            return signal.Signals(status - 128).name
        except ValueError:
            return None
    return None


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) if part.isdigit() else 0 for part in version.split("."))

