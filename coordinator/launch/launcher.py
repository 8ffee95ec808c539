"""The launcher seam: what coord needs from whatever starts a job's ranks.

A launcher turns the nodes an attempt runs on, and what they measured about their links, into
a typed ``LaunchPlan``; says what each rank runs and which environment it gets; says how the
job's global batch splits over ranks (so that an elastic shrink keeps it); and starts the
attempt. coord owns restarts and node loss for every launcher: a launcher's own restart loop
is always off, and its exit status is never the attempt's outcome (each node's agent reports
its rank).

mlx.launch is one implementation (``coordinator/launch/mlx.py``): one process on the head starts
every rank over SSH. torchrun, Accelerate and DeepSpeed are others (``coordinator/launch/torch_launchers.py``):
each node's agent starts that node's launcher, which starts its workers. Adding a launcher is one
module with a class that has these methods, and one line in ``coordinator/launch/registry.py``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from coordinator.launch.batch import BatchSplit
from coordinator.launch.hostfile import Hostfile
from coordinator.launch.mlx_backend import BackendChoice
from coordinator.launch.mlx_lm_command import JobCommand
from coordinator.launch.topology import Topology
from shared.agent_api.torch import TorchFactsReply

if TYPE_CHECKING:
    from coordinator.config.cluster_file import ClusterConfig
    from coordinator.nodes.cluster import Cluster


class PlanError(Exception):
    """No plan for these nodes; ``node`` names the node to blame (it is waited for like a lost
    one) when there is one."""

    def __init__(self, message: str, *, node: str | None = None):
        super().__init__(message)
        self.message = message
        self.node = node


class StartError(Exception):
    """The launcher could not be started; the message says what to install or fix."""


@dataclass(frozen=True)
class LaunchPlan:
    """One attempt's launch: who runs which rank, over which links, with the launcher's own files."""

    launcher: str  # the registered name of the launcher that made it
    backend: str  # what the ranks talk over (mlx: ring, jaccl, jaccl-ring; torch: gloo, nccl)
    order: tuple[str, ...]  # the nodes, rank by rank
    # The choice as measured (links, reasons, warnings), as pre-flight shows it; kept with the run
    # in short (coordinator.jobs.core.launch_links).
    choice: BackendChoice
    # The launcher's host list: mlx.launch's hostfile (empty for a launcher that has none).
    hosts: Hostfile
    # A launcher that runs on every node: each node's environment from the plan (NCCL's interface, ...).
    node_envs: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    master_address: str | None = None  # where every node finds rank 0 (a torch launcher's rendezvous)
    procs_per_node: int = 1  # processes each node's launcher starts (one per GPU, or as the job says)
    # How long a launcher's own connections to the nodes outlive silence (mlx.launch's ssh): the job's
    # --node-timeout and a margin, so that a head cut off for a while finds its ranks alive when it is back.
    outlive_silence_s: float = 90.0

    @property
    def envs(self) -> dict[str, str]:
        """``NAME=value`` environment the launcher passes every rank, as a mapping."""
        words = self.hosts.get("envs") or []
        found = dict(word.split("=", 1) for word in words if isinstance(word, str) and "=" in word)
        for env in self.node_envs.values():
            found.update(env)
        return found

    @property
    def world_size(self) -> int:
        return len(self.order) * self.procs_per_node


@dataclass(frozen=True)
class NodeReadings:
    """What the nodes measured that a launcher plans from: their links, and (for a torch launcher)
    their PyTorch facts, by node."""

    topologies: Mapping[str, Topology]
    torch: Mapping[str, TorchFactsReply] = field(default_factory=dict)


@dataclass(frozen=True)
class RankSlot:
    """One rank of one attempt, as its command and environment are made for it."""

    plan: LaunchPlan
    rank: int
    run_id: str
    attempt: int


class Launcher(Protocol):
    name: str
    # Where an attempt starts: "head" (one process on the head starts every rank, as mlx.launch does
    # over SSH: ``start``), or "nodes" (each node's agent starts its own rank: the supervisor asks
    # every node's agent to ``start_rank`` once its script is prepared).
    runs_on: Literal["head", "nodes"]

    def plan(self, cluster: Cluster, readings: NodeReadings, nodes: list[str], backend: str | None,
             job: JobCommand) -> LaunchPlan:
        """The plan for ``nodes`` from what they measured; PlanError when there is none."""

    def adopt(self, choice: BackendChoice, hosts: Hostfile, nodes: list[str]) -> LaunchPlan | None:
        """A plan for ``nodes`` from a choice and host list pre-flight already made (so the first
        attempt does not ask every node again); None when the launcher plans from other readings."""

    def rank_command(self, job: JobCommand, slot: RankSlot, *, checkpoint_dir: str, resume_file: str | None,
                     start_step: int, batch: BatchSplit | None) -> list[str]:
        """What one rank runs for one attempt. ``{rank_dir}`` in a word is that rank's directory on its
        node (the agent fills it in)."""

    def rank_env(self, job: JobCommand, slot: RankSlot, batch: BatchSplit | None) -> dict[str, str]:
        """What one rank's environment gets from this launcher, beyond coord's own COORD_* contract."""

    def rank_files(self, job: JobCommand, slot: RankSlot, batch: BatchSplit | None) -> dict[str, str]:
        """Files the rank's launcher reads ({name: text}), written in the rank's directory on its node
        (``batch``: this attempt's split, None for the job's own)."""

    def batch(self, job: JobCommand, ranks: int) -> BatchSplit | None:
        """The job's own global batch on ``ranks`` ranks (None: the launcher cannot tell, and the
        job's batch is left as it is); CommandError when the job states it wrongly."""

    def start(self, directory: Path, config: ClusterConfig, plan: LaunchPlan, run_id: str,
              attempt: int) -> subprocess.Popen[bytes]:
        """A head launcher: write the attempt's launch files in ``directory`` (OSError when they cannot
        be) and start the attempt from the head (StartError when the launcher cannot be started), in a
        session of its own (``start_new_session=True``): it must outlive a daemon that is stopped or
        restarted, and be stopped as one process group (the daemon refuses a launcher that is not). A
        launcher that runs on the nodes is never asked."""
