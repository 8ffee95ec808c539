"""``coord doctor``'s measurement: every link the job's backend will use (ring neighbours, or every pair),
each over the interface and address coord would put in the hostfile, judged against its baseline
(coordinator/readiness/link_verdict.py), and the RDMA devices a saved hostfile names checked against
what each node has now. Pre-flight runs the quick form (latency and a short burst).

The links are measured one after another, so no two probes share a node's bandwidth, each within its
share of the whole run's time limit: a run costs at most ``--bytes`` each way per link and the limit.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import secrets
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict

import anyio

from coordinator.launch.plan import node_topologies, plan_backend
from coordinator.launch.topology import Topology, connectivity_matrix
from coordinator.nodes.session import UP
from coordinator.readiness.link_verdict import (
    Baseline,
    Judgement,
    LinkFigures,
    RdmaProblem,
    baseline_from,
    judge_link,
    keeps_as_first_baseline,
    rdma_problems,
)
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.launch.topology import Link, Matrix
    from coordinator.nodes.cluster import Cluster
    from shared.agent_api.link import LinkMeasureReply, LinkRouteReply

DEFAULT_BYTES = 64 * 2**20
DEFAULT_SECONDS = 30.0
QUICK_BYTES = 4 * 2**20
QUICK_SECONDS = 6.0
MIN_LINK_SECONDS = 0.5
CALL_SLACK_S = 10.0  # beyond a probe's own limit, for the calls around it


class LinkReport(TypedDict):
    """One link of ``coord doctor --json``."""

    a: str
    b: str
    interface: str | None
    peer_interface: str | None
    kind: str | None
    address: str | None
    peer_address: str | None
    bits_per_second: float | None
    reverse_bits_per_second: float | None
    latency_ms: float | None
    mtu: int | None
    peer_mtu: int | None
    route_interface: str | None
    peer_route_interface: str | None
    baseline_bits_per_second: float | None
    baseline_reverse_bits_per_second: float | None
    verdict: str
    cause: str
    fix: str
    seconds: float
    detail: str


class DoctorReport(TypedDict):
    links: list[LinkReport]
    rdma: list[RdmaProblem]
    backend: str | None
    pairs: str  # "ring" or "all"
    quick: bool
    bytes: int
    seconds_limit: float
    seconds: float
    baselines_set: list[str]  # "a ↔ b" of each link whose baseline this run wrote
    status: str  # "ok", or the worst verdict
    error: str | None  # why nothing could be measured


def link_pairs(order: list[str], *, all_pairs: bool) -> list[tuple[str, str]]:
    """The links to measure: each ring neighbour once (a probe goes both ways), or every pair."""
    if len(order) < 2:
        return []
    if all_pairs:
        return list(itertools.combinations(order, 2))
    if len(order) == 2:
        return [(order[0], order[1])]
    return [(order[i], order[(i + 1) % len(order)]) for i in range(len(order))]


def worst(verdicts: list[str]) -> str:
    for verdict in ("down", "wrong-route", "slow"):
        if verdict in verdicts:
            return verdict
    return "ok"


async def measure_fabric(cluster: Cluster, *, all_pairs: bool = False, size: int = DEFAULT_BYTES,
                         seconds: float = DEFAULT_SECONDS, quick: bool = False, set_baseline: bool = False,
                         ibv_devices: list[Any] | None = None,
                         on_link: Callable[[LinkReport], Any] | None = None,
                         topologies: dict[str, Topology] | None = None, nodes: list[str] | None = None,
                         record: bool = True) -> DoctorReport:
    """Measure and judge the links. ``quick``: a short burst, judged for down and wrong-route only.
    ``topologies`` and ``nodes``: what pre-flight read already, and the nodes a job holds.
    ``record=False`` keeps nothing in the store (pre-flight's quick look)."""
    started = time.monotonic()
    if topologies is None:
        topologies = await node_topologies(cluster)
    report: DoctorReport = {"links": [], "rdma": [], "backend": None, "pairs": "all" if all_pairs else "ring",
                            "quick": quick, "bytes": size, "seconds_limit": seconds, "seconds": 0.0,
                            "baselines_set": [], "status": "ok", "error": None}
    choice, _document, error = plan_backend(cluster, topologies, nodes=nodes)
    names = nodes or [node.name for node in cluster.config.nodes]
    order = list((choice or {}).get("order") or names) if choice and choice.get("ok") else names
    report["backend"] = choice.get("backend") if choice else None
    up = [n for n in order if n in topologies]
    if len(up) < 2:
        report["error"] = error or f"doctor measures links between two nodes or more; up now: {', '.join(up) or 'none'}"
        report["status"] = "down"
        report["seconds"] = round(time.monotonic() - started, 3)
        return report
    matrix = connectivity_matrix(topologies)
    pairs = link_pairs(up, all_pairs=all_pairs)
    baselines = cluster.state.links("baseline")
    found: dict[tuple[str, str], LinkReport] = {}

    async def one(a: str, b: str, limit: float) -> None:
        link_started = time.monotonic()
        baseline = _baseline(baselines, a, b)
        figures = await measure_link(cluster, matrix, topologies, a, b, size=size, seconds=limit, baseline=baseline)
        link = _judged(cluster, report, figures, baseline, quick=quick, set_baseline=set_baseline, record=record)
        link["seconds"] = round(time.monotonic() - link_started, 3)
        found[(a, b)] = link
        if on_link is not None:
            await on_link(link)

    if quick:
        # A short burst judges no rate, so the links may share the nodes' bandwidth: all at once, each
        # within the whole limit, keep pre-flight's cost to about one link's.
        async with anyio.create_task_group() as tasks:
            for a, b in pairs:
                tasks.start_soon(one, a, b, seconds)
    else:
        for a, b in pairs:  # one after another, so no two probes share a node's bandwidth
            await one(a, b, max(seconds / len(pairs), MIN_LINK_SECONDS))
    report["links"] = [found[pair] for pair in pairs]
    named, source = _named_rdma(cluster, order, ibv_devices)
    report["rdma"] = rdma_problems(named, _present_rdma(topologies), source)
    verdicts = [link["verdict"] for link in report["links"]] + (["down"] if report["rdma"] else [])
    report["status"] = worst(verdicts)
    report["seconds"] = round(time.monotonic() - started, 3)
    return report


def _judged(cluster: Cluster, report: DoctorReport, figures: LinkFigures, baseline: Baseline | None, *,
            quick: bool, set_baseline: bool, record: bool) -> LinkReport:
    """The link's verdict, its baseline kept where this is its first healthy measurement or asked
    (--set-baseline), and its last figures kept."""
    a, b = figures["a"], figures["b"]
    now = time.time()
    if set_baseline and figures["connected"]:
        # The figures become the link's reference: this run is judged against them, not the old one.
        figures["interfaces_down"] = []
        baseline = _keep_baseline(cluster, report, figures, now, record)
    judgement = judge_link(figures, baseline, speed=not quick)
    if baseline is None and not quick and keeps_as_first_baseline(figures, judgement):
        baseline = _keep_baseline(cluster, report, figures, now, record)
    link = _link_report(figures, judgement, baseline)
    if record:
        cluster.state.forget_link(b, a, "last")
        cluster.state.save_link(a, b, "last", {**link, "measured_at": now}, now)
    return link


def _keep_baseline(cluster: Cluster, report: DoctorReport, figures: LinkFigures, now: float,
                   record: bool) -> Baseline:
    baseline = baseline_from(figures, now)
    if record:
        a, b = figures["a"], figures["b"]
        cluster.state.forget_link(b, a, "baseline")  # one baseline a link, from the side last measured
        cluster.state.save_link(a, b, "baseline", dict(baseline))
        report["baselines_set"].append(f"{a} ↔ {b}")
    return baseline


def _baseline(baselines: Mapping[tuple[str, str], Any], a: str, b: str) -> Baseline | None:
    """The link's baseline, from a's side: one measured the other way round (the ring's order changed)
    has its two ends swapped."""
    found = baselines.get((a, b))
    if isinstance(found, dict):
        return found  # type: ignore[return-value]
    other = baselines.get((b, a))
    if not isinstance(other, dict):
        return None
    swapped = dict(other)
    for one, two in (("interface", "peer_interface"), ("bits_per_second", "reverse_bits_per_second")):
        swapped[one], swapped[two] = other.get(two), other.get(one)
    return swapped  # type: ignore[return-value]


def _link_report(figures: LinkFigures, judgement: Judgement, baseline: Baseline | None) -> LinkReport:
    return {"a": figures["a"], "b": figures["b"], "interface": figures["interface"],
            "peer_interface": figures["peer_interface"], "kind": figures["kind"], "address": figures["address"],
            "peer_address": figures["peer_address"], "bits_per_second": figures["bits_per_second"],
            "reverse_bits_per_second": figures["reverse_bits_per_second"], "latency_ms": figures["latency_ms"],
            "mtu": figures["mtu"], "peer_mtu": figures["peer_mtu"], "route_interface": figures["route_interface"],
            "peer_route_interface": figures["peer_route_interface"],
            "baseline_bits_per_second": baseline["bits_per_second"] if baseline else None,
            "baseline_reverse_bits_per_second": baseline["reverse_bits_per_second"] if baseline else None,
            "verdict": judgement["verdict"], "cause": judgement["cause"], "fix": judgement["fix"],
            "seconds": 0.0, "detail": figures["detail"]}


# --- one link ----------------------------------------------------------------------------------------


def chosen_link(cluster: Cluster, matrix: Matrix, a: str, b: str) -> Link | None:
    """The link coord would put in the hostfile between a and b: the best shared subnet; loopback for
    two nodes that are both this machine; b's address from the cluster file where it gives one (the
    hostfile's then), over whatever interface the kernel picks ("" for an address or interface unknown)."""
    by_name = {node.name: node for node in cluster.config.nodes}
    if by_name[a].is_local and by_name[b].is_local:
        return {"kind": "loopback", "local_interface": "lo", "local_ip": "127.0.0.1", "peer_interface": "lo",
                "peer_ip": "127.0.0.1", "network": "127.0.0.0/8"}
    best: Link | None = matrix["pairs"].get(a, {}).get(b, {}).get("best")  # type: ignore[call-overload]
    configured = by_name[b].ips
    if configured and (best is None or best["peer_ip"] not in configured):
        return {"kind": "other", "local_interface": None, "local_ip": by_name[a].ips[0] if by_name[a].ips else "",
                "peer_interface": None, "peer_ip": configured[0], "network": ""}
    return best


async def measure_link(cluster: Cluster, matrix: Matrix, topologies: Mapping[str, Topology], a: str, b: str, *,
                       size: int, seconds: float, baseline: Baseline | None) -> LinkFigures:
    link = chosen_link(cluster, matrix, a, b)
    view = matrix["pairs"].get(a, {}).get(b)
    figures: LinkFigures = {
        "a": a, "b": b, "interface": link["local_interface"] if link else None,
        "peer_interface": link["peer_interface"] if link else None, "kind": link["kind"] if link else None,
        "address": link["local_ip"] if link else None, "peer_address": link["peer_ip"] if link else None,
        "connected": False, "complete": False, "bits_per_second": None, "reverse_bits_per_second": None,
        "latency_ms": None, "route_interface": None, "peer_route_interface": None, "mtu": None, "peer_mtu": None,
        # A Thunderbolt cable's speed as both ends report it; else the interface's, read below.
        "speed_bps": view["speed_gbps"] * 1e9 if view and view["speed_gbps"] and link and link["kind"] == "thunderbolt"
        else None,
        "generation": view["generation"] if view else None,
        "cabled": bool(view and view["thunderbolt"]),
        "interfaces_down": _interfaces_down(topologies, a, b, baseline, link),
        "detail": (view["link_detail"] if view else None) or "no shared subnet",
    }
    if link is None:
        return figures
    session_a, session_b = cluster.sessions[a], cluster.sessions[b]
    if session_a.state != UP or session_b.state != UP:
        figures["detail"] = f"{a if session_a.state != UP else b} is not up"
        return figures
    routes: dict[str, LinkRouteReply] = {}

    async def route(node: str, address: str, interface: str | None) -> None:
        with contextlib.suppress(RemoteError, TimeoutError):
            routes[node] = await cluster.sessions[node].call("link_route", {"address": address,
                                                                            "interface": interface}, timeout=15)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(route, a, link["peer_ip"], link["local_interface"])
        tasks.start_soon(route, b, link["local_ip"], link["peer_interface"])
    _read_routes(figures, routes.get(a), routes.get(b), link["kind"] == "loopback")
    measured = await _probe(cluster, a, b, link, size=size, seconds=seconds)
    figures["connected"] = measured["connected"]
    figures["complete"] = measured["complete"]
    figures["bits_per_second"] = measured["bits_per_second"]
    figures["reverse_bits_per_second"] = measured["reverse_bits_per_second"]
    figures["latency_ms"] = measured["latency_ms"]
    figures["detail"] = measured["detail"]
    return figures


def _read_routes(figures: LinkFigures, at_a: LinkRouteReply | None, at_b: LinkRouteReply | None,
                 loopback: bool) -> None:
    for reply, route_key, mtu_key in ((at_a, "route_interface", "mtu"), (at_b, "peer_route_interface", "peer_mtu")):
        if reply is None:
            continue
        route: Mapping[str, Any] = reply.get("route") or {}
        # Two nodes on one machine reach each other's address through lo whatever the interface.
        figures[route_key] = None if loopback else route.get("interface")  # type: ignore[literal-required]
        figures[mtu_key] = reply.get("interface_mtu") or reply.get("route_mtu")  # type: ignore[literal-required]
    if at_a is not None and at_a.get("interface_speed_bps") and figures["speed_bps"] is None:
        figures["speed_bps"] = at_a.get("interface_speed_bps")


async def _probe(cluster: Cluster, a: str, b: str, link: Link, *, size: int, seconds: float) -> LinkMeasureReply:
    token = secrets.token_hex(12)
    failed: LinkMeasureReply = {"connected": False, "latency_ms": None, "bits_per_second": None,
                                "reverse_bits_per_second": None, "bytes_up": 0, "bytes_down": 0, "seconds": 0.0,
                                "complete": False, "detail": ""}
    listener, connector = cluster.sessions[b], cluster.sessions[a]
    try:
        opened = await listener.call("link_listen", {"address": link["peer_ip"], "token": token,
                                                     "seconds": min(seconds + CALL_SLACK_S, 300.0)}, timeout=15)
    except (RemoteError, TimeoutError) as exc:
        failed["detail"] = f"{b} could not open the probe: {getattr(exc, 'message', exc)}"
        return failed
    if not opened["listening"]:
        failed["detail"] = f"{b}: {opened['detail']}"
        return failed
    try:
        measured: LinkMeasureReply = await connector.call(
            "link_measure", {"host": link["peer_ip"], "port": opened["port"], "token": token, "bytes": size,
                             "source": link["local_ip"] or None, "seconds": seconds},
            timeout=seconds + CALL_SLACK_S)
        return measured
    except (RemoteError, TimeoutError) as exc:
        failed["detail"] = f"{a} could not measure: {getattr(exc, 'message', exc)}"
        return failed
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(RemoteError, TimeoutError):
            await listener.call("link_close", {"port": opened["port"]}, timeout=10)


def _interfaces_down(topologies: Mapping[str, Topology], a: str, b: str, baseline: Baseline | None,
                     link: Link | None) -> list[str]:
    """The baseline's interfaces that are down or gone now, where coord no longer chooses them."""
    if baseline is None:
        return []
    found = []
    for node, name, now in ((a, baseline["interface"], link["local_interface"] if link else None),
                            (b, baseline["peer_interface"], link["peer_interface"] if link else None)):
        if not name or name == now or name == "lo":
            continue
        interfaces = {entry.get("name"): entry for entry in (topologies.get(node) or {}).get("interfaces") or []
                      if isinstance(entry, dict)}
        entry = interfaces.get(name)
        if entry is None:
            found.append(f"{name} on {node} is gone")
        elif not entry.get("up"):
            found.append(f"{name} on {node} is down")
    return found


# --- RDMA devices --------------------------------------------------------------------------------------


def _present_rdma(topologies: Mapping[str, Topology]) -> dict[str, list[str] | None]:
    present: dict[str, list[str] | None] = {}
    for node, topology in topologies.items():
        devices = ((topology or {}).get("rdma") or {}).get("devices")
        present[node] = [d for d in devices if isinstance(d, str)] if isinstance(devices, list) else None
    return present


def _named_rdma(cluster: Cluster, order: list[str], ibv_devices: list[Any] | None) -> tuple[dict[str, list[str]], str]:
    """The RDMA devices named for each node: by an MLX_IBV_DEVICES matrix the CLI sent (rank i is the
    saved hostfile's host i, else the cluster's node i), else by the saved hostfile (`coord hostfile`)."""
    saved = cluster.config.state_dir / "launch" / "hostfile.json"
    hosts: list[dict[str, Any]] = []
    with contextlib.suppress(OSError, ValueError, AttributeError):
        hosts = [h for h in json.loads(saved.read_text()).get("hosts", []) if isinstance(h, dict)]
    rank_nodes = _hostfile_nodes(cluster, hosts) or order
    named: dict[str, list[str]] = {}
    rows: list[Any] = ibv_devices if ibv_devices is not None else [h.get("rdma") for h in hosts]
    for rank, row in enumerate(rows):
        if rank < len(rank_nodes) and isinstance(row, list):
            named.setdefault(rank_nodes[rank], []).extend(d for d in row if isinstance(d, str))
    return named, "MLX_IBV_DEVICES" if ibv_devices is not None else f"the saved hostfile {saved}"


def _hostfile_nodes(cluster: Cluster, hosts: list[dict[str, Any]]) -> list[str]:
    """The node of each host of a saved hostfile, by its ssh name (coord's alias, the host or its name)."""
    names: dict[str, str] = {}
    for node in cluster.config.nodes:
        for key in (f"coord-{node.name}", node.host, node.name, node.address):
            names.setdefault(key, node.name)
    found = [names.get(str(h.get("ssh")), "") for h in hosts]
    return found if all(found) else []
