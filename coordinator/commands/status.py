"""`coord status`: what the cluster looks like, from the daemon's memory."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from coordinator.jobs.supervisor import ACTIVE

if TYPE_CHECKING:
    from coordinator.daemon import Daemon


MAX_EVENTS = 10_000


def recent_events(daemon: "Daemon", count: int) -> list[dict[str, Any]]:
    """The newest ``count`` events: from memory when it holds that many (the common, fast case),
    else from the store, which keeps them all; never silently fewer than asked for and kept."""
    count = min(max(0, count), MAX_EVENTS)
    if not count:
        return []
    held = daemon.cluster.events
    if count <= len(held) or len(held) < (held.maxlen or 0):
        return list(held)[-count:]
    return daemon.state.recent_events(count)


def serve_status(daemon: "Daemon", *, events: int = 10, every_run: bool = False) -> dict[str, Any]:
    """The daemon half: a plain document, the same one `--json` prints. Jobs are each name's newest
    run and any run still going; ``every_run`` adds every earlier run too."""
    nodes = daemon.cluster.node_views()
    recent = recent_events(daemon, events)
    return {
        "cluster": {"name": daemon.config.name},
        "daemon": daemon.info(),
        "dashboard": daemon.dashboard_url(),
        "time": time.time(),
        "summary": {"nodes": len(nodes), "up": sum(n["state"] == "up" for n in nodes)},
        "nodes": nodes,
        "jobs": [runner.view() for runner in daemon.runs.values()
                 if every_run or daemon.jobs.get(runner.spec.name) is runner or runner.state in ACTIVE],
        "events": recent,
    }


def render_status(doc: dict[str, Any], console) -> None:
    """The CLI half: a table of nodes, the reasons of those not up, the last events."""
    from rich.table import Table

    now = doc.get("time", time.time())
    summary = doc["summary"]
    console.print(f"cluster [bold]{doc['cluster']['name']}[/]: {summary['up']}/{summary['nodes']} nodes up "
                  f"(coordd pid {doc['daemon']['pid']}, up {_age(now - doc['daemon']['started'])})")
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("NODE", "USER@HOST", "STATE", "CHIP", "MEMORY", "OS", "PYTHON", "MLX", "MLX-LM", "LAST SEEN"):
        table.add_column(column, no_wrap=True)
    styles = {"up": "green", "down": "red", "connecting": "yellow", "installing": "yellow"}
    for node in doc["nodes"]:
        facts = node.get("facts") or {}
        user = facts.get("user") or node.get("user")
        where = f"{user}@{node['host']}" if user else node["host"]
        table.add_row(
            node["name"], where, f"[{styles.get(node['state'], 'white')}]{node['state']}[/]",
            _text(facts.get("chip")), _bytes(facts.get("memory_bytes")),
            _text(" ".join(x for x in (facts.get("os"), facts.get("os_version")) if x) or None),
            _text(facts.get("python_version")), _text(facts.get("mlx_version")), _text(facts.get("mlx_lm_version")),
            _age(now - node["last_seen"]) + " ago" if node.get("last_seen") else "never",
        )
    console.print(table)
    if doc.get("dashboard"):
        console.print(f"dashboard: {doc['dashboard']}", markup=False, highlight=False)
    for node in doc["nodes"]:
        if node["state"] != "up" and node.get("reason"):
            console.print(f"[red]{node['name']}[/] {node['state']}: {node['reason']}", soft_wrap=True)
    if doc.get("jobs"):
        from coordinator.commands.jobs import render_job

        console.print("\n[bold]jobs[/]")
        for job in doc["jobs"]:
            console.print("  " + render_job(job), soft_wrap=True, markup=False, highlight=False)
        active = [j["name"] for j in doc["jobs"] if j["state"] not in ("succeeded", "failed", "stopped")]
        if active:
            console.print(f"  next: coord logs -f {active[0]}   coord stop {active[0]}", markup=False)
    if doc.get("events"):
        console.print("\n[bold]recent events[/]")
        for event in doc["events"]:
            stamp = time.strftime("%H:%M:%S", time.localtime(event["ts"]))
            console.print(f"  {stamp}  {event['message']}", soft_wrap=True, markup=False, highlight=False)


def _text(value: Any) -> str:
    return "unknown" if value is None else str(value)


def _bytes(value: int | None) -> str:
    if value is None:
        return "unknown"
    return f"{value / 2**30:.0f} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
