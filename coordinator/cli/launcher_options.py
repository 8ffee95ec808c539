"""The options that say what starts a job's ranks, as `coord run` and `coord bench scaling` take them."""

from __future__ import annotations

import argparse

from coordinator.config.option_values import Whole
from coordinator.jobs.limits import WHOLE
from coordinator.launch.command_env import ENV_STYLES
from coordinator.launch.registry import LAUNCHERS


def add_launcher_options(p: argparse.ArgumentParser, global_batch_help: str) -> None:
    """--launcher, --procs-per-node, --env-style, --global-batch and --micro-batch."""
    p.add_argument("--launcher", choices=list(LAUNCHERS),
                   help="what starts the ranks: mlx.launch from the head (default), or on every node torchrun, "
                        "Accelerate or DeepSpeed with the NCCL/Gloo environment coord chose (a command that starts "
                        "with torchrun, accelerate launch or deepspeed names its own), or command: any program, "
                        "its world in COORD_RANK, COORD_WORLD_SIZE, COORD_COORDINATOR_ADDR, ...; coord owns their "
                        "restarts")
    p.add_argument("--procs-per-node", type=_whole("procs_per_node"), help="processes per node of a PyTorch or "
                   "command job (default: one per GPU, one on a CPU node, one for a command; torchrun's own "
                   "--nproc-per-node works too)")
    p.add_argument("--env-style", choices=list(ENV_STYLES), help="--launcher command: also set a framework's own "
                   "variables: jax (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID: "
                   "jax.distributed.initialize(**coord_script.jax_distributed())) or tf (TF_CONFIG, for "
                   "MultiWorkerMirroredStrategy)")
    p.add_argument("--global-batch", type=_whole("global_batch"), help=global_batch_help)
    p.add_argument("--micro-batch", type=_whole("micro_batch"), help="with --global-batch: examples per process "
                   "per micro-step (default 1)")


def _whole(key: str) -> Whole:
    return Whole(*WHOLE[key])
