"""Which nodes are cabled to which: the link facts any launcher needs.

Pure functions over the topologies the agents report (``agent.topology``): no I/O.

- :func:`connectivity_matrix` pairs the nodes up: a direct Thunderbolt cable (domain
  UUIDs reciprocal on both ends), its generation and speed, whether RDMA is active on
  that cable at both ends, and the IP links the two share (same IPv4 subnet on
  interfaces of the same kind), best first: Thunderbolt, Ethernet, Wi-Fi, other.
- What a person does on a node to make RDMA usable (:data:`RECOVERY_INSTRUCTION`,
  :data:`UPGRADE_INSTRUCTION`, :data:`BRIDGE_INSTRUCTION`).

Which MLX backend those links carry is :mod:`coordinator.launch.mlx_backend`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any, TypedDict, TypeGuard

from coordinator.nodes import versions

#: IP link kinds, best first. Loopback never links two nodes.
LINK_KINDS = ("thunderbolt", "ethernet", "wifi", "other")
RDMA_MIN_MACOS = "26.2"

RECOVERY_INSTRUCTION = (
    "RDMA can only be enabled from macOS Recovery: boot into Recovery, open Terminal, "
    "run `rdma_ctl enable`, reboot"
)
UPGRADE_INSTRUCTION = "upgrade macOS to 26.2 or later"
BRIDGE_INSTRUCTION = (
    "disable Thunderbolt Bridge (System Settings > Network > Thunderbolt Bridge > "
    "Disable, or `sudo ifconfig {interface} down`)"
)

_LINK_LOCAL_V4 = ipaddress.IPv4Network("169.254.0.0/16")

#: One node's topology as its agent reports it (``agent.topology``): read defensively, key by key, since
#: what a node can measure varies (macOS or Linux, tools present or not), so it stays a free-form dict.
Topology = dict[str, Any]


class Ipv4Address(TypedDict):
    kind: str  # one of LINK_KINDS
    interface: str | None
    address: str
    prefixlen: int


class NodeLinks(TypedDict):
    """What one node's topology says about its links."""

    readable: bool  # False: no topology was read, every other field is empty
    platform: str | None
    macos: bool
    os_version: str | None
    rdma_os_ok: bool | None  # macOS new enough for RDMA; None: unknown or not macOS
    rdma_state: str | None  # "enabled" | "disabled" | None (unknown)
    rdma_devices: list[str] | None
    rdma_active_devices: list[str]
    thunderbolt_readable: bool
    thunderbolt_bridge_enabled: bool | None
    thunderbolt_bridge_interface: str | None
    ipv4: list[Ipv4Address]
    detail: dict[str, Any]  # free-form: the agent's notes on what it could not read, by tool


class CableLink(TypedDict):
    """What both ends of one cable agree on."""

    speed_gbps: float | None
    generation: int | None  # Thunderbolt 5 | 4 | None
    rdma: bool  # RDMA active at both ends
    rdma_detail: str | None  # why not


class Cable(CableLink):
    """One direct Thunderbolt cable, from the local node's side."""

    local_bus: str | None
    peer_bus: str | None
    local_receptacle: str | None
    peer_receptacle: str | None
    local_interface: str | None
    peer_interface: str | None
    local_rdma_device: str | None
    peer_rdma_device: str | None


class Link(TypedDict):
    """An IPv4 subnet two nodes share on interfaces of the same kind, from the local node's side."""

    kind: str  # one of LINK_KINDS
    local_interface: str | None
    local_ip: str
    peer_interface: str | None
    peer_ip: str
    network: str


class PairView(TypedDict):
    """Node a's view of its links to node b."""

    peer: str  # b
    thunderbolt: bool  # a direct cable, reciprocal UUIDs
    cables: list[Cable]
    speed_gbps: float | None  # best cable speed
    generation: int | None  # 5 | 4 | None
    rdma: bool  # a cable with RDMA active at both ends
    rdma_device: str | None  # a's device on that cable, e.g. "rdma_en6"
    peer_rdma_device: str | None
    rdma_detail: str | None  # why there is no RDMA
    links: list[Link]  # best first
    best: Link | None  # links[0]
    link_detail: str | None


