"""`coord run`, `coord stop`, `coord wait`, `coord logs`: the daemon halves and the renderers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from coordinator.jobs.spec import REPLICA_HEAD, REPLICA_NONE, JobSpec, JobSpecError, validate
from coordinator.jobs.supervisor import ACTIVE, JobRunner
from shared import protocol as p
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.daemon import Daemon

MAX_LOG_READ = 1 << 20


def start_job(daemon: "Daemon", spec_fields: dict[str, Any]) -> dict[str, Any]:
    try:
        spec = validate(JobSpec(**spec_fields))
    except (TypeError, JobSpecError) as exc:
        raise RemoteError(p.BAD_ARGS, str(exc)) from None
    names = [n.name for n in daemon.config.nodes]
    if spec.min_nodes is not None and spec.min_nodes > len(names):
        raise RemoteError(p.BAD_ARGS, f"--min-nodes {spec.min_nodes} is more than the cluster's {len(names)} nodes")
    if spec.replica not in (REPLICA_HEAD, REPLICA_NONE, *names):
        raise RemoteError(p.BAD_ARGS, f"--replica {spec.replica!r} is not head, none or a node "
                          f"({', '.join(names)})")
    runner = daemon.jobs.get(spec.name)
    if runner is not None and runner.state in ACTIVE:
        raise RemoteError(p.REFUSED, f"job {spec.name} is already {runner.state}; stop it first: coord stop {spec.name}")
    runner = JobRunner(daemon, spec)
    runner.save()
    daemon.jobs[spec.name] = runner
    daemon.start_task(runner.run, name=f"job:{spec.name}")
    runner.event("submitted", f"submitted: {' '.join(spec.command)}")
    return runner.view()


def find(daemon: "Daemon", name: str) -> JobRunner:
    runner = daemon.jobs.get(name)
    if runner is None:
        known = ", ".join(sorted(daemon.jobs)) or "none"
        raise RemoteError(p.NOT_FOUND, f"no job named {name!r} (jobs: {known})")
    return runner


def stop_job(daemon: "Daemon", name: str) -> dict[str, Any]:
    runner = find(daemon, name)
    if runner.state not in ACTIVE:
        return runner.view()
    runner.request_stop()
    runner.event("stop_requested", "stop requested")
    return runner.view()


def resize_job(daemon: "Daemon", name: str) -> dict[str, Any]:
    runner = find(daemon, name)
    if runner.state not in ("running", "starting"):
        raise RemoteError(p.REFUSED, f"job {name} is {runner.state}; only a running job can be resized")
    detail = runner.request_resize()
    runner.event("resize_requested", detail)
    return {**runner.view(), "detail": detail}


def job_logs(daemon: "Daemon", name: str, rank: int = 0, attempt: int | None = None, offset: int = 0) -> dict[str, Any]:
    runner = find(daemon, name)
    attempt = runner.record["attempt"] if attempt is None else attempt
    if attempt < 0:
        return {"data": b"", "offset": 0, "attempt": attempt, "rank": rank, "done": runner.state not in ACTIVE}
    path = runner.attempt_dir(attempt) / f"rank-{rank}.log"
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(MAX_LOG_READ)
    except FileNotFoundError:
        if not (runner.attempt_dir(attempt)).exists():
            raise RemoteError(p.NOT_FOUND, f"job {name} has no attempt {attempt}") from None
        data = b""
    return {"data": data, "offset": offset + len(data), "attempt": attempt, "rank": rank, "path": str(path),
            "done": runner.state not in ACTIVE or attempt != runner.record["attempt"]}


def render_job(job: dict[str, Any]) -> str:
    step = f"{job['step']}/{job['total_steps']}" if job.get("total_steps") else str(job["step"])
    parts = [f"{job['name']}: {job['state']}", f"step {step}"]
    if job.get("loss") is not None:
        parts.append(f"loss {job['loss']:.4f}")
    if job.get("tokens_per_second"):
        parts.append(f"{job['tokens_per_second']:,.0f} tok/s")
    if job.get("eta_s"):
        parts.append(f"ETA {job['eta_s']:.0f}s")
    if job.get("last_checkpoint_step") is not None:
        parts.append(f"checkpoint {job['last_checkpoint_step']} ({job['last_checkpoint_age_s']:.0f}s ago)")
    parts.append(f"restarts {job['restarts']}/{job['max_restarts']}")
    line = ", ".join(parts)
    if job.get("batch"):
        line += f"\n  on {', '.join(job['nodes'])}: {job['batch']}"
    memory = job.get("rank_memory_bytes") or {}
    if memory:
        line += "\n  memory: " + ", ".join(f"rank {rank} ({job['nodes'][int(rank)]}) {size / 2**30:.2f} GiB"
                                           for rank, size in sorted(memory.items(), key=lambda kv: int(kv[0]))
                                           if int(rank) < len(job["nodes"]))
    if job.get("error"):
        line += f"\n  error: {job['error']}"
    for found in job.get("diagnoses", []):
        line += f"\n  known failure: {found['title']} ({found['detail']})\n    fix: {found['fix']}"
    return line
