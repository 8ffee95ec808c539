"""Where a relay's bytes go: the address each sender reaches each receiver at, and which pairs
are cabled with Thunderbolt, from the topology each node measured (asked once per node session,
so a sync does not wait on ``system_profiler`` every time).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio

from coordinator.config.cluster_file import NodeConfig
from coordinator.launch.hostfile import node_address
from coordinator.launch.topology import connectivity_matrix
from coordinator.nodes.session import UP, NodeSession
from coordinator.relay.broadcast import HEAD
from shared.rpc import RemoteError

TOPOLOGY_TIMEOUT_S = 30.0


class LinkBook:
    def __init__(self, nodes: list[NodeConfig]) -> None:
        self._configs = {node.name: node for node in nodes}
        # name -> (session generation, its agent's topology answer or None); read by coordinator.launch
        self._topologies: dict[str, tuple[int, dict[str, Any] | None]] = {}
        self._pairs: dict[str, dict[str, Any]] = {}  # the connectivity matrix's pairs (coordinator.launch's)
        self._head_addresses: dict[str, str | None] = {}

    async def refresh(self, sessions: Mapping[str, NodeSession], names: list[str]) -> None:
        """Ask each named node that came up since the last time for its topology."""
        async def one(name: str) -> None:
            session = sessions[name]
            self._head_addresses[name] = getattr(session, "peer_address", None)
            known = self._topologies.get(name)
            if known is not None and known[0] == session.generation:
                return
            topology: dict[str, Any] | None = None
            if session.state == UP:
                try:
                    topology = await session.call("topology", timeout=TOPOLOGY_TIMEOUT_S)
                except (RemoteError, TimeoutError):
                    topology = None  # nothing measured: the configured address is used
            self._topologies[name] = (session.generation, topology)

        async with anyio.create_task_group() as tasks:
            for name in names:
                if name in sessions:
                    tasks.start_soon(one, name)
        measured: dict[str, dict[str, Any] | None] = {
            name: topology for name, (_, topology) in self._topologies.items() if topology is not None}
        self._pairs = connectivity_matrix(measured)["pairs"] if len(measured) > 1 else {}

    def address(self, sender: str, receiver: str) -> str:
        """The address ``sender`` sends ``receiver``'s bytes to: the head uses the one its SSH session
        reached; a node uses their best shared link (Thunderbolt first), else the node's own."""
        config = self._configs[receiver]
        if sender == HEAD:
            return self._head_addresses.get(receiver) or node_address(config)
        if config.is_local and self._configs.get(sender) is not None and self._configs[sender].is_local:
            return "127.0.0.1"
        best = (self._pairs.get(sender, {}).get(receiver) or {}).get("best")
        if best and best.get("peer_ip") and not config.ips:
            return best["peer_ip"]
        return node_address(config)

    def thunderbolt(self, a: str, b: str) -> bool:
        view = self._pairs.get(a, {}).get(b) or {}
        best = view.get("best") or {}
        return bool(view.get("thunderbolt") or best.get("kind") == "thunderbolt")