class Matrix(TypedDict):
    names: list[str]  # in the order given
    nodes: dict[str, NodeLinks]
    pairs: dict[str, dict[str, PairView]]  # both directions, each from the first node's side
    notes: list[str]  # one-sided or outside cables


# --- the matrix --------------------------------------------------------------------------


def connectivity_matrix(topologies: Mapping[str, Topology | None]) -> Matrix:
    """Pair every two nodes of ``{node name: topology}`` (a topology may be None: unknown):
    each node's :class:`NodeLinks`, and for every two nodes a and b a's :class:`PairView`
    of b and b's of a."""
    names = list(topologies)
    nodes = {name: _node_summary(topologies[name]) for name in names}
    pairs: dict[str, dict[str, PairView]] = {}
    update_pairs(topologies, names, pairs, nodes)
    return {"names": names, "nodes": nodes, "pairs": pairs, "notes": _unmatched_cables(names, topologies)}


def update_pairs(topologies: Mapping[str, Topology | None], changed: Iterable[str],
                 pairs: dict[str, dict[str, PairView]], nodes: dict[str, NodeLinks] | None = None) -> None:
    """``connectivity_matrix``'s pairs kept up to date in place: every pair of a node in ``changed``
    (with each node of ``topologies``) made again, the others kept, those of nodes no longer there
    dropped. Nodes that answer one at a time then cost a row each, not a whole matrix each (a hundred
    nodes: ten thousand pairs a matrix)."""
    names = list(topologies)
    for gone in set(pairs) - set(names):
        del pairs[gone]
    for row in pairs.values():
        for gone in set(row) - set(topologies):
            del row[gone]
    for name in names:
        pairs.setdefault(name, {})
    nodes = nodes if nodes is not None else {name: _node_summary(topologies[name]) for name in names}
    # Each node's addresses parsed once, not once for every pair it is in (parsing was most of the time).
    parsed = {name: _ipv4_interfaces(topologies[name]) for name in names}
    order = {name: i for i, name in enumerate(names)}
    done: set[str] = set()
    for node in dict.fromkeys(changed):
        if node not in topologies:
            continue
        for other in names:
            if other == node or other in done:
                continue
            a, b = (node, other) if order[node] < order[other] else (other, node)  # as the whole matrix pairs them
            forward, backward = _pair(a, b, topologies[a], topologies[b], nodes, (parsed[a], parsed[b]))
            pairs[a][b] = forward
            pairs[b][a] = backward
        done.add(node)


def _node_summary(topology: Topology | None) -> NodeLinks:
    if not isinstance(topology, dict):
        return {
            "readable": False, "platform": None, "macos": False, "os_version": None,
            "rdma_os_ok": None, "rdma_state": None, "rdma_devices": None,
            "rdma_active_devices": [], "thunderbolt_readable": False,
            "thunderbolt_bridge_enabled": None, "thunderbolt_bridge_interface": None,
            "ipv4": [], "detail": {},
        }
    platform = topology.get("platform")
    macos = platform in ("macOS", "Darwin")
    version = topology.get("os_version")
    rdma = topology.get("rdma") or {}
    active = sorted({
        port["device"] for port in rdma.get("active_ports") or []
        if isinstance(port, dict) and port.get("device")
    })
    bridge = topology.get("thunderbolt_bridge") or {}
    return {
        "readable": True,
        "platform": platform,
        "macos": macos,
        "os_version": version,
        "rdma_os_ok": _rdma_os_ok(version) if macos else None,
        "rdma_state": rdma.get("state"),
        "rdma_devices": rdma.get("devices"),
        "rdma_active_devices": active,
        "thunderbolt_readable": isinstance(topology.get("thunderbolt"), dict),
        "thunderbolt_bridge_enabled": bridge.get("enabled"),
        "thunderbolt_bridge_interface": bridge.get("interface"),
        "ipv4": [
            {"kind": kind, "interface": name, "address": str(ip.ip), "prefixlen": ip.network.prefixlen}
            for kind, name, ip in _ipv4_interfaces(topology)
        ],
        "detail": dict(topology.get("detail") or {}),
    }


def _rdma_os_ok(version: Any) -> bool | None:
    """None when the macOS version is unknown or unparseable."""
    return versions.at_least(version, RDMA_MIN_MACOS)


