"""Where a relay's bytes go: the address each sender reaches each receiver at, and which pairs
are cabled with Thunderbolt, from the topology each node measured (asked once per node session,
so a sync does not wait on ``system_profiler`` every time).
"""

from __future__ import annotations

from collections.abc import Mapping

import anyio

from coordinator.config.cluster_file import NodeConfig
from coordinator.launch.hostfile import node_address
from coordinator.launch.topology import PairView, Topology, update_pairs
from coordinator.nodes.session import UP, NodeSession
from coordinator.relay.broadcast import HEAD
from shared.rpc import RemoteError

TOPOLOGY_TIMEOUT_S = 30.0


class LinkBook:
    def __init__(self, nodes: list[NodeConfig]) -> None:
        self._configs = {node.name: node for node in nodes}
        # name -> (session generation, its agent's topology answer or None); read by coordinator.launch
        self._topologies: dict[str, tuple[int, Topology | None]] = {}
        self._pairs: dict[str, dict[str, PairView]] = {}  # the connectivity matrix's pairs, both directions
        self._pairs_of: dict[str, int] = {}  # node -> the session generation of the answer its pairs came from
        self._head_addresses: dict[str, str | None] = {}

    async def refresh(self, sessions: Mapping[str, NodeSession], names: list[str]) -> None:
        """Ask each named node that came up since the last time for its topology."""
        async def one(name: str) -> None:
            session = sessions[name]
            self._head_addresses[name] = getattr(session, "peer_address", None)
            known = self._topologies.get(name)
            if known is not None and known[0] == session.generation:
                return
            topology: Topology | None = None
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
        measured: dict[str, Topology | None] = {
            name: topology for name, (_, topology) in self._topologies.items() if topology is not None}
        # The matrix is every pair of nodes (a hundred nodes: ten thousand pairs): only the pairs of a
        # node whose answer is new are made again, not the whole matrix for every copy the relay makes,
        # nor for each node as a checkpoint's copies reach the nodes one after another.
        answers = {name: generation for name, (generation, topology) in self._topologies.items()
                   if topology is not None}
        if answers != self._pairs_of:
            changed = [name for name, generation in answers.items() if self._pairs_of.get(name) != generation]
            update_pairs(measured, changed, self._pairs)
            self._pairs_of = answers

    def address(self, sender: str, receiver: str) -> str:
        """The address ``sender`` sends ``receiver``'s bytes to: the head uses the one its SSH session
        reached; a node uses their best shared link (Thunderbolt first), else the node's own."""
        config = self._configs[receiver]
        if sender == HEAD:
            return self._head_addresses.get(receiver) or node_address(config)
        if config.is_local and self._configs.get(sender) is not None and self._configs[sender].is_local:
            return "127.0.0.1"
        view = self._pairs.get(sender, {}).get(receiver)
        best = view["best"] if view is not None else None
        if best and best["peer_ip"] and not config.ips:
            return best["peer_ip"]
        return node_address(config)

    def thunderbolt(self, a: str, b: str) -> bool:
        view = self._pairs.get(a, {}).get(b)
        if view is None:
            return False
        best = view["best"]
        return view["thunderbolt"] or (best is not None and best["kind"] == "thunderbolt")
