"""The invariants the fault schedules check, against the world's ground truth and the live
daemon's job manager, after every effect and at the end.

Per run (each run of every job, as a single-run schedule always had them):

(a) a run succeeds only when one attempt's ranks all finished the total steps, or when the
    newest valid checkpoint of this run is at the total;
(b) a resume uses only a whole checkpoint of this run;
(c) one failure loses at most one checkpoint interval plus what the failed attempt did before
    its first checkpoint (one more interval when rank 0's own node was lost: its newest
    checkpoint may not have been copied off yet);
(d) at most one attempt's ranks run at a time, except on nodes the head cannot reach; those
    are stopped once their nodes are back; and no reachable node runs two runs' ranks at once;
(e) every run ends within a bound computed from its restarts, backoffs, node waits and hangs
    (from leaving the queue), and every job submitted ends before the schedule's deadline;
(f) a stop is honoured, across daemon restarts too: the run ends within STOP_BOUND_S of virtual
    time (plus the time the daemon was down after the stop was answered), launches no attempt
    it was not already launching, and ends stopped, or failed by the attempt going when the
    stop came, or succeeded only when that attempt's ranks had all finished by the next poll;
(g) each restart is counted once, across daemon restarts;
(h) no event or error says "internal error" (or shows an exception group);
(i) no run ends with the supervisor's edge error ("the job's supervisor stopped on an unexpected
    error": an exception nobody foresaw, an IllegalTransition among them).

The queue (coordinator/jobs/queue.py, applied by coordinator/jobs/manager.py):

(j) every change of a run's state, as the live daemon has it, is one the state table allows
    (coordinator/jobs/states.py), across daemon restarts too;
(k) no two runs hold a node at once (a run holds its job's nodes from leaving ``queued`` until
    it is finished), and a run leaves the queue only when no queued run ahead of it (a higher
    priority, or the same one submitted earlier) waits for one of its nodes: first in, first
    out within a priority;
(l) a cancel that was answered is honoured, across daemon restarts: that run never leaves the
    queue but to end ``stopped``, and no rank of it is ever launched;
(m) a queued run starts once its nodes are free: no run stays queued while virtual time passes
    with none of its nodes held and no queued run ahead of it (or submitted at the same
    instant, with the same priority) waiting for one of them.

The checkpoint store (coordinator/jobs/durability.py):

(n) every checkpoint the run holds durable is committed in the store with the SHA256 of a copy of
    that checkpoint that was catalogued valid; the store keeps at least the newest committed one;
    and a run that succeeded with its store answering at the end has its final checkpoint there.
"""

from __future__ import annotations

from typing import Any

import anyio

from coordinator.jobs import hang
from coordinator.jobs.durability import FINAL_UPLOAD_TIMEOUT_S
from coordinator.jobs.policy import MAX_BACKOFF_S
from coordinator.jobs.rank_watch import POLL_S
from coordinator.jobs.states import ACTIVE, FINISHED, IllegalTransition, check_transition
from coordinator.jobs.supervisor import NODE_WAIT_S

STOP_BOUND_S = 120.0  # a stop waits at most for calls in flight to nodes that hang (their timeouts)
REAP_GRACE_S = 5.0  # an old rank on a node that just came back is stopped at the next poll
EDGE_ERROR = "the job's supervisor stopped on an unexpected error"


class InvariantBroken(AssertionError):
    pass