def _buses(topology: Topology | None) -> list[Mapping[str, Any]]:
    if not isinstance(topology, dict):
        return []
    thunderbolt = topology.get("thunderbolt")
    if not isinstance(thunderbolt, dict):
        return []
    return [bus for bus in thunderbolt.get("buses") or [] if isinstance(bus, dict)]


def _peer_uuid(bus: Mapping[str, Any]) -> str | None:
    peer = bus.get("peer")
    return peer.get("domain_uuid") if isinstance(peer, dict) else None


def _cables(
    a: str, b: str, topo_a: Topology | None, topo_b: Topology | None
) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """(bus of a, bus of b) pairs whose domain UUIDs name each other."""
    found = []
    for bus_a in _buses(topo_a):
        peer = _peer_uuid(bus_a)
        if not peer or not bus_a.get("domain_uuid"):
            continue
        for bus_b in _buses(topo_b):
            if bus_b.get("domain_uuid") == peer and _peer_uuid(bus_b) == bus_a["domain_uuid"]:
                found.append((bus_a, bus_b))
    return found


def _one_sided(
    a: str, b: str, topo_a: Topology | None, topo_b: Topology | None
) -> list[str]:
    """A bus of a names one of b's domains, but b's bus does not name a back."""
    own_b = {bus.get("domain_uuid"): bus for bus in _buses(topo_b) if bus.get("domain_uuid")}
    notes = []
    for bus_a in _buses(topo_a):
        peer = _peer_uuid(bus_a)
        if peer in own_b and _peer_uuid(own_b[peer]) != bus_a.get("domain_uuid"):
            notes.append(
                f"{a} ({bus_a.get('bus')}) sees {b}'s Thunderbolt domain {peer}, "
                f"but {b} does not see {a} on that bus"
            )
    return notes


def _unmatched_cables(names: list[str], topologies: Mapping[str, Topology | None]) -> list[str]:
    owner = {}
    for name in names:
        for bus in _buses(topologies[name]):
            if bus.get("domain_uuid"):
                owner[bus["domain_uuid"]] = name
    notes = []
    for name in names:
        for bus in _buses(topologies[name]):
            peer = _peer_uuid(bus)
            if peer and peer not in owner:
                notes.append(
                    f"{name}: Thunderbolt {bus.get('receptacle') or bus.get('bus')} is cabled "
                    f"to a host outside the cluster (domain {peer})"
                )
    return notes


def _pair(
    a: str,
    b: str,
    topo_a: Topology | None,
    topo_b: Topology | None,
    nodes: dict[str, NodeLinks],
    parsed: tuple[list[Addressed], list[Addressed]] | None = None,
) -> tuple[PairView, PairView]:
    cables_ab: list[Cable] = []
    cables_ba: list[Cable] = []
    for bus_a, bus_b in _cables(a, b, topo_a, topo_b):
        cable_ab, cable_ba = _cable(a, b, bus_a, bus_b, nodes[a], nodes[b])
        cables_ab.append(cable_ab)
        cables_ba.append(cable_ba)
    cable_interfaces = {
        (c["local_interface"], c["peer_interface"]) for c in cables_ab
    }
    links_ab = _shared_links(topo_a, topo_b, cable_interfaces, parsed)
    links_ba = [_swap_link(link) for link in links_ab]
    link_detail = None
    if not links_ab:
        link_detail = _no_link_detail(a, b, topo_a, topo_b)
    elif links_ab[0]["kind"] != "thunderbolt" and cables_ab:
        link_detail = (
            f"{a} and {b} are cabled with Thunderbolt but share no IPv4 subnet on it"
        )
    one_sided = _one_sided(a, b, topo_a, topo_b) + _one_sided(b, a, topo_b, topo_a)
    forward = _pair_view(b, cables_ab, links_ab, a, b, one_sided, link_detail)
    backward = _pair_view(a, cables_ba, links_ba, a, b, one_sided, link_detail)
    return forward, backward


