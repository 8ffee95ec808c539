"""`coord run`, `coord stop`, `coord wait`, `coord logs`: the daemon halves and the renderers."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from coordinator.jobs.core import new_run_id
from coordinator.jobs.daemon_effects import attempt_dir
from coordinator.jobs.spec import REPLICA_HEAD, REPLICA_NONE, JobSpec, JobSpecError, validate
from coordinator.jobs.supervisor import ACTIVE, JobRunner
from shared import protocol as p
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.daemon import Daemon

MAX_LOG_READ = 1 << 20


def start_job(daemon: Daemon, spec_fields: dict[str, Any], *, resume: bool = False) -> dict[str, Any]:
    """A new run of the job (a name run again starts from step 0), or with ``resume`` the named
    job's newest run continued from its newest valid checkpoint."""
    previous = daemon.jobs.get(spec_fields.get("name", ""))
    if resume:
        if previous is None:
            known = ", ".join(sorted(daemon.jobs)) or "none"
            raise RemoteError(p.NOT_FOUND, f"no run of a job named {spec_fields.get('name')!r} to resume "
                              f"(jobs: {known})")
        if not spec_fields.get("command"):  # coord run --resume NAME alone: the run's own command
            spec_fields = {**previous.spec.as_dict(), "force": spec_fields.get("force", previous.spec.force)}
    try:
        spec = validate(JobSpec(**spec_fields))
    except (TypeError, JobSpecError) as exc:
        raise RemoteError(p.BAD_ARGS, str(exc)) from None
    names = [n.name for n in daemon.config.nodes]
    if spec.min_nodes is not None and spec.min_nodes > len(names):
        raise RemoteError(p.BAD_ARGS, f"--min-nodes {spec.min_nodes} is more than the cluster's {len(names)} nodes")
    unknown = [n for n in spec.nodes or [] if n not in names]
    if unknown:
        raise RemoteError(p.BAD_ARGS, f"--nodes names {', '.join(unknown)}, not a node of this cluster "
                          f"({', '.join(names)})")
    if spec.replica not in (REPLICA_HEAD, REPLICA_NONE, *names):
        raise RemoteError(p.BAD_ARGS, f"--replica {spec.replica!r} is not head, none or a node "
                          f"({', '.join(names)})")
    if previous is not None and previous.state in ACTIVE:
        raise RemoteError(p.REFUSED, f"job {spec.name} is already {previous.state} (run {previous.run_id}); "
                          f"stop it first: coord stop {spec.name}")
    if resume:
        runner = JobRunner(daemon.job_effects, spec, run_id=previous.run_id,
                           record=continued_record(previous.record, spec.total_steps), state="queued")
    else:
        runner = JobRunner(daemon.job_effects, spec, run_id=new_run_id(spec.name, daemon.state.run_ids()),
                           state="queued")
    runner.record["submitted"] = time.time()
    runner.save()
    daemon.add_run(runner)
    if resume:
        runner.event("resumed", f"run {runner.run_id} continued on request from its newest valid checkpoint: "
                     f"{' '.join(spec.command)}")
    else:
        runner.event("submitted", f"submitted as run {runner.run_id}: {' '.join(spec.command)}")
    daemon.schedule_jobs()  # it starts now if its nodes are free, else it waits its turn
    if runner.state == "queued":
        runner.event("queued", f"waiting for its nodes ({', '.join(runner.job_nodes())}), position "
                     f"{runner.queue_position}")
    return runner.view()


def continued_record(record: dict[str, Any], total_steps: int | None) -> dict[str, Any]:
    """The record of a run continued with coord run --resume: its attempts, checkpoints and progress
    stay; its restarts, outcomes and error start afresh (the new attempts get their own budget)."""
    kept = {key: record[key] for key in ("run_id", "attempt", "step", "loss", "tokens_per_second", "started",
                                          "last_checkpoint", "replica_check", "diagnoses", "order", "unstopped")
            if key in record}
    return {**kept, "restarts": 0, "history": [], "error": None, "warning": None, "total_steps": total_steps,
            "start_step": 0, "launcher_pid": None, "step_seconds": None, "last_progress": None,
            "first_step_at": None, "launched_at": None, "stop_requested": False, "resumes": int(record.get("resumes") or 0) + 1}


def find(daemon: Daemon, name: str) -> JobRunner:
    """A run by its id, or a job's newest run by the job's name."""
    runner = daemon.runs.get(name) or daemon.jobs.get(name)
    if runner is None:
        known = ", ".join(sorted(daemon.jobs)) or "none"
        raise RemoteError(p.NOT_FOUND, f"no job or run named {name!r} (jobs: {known})")
    return runner