def time_bound(schedule: Any, spec: dict[str, Any]) -> float:
    """(e): the longest a run of ``spec`` may take once out of the queue, from its restarts,
    backoffs, node waits and hangs."""
    attempts = spec["max_restarts"] + 1 + len(schedule.crashes) + 1 + spec.get("max_rollbacks", 3)
    bound = hang.hang_bound(spec["hang_timeout"], spec.get("first_step_timeout"))
    per_attempt = (schedule.startup_s + spec["total_steps"] * schedule.step_s + bound
                   + STOP_BOUND_S + 60 + 10 * schedule.copy_s)
    # An outage is waited out for up to --node-timeout (nodes out of the head's reach whose ranks may live).
    outages = sum((f.get("back_after") or f.get("for") or 0) + spec.get("node_timeout", 60.0) for f in schedule.faults
                  if f["kind"] in ("power", "cut", "isolate", "head", "agent"))
    # A run with a checkpoint store tries its final upload for up to FINAL_UPLOAD_TIMEOUT_S before it ends.
    final_upload = FINAL_UPLOAD_TIMEOUT_S + 60 if spec.get("checkpoint_store") else 0
    return (attempts * (per_attempt + MAX_BACKOFF_S + NODE_WAIT_S + 10) + outages
            + sum(delay for _, delay in schedule.crashes) + 60 + final_upload)


def _ahead(first: Any, then: Any, *, ties: bool) -> bool:
    """Whether queued run ``first`` comes before ``then`` (a higher priority, or the same one and
    submitted earlier; with ``ties``, submitted at the same instant counts too)."""
    if first.spec.priority != then.spec.priority:
        return first.spec.priority > then.spec.priority
    a, b = first.record.submitted or 0.0, then.record.submitted or 0.0
    return a < b or (ties and a == b)