def _pair_view(
    peer: str,
    cables: list[Cable],
    links: list[Link],
    a: str,
    b: str,
    one_sided: list[str],
    link_detail: str | None,
) -> PairView:
    rdma_cables = [c for c in cables if c["rdma"]]
    best_cable = max(
        rdma_cables or cables,
        key=lambda c: (c["speed_gbps"] or 0),
        default=None,
    )
    if rdma_cables:
        rdma_detail = None
    elif cables:
        rdma_detail = "; ".join(dict.fromkeys(c["rdma_detail"] for c in cables if c["rdma_detail"]))
    elif one_sided:
        rdma_detail = "no direct Thunderbolt cable: " + "; ".join(one_sided)
    else:
        rdma_detail = f"no direct Thunderbolt cable between {a} and {b}"
    speeds = [c["speed_gbps"] for c in cables if c["speed_gbps"] is not None]
    generations = [c["generation"] for c in cables if c["generation"] is not None]
    return {
        "peer": peer,
        "thunderbolt": bool(cables),
        "cables": cables,
        "speed_gbps": max(speeds) if speeds else None,
        "generation": max(generations) if generations else None,
        "rdma": bool(rdma_cables),
        "rdma_device": best_cable["local_rdma_device"] if rdma_cables and best_cable else None,
        "peer_rdma_device": best_cable["peer_rdma_device"] if rdma_cables and best_cable else None,
        "rdma_detail": rdma_detail,
        "links": links,
        "best": links[0] if links else None,
        "link_detail": link_detail,
    }


def _cable(
    a: str,
    b: str,
    bus_a: Mapping[str, Any],
    bus_b: Mapping[str, Any],
    node_a: NodeLinks,
    node_b: NodeLinks,
) -> tuple[Cable, Cable]:
    speeds = [s for s in (bus_a.get("link_gbps"), bus_b.get("link_gbps")) if _is_number(s)]
    speed = min(speeds) if speeds else None
    device_a = bus_a.get("rdma_device") or _rdma_name(bus_a.get("interface"))
    device_b = bus_b.get("rdma_device") or _rdma_name(bus_b.get("interface"))
    problems = _rdma_end_problems(a, bus_a, device_a, node_a) + _rdma_end_problems(
        b, bus_b, device_b, node_b
    )
    generation = _generation(speed)
    common: CableLink = {
        "speed_gbps": speed,
        "generation": generation,
        "rdma": not problems,
        "rdma_detail": "; ".join(problems) if problems else None,
    }
    forward: Cable = {
        "local_bus": bus_a.get("bus"), "peer_bus": bus_b.get("bus"),
        "local_receptacle": bus_a.get("receptacle"), "peer_receptacle": bus_b.get("receptacle"),
        "local_interface": bus_a.get("interface"), "peer_interface": bus_b.get("interface"),
        "local_rdma_device": device_a, "peer_rdma_device": device_b, **common,
    }
    backward: Cable = {
        "local_bus": bus_b.get("bus"), "peer_bus": bus_a.get("bus"),
        "local_receptacle": bus_b.get("receptacle"), "peer_receptacle": bus_a.get("receptacle"),
        "local_interface": bus_b.get("interface"), "peer_interface": bus_a.get("interface"),
        "local_rdma_device": device_b, "peer_rdma_device": device_a, **common,
    }
    return forward, backward


def _rdma_end_problems(
    name: str, bus: Mapping[str, Any], device: str | None, node: NodeLinks
) -> list[str]:
    if node["macos"] and node["rdma_os_ok"] is False:
        return [f"{name} runs macOS {node['os_version']}: RDMA needs 26.2 or later"]
    state = node["rdma_state"]
    if state == "disabled":
        return [f"RDMA is disabled on {name}"]
    if state != "enabled":
        return [f"RDMA state unknown on {name}"]
    if device is None:
        return [
            f"{name}: no interface known for Thunderbolt {bus.get('receptacle')} "
            "(networksetup did not list it)"
        ]
    devices = node["rdma_devices"]
    if isinstance(devices, list) and device not in devices:
        return [f"{name} has no RDMA device {device}"]
    if device not in node["rdma_active_devices"]:
        return [f"{device} on {name} is not active (port down)"]
    return []


def _rdma_name(interface: Any) -> str | None:
    return f"rdma_{interface}" if isinstance(interface, str) and interface else None


def _generation(speed: Any) -> int | None:
    if not _is_number(speed) or speed <= 0:
        return None
    return 5 if speed > 40 else 4


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- IP links ----------------------------------------------------------------------------


