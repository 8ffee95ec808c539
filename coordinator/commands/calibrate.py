"""`coord calibrate`: measure every node at once, keep the results until something changes."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Literal, Required, TypedDict

import anyio

from coordinator.nodes.session import UP
from coordinator.readiness.calibration import (
    WorkloadShares,
    calibration_record,
    is_stale,
    train_rate,
    workload_shares,
)
from shared.agent_api.calibration import CalibrationProgress, CalibrationReply
from shared.rpc import Emit, RemoteError

if TYPE_CHECKING:
    from rich.console import Console

    from coordinator.nodes.cluster import Cluster
    from coordinator.nodes.session import NodeSession


class CalibrateEntry(TypedDict, total=False):
    """One node in ``coord calibrate``'s report."""

    status: Required[Literal["skipped", "reused", "measured", "failed"]]
    detail: Required[str]  # why skipped or failed, why measured or reused
    result: CalibrationReply  # the agent's calibrate answer, as it reported it (agent/calibrate.py)
    measured_at: float


class CalibrateReport(TypedDict):
    nodes: dict[str, CalibrateEntry]
    shares: WorkloadShares
    status: Literal["ok", "failed"]


async def serve_calibrate(cluster: Cluster, emit: Emit, refresh: bool = False, quick: bool = False) -> CalibrateReport:
    entries: dict[str, CalibrateEntry] = {}

    async def one(session: NodeSession) -> None:
        name = session.node.name
        if session.state != UP or not session.view.facts:
            entries[name] = {"status": "skipped", "detail": f"node is {session.state}"}
            return
        facts = session.view.facts
        stored = cluster.state.calibration(name)
        stale, reason = is_stale(stored, facts, refresh=refresh)
        if not stale and stored is not None:  # (a calibration is stale when there is none)
            entries[name] = {"status": "reused", "detail": reason, "result": stored["result"],
                             "measured_at": stored["measured_at"]}
            return

        async def progress(event: CalibrationProgress) -> None:  # the agent's progress report, passed on
            await emit({"node": name, **event})

        await emit({"node": name, "progress": f"measuring ({reason})", "fraction": 0.0})
        try:
            result: CalibrationReply = await session.call(
                "calibrate", {"python": session.node.python, "workdir": session.node.workdir, "quick": quick},
                timeout=900, on_event=progress)
        except RemoteError as exc:
            entries[name] = {"status": "failed", "detail": exc.message}
            return
        if not result.get("ok"):
            entries[name] = {"status": "failed", "detail": result.get("error", "calibration failed"), "result": result}
            return
        record = calibration_record(facts, result)
        cluster.state.save_calibration(name, record)
        entries[name] = {"status": "measured", "detail": reason, "result": result, "measured_at": time.time()}

    async with anyio.create_task_group() as tasks:
        for session in cluster.sessions.values():
            tasks.start_soon(one, session)
    rates = {name: train_rate(entry.get("result")) if entry["status"] in ("measured", "reused") else None
             for name, entry in entries.items()}
    shares = workload_shares(rates)
    failed = [n for n, e in entries.items() if e["status"] in ("failed", "skipped")]
    report: CalibrateReport = {"nodes": entries, "shares": shares, "status": "failed" if failed else "ok"}
    measured = [n for n, e in entries.items() if e["status"] == "measured"]
    cluster.record_event("calibrate.done", f"calibration {report['status']}: measured {len(measured)}, "
                                           f"reused {sum(e['status'] == 'reused' for e in entries.values())}, "
                                           f"shares {shares['policy']}")
    return report


def render_calibrate(report: CalibrateReport, console: Console) -> None:
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("NODE", "STATUS", "DEVICE", "FP32 GFLOP/S", "BF16 GFLOP/S", "MEM GB/S", "PEAK MEM",
                   "TRAIN SAMPLES/S", "SHARE", "MEASURED"):
        table.add_column(column)
    shares = report["shares"]["shares"]
    for name, entry in sorted(report["nodes"].items()):
        result = entry.get("result") or {}
        gflops = result.get("matmul_gflops") or {}
        table.add_row(name, entry["status"], str(result.get("device", "-")), _num(gflops.get("float32")),
                      _num(gflops.get("bfloat16")), _num(result.get("memory_bandwidth_gbps")),
                      _gib(result.get("peak_memory_bytes")), _num(result.get("train_samples_per_s")),
                      f"{shares.get(name, 0):.3f}",
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(entry["measured_at"]))
                      if entry.get("measured_at") else "-")
    console.print(table)
    for name, entry in sorted(report["nodes"].items()):
        if entry["status"] in ("failed", "skipped"):
            console.print(f"[red]{name}[/]: {entry['detail']}", soft_wrap=True)
    console.print(f"workload shares: {report['shares']['policy']} ({report['shares']['reason']})", soft_wrap=True,
                  markup=False)


def _num(value: float | None) -> str:
    return "unknown" if value is None else f"{value:,.1f}"


def _gib(value: int | None) -> str:
    return "unknown" if value is None else f"{value / 2**30:.0f} GiB"
