"""Where the ranks of a launcher that meets at rank 0 find it: rank 0's address on a subnet every node
shares with it, on the best kind of link, and each node's interface toward it (torch's MASTER_ADDR, a
``--launcher command`` job's coordinator). Pure functions over the nodes' measured links."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

from coordinator.launch.topology import LINK_KINDS, Matrix

LOCAL_ADDRESS = "127.0.0.1"


class RendezvousChoice(TypedDict):
    master_node: str  # the node of rank 0
    master_address: str  # MASTER_ADDR: an address every node reaches rank 0's node at
    interfaces: dict[str, str | None]  # each node's interface toward it (None: not known)
    reason: str


def choose_rendezvous(matrix: Matrix | None, order: Sequence[str], *, configured: str | None = None,
                      fallback: str = LOCAL_ADDRESS, one_machine: bool = False) -> RendezvousChoice:
    """Rank 0's address and each node's interface toward it.

    ``order`` is the nodes, rank 0's first; ``configured`` the address the cluster file gives rank
    0's node (``ips``), which wins as it does for mlx.launch; ``fallback`` the address used when the
    links name none (the cluster file's host: a name there is resolved, and judged, on each node);
    ``one_machine``: every node is this one machine (local nodes), whose ranks meet on loopback.
    The measured address is the one of rank 0's IPv4 addresses that shares a subnet with every other
    node, on the best kind of link (Thunderbolt, Ethernet, Wi-Fi, other) its worst pair allows.
    """
    if not order:
        raise ValueError("no nodes to choose a rendezvous for")
    master = order[0]
    none: dict[str, str | None] = {name: None for name in order}
    if len(order) == 1 or one_machine:
        return {"master_node": master, "master_address": configured or LOCAL_ADDRESS, "interfaces": none,
                "reason": ("one node" if len(order) == 1 else "every node is this machine")
                + ": the ranks meet on " + (configured or "loopback")}
    candidates = _shared_addresses(matrix, order)
    if configured is not None:
        candidates = {address: found for address, found in candidates.items() if address == configured}
    if not candidates:
        address = configured or fallback
        why = "the cluster file's ips" if configured else "the cluster file's host for it"
        return {"master_node": master, "master_address": address, "interfaces": none,
                "reason": f"no IPv4 subnet measured that {master} shares with every other node: {address}, "
                          f"{why}, is used as it is, and each node resolves and reaches it itself"}
    address, (rank, interfaces) = min(candidates.items(), key=lambda item: (item[1][0], item[0]))
    return {"master_node": master, "master_address": address, "interfaces": interfaces,
            "reason": f"{master}'s {LINK_KINDS[rank]} address {address}, on a subnet every node shares with it"}


def _shared_addresses(matrix: Matrix | None,
                      order: Sequence[str]) -> dict[str, tuple[int, dict[str, str | None]]]:
    """Each of rank 0's addresses that every peer shares a subnet with: (the worst link kind's rank,
    each node's interface on it)."""
    if matrix is None:
        return {}
    master, peers = order[0], order[1:]
    found: dict[str, tuple[int, dict[str, str | None]]] = {}
    views = matrix["pairs"].get(master, {})
    per_peer = [views[peer]["links"] if peer in views else [] for peer in peers]
    for link in per_peer[0] if per_peer else []:
        address = link["local_ip"]
        interfaces: dict[str, str | None] = {master: link["local_interface"]}
        worst = 0
        for peer, links in zip(peers, per_peer, strict=True):
            match = next((other for other in links if other["local_ip"] == address), None)
            if match is None:
                break
            interfaces[peer] = match["peer_interface"]
            worst = max(worst, LINK_KINDS.index(match["kind"]))
        else:
            if address not in found or worst < found[address][0]:
                found[address] = (worst, interfaces)
    return found


def address_toward(matrix: Matrix | None, node: str, master: str, master_address: str) -> str | None:
    """``node``'s own address on the subnet it reaches ``master_address`` by (None: not measured)."""
    if matrix is None or node == master:
        return master_address if node == master else None
    view = matrix["pairs"].get(node, {}).get(master)
    for link in view["links"] if view else []:
        if link["peer_ip"] == master_address:
            return link["local_ip"]
    return None