Addressed = tuple[str, str | None, ipaddress.IPv4Interface]  # (kind, interface, its address)


def _ipv4_interfaces(topology: Topology | None) -> list[Addressed]:
    """(kind, interface, IPv4Interface) of the node's up, non-loopback, non-link-local
    addresses."""
    if not isinstance(topology, dict):
        return []
    found = []
    for entry in topology.get("interfaces") or []:
        if not isinstance(entry, dict) or not entry.get("up"):
            continue
        kind = entry.get("kind") if entry.get("kind") in LINK_KINDS else None
        if kind is None:
            continue
        for address in entry.get("addresses") or []:
            parsed = _ipv4(address)
            if parsed is None or parsed.ip.is_loopback or parsed.ip in _LINK_LOCAL_V4:
                continue
            found.append((kind, entry.get("name"), parsed))
    return found


def _ipv4(address: Any) -> ipaddress.IPv4Interface | None:
    """An IPv4Interface from ``{"family", "address", "prefixlen"}`` or ``"a.b.c.d/n"``."""
    try:
        if isinstance(address, str):
            return ipaddress.IPv4Interface(address) if "/" in address else None
        if not isinstance(address, dict) or address.get("family") not in (None, "ipv4", "inet"):
            return None
        prefixlen = address.get("prefixlen")
        if not isinstance(prefixlen, int) or isinstance(prefixlen, bool):
            return None
        return ipaddress.IPv4Interface(f"{address.get('address')}/{prefixlen}")
    except (ValueError, TypeError):
        return None


def _shared_links(
    topo_a: Topology | None,
    topo_b: Topology | None,
    cable_interfaces: set[tuple[str | None, str | None]],
    parsed: tuple[list[Addressed], list[Addressed]] | None = None,
) -> list[Link]:
    links: list[Link] = []
    mine, theirs = parsed if parsed is not None else (_ipv4_interfaces(topo_a), _ipv4_interfaces(topo_b))
    for kind_a, name_a, ip_a in mine:
        for kind_b, name_b, ip_b in theirs:
            if kind_a != kind_b or ip_a.ip == ip_b.ip:
                continue
            if ip_b.ip in ip_a.network and ip_a.ip in ip_b.network:
                links.append({
                    "kind": kind_a,
                    "local_interface": name_a,
                    "local_ip": str(ip_a.ip),
                    "peer_interface": name_b,
                    "peer_ip": str(ip_b.ip),
                    "network": str(ip_a.network),
                })
    links.sort(key=lambda link: (
        LINK_KINDS.index(link["kind"]),
        (link["local_interface"], link["peer_interface"]) not in cable_interfaces,
        -ipaddress.IPv4Network(link["network"]).prefixlen,
        link["local_interface"] or "",
        link["local_ip"],
    ))
    return links


def _swap_link(link: Link) -> Link:
    return {
        "kind": link["kind"],
        "local_interface": link["peer_interface"],
        "local_ip": link["peer_ip"],
        "peer_interface": link["local_interface"],
        "peer_ip": link["local_ip"],
        "network": link["network"],
    }


def _no_link_detail(a: str, b: str, topo_a: Any, topo_b: Any) -> str:
    for name, topo in ((a, topo_a), (b, topo_b)):
        if not isinstance(topo, dict) or topo.get("interfaces") is None:
            return f"{name}'s interfaces are unknown"
    link_local = [
        name for name, topo in ((a, topo_a), (b, topo_b))
        if _has_link_local_thunderbolt(topo)
    ]
    if len(link_local) == 2:
        return (
            f"{a} and {b} share no IPv4 subnet; their Thunderbolt interfaces have only "
            "link-local (169.254) addresses: give them static addresses"
        )
    return f"{a} and {b} share no IPv4 subnet"


def _has_link_local_thunderbolt(topology: Topology) -> bool:
    for entry in topology.get("interfaces") or []:
        if entry.get("kind") != "thunderbolt" or not entry.get("up"):
            continue
        for address in entry.get("addresses") or []:
            parsed = _ipv4(address)
            if parsed is not None and parsed.ip in _LINK_LOCAL_V4:
                return True
    return False
