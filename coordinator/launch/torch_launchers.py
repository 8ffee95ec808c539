"""torchrun, Accelerate and DeepSpeed behind the launcher seam.

Each node's agent starts that node's launcher (``runs_on = "nodes"``), which starts the node's
workers; coord gives every launcher a fixed world (the number of nodes, this node's rank, rank 0's
address on the link coord chose, the run's own port for this attempt: a static rendezvous), and
turns its own restarts off: coord owns restarts, node loss and the elastic shrink, whatever the
launcher. The NCCL/Gloo environment comes from what the nodes measured
(:mod:`coordinator.launch.torch_env`); the command from the job's
(:mod:`coordinator.launch.torch_command`).

A coord rank is a node here: ``COORD_RANK`` is the node's rank, and each worker gets its own
``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` from its launcher. Every worker of a node shares the
node's progress file and checkpoint directory.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from coordinator.launch.batch import BatchSplit
from coordinator.launch.rendezvous import choose_rendezvous
from coordinator.launch.seam import (
    Capabilities,
    CommandError,
    JobCommand,
    LaunchPlan,
    NodeReadings,
    PlanError,
    RankSlot,
    StartError,
    no_links,
)
from coordinator.launch.topology import connectivity_matrix
from coordinator.launch.torch_command import MODULES, TorchCommand, option_value, read_command, without
from coordinator.launch.torch_env import shares_network, torch_backend, torch_envs
from shared.agent_api.torch import TorchFactsReply

if TYPE_CHECKING:
    from coordinator.config.cluster_file import ClusterConfig
    from coordinator.nodes.cluster import Cluster

#: Where each attempt's rendezvous port is drawn from: below the MLX ring's ports
#: (coordinator/launch/mlx_launch.py) and below Linux's ephemeral ports (32768 on).
MASTER_PORTS = (17000, 20000)


def master_port(run_id: str, attempt: int) -> int:
    """This attempt's own rendezvous port. torchrun's default (29500) is the same for every job: two
    jobs on one machine would meet in one store; a new attempt would wait on the last one's socket.
    Drawn from the run id and the attempt, it is stable across a daemon restart."""
    digest = hashlib.sha256(f"torch:{run_id}:{attempt}".encode()).digest()
    return MASTER_PORTS[0] + int.from_bytes(digest[:4], "big") % (MASTER_PORTS[1] - MASTER_PORTS[0])


def torch_plan(name: str, cluster: Cluster, readings: NodeReadings, nodes: list[str], backend: str | None,
               job: JobCommand) -> LaunchPlan:
    """The plan every torch launcher shares: rank 0's address and each node's interface toward it, the
    collective backend and its environment, and the processes per node."""
    if backend is not None:
        raise PlanError(f"--backend {backend} is an MLX backend; a {name} job's backend follows its nodes "
                        "(NCCL on GPUs, Gloo on CPUs)")
    missing = [n for n in nodes if n not in readings.facts]
    if missing:
        raise PlanError(f"no PyTorch facts from {', '.join(missing)} (is it up?)", node=missing[0])
    facts = {n: cast(TorchFactsReply, readings.facts[n]) for n in nodes}
    without_torch = [n for n in nodes if not facts[n]["versions"]["torch"]]
    if without_torch:
        raise PlanError(f"torch is not installed in the Python of {', '.join(without_torch)} (pip install torch "
                        "with that node's python; coord preflight --torch says which build)")
    by_name = {n.name: n for n in cluster.config.nodes}
    master = by_name[nodes[0]]
    one_machine = all(shares_network(by_name[n], master, facts[n], facts[master.name]) for n in nodes)
    matrix = connectivity_matrix({n: readings.topologies.get(n) for n in nodes})
    choice = choose_rendezvous(matrix, nodes, configured=master.ips[0] if master.ips else None,
                               fallback=master.host, one_machine=one_machine)
    collective = torch_backend(facts)
    procs = procs_per_node(job, name, [len(facts[n]["gpus"]) for n in nodes], collective)
    return LaunchPlan(name, collective, tuple(nodes), no_links(collective),
                      node_envs=torch_envs(facts, choice["interfaces"]),
                      rendezvous_address=choice["master_address"], procs_per_node=procs)


def procs_per_node(job: JobCommand, launcher: str, gpus: list[int], backend: str) -> int:
    """The job's processes per node: as it says (``--procs-per-node``, torchrun's ``--nproc-per-node``),
    else one per GPU (the fewest any node has), one on CPU nodes."""
    if job.procs_per_node is not None:
        return job.procs_per_node
    given = read_command(job.command, launcher).procs_per_node
    if given is not None and given.isdigit() and int(given) > 0:
        return int(given)
    if given not in (None, "gpu", "auto", "cpu"):
        raise PlanError(f"--nproc-per-node {given}: give a number of processes (or gpu, auto, cpu)")
    if backend == "nccl" and given != "cpu":
        return max(1, min(gpus))
    return 1


def known_procs(job: JobCommand, launcher: str) -> int | None:
    """The processes per node a job states itself (None: one per GPU, known only from the nodes)."""
    if job.procs_per_node is not None:
        return job.procs_per_node
    given = read_command(job.command, launcher).procs_per_node
    return int(given) if given is not None and given.isdigit() and int(given) > 0 else None


class TorchLauncher:
    """What the three torch launchers share: the plan, the environment, the batch."""

    name = "torch"
    capabilities: Capabilities

    def plan(self, cluster: Cluster, readings: NodeReadings, nodes: list[str], backend: str | None,
             job: JobCommand) -> LaunchPlan:
        try:
            read_command(job.command, self.name)
        except CommandError as exc:
            raise PlanError(str(exc)) from None
        return torch_plan(self.name, cluster, readings, nodes, backend, job)

    def adopt(self, preflight: Mapping[str, Any], nodes: list[str]) -> LaunchPlan | None:
        return None  # planned at launch, from the nodes' PyTorch facts

    def rank_command(self, job: JobCommand, slot: RankSlot, *, checkpoint_dir: str, resume_file: str | None,
                     start_step: int, batch: BatchSplit | None) -> list[str]:
        raise NotImplementedError

    def rank_env(self, job: JobCommand, slot: RankSlot, batch: BatchSplit | None) -> dict[str, str]:
        plan = slot.plan
        env = dict(plan.node_envs.get(plan.order[slot.rank], {}))
        env.update({"COORD_NODE_RANK": str(slot.rank), "COORD_NNODES": str(len(plan.order)),
                    "COORD_PROCS_PER_NODE": str(plan.procs_per_node), "COORD_WORLD_SIZE": str(plan.world_size),
                    "MASTER_ADDR": plan.rendezvous_address or "", "MASTER_PORT": str(master_port(slot.run_id,
                                                                                              slot.attempt))})
        split = batch if batch is not None else self.batch(job, len(plan.order))
        if split is not None and job.global_batch is not None:
            env.update({"COORD_GLOBAL_BATCH": str(split.global_batch), "COORD_GRAD_ACCUM": str(split.accumulation),
                        "COORD_MICRO_BATCH": str(split.per_rank // plan.procs_per_node)})
        return env

    def rank_files(self, job: JobCommand, slot: RankSlot, batch: BatchSplit | None) -> dict[str, str]:
        return {}

    def rank_ports(self, job: JobCommand, slot: RankSlot) -> list[int]:
        return []  # the rendezvous port is probed by pre-flight, and torchrun says when it is taken

    def batch(self, job: JobCommand, ranks: int) -> BatchSplit | None:
        """``--global-batch G --micro-batch M``: on N nodes of P processes each, G = M × P × N × accumulation;
        a shrink keeps G and recomputes the accumulation (coordinator/launch/batch.py)."""
        if job.global_batch is None:
            return None
        micro = job.micro_batch or 1
        procs = known_procs(job, self.name)
        if procs is None:
            raise CommandError("--global-batch needs the processes per node to keep the global batch on a shrink: "
                               "give --procs-per-node N (or torchrun's --nproc-per-node N)")
        per_step = micro * procs * ranks
        if job.global_batch % per_step:
            raise CommandError(f"--global-batch {job.global_batch} is not a whole number of micro-steps of {micro} "
                               f"examples on each of {procs * ranks} processes ({per_step} examples)")
        return BatchSplit(per_step, job.global_batch // per_step, ranks)

    def start(self, directory: Path, config: ClusterConfig, plan: LaunchPlan, run_id: str,
              attempt: int) -> subprocess.Popen[bytes]:
        raise StartError(f"{self.name} starts on every node through its agent, never from the head")

    def _fixed(self, slot: RankSlot) -> tuple[int, int, str, int]:
        plan = slot.plan
        if not plan.rendezvous_address:
            raise PlanError(f"the {self.name} plan has no rendezvous address")
        return len(plan.order), plan.procs_per_node, plan.rendezvous_address, master_port(slot.run_id, slot.attempt)


class TorchrunLauncher(TorchLauncher):
    """``python -m torch.distributed.run`` on every node: a static rendezvous at rank 0's node, the
    workers' error files kept in the rank's directory (``{rank_dir}/torchrun``), no restarts."""

    name = "torchrun"

    def rank_command(self, job: JobCommand, slot: RankSlot, *, checkpoint_dir: str, resume_file: str | None,
                     start_step: int, batch: BatchSplit | None) -> list[str]:
        command = read_command(job.command, self.name)
        nodes, procs, address, port = self._fixed(slot)
        return ["python", "-m", MODULES[self.name], "--nnodes", str(nodes), "--node-rank", str(slot.rank),
                "--nproc-per-node", str(procs), "--master-addr", address, "--master-port", str(port),
                "--max-restarts", "0", "--log-dir", "{rank_dir}/torchrun", *command.options, *command.program]


#: The keys of an Accelerate config that make a node one machine of the job: coord's, whatever a plan or
#: the user's file says.
MACHINE_KEYS = frozenset({"compute_environment", "num_machines", "machine_rank", "main_process_ip",
                          "main_process_port", "num_processes", "rdzv_backend", "same_network", "use_cpu"})
#: The plan's DeepSpeed JSON with the attempt's batch, in each rank's directory ($COORD_DEEPSPEED_CONFIG).
DEEPSPEED_CONFIG = "ds_config.json"


class AccelerateLauncher(TorchLauncher):
    """``accelerate launch`` on every node with a config coord writes for that node (its rank, rank 0's
    address and port, the machines and processes), laid over the user's own ``--config_file``."""

    name = "accelerate"

    def rank_command(self, job: JobCommand, slot: RankSlot, *, checkpoint_dir: str, resume_file: str | None,
                     start_step: int, batch: BatchSplit | None) -> list[str]:
        command = read_command(job.command, self.name)
        options = without(command.options, ("--config_file", "--config-file"))
        return ["python", "-m", MODULES[self.name], "--config_file", "{rank_dir}/accelerate.yaml", *options,
                *command.program]

    def rank_env(self, job: JobCommand, slot: RankSlot, batch: BatchSplit | None) -> dict[str, str]:
        env = super().rank_env(job, slot, batch)
        if slot.plan.backend == "gloo":
            env["ACCELERATE_USE_CPU"] = "true"  # its processes take the CPU and Gloo (MULTI_CPU), not "no GPU: alone"
        return env

    def rank_files(self, job: JobCommand, slot: RankSlot, batch: BatchSplit | None) -> dict[str, str]:
        import yaml  # mlx-lm's own dependency, on the head

        return {"accelerate.yaml": yaml.safe_dump(self.node_config(job, slot), sort_keys=True)}

    def node_config(self, job: JobCommand, slot: RankSlot) -> dict[str, Any]:
        """The user's config (their ``--config_file``, read from the job's source on the head), under the
        plan's settings (``coord run --plan``: strategy, precision, FSDP), with the keys that make this
        node one machine of the job set by coord."""
        command = read_command(job.command, self.name)
        nodes, procs, address, port = self._fixed(slot)
        config = user_config(job, command)
        config.update({key: value for key, value in (job.launcher_config or {}).items() if key not in MACHINE_KEYS})
        distributed = config.get("distributed_type")
        if distributed in (None, "NO", "MULTI_CPU", "MULTI_GPU"):
            # MULTI_GPU on CPU nodes too: it is the type Accelerate starts through torchrun (its MULTI_CPU
            # type runs the script alone, with its ranks left to mpirun), and its processes find no GPU and
            # take Gloo, as Accelerate's own MULTI_CPU processes do.
            distributed = "MULTI_GPU" if nodes * procs > 1 else "NO"
        config.update({"compute_environment": "LOCAL_MACHINE", "distributed_type": distributed,
                       "num_machines": nodes, "machine_rank": slot.rank, "main_process_ip": address,
                       "main_process_port": port, "num_processes": nodes * procs, "rdzv_backend": "static",
                       "same_network": True, "use_cpu": False})
        config.setdefault("mixed_precision", "no")
        return config


