"""`coord run`, `coord stop`, `coord cancel`, `coord resize`, `coord logs`: the daemon halves (each a
call on the job manager, coordinator.jobs.manager) and the renderers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Named for the checker only: the CLI imports this module to draw a job, and keeps its start-up free of
# the jobs layer.
if TYPE_CHECKING:
    from coordinator.jobs.manager import JobManager, LogPiece
    from coordinator.jobs.record import Durability
    from coordinator.jobs.view import RunView

    class ResizeAnswer(RunView):
        """``coord resize``'s answer: the run, and what the resize will do."""

        detail: str


def start_job(jobs: JobManager, spec: dict[str, Any], resume: bool = False) -> RunView:
    """``spec``: the job's fields as the CLI sent them, free-form until the manager checks them."""
    return jobs.submit(spec, resume=resume).view()


def cancel_job(jobs: JobManager, name: str) -> RunView:
    return jobs.cancel(name).view()


def stop_job(jobs: JobManager, name: str) -> RunView:
    return jobs.stop(name).view()


def resize_job(jobs: JobManager, name: str) -> ResizeAnswer:
    runner, detail = jobs.resize(name)
    return {**runner.view(), "detail": detail}


def job_view(jobs: JobManager, name: str) -> RunView:
    return jobs.find(name).view()


def job_logs(jobs: JobManager, name: str, rank: int = 0, attempt: int | None = None,
             offset: int = 0) -> LogPiece:
    return jobs.read_log(name, rank=rank, attempt=attempt, offset=offset)

def render_job(job: RunView) -> str:
    line = ", ".join(_summary(job))
    if job.get("state") == "queued" and job.get("job_nodes"):
        line += f"\n  waits for {', '.join(job['job_nodes'])}"
    if job.get("batch"):
        line += f"\n  on {', '.join(job['nodes'])}: {job['batch']}"
    memory = job.get("rank_memory_bytes") or {}
    if memory:
        line += "\n  memory: " + ", ".join(f"rank {rank} ({job['nodes'][int(rank)]}) {size / 2**30:.2f} GiB"
                                           for rank, size in sorted(memory.items(), key=lambda kv: int(kv[0]))
                                           if int(rank) < len(job["nodes"]))
    waiting = job.get("waiting")
    if waiting:
        line += (f"\n  waiting for nodes, {waiting['waited_s']:.0f} s of at most {waiting['limit_s']:g} s "
                 "(--node-wait): " + "; ".join(f"{node}: {reason}" for node, reason in waiting["reasons"].items()))
    for label, key in (("error", "error"), ("warning", "warning"), ("note", "note"), ("note", "hang_watch")):
        if job.get(key):
            line += f"\n  {label}: {job[key]}"  # type: ignore[literal-required]
    for found in job.get("diagnoses", []):
        line += f"\n  known failure: {found['title']} ({found['detail']})\n    fix: {found['fix']}"
    for slow in job.get("stragglers", []):
        line += (f"\n  straggler: rank {slow['rank']} on {slow['node']}, {slow['score']:.1f}x the median compute "
                 f"time; cause: {slow['cause']}")
    durable = job.get("durability")
    if durable:
        line += "\n  " + durability_line(durable)
    return line


def durability_line(durable: Durability) -> str:
    """"durable up to step N in STORE", the lag and the speed (coord status)."""
    text = (f"durable up to step {durable['durable_step']}" if durable["durable_step"] is not None
            else "nothing durable yet") + f" in {durable['store']}"
    if durable["lag_steps"]:
        text += f"; {durable['lag_steps']} steps ({durable['lag_seconds']:.0f} s) behind"
    if durable["bytes_per_s"]:
        text += f"; {durable['bytes_per_s'] / 1e6:.1f} MB/s to the store"
    if durable["error"]:
        text += f"; last upload failed: {durable['error']}"
    return text


def _summary(job: RunView) -> list[str]:
    """The job's one line: state, step, loss, speed, ETA, checkpoint, restarts, rollbacks, run, priority."""
    step = f"{job['step']}/{job['total_steps']}" if job.get("total_steps") else str(job["step"])
    state = job["state"] + (f" (position {job['queue_position']})" if job.get("queue_position") else "")
    parts = [f"{job['name']}: {state}", f"step {step}"]
    if job.get("loss") is not None:
        parts.append(f"loss {job['loss']:.4f}")  # a NaN is "loss nan": what it is, never an older value
    if job.get("tokens_per_second"):
        parts.append(f"{job['tokens_per_second']:,.0f} tok/s")
    if job.get("eta_s"):
        parts.append(f"ETA {job['eta_s']:.0f}s")
    if job.get("last_checkpoint_step") is not None:
        parts.append(f"checkpoint {job['last_checkpoint_step']} ({job['last_checkpoint_age_s']:.0f}s ago)")
    parts.append(f"restarts {job['restarts']}/{job['max_restarts']}")
    if job.get("rollbacks"):
        parts.append(f"rollbacks {job['rollbacks']}/{job['max_rollbacks']}")
    if job.get("run_id") and job["run_id"] != job["name"]:
        parts.append(f"run {job['run_id']}")
    if job.get("priority"):
        parts.append(f"priority {job['priority']}")
    return parts
