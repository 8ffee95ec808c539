"""Which nodes are cabled to which, and which MLX backend the cluster can use.

Pure functions over the topologies the agents report (``agent.topology``): no I/O.

- :func:`connectivity_matrix` pairs the nodes up: a direct Thunderbolt cable (domain
  UUIDs reciprocal on both ends), its generation and speed, whether RDMA is active on
  that cable at both ends, and the IP links the two share (same IPv4 subnet on
  interfaces of the same kind), best first: Thunderbolt, Ethernet, Wi-Fi, other.
- :func:`choose_backend` picks ``jaccl`` (RDMA between every pair), ``jaccl-ring`` (a
  ring of RDMA links through every node) or ``ring`` over TCP, with the addresses and
  RDMA devices the hostfile needs, and what a person should fix.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from typing import Any

from coordinator.nodes import versions

BACKENDS = ("jaccl", "jaccl-ring", "ring")
#: IP link kinds, best first. Loopback never links two nodes.
LINK_KINDS = ("thunderbolt", "ethernet", "wifi", "other")
RDMA_MIN_MACOS = "26.2"
#: Largest cluster for which a ring is searched exhaustively.
MAX_RING_SEARCH_NODES = 16

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


# --- the matrix --------------------------------------------------------------------------


def connectivity_matrix(topologies: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """Pair every two nodes of ``{node name: topology}`` (a topology may be None: unknown).

    Returns::

        {"names": [node, ...],                       # in the order given
         "nodes": {node: {"readable", "platform", "macos", "os_version",
                          "rdma_os_ok": bool | None, "rdma_state", "rdma_devices",
                          "rdma_active_devices", "thunderbolt_readable",
                          "thunderbolt_bridge_enabled", "thunderbolt_bridge_interface",
                          "ipv4": [{"kind", "interface", "address", "prefixlen"}],
                          "detail"}},
         "pairs": {a: {b: PairView}},                # both directions, each from a's side
         "notes": [str, ...]}                        # one-sided or outside cables

    PairView (from ``a``'s side)::

        {"peer": b,
         "thunderbolt": bool,                        # a direct cable, reciprocal UUIDs
         "cables": [{"local_bus", "peer_bus", "local_receptacle", "peer_receptacle",
                     "local_interface", "peer_interface", "local_rdma_device",
                     "peer_rdma_device", "speed_gbps", "generation", "rdma",
                     "rdma_detail"}],
         "speed_gbps": best cable speed | None, "generation": 5 | 4 | None,
         "rdma": bool,                               # a cable with RDMA active at both ends
         "rdma_device": "rdma_en6" | None,           # a's device on that cable
         "peer_rdma_device": ... | None,
         "rdma_detail": why not | None,
         "links": [{"kind", "local_interface", "local_ip", "peer_interface", "peer_ip",
                    "network"}],                     # best first
         "best": links[0] | None,
         "link_detail": str | None}
    """
    names = list(topologies)
    nodes = {name: _node_summary(topologies[name]) for name in names}
    pairs: dict[str, dict[str, Any]] = {name: {} for name in names}
    notes: list[str] = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            forward, backward = _pair(a, b, topologies[a], topologies[b], nodes)
            pairs[a][b] = forward
            pairs[b][a] = backward
    notes.extend(_unmatched_cables(names, topologies))
    return {"names": names, "nodes": nodes, "pairs": pairs, "notes": notes}


def _node_summary(topology: dict[str, Any] | None) -> dict[str, Any]:
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
        port.get("device") for port in rdma.get("active_ports") or []
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


def _buses(topology: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not isinstance(topology, dict):
        return []
    thunderbolt = topology.get("thunderbolt")
    if not isinstance(thunderbolt, dict):
        return []
    return [bus for bus in thunderbolt.get("buses") or [] if isinstance(bus, dict)]


def _peer_uuid(bus: dict[str, Any]) -> str | None:
    peer = bus.get("peer")
    return peer.get("domain_uuid") if isinstance(peer, dict) else None


def _cables(
    a: str, b: str, topo_a: dict[str, Any] | None, topo_b: dict[str, Any] | None
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
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
    a: str, b: str, topo_a: dict[str, Any] | None, topo_b: dict[str, Any] | None
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


def _unmatched_cables(names: list[str], topologies: dict[str, Any]) -> list[str]:
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
    topo_a: dict[str, Any] | None,
    topo_b: dict[str, Any] | None,
    nodes: dict[str, dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    cables_ab = []
    cables_ba = []
    for bus_a, bus_b in _cables(a, b, topo_a, topo_b):
        forward, backward = _cable(a, b, bus_a, bus_b, nodes[a], nodes[b])
        cables_ab.append(forward)
        cables_ba.append(backward)
    cable_interfaces = {
        (c["local_interface"], c["peer_interface"]) for c in cables_ab
    }
    links_ab = _shared_links(topo_a, topo_b, cable_interfaces)
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
    cables: list[dict[str, Any]],
    links: list[dict[str, Any]],
    a: str,
    b: str,
    one_sided: list[str],
    link_detail: str | None,
) -> dict[str, Any]:
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
        "rdma_device": best_cable["local_rdma_device"] if rdma_cables else None,
        "peer_rdma_device": best_cable["peer_rdma_device"] if rdma_cables else None,
        "rdma_detail": rdma_detail,
        "links": links,
        "best": links[0] if links else None,
        "link_detail": link_detail,
    }


def _cable(
    a: str,
    b: str,
    bus_a: dict[str, Any],
    bus_b: dict[str, Any],
    node_a: dict[str, Any],
    node_b: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    speeds = [s for s in (bus_a.get("link_gbps"), bus_b.get("link_gbps")) if _is_number(s)]
    speed = min(speeds) if speeds else None
    device_a = bus_a.get("rdma_device") or _rdma_name(bus_a.get("interface"))
    device_b = bus_b.get("rdma_device") or _rdma_name(bus_b.get("interface"))
    problems = _rdma_end_problems(a, bus_a, device_a, node_a) + _rdma_end_problems(
        b, bus_b, device_b, node_b
    )
    generation = _generation(speed)
    common = {
        "speed_gbps": speed,
        "generation": generation,
        "rdma": not problems,
        "rdma_detail": "; ".join(problems) if problems else None,
    }
    forward = {
        "local_bus": bus_a.get("bus"), "peer_bus": bus_b.get("bus"),
        "local_receptacle": bus_a.get("receptacle"), "peer_receptacle": bus_b.get("receptacle"),
        "local_interface": bus_a.get("interface"), "peer_interface": bus_b.get("interface"),
        "local_rdma_device": device_a, "peer_rdma_device": device_b, **common,
    }
    backward = {
        "local_bus": bus_b.get("bus"), "peer_bus": bus_a.get("bus"),
        "local_receptacle": bus_b.get("receptacle"), "peer_receptacle": bus_a.get("receptacle"),
        "local_interface": bus_b.get("interface"), "peer_interface": bus_a.get("interface"),
        "local_rdma_device": device_b, "peer_rdma_device": device_a, **common,
    }
    return forward, backward


def _rdma_end_problems(
    name: str, bus: dict[str, Any], device: str | None, node: dict[str, Any]
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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- IP links ----------------------------------------------------------------------------


def _ipv4_interfaces(topology: dict[str, Any] | None) -> list[tuple[str, str, Any]]:
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


def _ipv4(address: Any) -> Any:
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
    topo_a: dict[str, Any] | None,
    topo_b: dict[str, Any] | None,
    cable_interfaces: set[tuple[Any, Any]],
) -> list[dict[str, Any]]:
    links = []
    for kind_a, name_a, ip_a in _ipv4_interfaces(topo_a):
        for kind_b, name_b, ip_b in _ipv4_interfaces(topo_b):
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


def _swap_link(link: dict[str, Any]) -> dict[str, Any]:
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


def _has_link_local_thunderbolt(topology: dict[str, Any]) -> bool:
    for entry in topology.get("interfaces") or []:
        if entry.get("kind") != "thunderbolt" or not entry.get("up"):
            continue
        for address in entry.get("addresses") or []:
            parsed = _ipv4(address)
            if parsed is not None and parsed.ip in _LINK_LOCAL_V4:
                return True
    return False


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
    matrix: dict[str, Any], node_order: Iterable[str], forced: str | None = None
) -> dict[str, Any]:
    """Pick the MLX backend for ``node_order`` (rank order) from a connectivity matrix.

    ``forced`` (jaccl | jaccl-ring | ring) is validated, not trusted: forcing a backend
    the cables cannot carry gives ``ok: False`` with the reason.

    Returns::

        {"ok": bool, "backend": "jaccl" | "jaccl-ring" | "ring" | None,
         "transport": "rdma" | "tcp" | None, "forced": forced,
         "order": [node, ...],                      # rank order (the ring for rings)
         "ring": [node, ...] | None,                # jaccl-ring and ring: the cycle
         "hosts": [{"node", "rank",
                    "ip": str | None,               # for the hostfile's "ips"; None
                                                    # (with a warning) when unmeasured
                    "ips": [ip] | [],
                    "rdma": [device | None per rank] | [],
                    "neighbours": [node, ...],      # ring: [left, right]; jaccl: all
                    "toward": {node: {"kind", "local_ip", "peer_ip", "local_interface",
                               "peer_interface", "rdma_device", "peer_rdma_device",
                               "generation", "speed_gbps"} | None}}],
         "reasons": [str], "warnings": [str],
         "fixes": [{"node", "instruction", "command": str | None}],
         "error": str | None}
    """
    order = list(node_order)
    _validate_order(matrix, order)
    result: dict[str, Any] = {
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
        result.update(backend="ring", transport=None, ring=None)
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
    elif forced == "jaccl-ring" or (forced is None and rdma_ring is not None):
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


def _validate_order(matrix: dict[str, Any], order: list[str]) -> None:
    if not order:
        raise ValueError("node_order is empty")
    known = set(matrix.get("nodes") or {})
    unknown = [name for name in order if name not in known]
    if unknown:
        raise ValueError(f"node_order names nodes not in the matrix: {', '.join(unknown)}")
    if len(set(order)) != len(order):
        raise ValueError("node_order lists a node twice")


def _fail(result: dict[str, Any], error: str) -> dict[str, Any]:
    result.update(ok=False, backend=None, transport=None, error=error)
    result["reasons"].append(error)
    return result


def _node_advice(result: dict[str, Any], order: list[str], nodes: dict[str, Any]) -> None:
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


def _missing_text(missing: list[tuple[str, str]], pairs: dict[str, Any], limit: int = 6) -> str:
    if not missing:
        return "every pair has RDMA"
    parts = [f"{a}–{b}: {pairs[a][b]['rdma_detail']}" for a, b in missing[:limit]]
    if len(missing) > limit:
        parts.append(f"and {len(missing) - limit} more pairs")
    return "; ".join(parts)


def _ring_text(ring: list[str]) -> str:
    return " → ".join([*ring, ring[0]])


def _toward(view: dict[str, Any]) -> dict[str, Any] | None:
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


def _jaccl(result: dict[str, Any], order: list[str], pairs: dict[str, Any], ring: bool) -> None:
    """Hosts for jaccl / jaccl-ring: RDMA devices per rank and an address every node
    can reach (rank 0's is the coordinator's)."""
    n = len(order)
    result.update(backend="jaccl-ring" if ring else "jaccl", transport="rdma",
                  order=list(order), ring=list(order) if ring else None)
    hosts = []
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


def _common_address(name: str, order: list[str], pairs: dict[str, Any]) -> tuple[str | None, str | None]:
    """This node's address that every other node shares a subnet with, best kind first."""
    candidates: dict[str, str] | None = None
    for other in order:
        if other == name:
            continue
        mine = {}
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
    result: dict[str, Any], order: list[str], pairs: dict[str, Any], nodes: dict[str, Any]
) -> None:
    """A TCP ring: over Thunderbolt links where they close a ring, else the given order
    where every neighbour shares a subnet, else any ring of shared subnets."""
    def link_of_kind(kind: str) -> Callable[[str, str], bool]:
        return lambda a, b: bool(pairs[a][b]["best"]) and pairs[a][b]["best"]["kind"] == kind

    def any_link(a: str, b: str) -> bool:
        return pairs[a][b]["best"] is not None

    ring = find_ring(order, link_of_kind("thunderbolt")) or find_ring(order, any_link) or order
    n = len(ring)
    result.update(backend="ring", transport="tcp", order=list(ring), ring=list(ring))
    hosts = []
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
    name: str, pairs: dict[str, Any], ring: list[str], nodes: dict[str, Any]
) -> str | None:
    """An address of this node for a neighbour it shares no subnet with (a routed
    network): one another node does share a subnet with, else any, LAN kinds first
    (Thunderbolt addresses are point-to-point)."""
    seen = []
    for other in ring:
        if other != name:
            seen.extend((link["kind"], link["local_ip"]) for link in pairs[name][other]["links"])
    if not seen:
        seen = [(entry["kind"], entry["address"]) for entry in nodes[name]["ipv4"]]
    if not seen:
        return None
    return min(seen, key=lambda item: _FALLBACK_KINDS.index(item[0]))[1]
