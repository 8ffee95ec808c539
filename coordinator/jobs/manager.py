"""Every run the cluster has had, and who may start when: the job manager.

It owns the runs registry (run id -> supervisor; job name -> its newest run), the queue (a
job holds its nodes; one that needs busy nodes waits, by priority then submission time, as
``coordinator.jobs.queue`` decides), re-attach after a daemon restart, and what the control
commands ask of jobs: submit, resume, stop, cancel, resize, read a rank's log.

It reaches the world only through the supervisor's effects (``JobEffects``) and a store of
runs (``RunStore``): the daemon fills them with real parts, the fault simulator with
simulated ones, so that the queue is checked under fault schedules like the supervisor.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NotRequired, Protocol, TypedDict

from coordinator.jobs.core import new_run_id
from coordinator.jobs.effects import JobEffects, Task
from coordinator.jobs.head_paths import attempt_dir, run_dir
from coordinator.jobs.queue import Waiting, positions, startable
from coordinator.jobs.record import JobRecord
from coordinator.jobs.spec import (
    REPLICA_HEAD,
    REPLICA_NONE,
    JobSpec,
    JobSpecError,
    progress_note,
    resumed_fields,
    spec_from_fields,
)
from coordinator.jobs.supervisor import ACTIVE, JobRunner
from coordinator.store.state import CheckpointEntry, DurableRow, RunRow
from shared import protocol as p
from shared.rpc import RemoteError

MAX_LOG_READ = 1 << 20


class JobError(RemoteError):
    """A job request that cannot be honoured, with the protocol code the CLI turns into an exit status."""


class RunStore(Protocol):
    def runs(self) -> list[RunRow]:
        """Every stored run, oldest first."""

    def run_ids(self) -> set[str]: ...

    def forget_run(self, run_id: str) -> int:
        """Every row of the run, its events too; how many events went."""


class LogPiece(TypedDict):
    """Up to 1 MiB of a rank's output (``coord logs``)."""

    data: bytes
    offset: int  # where the next read starts
    attempt: int
    rank: int
    path: NotRequired[str]  # the head's copy (absent before the first attempt)
    run_id: NotRequired[str]
    done: bool  # nothing more will be written: the run is over, or this is an earlier attempt


@dataclass(frozen=True)
class StoredStart:
    """A checkpoint fetched from a checkpoint store, to continue its run from (coord run --resume-from)."""

    run_id: str
    attempt: int
    step: int
    store: str  # the store the run's checkpoints go on to (the run's prefix's parent)
    checkpoint: CheckpointEntry  # the head's copy, as the catalog takes it
    durable: DurableRow


