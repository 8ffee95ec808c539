"""Which MLX backend the cluster can use, from the link facts of :mod:`coordinator.launch.topology`.

Pure functions: no I/O. :func:`choose_backend` picks ``jaccl`` (RDMA between every pair),
``jaccl-ring`` (a ring of RDMA links through every node) or ``ring`` over TCP, with the
addresses and RDMA devices mlx.launch's hostfile needs, and what a person should fix;
:func:`find_ring` finds the ring the two ring backends run on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NotRequired, TypedDict

from coordinator.launch.seam import LaunchLinks, NeighbourLink
from coordinator.launch.topology import (
    BRIDGE_INSTRUCTION,
    LINK_KINDS,
    RECOVERY_INSTRUCTION,
    UPGRADE_INSTRUCTION,
    Matrix,
    NodeLinks,
    PairView,
)

BACKENDS = ("jaccl", "jaccl-ring", "ring")
#: Largest cluster for which a ring is searched exhaustively.
MAX_RING_SEARCH_NODES = 16

Pairs = dict[str, dict[str, PairView]]  # Matrix["pairs"]


class Toward(TypedDict):
    """How a rank reaches one neighbour: the best shared subnet and the RDMA devices."""

    kind: str | None  # the link's kind (LINK_KINDS); None: RDMA but no shared subnet
    local_ip: str | None
    peer_ip: str | None
    local_interface: str | None
    peer_interface: str | None
    rdma_device: str | None
    peer_rdma_device: str | None
    generation: int | None
    speed_gbps: float | None


class Host(TypedDict):
    """One rank of the choice."""

    node: str
    rank: int
    ip: str | None  # for the hostfile's "ips"; None (with a warning) when unmeasured
    ips: list[str]  # [ip] or []
    rdma: list[str | None]  # jaccl: the device toward each rank (None for itself, non-neighbours); ring: []
    neighbours: list[str]  # ring: [left, right]; jaccl: every other node
    toward: dict[str, Toward | None]


class Fix(TypedDict):
    node: str
    instruction: str
    command: str | None


class BackendChoice(TypedDict):
    ok: bool
    backend: str | None  # "jaccl" | "jaccl-ring" | "ring" | None
    transport: str | None  # "rdma" | "tcp" | None
    order: list[str]  # rank order (the ring for rings)
    hosts: list[Host]
    reasons: list[str]
    warnings: list[str]
    fixes: list[Fix]
    # Absent from the loopback choice coordinator.launch.plan makes when every node is this machine:
    forced: NotRequired[str | None]
    ring: NotRequired[list[str] | None]  # jaccl-ring and ring: the cycle
    error: NotRequired[str | None]


# --- rings -------------------------------------------------------------------------------


def find_ring(
    nodes: list[str], connected: Callable[[str, str], bool]
) -> list[str] | None:
    """A cycle through every node, starting at ``nodes[0]``, using only pairs for which
    ``connected(a, b)``; ``nodes`` itself when it already is one. None when there is
    none, or more than :data:`MAX_RING_SEARCH_NODES` nodes and ``nodes`` is not one.
    """
    n = len(nodes)
    if n < 2:
        return list(nodes) if n == 1 else None
    if all(connected(nodes[i], nodes[(i + 1) % n]) for i in range(n)):
        return list(nodes)
    if n == 2 or n > MAX_RING_SEARCH_NODES:
        return None
    adjacency = [0] * n
    for i in range(n):
        for j in range(n):
            if i != j and connected(nodes[i], nodes[j]) and connected(nodes[j], nodes[i]):
                adjacency[i] |= 1 << j
    # ends[mask]: the nodes v such that a path from node 0 through exactly ``mask`` ends at v.
    size = 1 << n
    ends = [0] * size
    ends[1] = 1
    for mask in range(1, size, 2):
        reach = ends[mask]
        if not reach:
            continue
        onward = 0
        v = reach
        while v:
            low = v & -v
            onward |= adjacency[low.bit_length() - 1]
            v ^= low
        onward &= ~mask
        while onward:
            low = onward & -onward
            ends[mask | low] |= low
            onward ^= low
    full = size - 1
    closing = ends[full] & adjacency[0]
    if not closing:
        return None
    current = (closing & -closing).bit_length() - 1
    path = [current]
    mask = full
    while mask != 1:
        previous_mask = mask ^ (1 << current)
        candidates = ends[previous_mask]
        step = candidates
        while step:
            low = step & -step
            u = low.bit_length() - 1
            if adjacency[u] >> current & 1:
                break
            step ^= low
        else:  # pragma: no cover - the table guarantees a predecessor
            return None
        path.append(u)
        current, mask = u, previous_mask
    path.reverse()
    return [nodes[i] for i in path]


# --- the backend -------------------------------------------------------------------------


def choose_backend(
    matrix: Matrix, node_order: Iterable[str], forced: str | None = None
) -> BackendChoice:
    """Pick the MLX backend for ``node_order`` (rank order) from a connectivity matrix.

    ``forced`` (jaccl | jaccl-ring | ring) is validated, not trusted: forcing a backend
    the cables cannot carry gives ``ok: False`` with the reason. The choice carries every
    key of :class:`BackendChoice`.
    """
    order = list(node_order)
    _validate_order(matrix, order)
    result: BackendChoice = {
        "ok": True,
        "backend": None,
        "transport": None,
        "forced": forced,
        "order": order,
        "ring": None,
        "hosts": [],
        "reasons": [],
        "warnings": [],
        "fixes": [],
        "error": None,
    }
    if forced is not None and forced not in BACKENDS:
        return _fail(result, f"unknown backend {forced!r}: use one of {', '.join(BACKENDS)}")

    nodes = matrix["nodes"]
    pairs = matrix["pairs"]
    if len(order) == 1:
        only = order[0]
        result.update({"backend": "ring", "transport": None, "ring": None})
        result["reasons"].append(f"single node ({only}): nothing to connect")
        if forced not in (None, "ring"):
            result["warnings"].append(f"backend {forced} ignored: a single node needs none")
        result["hosts"] = [{
            "node": only, "rank": 0, "ip": None, "ips": [], "rdma": [],
            "neighbours": [], "toward": {},
        }]
        return result

    _node_advice(result, order, nodes)
    for note in matrix.get("notes") or []:
        result["warnings"].append(note)

    def rdma(a: str, b: str) -> bool:
        return bool(pairs[a][b]["rdma"])

    missing = [(a, b) for i, a in enumerate(order) for b in order[i + 1:] if not rdma(a, b)]
    mesh = not missing
    rdma_ring = order if mesh else find_ring(order, rdma)
    if rdma_ring is None and len(order) > MAX_RING_SEARCH_NODES:
        result["warnings"].append(
            f"{len(order)} nodes: an RDMA ring is searched for up to {MAX_RING_SEARCH_NODES} "
            "nodes only; list the nodes in ring order to use one"
        )

    if forced == "jaccl" and not mesh:
        return _fail(result, "jaccl needs an active RDMA link between every pair of nodes: "
                     + _missing_text(missing, pairs))
    if forced == "jaccl-ring" and rdma_ring is None:
        return _fail(result, "jaccl-ring needs a ring of active RDMA links through every "
                     "node, and there is none: " + _missing_text(missing, pairs))

    if forced == "jaccl" or (forced is None and mesh):
        _jaccl(result, order, pairs, ring=False)
        result["reasons"].append(
            f"jaccl: every pair of the {len(order)} nodes has an active RDMA link "
            "over Thunderbolt"
            + (" (forced)" if forced else "")
        )
    elif rdma_ring is not None and (forced == "jaccl-ring" or forced is None):  # forced jaccl-ring has a ring
        _jaccl(result, rdma_ring, pairs, ring=True)
        text = f"jaccl-ring: RDMA links form a ring {_ring_text(rdma_ring)}"
        if not mesh:
            text += "; no full RDMA mesh: " + _missing_text(missing, pairs)
        result["reasons"].append(text + (" (forced)" if forced else ""))
    else:
        _tcp_ring(result, order, pairs, nodes)
        if forced == "ring":
            result["reasons"].append(
                "ring over TCP (forced)"
                + ("; jaccl was possible" if mesh else
                   "; jaccl-ring was possible" if rdma_ring is not None else "")
            )
        else:
            result["reasons"].append(
                "ring over TCP: no ring of active RDMA links covers all nodes: "
                + _missing_text(missing, pairs)
            )
    return result


def _validate_order(matrix: Matrix, order: list[str]) -> None:
    if not order:
        raise ValueError("node_order is empty")
    known = set(matrix.get("nodes") or {})
    unknown = [name for name in order if name not in known]
    if unknown:
        raise ValueError(f"node_order names nodes not in the matrix: {', '.join(unknown)}")
    if len(set(order)) != len(order):
        raise ValueError("node_order lists a node twice")


def _fail(result: BackendChoice, error: str) -> BackendChoice:
    result.update({"ok": False, "backend": None, "transport": None, "error": error})
    result["reasons"].append(error)
    return result


def _node_advice(result: BackendChoice, order: list[str], nodes: dict[str, NodeLinks]) -> None:
    for name in order:
        node = nodes[name]
        if not node["readable"]:
            result["warnings"].append(f"{name}: no topology was read")
            continue
        if node["macos"]:
            if node["rdma_os_ok"] is False:
                result["warnings"].append(
                    f"{name} runs macOS {node['os_version']}: RDMA needs macOS 26.2 or later"
                )
                result["fixes"].append(
                    {"node": name, "instruction": UPGRADE_INSTRUCTION, "command": None}
                )
            elif node["rdma_os_ok"] is None:
                result["warnings"].append(f"{name}: macOS version unknown")
            if node["rdma_os_ok"] is not False:
                if node["rdma_state"] == "disabled":
                    result["warnings"].append(f"RDMA is disabled on {name}")
                    result["fixes"].append(
                        {"node": name, "instruction": RECOVERY_INSTRUCTION, "command": None}
                    )
                elif node["rdma_state"] is None:
                    why = node["detail"].get("rdma_ctl")
                    result["warnings"].append(
                        f"RDMA state unknown on {name}" + (f" ({why})" if why else "")
                    )
        if node["thunderbolt_bridge_enabled"] and node["rdma_state"] == "enabled":
            interface = node["thunderbolt_bridge_interface"] or "bridge0"
            result["warnings"].append(
                f"Thunderbolt Bridge is enabled on {name} alongside RDMA: "
                "it must be disabled for RDMA"
            )
            result["fixes"].append({
                "node": name,
                "instruction": BRIDGE_INSTRUCTION.format(interface=interface),
                "command": f"sudo ifconfig {interface} down",
            })


def _missing_text(missing: list[tuple[str, str]], pairs: Pairs, limit: int = 6) -> str:
    if not missing:
        return "every pair has RDMA"
    parts = [f"{a}–{b}: {pairs[a][b]['rdma_detail']}" for a, b in missing[:limit]]
    if len(missing) > limit:
        parts.append(f"and {len(missing) - limit} more pairs")
    return "; ".join(parts)


def _ring_text(ring: list[str]) -> str:
    return " → ".join([*ring, ring[0]])


def _toward(view: PairView) -> Toward | None:
    best = view.get("best")
    if best is None and not view.get("rdma"):
        return None
    return {
        "kind": best["kind"] if best else None,
        "local_ip": best["local_ip"] if best else None,
        "peer_ip": best["peer_ip"] if best else None,
        "local_interface": best["local_interface"] if best else None,
        "peer_interface": best["peer_interface"] if best else None,
        "rdma_device": view.get("rdma_device"),
        "peer_rdma_device": view.get("peer_rdma_device"),
        "generation": view.get("generation"),
        "speed_gbps": view.get("speed_gbps"),
    }


def _jaccl(result: BackendChoice, order: list[str], pairs: Pairs, ring: bool) -> None:
    """Hosts for jaccl / jaccl-ring: RDMA devices per rank and an address every node
    can reach (rank 0's is the coordinator's)."""
    n = len(order)
    result.update({"backend": "jaccl-ring" if ring else "jaccl", "transport": "rdma",
                   "order": list(order), "ring": list(order) if ring else None})
    hosts: list[Host] = []
    for rank, name in enumerate(order):
        if ring:
            neighbours = list(dict.fromkeys([order[rank - 1], order[(rank + 1) % n]]))
        else:
            neighbours = [other for other in order if other != name]
        devices = [
            pairs[name][other]["rdma_device"] if other in neighbours else None
            for other in order
        ]
        ip, kind = _common_address(name, order, pairs)
        if ip is None:
            text = (
                f"{name} has no address that every other node shares a subnet with"
            )
            if rank == 0:
                text += "; rank 0's address is the jaccl coordinator's"
            result["warnings"].append(text)
            previous = pairs[name][order[rank - 1]]["best"]
            ip = previous["local_ip"] if previous else None
        hosts.append({
            "node": name,
            "rank": rank,
            "ip": ip,
            "ips": [ip] if ip else [],
            "rdma": devices,
            "neighbours": neighbours,
            "toward": {other: _toward(pairs[name][other]) for other in neighbours},
        })
        if ip is None:
            result["warnings"].append(
                f"no address measured for {name}: the cluster file must give one"
            )
    result["hosts"] = hosts


def _common_address(name: str, order: list[str], pairs: Pairs) -> tuple[str | None, str | None]:
    """This node's address that every other node shares a subnet with, best kind first."""
    candidates: dict[str, str] | None = None
    for other in order:
        if other == name:
            continue
        mine: dict[str, str] = {}
        for link in pairs[name][other]["links"]:
            mine.setdefault(link["local_ip"], link["kind"])
        candidates = mine if candidates is None else {
            ip: kind for ip, kind in candidates.items() if ip in mine
        }
    if not candidates:
        return None, None
    ip, kind = min(candidates.items(), key=lambda item: (LINK_KINDS.index(item[1]), item[0]))
    return ip, kind