def cancel_job(daemon: Daemon, name: str) -> dict[str, Any]:
    """coord cancel: a queued job leaves the queue (a running one is stopped with coord stop)."""
    runner = find(daemon, name)
    if runner.state != "queued":
        raise RemoteError(p.REFUSED, f"job {runner.spec.name} is {runner.state}, not queued"
                          + (f"; stop it with: coord stop {runner.spec.name}" if runner.state in ACTIVE else ""))
    runner.queue_position = None
    runner.set_state("stopped")
    runner.event("cancelled", "cancelled while queued: it never started")
    daemon.schedule_jobs()
    return runner.view()


def stop_job(daemon: Daemon, name: str) -> dict[str, Any]:
    runner = find(daemon, name)
    if runner.state == "queued":
        return cancel_job(daemon, name)
    if runner.state not in ACTIVE:
        return runner.view()
    runner.request_stop()
    runner.event("stop_requested", "stop requested")
    return runner.view()


def resize_job(daemon: Daemon, name: str) -> dict[str, Any]:
    runner = find(daemon, name)
    if runner.state not in ("running", "starting"):
        raise RemoteError(p.REFUSED, f"job {name} is {runner.state}; only a running job can be resized")
    detail = runner.request_resize()
    runner.event("resize_requested", detail)
    return {**runner.view(), "detail": detail}


def job_logs(daemon: Daemon, name: str, rank: int = 0, attempt: int | None = None, offset: int = 0) -> dict[str, Any]:
    runner = find(daemon, name)
    attempt = runner.record["attempt"] if attempt is None else attempt
    if attempt < 0:
        return {"data": b"", "offset": 0, "attempt": attempt, "rank": rank, "done": runner.state not in ACTIVE}
    directory = attempt_dir(daemon.config.state_dir, runner.run_id, attempt)
    path = directory / f"rank-{rank}.log"
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(MAX_LOG_READ)
    except FileNotFoundError:
        if not directory.exists():
            raise RemoteError(p.NOT_FOUND, f"run {runner.run_id} of job {runner.spec.name} has no attempt "
                              f"{attempt}") from None
        data = b""
    return {"data": data, "offset": offset + len(data), "attempt": attempt, "rank": rank, "path": str(path),
            "run_id": runner.run_id, "done": runner.state not in ACTIVE or attempt != runner.record["attempt"]}


def render_job(job: dict[str, Any]) -> str:
    step = f"{job['step']}/{job['total_steps']}" if job.get("total_steps") else str(job["step"])
    state = job["state"] + (f" (position {job['queue_position']})" if job.get("queue_position") else "")
    parts = [f"{job['name']}: {state}", f"step {step}"]
    if job.get("loss") is not None:
        parts.append(f"loss {job['loss']:.4f}")
    if job.get("tokens_per_second"):
        parts.append(f"{job['tokens_per_second']:,.0f} tok/s")
    if job.get("eta_s"):
        parts.append(f"ETA {job['eta_s']:.0f}s")
    if job.get("last_checkpoint_step") is not None:
        parts.append(f"checkpoint {job['last_checkpoint_step']} ({job['last_checkpoint_age_s']:.0f}s ago)")
    parts.append(f"restarts {job['restarts']}/{job['max_restarts']}")
    if job.get("run_id") and job["run_id"] != job["name"]:
        parts.append(f"run {job['run_id']}")
    if job.get("priority"):
        parts.append(f"priority {job['priority']}")
    line = ", ".join(parts)
    if job.get("state") == "queued" and job.get("job_nodes"):
        line += f"\n  waits for {', '.join(job['job_nodes'])}"
    if job.get("batch"):
        line += f"\n  on {', '.join(job['nodes'])}: {job['batch']}"
    memory = job.get("rank_memory_bytes") or {}
    if memory:
        line += "\n  memory: " + ", ".join(f"rank {rank} ({job['nodes'][int(rank)]}) {size / 2**30:.2f} GiB"
                                           for rank, size in sorted(memory.items(), key=lambda kv: int(kv[0]))
                                           if int(rank) < len(job["nodes"]))
    if job.get("error"):
        line += f"\n  error: {job['error']}"
    if job.get("warning"):
        line += f"\n  warning: {job['warning']}"
    for found in job.get("diagnoses", []):
        line += f"\n  known failure: {found['title']} ({found['detail']})\n    fix: {found['fix']}"
    return line
