"""`coord doctor`: every link the job's backend will use, measured against its baseline
(the measuring is coordinator/readiness/doctor.py, the verdicts coordinator/readiness/link_verdict.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from coordinator.readiness.doctor import (
    DEFAULT_BYTES,
    DEFAULT_SECONDS,
    QUICK_BYTES,
    QUICK_SECONDS,
    DoctorReport,
    LinkReport,
    measure_fabric,
)
from coordinator.readiness.link_verdict import bps_text
from shared import protocol as p
from shared.rpc import Emit, RemoteError

if TYPE_CHECKING:
    from rich.console import Console

    from coordinator.nodes.cluster import Cluster

MAX_BYTES = 8 * 2**30
MAX_SECONDS = 600.0


async def serve_doctor(cluster: Cluster, training: Callable[[], dict[str, str]], emit: Emit, *,
                       all_pairs: bool = False, bytes: int | None = None,  # noqa: A002 (the wire's name)
                       seconds: float | None = None, quick: bool = False, set_baseline: bool = False,
                       while_training: bool = False, ibv_devices: list[Any] | None = None) -> DoctorReport:
    size = (QUICK_BYTES if quick else DEFAULT_BYTES) if bytes is None else bytes
    limit = (QUICK_SECONDS if quick else DEFAULT_SECONDS) if seconds is None else seconds
    if not 0 <= size <= MAX_BYTES:
        raise RemoteError(p.BAD_ARGS, f"bytes must be from 0 to {MAX_BYTES}, got {size}")
    if not 0 < limit <= MAX_SECONDS:
        raise RemoteError(p.BAD_ARGS, f"seconds must be more than 0 and at most {MAX_SECONDS:g}, got {limit}")
    busy = training()
    if busy and not while_training:
        held = ", ".join(f"{node} ({job})" for node, job in sorted(busy.items()))
        raise RemoteError(p.REFUSED, f"a job trains on {held}: measuring its links would take its bandwidth; "
                                     "run `coord doctor` once it is done, or add --while-training")

    async def said(link: LinkReport) -> None:
        await emit({"node": f"{link['a']}↔{link['b']}", "progress": link["verdict"], "fraction": 1.0})

    report = await measure_fabric(cluster, all_pairs=all_pairs, size=size, seconds=limit, quick=quick,
                                  set_baseline=set_baseline, ibv_devices=ibv_devices, on_link=said)
    named = "; ".join(f"{link['a']} ↔ {link['b']} {link['verdict']}" for link in report["links"]
                      if link["verdict"] != "ok")
    cluster.record_event("doctor.done", f"doctor {report['status']}: {len(report['links'])} links in "
                                        f"{report['seconds']:.1f} s" + (f"; {named}" if named else ""),
                         data={"status": report["status"], "links": len(report["links"])})
    return report


def render_doctor(report: DoctorReport, console: Console) -> None:
    from rich.table import Table

    if report["error"]:
        console.print(f"[red]no link measured[/]: {report['error']}", soft_wrap=True)
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("LINK", "INTERFACE", "KIND", "→", "←", "LATENCY", "MTU", "BASELINE", "VERDICT"):
        table.add_column(column)
    colours = {"ok": "green", "slow": "yellow", "down": "red", "wrong-route": "red"}
    for link in report["links"]:
        interfaces = link["interface"] or "-"
        if link["peer_interface"] and link["peer_interface"] != link["interface"]:
            interfaces += f"/{link['peer_interface']}"
        mtus = "/".join(str(m) if m else "?" for m in (link["mtu"], link["peer_mtu"]))
        table.add_row(f"{link['a']} ↔ {link['b']}", interfaces, link["kind"] or "-",
                      bps_text(link["bits_per_second"]), bps_text(link["reverse_bits_per_second"]),
                      f"{link['latency_ms']:.2f} ms" if link["latency_ms"] is not None else "-", mtus,
                      bps_text(link["baseline_bits_per_second"]) if link["baseline_bits_per_second"] else "-",
                      f"[{colours.get(link['verdict'], 'white')}]{link['verdict']}[/]")
    console.print(table)
    for link in report["links"]:
        if link["cause"]:
            console.print(f"{link['a']} ↔ {link['b']}: {link['cause']}", soft_wrap=True, markup=False)
            if link["fix"]:
                console.print(f"  fix: {link['fix']}", soft_wrap=True, markup=False)
    for problem in report["rdma"]:
        console.print(f"[red]{problem['node']}[/]: {problem['cause']}", soft_wrap=True)
        console.print(f"  fix: {problem['fix']}", soft_wrap=True, markup=False)
    if report["baselines_set"]:
        console.print(f"baseline kept for {', '.join(report['baselines_set'])}", soft_wrap=True, markup=False)
    console.print(f"{report['status']}: {len(report['links'])} links ({report['pairs']}, backend "
                  f"{report['backend'] or 'unknown'}) in {report['seconds']:.1f} s, at most "
                  f"{report['bytes']} bytes each way per link", soft_wrap=True, markup=False)