def _tcp_ring(
    result: BackendChoice, order: list[str], pairs: Pairs, nodes: dict[str, NodeLinks]
) -> None:
    """A TCP ring: over Thunderbolt links where they close a ring, else the given order
    where every neighbour shares a subnet, else any ring of shared subnets."""
    def link_of_kind(kind: str) -> Callable[[str, str], bool]:
        return lambda a, b: (best := pairs[a][b]["best"]) is not None and best["kind"] == kind

    def any_link(a: str, b: str) -> bool:
        return pairs[a][b]["best"] is not None

    ring = find_ring(order, link_of_kind("thunderbolt")) or find_ring(order, any_link) or order
    n = len(ring)
    result.update({"backend": "ring", "transport": "tcp", "order": list(ring), "ring": list(ring)})
    hosts: list[Host] = []
    for rank, name in enumerate(ring):
        left, right = ring[rank - 1], ring[(rank + 1) % n]
        neighbours = list(dict.fromkeys([left, right]))
        # The ring backend's address of a rank is the one its left neighbour reaches it on.
        best = pairs[name][left]["best"]
        ip = best["local_ip"] if best else None
        if best is None:
            ip = _fallback_address(name, pairs, ring, nodes)
            result["warnings"].append(
                f"{left} and {name} share no IPv4 subnet ({pairs[name][left]['link_detail']})"
                + (f"; using {name}'s address {ip}, which must be routable from {left}"
                   if ip else "")
            )
        elif best["kind"] == "wifi":
            result["warnings"].append(f"{left} → {name} goes over Wi-Fi: expect it to be slow")
        hosts.append({
            "node": name,
            "rank": rank,
            "ip": ip,
            "ips": [ip] if ip else [],
            "rdma": [],
            "neighbours": neighbours,
            "toward": {other: _toward(pairs[name][other]) for other in neighbours},
        })
        if ip is None:
            result["warnings"].append(
                f"no address measured for {name}: the cluster file must give one"
            )
    result["hosts"] = hosts