class JobManager:
    def __init__(self, effects: JobEffects, store: RunStore, state_dir: Path):
        self.fx = effects
        self.store = store
        self.state_dir = state_dir
        self.jobs: dict[str, JobRunner] = {}  # job name -> its newest run's supervisor
        self.runs: dict[str, JobRunner] = {}  # run id -> supervisor, every run this cluster has had

    # --- the registry ---------------------------------------------------------------------

    def add_run(self, runner: JobRunner) -> None:
        """A run is known by its id; its name means its newest run."""
        self.runs[runner.run_id] = runner
        self.jobs[runner.spec.name] = runner

    def find(self, name: str) -> JobRunner:
        """A run by its id, or a job's newest run by the job's name."""
        runner = self.runs.get(name) or self.jobs.get(name)
        if runner is None:
            known = ", ".join(sorted(self.jobs)) or "none"
            raise JobError(p.NOT_FOUND, f"no job or run named {name!r} (jobs: {known})")
        return runner

    def shown_runs(self, *, every_run: bool = False) -> list[JobRunner]:
        """Each job's newest run and every run still going (``every_run``: all of them)."""
        return [runner for runner in self.runs.values()
                if every_run or self.jobs.get(runner.spec.name) is runner or runner.state in ACTIVE]

    def training_nodes(self) -> dict[str, str]:
        """{node: job} of every run that holds its nodes now (started, not queued): what `coord doctor`
        must not take bandwidth from unasked."""
        return {node: runner.spec.name for runner in self.runs.values()
                if runner.state in ACTIVE and runner.state != "queued" for node in runner.job_nodes()}

    def runs_of(self, run_id: str | None) -> list[tuple[str, str]]:
        """(run id, job name) of a run (or a job's newest run); without one, the runs status lists."""
        if run_id is None:
            return [(runner.run_id, runner.spec.name) for runner in self.shown_runs()]
        runner = self.runs.get(run_id) or self.jobs.get(run_id)
        return [(runner.run_id, runner.spec.name)] if runner is not None else []

    # --- after a daemon restart -------------------------------------------------------------

    def reattach(self) -> None:
        """Runs that were going when the daemon stopped are supervised again, not relaunched;
        finished ones stay readable (coord status --all, coord logs)."""
        for row in self.store.runs():
            runner = JobRunner(self.fx, JobSpec.from_dict(row["spec"]), run_id=row["run_id"],
                               record=JobRecord.from_json(row["record"]), state=row["state"])
            self.add_run(runner)
            if row["state"] not in ACTIVE:
                if runner.record.unstopped:  # ranks left on nodes that were away at its end
                    self.fx.spawn(runner.reap_when_back, name=f"job:{row['run_id']}:reap")
                continue
            if row["state"] == "queued":
                continue  # it waits for its nodes again: schedule starts it
            if runner.record.attempt >= 0:
                # An attempt was launched: watch it again, or finish the recovery that was under way.
                self._start(runner, reattach=True)
            else:
                # Stopped before its first launch (sync, pre-flight): no rank runs, start it again.
                runner.event("reattached", f"starting again after a daemon restart (it was {row['state']})")
                self._start(runner)

    # --- the queue --------------------------------------------------------------------------

    def schedule(self) -> None:
        """Start every queued run whose nodes are free (the policy: coordinator/jobs/queue.py); the
        others learn their place in the queue."""
        busy = {node for runner in self.runs.values() if runner.state in ACTIVE and runner.state != "queued"
                for node in runner.job_nodes()}
        waiting = [Waiting(runner.run_id, frozenset(runner.job_nodes()), runner.spec.priority,
                           runner.record.submitted or runner.record.started or 0.0)
                   for runner in self.runs.values() if runner.state == "queued"]
        started = startable(waiting, busy)
        for run_id in started:
            runner = self.runs[run_id]
            runner.queue_position = None
            runner.set_state("pending")
            runner.event("dequeued", f"its nodes are free ({', '.join(runner.job_nodes())}): starting")
            self._start(runner)
        for run_id, position in positions([w for w in waiting if w.run_id not in started]).items():
            self.runs[run_id].queue_position = position

    def _start(self, runner: JobRunner, *, reattach: bool = False) -> None:
        self.fx.spawn(self._run_then_schedule(runner, reattach), name=f"job:{runner.run_id}")

    def _run_then_schedule(self, runner: JobRunner, reattach: bool) -> Task:
        async def run() -> None:
            """A run holds its nodes until it ends; then the queue moves on, however it ended."""
            try:
                await runner.run(reattach=reattach)
            finally:
                self.schedule()
        return run

    # --- what the control commands ask ------------------------------------------------------

    def submit(self, spec_fields: dict[str, Any], *, resume: bool = False,
               from_store: StoredStart | None = None) -> JobRunner:
        """A new run of the job (a name run again starts from step 0), or with ``resume`` the named
        job's newest run continued from its newest valid checkpoint, with its own fields but those
        given again, or with ``from_store`` a run continued from a checkpoint fetched from a checkpoint
        store (coord run --resume-from: a head that never saw it). ``spec_fields``: the job as the CLI
        sent it, free-form until checked here."""
        if from_store is not None:
            return self._adopt(spec_fields, from_store)
        name = spec_fields.get("name")
        previous = self.jobs.get(name) if isinstance(name, str) else None
        if resume:
            if previous is None:
                known = ", ".join(sorted(self.jobs)) or "none"
                raise JobError(p.NOT_FOUND, f"no run of a job named {name!r} to resume (jobs: {known})")
            spec_fields = resumed_fields(previous.spec.as_dict(), spec_fields)
        spec = self._checked_spec(spec_fields)
        self._refuse_if_active(spec.name)
        if resume:
            assert previous is not None
            runner = JobRunner(self.fx, spec, run_id=previous.run_id,
                               record=previous.record.continued(spec.total_steps), state="queued")
            return self._enqueue(runner, "resumed", f"run {runner.run_id} continued on request from its newest "
                                 f"valid checkpoint: {' '.join(spec.command)}")
        runner = JobRunner(self.fx, spec, run_id=new_run_id(spec.name, self.store.run_ids()), state="queued")
        return self._enqueue(runner, "submitted", f"submitted as run {runner.run_id}: {' '.join(spec.command)}")

    def check_from_store(self, spec_fields: dict[str, object], run_id: str, store: str) -> JobSpec:
        """A run to continue from a checkpoint store, checked before its checkpoint is fetched: the job's
        fields (its store, unless it names one, the cluster file's, else the one it came from), a run
        this head already knows (that is coord run --resume), a job of that name still going."""
        if run_id in self.runs:
            known = self.runs[run_id]
            raise JobError(p.REFUSED, f"run {run_id} is known to this head (job {known.spec.name}, {known.state}): "
                           f"continue it with coord run --resume {known.spec.name}")
        spec = self._checked_spec({**spec_fields, "checkpoint_store": spec_fields.get("checkpoint_store")
                                   or self.fx.store_url(None) or store})
        self._refuse_if_active(spec.name)
        return spec

    def _adopt(self, spec_fields: dict[str, object], start: StoredStart) -> JobRunner:
        """A run that lives on from a checkpoint store: its own run id (so that its checkpoints go on
        under the same prefix of the same store), the fetched checkpoint catalogued as the head's copy
        and as durable, and its next attempt after the stored one."""
        spec = self.check_from_store(spec_fields, start.run_id, start.store)
        record = JobRecord(run_id=start.run_id, attempt=start.attempt, step=start.step, total_steps=spec.total_steps,
                           started=self.fx.now(), resumes=1)
        self.fx.add_checkpoint(start.run_id, start.checkpoint)
        self.fx.add_durable(start.run_id, start.durable)
        runner = JobRunner(self.fx, spec, run_id=start.run_id, record=record, state="queued")
        return self._enqueue(runner, "resumed_from_store", f"run {start.run_id} continued from the checkpoint of "
                             f"step {start.step} (attempt {start.attempt}) in {start.durable['url']}, fetched to the "
                             f"head and checked against its manifest: {' '.join(spec.command)}",
                             step=start.step, url=start.durable["url"])

    def _refuse_if_active(self, name: str) -> None:
        previous = self.jobs.get(name)
        if previous is not None and previous.state in ACTIVE:
            raise JobError(p.REFUSED, f"job {name} is already {previous.state} (run {previous.run_id}); "
                           f"stop it first: coord stop {name}")

    def _enqueue(self, runner: JobRunner, kind: str, message: str, **data: object) -> JobRunner:
        """A new or continued run saved, known, said (``kind``), and started now if its nodes are free,
        else queued behind the runs ahead of it."""
        runner.record.submitted = self.fx.now()
        runner.save()
        self.add_run(runner)
        runner.event(kind, message, **data)
        note = progress_note(runner.spec)
        if note and not runner.record.progress_seen:
            runner.event("hang_watch", note)
        self.schedule()  # it starts now if its nodes are free, else it waits its turn
        if runner.state == "queued":
            runner.event("queued", f"waiting for its nodes ({', '.join(runner.job_nodes())}), position "
                         f"{runner.queue_position}")
        return runner

    def _checked_spec(self, spec_fields: Mapping[str, Any]) -> JobSpec:
        """The job checked as the CLI checks it (the control socket takes anything), then against
        this cluster: its nodes exist, and none of them has failed to come up since coordd started
        (a job on such a node would only wait; the user is told at once, with the node's error)."""
        try:
            spec = spec_from_fields(spec_fields)
        except JobSpecError as exc:
            raise JobError(p.BAD_ARGS, str(exc)) from None
        names = self.fx.node_names()
        if spec.min_nodes is not None and spec.min_nodes > len(names):
            raise JobError(p.BAD_ARGS, f"--min-nodes {spec.min_nodes} is more than the cluster's {len(names)} nodes")
        unknown = [n for n in spec.nodes or [] if n not in names]
        if unknown:
            raise JobError(p.BAD_ARGS, f"--nodes names {', '.join(unknown)}, not a node of this cluster "
                           f"({', '.join(names)})")
        if spec.replica not in (REPLICA_HEAD, REPLICA_NONE, *names):
            raise JobError(p.BAD_ARGS, f"--replica {spec.replica!r} is not head, none or a node "
                           f"({', '.join(names)})")
        never_up = {n: reason for n in spec.nodes or names if (reason := self.fx.node(n).unreachable)}
        if never_up:
            others = [n for n in spec.nodes or names if n not in never_up]
            raise JobError(p.BAD_ARGS, "; ".join(f"node {n} has not been up since coordd started: {reason}"
                                                 for n, reason in never_up.items())
                           + " (coord status shows every node); fix it and run again"
                           + (f", or leave it out: --nodes {','.join(others)}" if others else ""))
        return spec

    def cancel(self, name: str) -> JobRunner:
        """coord cancel: a queued job leaves the queue (a running one is stopped with coord stop)."""
        runner = self.find(name)
        if runner.state != "queued":
            raise JobError(p.REFUSED, f"job {runner.spec.name} is {runner.state}, not queued"
                           + (f"; stop it with: coord stop {runner.spec.name}" if runner.state in ACTIVE else ""))
        runner.queue_position = None
        runner.set_state("stopped")
        runner.event("cancelled", "cancelled while queued: it never started")
        self.schedule()
        return runner

    def stop(self, name: str) -> JobRunner:
        runner = self.find(name)
        if runner.state == "queued":
            return self.cancel(name)
        if runner.state not in ACTIVE:
            return runner
        runner.request_stop()
        runner.event("stop_requested", "stop requested")
        return runner

    def forget(self, name: str) -> JobRunner:
        """A finished run, as if it had never been (coord drill's own): its rows and the head's files of it.
        The nodes' files of it are the caller's to remove. A run still going is refused."""
        runner = self.find(name)
        if runner.state in ACTIVE:
            raise JobError(p.REFUSED, f"job {runner.spec.name} is {runner.state}; stop it before it is forgotten")
        self.runs.pop(runner.run_id, None)
        if self.jobs.get(runner.spec.name) is runner:
            del self.jobs[runner.spec.name]
            earlier = [other for other in self.runs.values() if other.spec.name == runner.spec.name]
            if earlier:
                self.jobs[runner.spec.name] = earlier[-1]  # the name means its newest run left
        self.store.forget_run(runner.run_id)
        for directory in (run_dir(self.state_dir, runner.run_id), self.state_dir / "replicas" / runner.run_id):
            shutil.rmtree(directory, ignore_errors=True)
        return runner

    def resize(self, name: str) -> tuple[JobRunner, str]:
        runner = self.find(name)
        if runner.state not in ("running", "starting"):
            raise JobError(p.REFUSED, f"job {name} is {runner.state}; only a running job can be resized")
        detail = runner.request_resize()
        runner.event("resize_requested", detail)
        return runner, detail

    def read_log(self, name: str, rank: int = 0, attempt: int | None = None, offset: int = 0) -> LogPiece:
        """Up to 1 MiB of a rank's output from ``offset``, as the head keeps it."""
        runner = self.find(name)
        if rank < 0 or offset < 0 or (attempt is not None and attempt < 0):
            raise JobError(p.BAD_ARGS, f"rank, attempt and offset are 0 or more, got rank {rank}, attempt {attempt}, "
                           f"offset {offset}")
        current = runner.record.attempt
        attempt = current if attempt is None else attempt
        if attempt > current:
            raise JobError(p.NOT_FOUND, f"run {runner.run_id} of job {runner.spec.name} has no attempt {attempt} "
                           + (f"(its attempts: 0 to {current})" if current >= 0 else "(none has started yet)"))
        if attempt == current and runner.record.order and rank >= len(runner.record.order):
            raise JobError(p.NOT_FOUND, f"attempt {attempt} of run {runner.run_id} has no rank {rank} (its ranks: 0 "
                           f"to {len(runner.record.order) - 1}, on {', '.join(runner.record.order)})")
        if attempt < 0:
            return {"data": b"", "offset": 0, "attempt": attempt, "rank": rank, "done": runner.state not in ACTIVE}
        directory = attempt_dir(self.state_dir, runner.run_id, attempt)
        path = directory / f"rank-{rank}.log"
        try:
            with open(path, "rb") as handle:
                handle.seek(offset)
                data = handle.read(MAX_LOG_READ)
        except FileNotFoundError:
            if not directory.exists():
                raise JobError(p.NOT_FOUND, f"run {runner.run_id} of job {runner.spec.name} has no attempt "
                               f"{attempt}") from None
            data = b""
        return {"data": data, "offset": offset + len(data), "attempt": attempt, "rank": rank, "path": str(path),
                "run_id": runner.run_id, "done": runner.state not in ACTIVE or attempt != runner.record.attempt}
