"""A PyTorch job's pre-flight: its facts from every node at once, and the rendezvous probe.

Asked only for launchers that declare the PyTorch checks (``"pytorch"`` in ``Capabilities.preflight``:
torchrun, Accelerate, DeepSpeed; ``coord preflight --launcher torchrun``). What the answers mean
is decided by the pure checks in :mod:`coordinator.readiness.torch_checks`; the environment each
node's ranks get by :mod:`coordinator.launch.torch_env`.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypedDict

import anyio

from coordinator.launch.registry import capabilities
from coordinator.launch.rendezvous import RendezvousChoice, choose_rendezvous
from coordinator.launch.topology import Topology, connectivity_matrix
from coordinator.launch.torch_env import DEFAULT_MASTER_PORT, shares_network, torch_envs
from coordinator.readiness.checks import CheckResult, NodeAccess
from coordinator.readiness.node_facts import AgentCall, gather_facts, session_call
from coordinator.readiness.torch_checks import RendezvousProbe, torch_checks
from shared.agent_api.torch import RendezvousConnectReply, RendezvousListenReply, TorchFactsReply
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.nodes.cluster import Cluster

FACTS_CALL = "torch_facts"  # the agent call a PyTorch job's facts come from (its launchers' node_facts)
LISTEN_S = 60.0  # the listener closes by itself after this, should the close never come
CONNECT_TIMEOUT_S = 10.0

class TorchPreflight(TypedDict):
    """What a PyTorch job's pre-flight found, beside its checks."""

    facts: dict[str, TorchFactsReply]
    missing: dict[str, str]
    rendezvous: RendezvousProbe | None
    envs: dict[str, dict[str, str]]  # each node's environment (coordinator.launch.torch_env.torch_envs)
    checks: list[CheckResult]


async def torch_preflight(cluster: Cluster, nodes: Mapping[str, NodeAccess], topologies: Mapping[str, Topology], *,
                          launcher: str, master_port: int | None = None) -> TorchPreflight:
    """Facts from every node of ``nodes`` that is up, the rendezvous among them (rank 0 is the first,
    in the cluster file's order), the checks and each node's environment."""
    order = [n.name for n in cluster.config.nodes if n.name in nodes]
    needs, needed_by = capabilities(launcher).needs, f"the {launcher} launcher"
    by_name = {n.name: n for n in cluster.config.nodes}

    call = session_call(cluster.sessions)
    facts, missing = await gather_facts(call, FACTS_CALL, {name: by_name[name].python for name in order})
    up = [name for name in order if name in facts]
    if not up:
        return {"facts": facts, "missing": missing, "rendezvous": None, "envs": {},
                "checks": torch_checks(facts, needs=needs, needed_by=needed_by, nodes=nodes, missing=missing)}
    master = by_name[up[0]]
    matrix = connectivity_matrix({name: topologies.get(name) for name in up})
    colocated = [name for name in up if shares_network(by_name[name], master, facts[name], facts[master.name])]
    one_machine = len(colocated) == len(up)
    choice = choose_rendezvous(matrix, up, configured=master.ips[0] if master.ips else None,
                               fallback=master.host, one_machine=one_machine)
    suggested = next((a["address"] for a in matrix["nodes"][master.name]["ipv4"]), None)
    probe = await probe_rendezvous(call, choice, up, master_port or DEFAULT_MASTER_PORT, colocated=colocated,
                                   suggested=suggested)
    return {"facts": facts, "missing": missing, "rendezvous": probe,
            "envs": torch_envs(facts, choice["interfaces"]),
            "checks": torch_checks(facts, needs=needs, needed_by=needed_by, nodes=nodes, missing=missing,
                                   rendezvous=probe,
                                   interfaces=choice["interfaces"], one_machine=one_machine)}


async def probe_rendezvous(call: AgentCall, choice: RendezvousChoice, order: list[str], port: int, *,
                           colocated: list[str], suggested: str | None) -> RendezvousProbe:
    """Rank 0's node listens on ``port``; every node (rank 0's too) connects to the master address
    as the ranks will be given it; the listener is closed whatever happened."""
    master, token = choice["master_node"], secrets.token_hex(16)
    probe: RendezvousProbe = {"choice": choice, "port": port, "listen": None, "connects": {}, "missing": {},
                              "colocated": colocated, "suggested": suggested}
    try:
        listened: RendezvousListenReply = await call(master, "rendezvous_listen",
                                                     {"port": port, "token": token, "seconds": LISTEN_S}, 30.0)
    except RemoteError as exc:
        probe["missing"][master] = exc.message
        return probe
    probe["listen"] = listened
    if not listened["listening"]:
        return probe

    async def connect(name: str) -> None:
        try:
            reply: RendezvousConnectReply = await call(
                name, "rendezvous_connect", {"host": choice["master_address"], "port": port, "token": token,
                                             "timeout": CONNECT_TIMEOUT_S}, CONNECT_TIMEOUT_S * 4)
            probe["connects"][name] = reply
        except RemoteError as exc:
            probe["missing"][name] = exc.message

    try:
        async with anyio.create_task_group() as tasks:
            for name in order:
                tasks.start_soon(connect, name)
    finally:
        # Closed even when the probe was cancelled; one that cannot be closes by itself after LISTEN_S.
        with anyio.CancelScope(shield=True), contextlib.suppress(RemoteError):
            await call(master, "rendezvous_close", {"port": port}, 30.0)
    return probe
