"""What the dashboard shows, as one plain JSON document built from the daemon's state.

The page (static/) draws this document and nothing else; the web server sends it once on
connect and again whenever it changes. Everything here is read-only: the dashboard can see
the cluster, never steer it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from coordinator.jobs.supervisor import ACTIVE
from coordinator.jobs.view import RunView

if TYPE_CHECKING:
    from coordinator.jobs.supervisor import JobRunner
    from coordinator.launch.seam import LaunchLinks
    from coordinator.nodes.cluster import Cluster, ClusterNodeView
    from coordinator.observe.metrics.history import RunHistory, UsageSample
    from coordinator.store.state import CheckpointRow, EventRecord

#: How many finished runs the page lists beside the active and queued ones.
FINISHED_SHOWN = 10
#: How many of a run's newest checkpoint steps the page lists.
CHECKPOINTS_SHOWN = 8
EVENTS_SHOWN = 60


class CheckpointCopy(TypedDict):
    node: str
    role: str  # primary, replica or placed
    valid: bool
    attempt: int
    detail: str | None


class CheckpointStep(TypedDict):
    step: int
    age_s: float | None
    valid: bool  # any copy is
    size: int | None
    copies: list[CheckpointCopy]


class DashboardNode(TypedDict):
    name: str
    state: str
    reason: str | None
    chip: str | None
    memory_bytes: int | None
    os: str | None
    python: str | None
    mlx: str | None
    mlx_lm: str | None
    last_seen: float | None
    user: str | None
    host: str | None
    memory_used_bytes: int | None
    gpu_utilization: float | None
    power_watts: float | None
    temperature_c: float | None
    needs_reboot: str | None  # why it takes no part in jobs until it is rebooted, and the fix


class DashboardRun(RunView):
    """A run as JobRunner.view() shows it, with what the page draws of it beside."""

    checkpoints: list[CheckpointStep]
    backend: LaunchLinks | None
    history: NotRequired[RunHistory | None]  # its curves: for the runs still going and the first listed
    compute_heat: list[list[Any]]  # [step, [each rank's compute time]]: the rank x step heatmap, while running


class DashboardLink(TypedDict):
    """A link's last figures from `coord doctor`, beside its baseline (coordinator/readiness/doctor.py)."""

    a: str
    b: str
    interface: str | None
    bits_per_second: float | None
    reverse_bits_per_second: float | None
    baseline_bits_per_second: float | None
    verdict: str
    measured_at: float | None


class DashboardDocument(TypedDict):
    cluster: str
    time: float
    nodes: list[DashboardNode]
    jobs: list[DashboardRun]
    events: list[EventRecord]
    links: list[DashboardLink]


def link_entries(last: Mapping[tuple[str, str], Mapping[str, Any]]) -> list[DashboardLink]:
    """Each link's last figures as `coord doctor` kept them (the store's ``links`` table, role last)."""
    return [{"a": a, "b": b, "interface": link.get("interface"), "bits_per_second": link.get("bits_per_second"),
             "reverse_bits_per_second": link.get("reverse_bits_per_second"),
             "baseline_bits_per_second": link.get("baseline_bits_per_second"),
             "verdict": str(link.get("verdict") or "unknown"), "measured_at": link.get("measured_at")}
            for (a, b), link in sorted(last.items())]


def shown_runs(runners: list[JobRunner]) -> list[JobRunner]:
    """Active and queued runs first (queue order), then the newest finished ones."""
    active = [r for r in runners if r.state in ACTIVE]
    finished = [r for r in runners if r.state not in ACTIVE]
    finished.sort(key=lambda r: r.record.started or 0, reverse=True)
    active.sort(key=lambda r: (r.state == "queued", r.queue_position or 0, -(r.record.started or 0)))
    return active + finished[:FINISHED_SHOWN]


def checkpoint_rows(rows: list[CheckpointRow], now: float) -> list[CheckpointStep]:
    """A run's catalogued checkpoints by step, newest first: each with its age, whether any
    copy is valid, and where every copy is (node and role: primary, replica, placed)."""
    by_step: dict[int, list[CheckpointRow]] = defaultdict(list)
    for row in rows:
        by_step[row["step"]].append(row)
    out: list[CheckpointStep] = []
    for step in sorted(by_step, reverse=True)[:CHECKPOINTS_SHOWN]:
        copies = by_step[step]
        created = min(c["created"] for c in copies if c.get("created") is not None) if any(
            c.get("created") is not None for c in copies) else None
        out.append({"step": step, "age_s": None if created is None else max(0.0, now - created),
                    "valid": any(c["valid"] for c in copies),
                    "size": next((c["size"] for c in copies if c.get("size")), None),
                    "copies": [{"node": c["node"], "role": c["role"], "valid": c["valid"],
                                "attempt": c["attempt"], "detail": c.get("detail")} for c in copies]})
    return out


def node_entry(view: ClusterNodeView, usage: UsageSample | None = None) -> DashboardNode:
    """The part of a node's view the page draws (no paths, no keys), with its latest usage
    sample (memory in use; on Macs GPU use and power where macOS gives them without root)."""
    facts: Mapping[str, Any] = view.get("facts") or {}
    sample: Mapping[str, Any] = usage or {}
    return {"name": view["name"], "state": view["state"], "reason": view.get("reason"),
            "chip": facts.get("chip"), "memory_bytes": facts.get("memory_bytes"),
            "os": " ".join(x for x in (facts.get("os"), facts.get("os_version")) if x) or None,
            "python": facts.get("python_version"), "mlx": facts.get("mlx_version"),
            "mlx_lm": facts.get("mlx_lm_version"),
            "last_seen": view.get("last_seen"), "user": view.get("user"), "host": view.get("host"),
            "memory_used_bytes": sample.get("memory_used_bytes"), "gpu_utilization": sample.get("gpu_utilization"),
            "power_watts": sample.get("power_watts"), "temperature_c": sample.get("temperature_c"),
            "needs_reboot": f"{mark['reason']}; fix: {mark['fix']}" if (mark := view.get("needs_reboot")) else None}


def dashboard_document(cluster: Cluster, runs: list[JobRunner], *,
                       history: Callable[[str], RunHistory | None] | None = None,
                       usage: Mapping[str, UsageSample] | None = None, now: float | None = None) -> DashboardDocument:
    """The whole page's data. ``history(run_id)`` gives a run's metric points (its curves);
    ``usage`` each node's latest usage sample."""
    now = time.time() if now is None else now
    runners = shown_runs(runs)
    jobs: list[DashboardRun] = []
    for runner in runners:
        view: DashboardRun = {**runner.view(),
                              "checkpoints": checkpoint_rows(cluster.state.checkpoints(runner.run_id), now),
                              "backend": runner.record.backend,
                              "compute_heat": list(runner.record.compute_heat) if runner.state == "running" else []}
        # Live curves for the runs still going and the first run listed (the page's choice when
        # nothing runs); another finished run's the page asks /api/history for once, when chosen.
        if history is not None and (runner.state in ACTIVE or runner is runners[0]):
            view["history"] = history(runner.run_id)
        jobs.append(view)
    nodes = [node_entry(v, (usage or {}).get(v["name"])) for v in cluster.node_views()]
    return {"cluster": cluster.config.name, "time": now, "nodes": nodes, "jobs": jobs,
            "events": list(cluster.events)[-EVENTS_SHOWN:], "links": link_entries(cluster.state.links("last"))}
