"""`coord status`: what the cluster looks like, from the daemon's memory."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NotRequired, Required, TypedDict

from shared.json_values import value_text

# Types named for the checker only: the CLI imports this module to draw status, and keeps its
# start-up free of the daemon's modules.
if TYPE_CHECKING:
    from rich.console import Console

    from coordinator.jobs.manager import JobManager
    from coordinator.jobs.view import RunView
    from coordinator.nodes.cluster import Cluster, ClusterNodeView
    from coordinator.observe.metrics.history import HistoryDocument
    from coordinator.store.state import EventRecord


MAX_EVENTS = 10_000


class DaemonInfo(TypedDict):
    """Which daemon answered, and where it keeps its state."""

    pid: int
    version: str
    started: float
    socket: str
    state_dir: str
    config: str | None  # the cluster file


class DashboardInfo(TypedDict, total=False):
    """Where the daemon's HTTP server answers, or why it does not."""

    url: Required[str | None]
    metrics: str | None
    token_required: bool
    error: Required[str | None]


class ClusterName(TypedDict):
    name: str


class StatusSummary(TypedDict):
    nodes: int
    up: int


class StatusDocument(TypedDict):
    """``coord status --json`` (and the web server's /api/status)."""

    cluster: ClusterName
    daemon: DaemonInfo
    dashboard: DashboardInfo
    time: float
    summary: StatusSummary
    nodes: list[ClusterNodeView]
    jobs: list[RunView]  # each run as JobRunner.view() shows it
    events: list[EventRecord]
    history: NotRequired[HistoryDocument]  # with --history


def recent_events(cluster: Cluster, count: int) -> list[EventRecord]:
    """The newest ``count`` events: from memory when it holds that many (the common, fast case),
    else from the store, which keeps them all; never silently fewer than asked for and kept."""
    count = min(max(0, count), MAX_EVENTS)
    if not count:
        return []
    held = cluster.events
    # Memory holds only this daemon's newest events: a daemon restarted a moment ago holds few,
    # while the store still has its predecessors' (they were missing from coord status).
    if count <= len(held):
        return list(held)[-count:]
    return cluster.state.recent_events(count)


def serve_status(cluster: Cluster, jobs: JobManager, *, daemon: DaemonInfo, dashboard: DashboardInfo,
                 events: int = 10, every_run: bool = False) -> StatusDocument:
    """The daemon half: a plain document, the same one `--json` prints. Jobs are each name's newest
    run and any run still going; ``every_run`` adds every earlier run too. ``daemon`` and
    ``dashboard`` say where the daemon and its web server are."""
    nodes = cluster.node_views()
    recent = recent_events(cluster, events)
    return {
        "cluster": {"name": cluster.config.name},
        "daemon": daemon,
        "dashboard": dashboard,
        "time": time.time(),
        "summary": {"nodes": len(nodes), "up": sum(n["state"] == "up" for n in nodes)},
        "nodes": nodes,
        "jobs": [runner.view() for runner in jobs.shown_runs(every_run=every_run)],
        "events": recent,
    }


def render_status(doc: StatusDocument, console: Console) -> None:
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
        state = f"[{styles.get(node['state'], 'white')}]{node['state']}[/]"
        if node.get("needs_reboot"):
            state = f"[red]{node['state']}, needs reboot[/]"
        table.add_row(
            node["name"], where, state,
            _text(facts.get("chip")), _bytes(facts.get("memory_bytes")),
            _text(" ".join(x for x in (facts.get("os"), facts.get("os_version")) if x) or None),
            _text(facts.get("python_version")), _text(facts.get("mlx_version")), _text(facts.get("mlx_lm_version")),
            _age(now - seen) + " ago" if (seen := node.get("last_seen")) else "never",
        )
    console.print(table)
    dashboard: Mapping[str, Any] = doc.get("dashboard") or {}
    if dashboard.get("url"):
        console.print(f"dashboard {dashboard['url']}  metrics {dashboard['metrics']}"
                      + ("  (token required)" if dashboard.get("token_required") else ""),
                      markup=False, highlight=False)
    elif dashboard.get("error"):
        console.print(f"dashboard: {dashboard['error']}", markup=False, highlight=False, soft_wrap=True)
    for node in doc["nodes"]:
        if node["state"] != "up" and node.get("reason"):
            console.print(f"[red]{node['name']}[/] {node['state']}: {node['reason']}", soft_wrap=True)
        if mark := node.get("needs_reboot"):
            console.print(f"{node['name']} needs a reboot (no job runs on it until then): {mark['reason']}\n"
                          f"  fix: {mark['fix']}", soft_wrap=True, markup=False, highlight=False)
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


def _text(value: object) -> str:
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


SPARK = "▁▂▃▄▅▆▇█"


def render_history(history: HistoryDocument, console: Console) -> None:
    """The CLI half of --history: per run a line of its loss curve and the restarts on it, per node
    its memory and GPU use now and at their peak in the window."""
    console.print("\n[bold]history[/]")
    for run in history["runs"]:
        train, val = run["train"], run["val"]
        if not train["step"]:
            console.print(f"  {run['name']} ({run['run_id']}): no points yet", markup=False, highlight=False)
            continue
        losses = [v for v in train["loss"] if v is not None]
        speeds = [v for v in train["tokens_per_second"] if v is not None]
        line = (f"  {run['name']} ({run['run_id']}): {len(train['step'])} points, steps {train['step'][0]}-"
                f"{train['step'][-1]}")
        if losses:
            line += f", loss {value_text(losses[0])} → {value_text(losses[-1])} {sparkline(losses)}"
        if speeds:
            line += f", {speeds[-1]:.0f} tokens/s"
        if val["step"]:
            line += f", val loss {value_text(val['loss'][-1]) if val['loss'][-1] is not None else '-'} at step " \
                    f"{val['step'][-1]}"
        console.print(line, markup=False, highlight=False, soft_wrap=True)
        for attempt in run["attempts"][1:]:
            after = f" after {attempt['detail']}" if attempt["detail"] else ""
            console.print(f"    restart: attempt {attempt['attempt']} from step {attempt['start_step']} on "
                          f"{', '.join(attempt['nodes'])}" + after, markup=False, highlight=False, soft_wrap=True)
    for node in history["nodes"]:
        if not node["time"]:
            continue
        used = [v for v in node["memory_used_bytes"] if v is not None]
        total = next((v for v in reversed(node["memory_total_bytes"]) if v is not None), None)
        gpu = [v for v in node["gpu_utilization"] if v is not None]
        line = f"  {node['name']}: {len(node['time'])} samples"
        if used:
            line += f", memory {_bytes(used[-1])}" + (f" of {_bytes(total)}" if total else "") + \
                    f" (peak {_bytes(max(used))})"
        if gpu:
            line += f", GPU {gpu[-1]:.0f}% (peak {max(gpu):.0f}%)"
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def sparkline(values: list[float], width: int = 24) -> str:
    """``values`` resampled to ``width`` and drawn with block characters, lowest to highest."""
    if not values:
        return ""
    picked = [values[int(i * len(values) / width)] for i in range(min(width, len(values)))]
    finite = [v for v in picked if math.isfinite(v)]
    if not finite:
        return "!" * len(picked)
    low, high = min(finite), max(finite)
    span = (high - low) or 1.0
    # A value that is not finite (a diverged run's NaN loss) is drawn as "!", never as a bar.
    return "".join(SPARK[min(len(SPARK) - 1, int((v - low) / span * len(SPARK)))] if math.isfinite(v) else "!"
                   for v in picked)
