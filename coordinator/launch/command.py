"""``--launcher command``: any program, started by coord on every node.

Each node's agent starts the job's command as that node's rank (``runs_on = "nodes"``), or, with
``--procs-per-node K``, a small runner of the agent's (``agent.local_ranks``) that starts K copies of
it and ends them together. Every process finds its world in its environment
(:mod:`coordinator.launch.command_env`): ``COORD_RANK``, ``COORD_LOCAL_RANK``, ``COORD_WORLD_SIZE``,
``COORD_NODE_RANK``, ``COORD_NNODES`` and ``COORD_COORDINATOR_ADDR``, host:port on the first node, the
address every node reaches it by (as torch's rendezvous is chosen) and a port drawn for the run and
attempt; with ``--env-style jax`` or ``tf``, the variables that framework reads as well. So JAX,
TensorFlow, Horovod or a program with sockets of its own runs under coord, and gets what every
launcher gets: its exit status, hangs from its progress (``coord_script.report``), the checkpoint
contract, node loss, the elastic shrink (a new world in the environment), the queue, the dashboard
and the alerts.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.launch.batch import BatchSplit
from coordinator.launch.command_env import coordinator_port, process_env
from coordinator.launch.rendezvous import address_toward, choose_rendezvous
from coordinator.launch.seam import (
    Capabilities,
    JobCommand,
    LaunchPlan,
    NodeReadings,
    PlanError,
    RankSlot,
    StartError,
    no_links,
)
from coordinator.launch.topology import connectivity_matrix

if TYPE_CHECKING:
    from coordinator.config.cluster_file import ClusterConfig
    from coordinator.nodes.cluster import Cluster

#: The runner of K processes on a node (in the agent's bundle, on every rank's PYTHONPATH), and the file
#: in the rank's directory it reads each process's environment from.
LOCAL_RANKS = ("python", "-m", "agent.local_ranks")
RANKS_FILE = "ranks.json"


@dataclass(frozen=True, kw_only=True)
class CommandPlan(LaunchPlan):
    """A command attempt: each node's address, rank by rank, where its processes listen (the first is
    the coordinator's)."""

    addresses: tuple[str, ...]


class CommandLauncher:
    """The job's command on every node, with the world in its environment."""

    name = "command"
    capabilities: Capabilities

    def plan(self, cluster: Cluster, readings: NodeReadings, nodes: list[str], backend: str | None,
             job: JobCommand) -> LaunchPlan:
        if backend is not None:
            raise PlanError(f"--backend {backend}: a command job's program chooses how its processes talk")
        by_name = {n.name: n for n in cluster.config.nodes}
        first = by_name[nodes[0]]
        matrix = connectivity_matrix({n: readings.topologies.get(n) for n in nodes})
        choice = choose_rendezvous(matrix, nodes, configured=first.ips[0] if first.ips else None,
                                   fallback=first.host, one_machine=all(by_name[n].is_local for n in nodes))
        coordinator = choice["master_address"]
        together = choice["reason"].startswith(("one node", "every node is this machine"))
        addresses = [coordinator]
        for name in nodes[1:]:
            node = by_name[name]
            own = coordinator if together else address_toward(matrix, name, nodes[0], coordinator)
            addresses.append(own or (node.ips[0] if node.ips else node.host))
        return CommandPlan(self.name, "own", tuple(nodes), no_links("own"), rendezvous_address=coordinator,
                           procs_per_node=job.procs_per_node or 1, addresses=tuple(addresses))

    def adopt(self, preflight: Mapping[str, Any], nodes: list[str]) -> LaunchPlan | None:
        return None  # planned at launch, from the links

    def rank_command(self, job: JobCommand, slot: RankSlot, *, checkpoint_dir: str, resume_file: str | None,
                     start_step: int, batch: BatchSplit | None) -> list[str]:
        command = list(job.command)
        if slot.plan.procs_per_node == 1:
            return command
        return [*LOCAL_RANKS, "--ranks", "{rank_dir}/" + RANKS_FILE, "--", *command]

    def rank_env(self, job: JobCommand, slot: RankSlot, batch: BatchSplit | None) -> dict[str, str]:
        envs = self._envs(job, slot)
        return envs[0] if len(envs) == 1 else {}  # K processes: each one's, from the ranks file

    def rank_files(self, job: JobCommand, slot: RankSlot, batch: BatchSplit | None) -> dict[str, str]:
        envs = self._envs(job, slot)
        return {} if len(envs) == 1 else {RANKS_FILE: json.dumps(envs, indent=1, sort_keys=True) + "\n"}

    def rank_ports(self, job: JobCommand, slot: RankSlot) -> list[int]:
        """Rank 0's node listens at the coordinator's port (and, with ``tf``, every node at a port per
        process from it): checked free there before the attempt starts. One in use fails this attempt's
        launch, and the next attempt draws another port."""
        port = coordinator_port(slot.run_id, slot.attempt)
        if job.env_style == "tf":
            return [port + local for local in range(slot.plan.procs_per_node)]
        return [port] if slot.rank == 0 else []

    def batch(self, job: JobCommand, ranks: int) -> BatchSplit | None:
        return None  # the program's batch is its own; a shrink gives it the new world to size it by

    def start(self, directory: Path, config: ClusterConfig, plan: LaunchPlan, run_id: str,
              attempt: int) -> subprocess.Popen[bytes]:
        raise StartError("a command job starts on every node through its agent, never from the head")

    def _envs(self, job: JobCommand, slot: RankSlot) -> list[dict[str, str]]:
        """Each process's environment on this slot's node, local rank by local rank."""
        plan = slot.plan
        if not isinstance(plan, CommandPlan):
            raise PlanError(f"a command rank cannot run from a {plan.launcher} plan")
        port = coordinator_port(slot.run_id, slot.attempt)
        return [process_env(job.env_style, node_rank=slot.rank, local_rank=local, procs=plan.procs_per_node,
                            addresses=plan.addresses, port=port) for local in range(plan.procs_per_node)]