class DeepSpeedLauncher(TorchLauncher):
    """DeepSpeed's runner on every node with ``--no_ssh`` and this node's rank, and a hostfile of
    ``nodeR slots=P`` lines coord writes in the rank's directory."""

    name = "deepspeed"

    def rank_command(self, job: JobCommand, slot: RankSlot, *, checkpoint_dir: str, resume_file: str | None,
                     start_step: int, batch: BatchSplit | None) -> list[str]:
        command = read_command(job.command, self.name)
        nodes, procs, address, port = self._fixed(slot)
        return ["python", "-m", MODULES[self.name], "--no_ssh", "--hostfile", "{rank_dir}/hostfile", "--num_nodes",
                str(nodes), "--node_rank", str(slot.rank), "--num_gpus", str(procs), "--master_addr", address,
                "--master_port", str(port), *command.options, *command.program]

    def rank_files(self, job: JobCommand, slot: RankSlot, batch: BatchSplit | None) -> dict[str, str]:
        files = {"hostfile": "".join(f"node{rank} slots={slot.plan.procs_per_node}\n"
                                     for rank in range(len(slot.plan.order)))}
        if job.launcher_config is not None:
            files[DEEPSPEED_CONFIG] = json.dumps(self.attempt_config(job, slot, batch), indent=2, sort_keys=True) + "\n"
        return files

    def rank_env(self, job: JobCommand, slot: RankSlot, batch: BatchSplit | None) -> dict[str, str]:
        env = super().rank_env(job, slot, batch)
        if job.launcher_config is not None:
            env["COORD_DEEPSPEED_CONFIG"] = "{rank_dir}/" + DEEPSPEED_CONFIG
        return env

    def attempt_config(self, job: JobCommand, slot: RankSlot, batch: BatchSplit | None) -> dict[str, Any]:
        """The plan's DeepSpeed JSON with this attempt's batch: DeepSpeed checks train_batch_size = micro ×
        accumulation × world, and a shrink keeps the global batch with more accumulation (and no larger a
        micro-batch), so all three are this attempt's."""
        config = dict(job.launcher_config or {})
        split = batch if batch is not None else self.batch(job, len(slot.plan.order))
        if split is not None:
            config.update(train_batch_size=split.global_batch, gradient_accumulation_steps=split.accumulation,
                          train_micro_batch_size_per_gpu=split.per_rank // slot.plan.procs_per_node)
        return config


def user_config(job: JobCommand, command: TorchCommand) -> dict[str, Any]:
    """The Accelerate config file the command names (relative to the job's source on the head), or {}."""
    name = option_value(command.options, ("--config_file", "--config-file"))
    if name is None:
        return {}
    path = Path(name).expanduser()
    if not path.is_absolute():
        if not job.source:
            raise CommandError(f"the config file {name} is relative and the job has no source to find it in")
        path = Path(job.source) / path
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise CommandError(f"cannot read the Accelerate config file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise CommandError(f"the Accelerate config file {path} is not valid YAML: {exc}") from None
    if not isinstance(loaded, Mapping):
        raise CommandError(f"the Accelerate config file {path} is not a mapping of settings")
    return dict(loaded)
