"""The launcher seam: what coord needs from whatever starts a job's ranks, in no framework's words.

A launcher turns the nodes an attempt runs on, and what they measured, into a typed ``LaunchPlan``;
says what each rank runs and which environment and files it gets; says how the job's global batch
splits over ranks (so that an elastic shrink keeps it); and, if it runs on the head, starts the
attempt. coord owns restarts and node loss for every launcher: a launcher's own restart loop is
always off, and its exit status is never the attempt's outcome (each node's agent reports its rank).

What differs between launchers beyond those methods is declared, never asked by name: a launcher's
``Capabilities`` (where it runs, what it needs from the nodes, which pre-flight checks it gets, how
its checkpoints lie on the nodes, which job options it takes) sit beside its name in
:mod:`coordinator.launch.registry`, where the rest of coord reads them. Adding a launcher is one
module with a class that has these methods, and one line in the registry.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from coordinator.launch.batch import BatchSplit
from coordinator.launch.kinds import OPTIONS, Capabilities, CommandError, JobCommand
from coordinator.launch.topology import Topology

if TYPE_CHECKING:
    from coordinator.config.cluster_file import ClusterConfig
    from coordinator.nodes.cluster import Cluster

__all__ = ["OPTIONS", "Capabilities", "CommandError", "JobCommand", "LaunchLinks", "LaunchPlan", "Launcher",
           "NeighbourLink", "NodeReadings", "PlanError", "RankSlot", "StartError", "no_links"]


class PlanError(Exception):
    """No plan for these nodes; ``node`` names the node to blame (it is waited for like a lost
    one) when there is one."""

    def __init__(self, message: str, *, node: str | None = None):
        super().__init__(message)
        self.message = message
        self.node = node


class StartError(Exception):
    """The launcher could not be started; the message says what to install or fix."""


class NeighbourLink(TypedDict):
    """Two neighbouring ranks' nodes (``a`` < ``b``) and the link between them."""

    a: str
    b: str
    kind: str | None  # thunderbolt, ethernet, wifi, other; None: RDMA without a shared subnet
    speed_gbps: float | None


class LaunchLinks(TypedDict):
    """What an attempt ran over, small enough to keep with the run (``JobRecord.backend``; the
    dashboard shows it)."""

    backend: str | None
    transport: str | None
    ring: list[str] | None
    links: list[NeighbourLink]


def no_links(backend: str | None, transport: str | None = "tcp") -> LaunchLinks:
    """What an attempt runs over when its launcher measured no pairs of its own."""
    return {"backend": backend, "transport": transport, "ring": None, "links": []}


@dataclass(frozen=True)
class LaunchPlan:
    """One attempt's launch: who runs which rank, over what, with which environment. A launcher that
    needs more of its own (mlx.launch's hostfile) makes a subclass of it."""

    launcher: str  # the registered name of the launcher that made it
    backend: str  # what the ranks talk over, in the launcher's words
    order: tuple[str, ...]  # the nodes, rank by rank
    links: LaunchLinks  # the same, in short, kept with the run
    rank_envs: Mapping[str, str] = field(default_factory=dict)  # what every rank's environment gets
    node_envs: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # and each node's, by node
    rendezvous_address: str | None = None  # where every node finds rank 0, for a launcher that meets there
    procs_per_node: int = 1  # processes each node's rank starts (one per GPU, or as the job says)
    # How long a launcher's own connections to the nodes outlive silence: the job's --node-timeout and
    # a margin, so that a head cut off for a while finds its ranks alive when it is back.
    outlive_silence_s: float = 90.0

    @property
    def envs(self) -> dict[str, str]:
        """Every ``NAME=value`` the plan gives its ranks, as one mapping (for the launch's diagnosis)."""
        found = dict(self.rank_envs)
        for env in self.node_envs.values():
            found.update(env)
        return found

    @property
    def world_size(self) -> int:
        return len(self.order) * self.procs_per_node


@dataclass(frozen=True)
class NodeReadings:
    """What the nodes measured that a launcher plans from: their links, and the facts its capabilities
    ask for (``Capabilities.node_facts``), by node."""

    topologies: Mapping[str, Topology]
    facts: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class RankSlot:
    """One rank of one attempt, as its command and environment are made for it."""

    plan: LaunchPlan
    rank: int
    run_id: str
    attempt: int


class Launcher(Protocol):
    name: str
    capabilities: Capabilities

    def plan(self, cluster: Cluster, readings: NodeReadings, nodes: list[str], backend: str | None,
             job: JobCommand) -> LaunchPlan:
        """The plan for ``nodes`` from what they measured; PlanError when there is none."""

    def adopt(self, preflight: Mapping[str, Any], nodes: list[str]) -> LaunchPlan | None:
        """A plan for ``nodes`` from what pre-flight just found (its report), so that the first attempt
        does not ask every node again; None when the launcher plans from other readings."""

    def rank_command(self, job: JobCommand, slot: RankSlot, *, checkpoint_dir: str, resume_file: str | None,
                     start_step: int, batch: BatchSplit | None) -> list[str]:
        """What one rank runs for one attempt. ``{rank_dir}`` in a word is that rank's directory on its
        node (the agent fills it in); a leading ``python`` is the node's Python."""

    def rank_env(self, job: JobCommand, slot: RankSlot, batch: BatchSplit | None) -> dict[str, str]:
        """What one rank's environment gets from this launcher, beyond coord's own COORD_* contract."""

    def rank_files(self, job: JobCommand, slot: RankSlot, batch: BatchSplit | None) -> dict[str, str]:
        """Files the rank's launcher reads ({name: text}), written in the rank's directory on its node
        (``batch``: this attempt's split, None for the job's own)."""

    def rank_ports(self, job: JobCommand, slot: RankSlot) -> list[int]:
        """The TCP ports this rank will listen on (a coordinator's), checked free on its node when its
        script is prepared; empty when it listens on none coord chose."""

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
