"""What the dashboard shows, as one plain JSON document built from the daemon's state.

The page (static/) draws this document and nothing else; the web server sends it once on
connect and again whenever it changes. Everything here is read-only: the dashboard can see
the cluster, never steer it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from coordinator.jobs.supervisor import ACTIVE

if TYPE_CHECKING:
    from coordinator.jobs.supervisor import JobRunner
    from coordinator.nodes.cluster import Cluster

#: How many finished runs the page lists beside the active and queued ones.
FINISHED_SHOWN = 10
#: How many of a run's newest checkpoint steps the page lists.
CHECKPOINTS_SHOWN = 8
EVENTS_SHOWN = 60


def shown_runs(runners: list[Any]) -> list[Any]:
    """Active and queued runs first (queue order), then the newest finished ones."""
    active = [r for r in runners if r.state in ACTIVE]
    finished = [r for r in runners if r.state not in ACTIVE]
    finished.sort(key=lambda r: r.record.get("started") or 0, reverse=True)
    active.sort(key=lambda r: (r.state == "queued", r.queue_position or 0, -(r.record.get("started") or 0)))
    return active + finished[:FINISHED_SHOWN]


def checkpoint_rows(rows: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """A run's catalogued checkpoints by step, newest first: each with its age, whether any
    copy is valid, and where every copy is (node and role: primary, replica, placed)."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_step[row["step"]].append(row)
    out = []
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


def node_entry(view: dict[str, Any], usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """The part of a node's view the page draws (no paths, no keys), with its latest usage
    sample (memory in use; on Macs GPU use and power where macOS gives them without root)."""
    facts = view.get("facts") or {}
    usage = usage or {}
    return {"name": view["name"], "state": view["state"], "reason": view.get("reason"),
            "chip": facts.get("chip"), "memory_bytes": facts.get("memory_bytes"),
            "os": " ".join(x for x in (facts.get("os"), facts.get("os_version")) if x) or None,
            "python": facts.get("python_version"), "mlx": facts.get("mlx_version"),
            "mlx_lm": facts.get("mlx_lm_version"),
            "last_seen": view.get("last_seen"), "user": view.get("user"), "host": view.get("host"),
            "memory_used_bytes": usage.get("memory_used_bytes"), "gpu_utilization": usage.get("gpu_utilization"),
            "power_watts": usage.get("power_watts"), "temperature_c": usage.get("temperature_c")}


def dashboard_document(cluster: Cluster, runs: list[JobRunner], *, history: Callable[[str], dict[str, Any] | None] | None = None,
                       usage: dict[str, dict[str, Any]] | None = None, now: float | None = None) -> dict[str, Any]:
    """The whole page's data. ``history(run_id)`` gives a run's metric points (its curves);
    ``usage`` each node's latest usage sample."""
    now = time.time() if now is None else now
    runners = shown_runs(runs)
    jobs = []
    for runner in runners:
        view = runner.view()
        view["checkpoints"] = checkpoint_rows(cluster.state.checkpoints(runner.run_id), now)
        view["backend"] = runner.record.get("backend")
        # Live curves for the runs still going and the first run listed (the page's choice when
        # nothing runs); another finished run's the page asks /api/history for once, when chosen.
        if history is not None and (runner.state in ACTIVE or runner is runners[0]):
            view["history"] = history(runner.run_id)
        jobs.append(view)
    nodes = [node_entry(v, (usage or {}).get(v["name"])) for v in cluster.node_views()]
    return {"cluster": cluster.config.name, "time": now, "nodes": nodes, "jobs": jobs,
            "events": list(cluster.events)[-EVENTS_SHOWN:]}
