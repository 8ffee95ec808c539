"""mlx.launch behind the launcher seam: the backend from the measured links (ring, jaccl,
jaccl-ring), the hostfile mlx.launch reads, one process on the head that starts every rank over
SSH with this attempt's own ports, and mlx-lm's command and batch."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from agent.launch import rank_command
from coordinator.launch.batch import BatchSplit
from coordinator.launch.hostfile import Hostfile
from coordinator.launch.mlx_backend import BackendChoice, launch_links
from coordinator.launch.mlx_launch import launcher_argv, ring_starting_port
from coordinator.launch.mlx_lm_command import JobCommand, attempt_command, batch_split, is_mlx_lm
from coordinator.launch.plan import plan_backend, write_launch_files
from coordinator.launch.seam import Capabilities, LaunchPlan, NodeReadings, PlanError, RankSlot, StartError

if TYPE_CHECKING:
    from coordinator.config.cluster_file import ClusterConfig
    from coordinator.nodes.cluster import Cluster


@dataclass(frozen=True, kw_only=True)
class MlxPlan(LaunchPlan):
    """An mlx.launch attempt: the backend choice as measured (links, reasons, warnings, as pre-flight
    shows it) and the hostfile mlx.launch reads."""

    choice: BackendChoice
    hosts: Hostfile


def mlx_plan(name: str, choice: BackendChoice, hosts: Hostfile, nodes: list[str]) -> MlxPlan:
    order = choice.get("order") or nodes
    envs = dict(word.split("=", 1) for word in hosts.get("envs") or [] if isinstance(word, str) and "=" in word)
    return MlxPlan(name, str(choice.get("backend") or hosts.get("backend")), tuple(order), launch_links(choice),
                   rank_envs=envs, choice=choice, hosts=hosts)


class MlxLauncher:
    name = "mlx"
    capabilities: Capabilities

    def plan(self, cluster: Cluster, readings: NodeReadings, nodes: list[str], backend: str | None,
             job: JobCommand) -> LaunchPlan:
        topologies = readings.topologies
        missing = [n for n in nodes if n not in topologies]
        if missing:
            # A node whose session has not noticed yet that it is gone: blame it, so that the
            # next launch waits for it like a lost node.
            raise PlanError(f"no link information from {', '.join(missing)} (is it up?)", node=missing[0])
        choice, document, error = plan_backend(cluster, dict(topologies), forced=backend, nodes=nodes)
        if choice is None or document is None:
            raise PlanError(f"no hostfile: {error}")
        return mlx_plan(self.name, choice, document, nodes)

    def adopt(self, preflight: Mapping[str, Any], nodes: list[str]) -> LaunchPlan | None:
        choice, hosts = preflight.get("backend"), preflight.get("hostfile")
        if not choice or not hosts:
            return None
        return mlx_plan(self.name, cast(BackendChoice, choice), cast(Hostfile, hosts), nodes)

    def rank_command(self, job: JobCommand, slot: RankSlot, *, checkpoint_dir: str, resume_file: str | None,
                     start_step: int, batch: BatchSplit | None) -> list[str]:
        return attempt_command(job, adapter_path=checkpoint_dir, resume_file=resume_file, start_step=start_step,
                               batch=batch)

    def rank_env(self, job: JobCommand, slot: RankSlot, batch: BatchSplit | None) -> dict[str, str]:
        return {}  # mlx.launch gives each rank MLX_RANK and its hostfile itself

    def rank_files(self, job: JobCommand, slot: RankSlot, batch: BatchSplit | None) -> dict[str, str]:
        return {}  # the hostfile is mlx.launch's, on the head

    def rank_ports(self, job: JobCommand, slot: RankSlot) -> list[int]:
        return []  # mlx.launch's ring ports are drawn per attempt (mlx_launch.ring_starting_port)

    def batch(self, job: JobCommand, ranks: int) -> BatchSplit | None:
        if not is_mlx_lm(list(job.command)):
            return None  # a script of one's own: its batch is its own business
        return batch_split(job, ranks)

    def start(self, directory: Path, config: ClusterConfig, plan: LaunchPlan, run_id: str,
              attempt: int) -> subprocess.Popen[bytes]:
        if not isinstance(plan, MlxPlan):
            raise StartError(f"mlx.launch cannot start a {plan.launcher} plan")
        files = write_launch_files(directory, config, plan.hosts, outlive_silence_s=plan.outlive_silence_s)
        argv = [*launcher_argv(), "--hostfile", files["hostfile"], "--starting-port",
                str(ring_starting_port(run_id, attempt)), "--", *rank_command(run_id)]
        env = dict(os.environ, PATH=files["path_prefix"] + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"))
        # A session of its own: a service manager stopping the daemon signals the daemon's process
        # group (launchd), and a terminal its session; mlx.launch, its ssh connections and the local
        # ranks it holds must live on for the next daemon to re-attach to (docs/deploy.md).
        try:
            with open(directory / "launcher.log", "ab") as output:
                return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True, cwd=str(directory))
        except OSError as exc:
            raise StartError(f"mlx.launch could not be started ({argv[0]}: {exc.strerror or exc}); install mlx "
                             "into the head's Python (pip install mlx) or put mlx.launch on the daemon's PATH") \
                from None