class Checker:
    """The invariants, against the world's ground truth and the live daemon's job manager."""

    def __init__(self, schedule: Any, world: Any):
        self.schedule, self.world = schedule, world
        self.launches_checked = 0
        self.manager: Any = None  # the live daemon's JobManager; None while the daemon is down
        self.timeline: dict[str, list[tuple[float, str]]] = {}  # run id -> (time, state) as the daemon had it
        self.due_since: dict[str, float] = {}  # queued runs whose nodes are free, since when (this daemon)
        self.cancelled: dict[str, float] = {}  # run id -> when its cancel was answered
        # run id -> when its stop was answered (it was active, not queued), and its attempt then
        self.stopped: dict[str, tuple[float, int]] = {}
        self.down: list[tuple[float, float]] = []  # (time the daemon died, seconds until it was back)
        self.changed = anyio.Event()  # set (and made anew) when a run's state changed or a request was answered
        self.broken: InvariantBroken | None = None
        self.recheck = False  # check who holds and who waits at the next observation, changed or not

    def fail(self, letter: str, message: str) -> None:
        """Break: the first invariant broken is kept (a task that meets it may swallow it, as the
        supervisor's edge would; every later check raises it again)."""
        if self.broken is None:
            self.broken = InvariantBroken(f"({letter}) {message}")
        raise InvariantBroken(str(self.broken))

    def spec_of(self, run_id: str) -> dict[str, Any]:
        return self.world.store[run_id]["spec"]

    # --- the daemon's life ------------------------------------------------------------------

    def attach(self, manager: Any) -> None:
        """A daemon (re)started with this job manager. What it goes on from is what the store kept:
        a daemon killed while saving a state never saved it, and that state is no run's past."""
        self.manager = manager
        for run_id, row in self.world.store.items():
            line = self.timeline.get(run_id)
            if line and line[-1][1] != row["state"]:
                line[-1] = (line[-1][0], row["state"])
        self.due_since.clear()
        self.recheck = True
        self.notify()

    def detach(self, delay: float) -> None:
        """The daemon died; it is back after ``delay``."""
        self.manager = None
        self.down.append((anyio.current_time(), delay))

    def notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    # --- after every effect -----------------------------------------------------------------

    def continuous(self) -> None:
        if self.broken is not None:
            raise InvariantBroken(str(self.broken))
        world = self.world
        running: dict[str, set[int]] = {}
        for run, attempt in world.running_attempts(reachable_only=True, grace=REAP_GRACE_S):
            running.setdefault(run, set()).add(attempt)
        for run, attempts in running.items():
            if len(attempts) > 1:
                self.fail("d", f"ranks of {len(attempts)} attempts of run {run} run at once on reachable nodes: "
                               f"{sorted(attempts)}")
        if len(running) > 1:
            for node, runs in world.ranks_by_node(grace=REAP_GRACE_S).items():
                if len(runs) > 1:
                    self.fail("d", f"ranks of runs {sorted(runs)} run at once on {node}")
        for _, kind, message in world.events[-3:]:
            if "internal error" in message or "ExceptionGroup" in message:
                self.fail("h", f"{kind}: {message}")
        while self.launches_checked < len(world.launch_log):
            launch = world.launch_log[self.launches_checked]
            if launch["run"] in self.cancelled:
                self.fail("l", f"run {launch['run']} was cancelled while queued, and its attempt "
                               f"{launch['attempt']} launched")
            self.check_launch(launch)
            self.launches_checked += 1
        self.observe()

    def observe(self) -> None:
        """The live daemon's runs: each change of state (j, k, l), who holds which node (k), and
        who waits with its nodes free (m)."""
        manager = self.manager
        if manager is None:
            return
        now = self.world.now()
        runners = list(manager.runs.values())
        changed = False
        for runner in runners:
            line = self.timeline.setdefault(runner.run_id, [])
            state = str(runner.state)
            if line and line[-1][1] == state:
                continue
            previous = line[-1][1] if line else None
            line.append((now, state))
            changed = True
            self._changed_state(runner, previous, state, runners)
        if changed or self.recheck:  # who holds a node, and who may start, change only with a run's state
            self.recheck = False
            self._check_holding(runners)
            self._check_waiting(runners, now)
            if changed:
                self.notify()
        elif self.due_since:  # time passes for a run that may start
            self._check_waiting(runners, now)

    def _changed_state(self, runner: Any, previous: str | None, state: str, runners: list[Any]) -> None:
        run_id = runner.run_id
        if previous is not None:
            try:
                check_transition(previous, state)
            except IllegalTransition as exc:
                self.fail("j", f"run {run_id} went from {previous} to {state}: {exc}")
        if run_id in self.cancelled and state != "stopped":
            self.fail("l", f"run {run_id} was cancelled while queued, and is {state} now")
        if previous == "queued" and state != "stopped":  # it leaves the queue: it starts
            mine = set(runner.job_nodes())
            for other in runners:
                if other is not runner and other.state == "queued" and _ahead(other, runner, ties=False) \
                        and mine & set(other.job_nodes()):
                    self.fail("k", f"run {run_id} (priority {runner.spec.priority}) started before run "
                                   f"{other.run_id} (priority {other.spec.priority}), ahead of it in the queue, "
                                   f"which waits for {', '.join(sorted(mine & set(other.job_nodes())))}")

    def _check_holding(self, runners: list[Any]) -> None:
        held: dict[str, str] = {}
        for runner in runners:
            if runner.state in ACTIVE and runner.state != "queued":
                for node in runner.job_nodes():
                    if node in held:
                        self.fail("k", f"runs {held[node]} and {runner.run_id} both hold {node}")
                    held[node] = runner.run_id

    def _check_waiting(self, runners: list[Any], now: float) -> None:
        queued = [r for r in runners if r.state == "queued"]
        if not queued:
            self.due_since.clear()
            return
        held = {node for r in runners if r.state in ACTIVE and r.state != "queued" for node in r.job_nodes()}
        for runner in queued:
            mine = set(runner.job_nodes())
            due = not mine & held and not any(
                other is not runner and _ahead(other, runner, ties=True) and mine & set(other.job_nodes())
                for other in queued)
            if not due:
                self.due_since.pop(runner.run_id, None)
                continue
            since = self.due_since.setdefault(runner.run_id, now)
            if now > since:
                self.fail("m", f"run {runner.run_id} has waited in the queue for {now - since:.2f} s with its "
                               f"nodes ({', '.join(sorted(mine))}) free and no run ahead of it waiting for them")
        for run_id in [r for r in self.due_since if r not in {q.run_id for q in queued}]:
            del self.due_since[run_id]

    def check_launch(self, launch: dict[str, Any]) -> None:
        """(b) and (c) for one launch."""
        world, run = self.world, launch["run"]
        steps = {start for _, start, _ in launch["ranks"].values()}
        if len(steps) != 1:
            self.fail("b", f"ranks of attempt {launch['attempt']} start from different steps {steps}")
        start = steps.pop()
        for rank, (node, _, resume) in launch["ranks"].items():
            if start == 0:
                if resume:
                    self.fail("b", f"rank {rank} resumes from {resume} at step 0")
                continue
            file = world.nodes[node].files.get(resume or "")
            if file is None:
                self.fail("b", f"rank {rank} on {node} resumes from {resume}, which is not there")
            if file.run != run:
                self.fail("b", f"rank {rank} resumes from a checkpoint of run {file.run}, not {run}")
            if not file.whole(world.now()) or file.step != start:
                self.fail("b", f"rank {rank} resumes from {resume} (step {file.step}, whole "
                               f"{file.whole(world.now())}) as step {start}")
        earlier = [r for (r_run, attempt, _), r in world.ranks.items() if r_run == run and attempt < launch["attempt"]]
        if not earlier:
            return
        last_attempt = max(r.attempt for r in earlier)
        previous = [r for r in earlier if r.attempt == last_attempt]
        rank0 = next((r for r in previous if r.rank == 0), None)
        if rank0 is None or rank0.launched_at is None:
            return
        diverged = [max(r.diverge_at, r.start_step + 1) for r in previous if r.diverge_at is not None]
        job = f"{world.job_of(run)}: "  # each event of a run's says its job's name first
        seen = any(kind == "job.attempt_ended" and message.startswith(job)
                   and f"attempt {last_attempt}: diverged" in message
                   for t, kind, message in world.events if t >= rank0.launched_at)
        if diverged and seen:  # a divergence coord saw is never resumed from: the resume is from before it
            if start >= min(diverged):
                self.fail("c", f"attempt {launch['attempt']} resumes from step {start}, at or after rank weights "
                               f"diverged at step {min(diverged)}")
            return
        nan_from = world.fault_for(world.nan_loss, world.job_of(run), last_attempt)
        rolled_back = any(kind == "job.attempt_ended" and message.startswith(job)
                          and f"attempt {last_attempt}: non_finite" in message
                          for t, kind, message in world.events if t >= rank0.launched_at)
        if nan_from is not None and rolled_back:  # a rollback loses what came after, but never resumes into it
            if start >= max(nan_from, rank0.start_step + 1):
                self.fail("c", f"attempt {launch['attempt']} rolls back to step {start}, at or after the loss of "
                               f"attempt {last_attempt} went NaN (step {nan_from})")
            return
        failed_at = min((r.exited_at for r in previous if r.exited_at is not None and r.exit != 0),
                        default=world.now())
        reached = rank0.step_at(failed_at)
        spec = self.spec_of(run)
        interval = spec["save_every"]
        first_checkpoint = min(rank0.total, (rank0.start_step // interval + 1) * interval)
        before_first = first_checkpoint - rank0.start_step
        allowed = interval + before_first
        if not world.nodes[rank0.node].reachable or not world.nodes[rank0.node].powered:
            allowed += interval + int(self.schedule.copy_s / self.schedule.step_s) + 1
        if any(f["kind"] in ("checkpoint", "disk") for f in self.schedule.faults) or \
                spec["replica"] == "none" or self.schedule.crashes:
            # a damaged checkpoint's work is lost with it; so is a lost node's without a copy
            return
        if reached - start > allowed:
            self.fail("c", f"attempt {launch['attempt']} resumes from step {start}; attempt {last_attempt} had "
                           f"reached {reached} (allowed loss {allowed})")

    # --- at the end -------------------------------------------------------------------------

    def started_at(self, run_id: str) -> float | None:
        """When the run left the queue (None: it never did)."""
        line = self.timeline.get(run_id, [])
        return next((t for (t, state), (_, before) in zip(line[1:], line, strict=False)
                     if before == "queued" and state != "stopped"), None)

    def ended_at(self, run_id: str) -> float | None:
        return next((t for t, state in self.timeline.get(run_id, []) if state in FINISHED), None)

    def down_after(self, when: float) -> float:
        """How long the daemon was down after ``when``."""
        return sum(delay for died, delay in self.down if died >= when)

    def final(self) -> None:
        """Every run of the store, once the schedule is over."""
        for run_id, row in self.world.store.items():
            self.final_run(run_id, row["state"], row["record"], row["spec"])

    def _final_store(self, run_id: str, state: str, record: dict[str, Any]) -> None:
        world = self.world
        durable = world.durable.get(run_id, {})
        for (step, attempt), row in durable.items():
            stored = world.stored.get(row["url"])
            shas = {c["sha256"] for c in world.catalogued.get(run_id, [])
                    if c["valid"] and (c["step"], c["attempt"]) == (step, attempt)}
            if stored is None:
                self.fail("n", f"run {run_id}: the checkpoint of step {step} is held durable, but {row['url']} is not "
                               "in the store")
            elif stored["sha256"] not in shas:
                self.fail("n", f"run {run_id}: the store's checkpoint of step {step} is not a copy catalogued valid")
        if durable and max(durable.values(), key=lambda r: (r["step"], r["attempt"]))["url"] not in world.stored:
            self.fail("n", f"run {run_id}: the store lost its newest committed checkpoint")
        newest = max((c for c in world.catalog.get(run_id, {}).values() if c["valid"]),
                     key=lambda c: (c["step"], c["attempt"]), default=None)
        if (state == "succeeded" and world.store_up and record.get("durability") is not None and newest is not None
                and (newest["step"], newest["attempt"]) not in durable
                and "not in the checkpoint store" not in (record.get("warning") or "")):
            self.fail("n", f"run {run_id} succeeded, its store answering, without its final checkpoint "
                           f"(step {newest['step']}) in the store, and without saying so")

    def final_run(self, run_id: str, state: str, record: dict[str, Any], spec: dict[str, Any]) -> None:
        world = self.world
        total = spec["total_steps"]
        started, ended = self.started_at(run_id), self.ended_at(run_id)
        bound = time_bound(self.schedule, spec)
        if state not in FINISHED:
            self.fail("e", f"run {run_id} did not end in time; it is {state}")
        if ended is None or self.timeline[run_id][-1][1] != state:
            self.fail("j", f"run {run_id} ended {state}, which the daemon was never seen to reach "
                           f"({self.timeline.get(run_id)})")
        if started is not None and ended - started > bound:
            self.fail("e", f"run {run_id} took {ended - started:.0f} s from leaving the queue (bound {bound:.0f})")
        if run_id in self.cancelled:
            if state != "stopped" or started is not None:
                self.fail("l", f"run {run_id} was cancelled while queued, and ended {state} "
                               f"(timeline {self.timeline[run_id]})")
            if any(launch["run"] == run_id for launch in world.launch_log):
                self.fail("l", f"run {run_id} was cancelled while queued, and launched")
        if state == "succeeded":
            self._final_success(run_id, record, spec, total)
        self._final_store(run_id, state, record)
        if run_id in self.stopped:
            self._final_stop(run_id, state, record, ended)
        history = record.get("history", [])
        attempts = [h.get("attempt") for h in history]
        if len(attempts) != len(set(attempts)):
            self.fail("g", f"an attempt's outcome was counted twice: {attempts}")
        counted = sum(1 for h in history if h.get("counted"))
        if record.get("restarts") != counted:
            self.fail("g", f"restarts {record.get('restarts')} but {counted} counted outcomes in the history")
        if record.get("restarts", 0) > spec["max_restarts"]:
            self.fail("g", f"restarts {record['restarts']} over --max-restarts {spec['max_restarts']}")
        text = str(record.get("error") or "")
        if "internal error" in text or "ExceptionGroup" in text:
            self.fail("h", text)
        if EDGE_ERROR in text:
            self.fail("i", f"run {run_id}: {text}")

    def _final_stop(self, run_id: str, state: str, record: dict[str, Any], ended: float) -> None:
        asked, attempt = self.stopped[run_id]
        if ended - asked > STOP_BOUND_S + self.down_after(asked):
            self.fail("f", f"a stop of run {run_id} took {ended - asked:.0f} s")
        later = sorted({launch["attempt"] for launch in self.world.launch_log
                        if launch["run"] == run_id and launch["attempt"] > attempt})
        if later:
            self.fail("f", f"run {run_id} was stopped at t={asked:.2f} during attempt {attempt}, and launched "
                           f"attempts {later} after")
        if state == "succeeded":
            ranks = [r for (r_run, number, _), r in self.world.ranks.items()
                     if r_run == run_id and number == record.get("attempt")]
            # finished: exited 0, or aborted on its way out after its last step (its work done)
            finished = [r.exited_at for r in ranks if r.exited_at is not None and (
                r.exit == 0 or (r.teardown_status and r.exit == r.teardown_status
                                and r.step_at(r.exited_at) >= r.total))]
            if len(finished) < len(ranks) or max(finished, default=0.0) > asked + 2 * POLL_S:
                self.fail("f", f"run {run_id} was stopped at t={asked:.2f}, and succeeded with attempt "
                               f"{record.get('attempt')}, whose ranks had not all finished by then")

    def _final_success(self, run_id: str, record: dict[str, Any], spec: dict[str, Any], total: int) -> None:
        world = self.world
        finished: dict[int, list[bool]] = {}
        for (r_run, attempt, _), rank in world.ranks.items():
            if r_run == run_id:
                finished.setdefault(attempt, []).append(rank.exit == 0 and rank.step_at(rank.exited_at or 0)
                                                         >= total)
        all_ranks = any(all(flags) for flags in finished.values())
        at_total = any(f.run == run_id and f.step >= total and f.whole(world.now())
                       for node in world.nodes.values() for f in node.files.values())
        at_total = at_total or any(f.run == run_id and f.step >= total and f.whole(world.now())
                                   for f in world.head_files.values() if hasattr(f, "run"))
        if not (all_ranks or at_total):
            self.fail("a", f"run {run_id} succeeded without an attempt that finished and without a checkpoint "
                           f"at step {total}")
        last = record.get("attempt")  # the attempt the success is of
        peers = [r for (r_run, attempt, _), r in world.ranks.items() if r_run == run_id and attempt == last]
        for rank in peers:
            every, start, rank_no, attempt = rank.fingerprint_every, rank.diverge_at, rank.rank, last
            # a step whose fingerprint every rank of the attempt reported, the diverged one's differing
            if start is not None and every and any(
                    step % every == 0 and all(p.step_at(p.exited_at or world.now()) >= step for p in peers)
                    for step in range(max(start, rank.start_step + 1), total + 1)):
                self.fail("a", f"run {run_id} succeeded with attempt {attempt}, whose rank {rank_no} reported "
                               f"weights that diverged from step {start}")
        copies = list(world.catalog.get(run_id, {}).values())
        valid = [c for c in copies if c["valid"]]
        if valid and spec["replica"] != "none" and not record.get("warning"):
            newest = max((c["step"], c["attempt"]) for c in valid)
            group = [c for c in valid if (c["step"], c["attempt"]) == newest]
            primary = next((c["node"] for c in group if c.get("role", "primary") == "primary"), None)
            on_head = world.head_machine | {"head"}
            if not any(c.get("role") == "replica" or (c.get("role") == "local" and c["node"] != primary and not
                                                      (c["node"] in on_head and primary in on_head))
                       for c in group):
                self.fail("a", f"run {run_id} succeeded before a copy of its final checkpoint {newest} landed "
                               "off its primary's machine, and says nothing of it")

    def final_leftovers(self) -> None:
        """(d) at the end: once every run ended and the nodes are back, no rank runs on one."""
        world = self.world
        world.settle()
        for rank in world.ranks.values():
            node = world.nodes[rank.node]
            if rank.running() and node.reachable:
                self.fail("d", f"rank {rank.rank} of attempt {rank.attempt} of run {rank.run} still runs on "
                               f"{rank.node} after every run ended and its node is back")