_FALLBACK_KINDS = ("ethernet", "wifi", "other", "thunderbolt")


def _fallback_address(
    name: str, pairs: Pairs, ring: list[str], nodes: dict[str, NodeLinks]
) -> str | None:
    """An address of this node for a neighbour it shares no subnet with (a routed
    network): one another node does share a subnet with, else any, LAN kinds first
    (Thunderbolt addresses are point-to-point)."""
    seen: list[tuple[str, str]] = []
    for other in ring:
        if other != name:
            seen.extend((link["kind"], link["local_ip"]) for link in pairs[name][other]["links"])
    if not seen:
        seen = [(entry["kind"], entry["address"]) for entry in nodes[name]["ipv4"]]
    if not seen:
        return None
    return min(seen, key=lambda item: _FALLBACK_KINDS.index(item[0]))[1]


def launch_links(choice: BackendChoice) -> LaunchLinks:
    """What an attempt's backend choice says about its links, small enough to keep with the run:
    the backend, the transport, and each pair of neighbours with the kind and speed of their link."""
    links: list[NeighbourLink] = []
    for host in choice.get("hosts") or []:
        for peer, link in (host.get("toward") or {}).items():
            if link and host["node"] < peer:
                links.append({"a": host["node"], "b": peer, "kind": link.get("kind"),
                              "speed_gbps": link.get("speed_gbps")})
    return {"backend": choice.get("backend"), "transport": choice.get("transport"),
            "ring": choice.get("ring"), "links": links}
