"""torchrun, Accelerate and DeepSpeed behind the launcher seam, with plain data: a job's command read
(coord's own options refused), each node's command, environment and files, the batch kept on a shrink."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml

from coordinator.jobs.spec import JobSpec, JobSpecError, spec_from_fields, validate
from coordinator.launch.batch import BatchSplit, rebatch
from coordinator.launch.seam import LaunchPlan, NodeReadings, PlanError, RankSlot
from coordinator.launch.mlx_lm_command import CommandError
from coordinator.launch.registry import launcher_named
from coordinator.launch.torch_command import launcher_in, read_command
from coordinator.launch.torch_launchers import MASTER_PORTS, master_port, torch_plan


def _facts(gpus: int = 0, torch: str | None = "2.13.0+cpu", hostname: str = "h") -> dict:
    return {"hostname": hostname, "os": "Linux", "python": "/p", "memory_bytes": 1 << 34,
            "versions": {"torch": torch, "cuda": None, "nccl": None, "accelerate": "1.15.0", "deepspeed": None},
            "distributed": True, "gloo": True, "nccl_available": gpus > 0, "cuda_available": gpus > 0,
            "gpus": [{"index": i, "name": "NVIDIA H100", "memory_total_bytes": 80 << 30, "memory_used_bytes": 0,
                      "compute_capability": "9.0"} for i in range(gpus)],
            "gpu_source": "nvidia-smi", "infiniband": [], "infiniband_source": "ibv_devinfo", "shm": None,
            "detail": {}}


def _cluster(*names: str, local: bool = True):
    nodes = [SimpleNamespace(name=n, is_local=local, ips=[], host="local" if local else f"{n}.lan") for n in names]
    return SimpleNamespace(config=SimpleNamespace(nodes=nodes))


def _plan(launcher: str, job: JobSpec, nodes=("a", "b"), gpus: int = 0) -> LaunchPlan:
    readings = NodeReadings({}, {n: _facts(gpus, hostname="h") for n in nodes})
    return launcher_named(launcher).plan(_cluster(*nodes), readings, list(nodes), None, job)


# --- reading a job's command ---------------------------------------------------------


def test_a_command_names_its_launcher_itself_in_any_of_its_forms():
    assert launcher_in(["torchrun", "--nproc-per-node", "2", "train.py"]) == "torchrun"
    assert launcher_in(["/usr/bin/python3", "-m", "torch.distributed.run", "train.py"]) == "torchrun"
    assert launcher_in(["accelerate", "launch", "train.py"]) == "accelerate"
    assert launcher_in(["python", "-m", "accelerate.commands.launch", "train.py"]) == "accelerate"
    assert launcher_in(["deepspeed", "train.py"]) == "deepspeed"
    assert launcher_in(["python", "train.py"]) is None and launcher_in(["accelerate", "config"]) is None


def test_the_launchers_options_and_the_program_are_told_apart():
    command = read_command(["torchrun", "--nproc-per-node=4", "--standalone-ish", "x", "-m", "pkg.train",
                            "--lr", "1e-3"], "torchrun")
    assert command.procs_per_node == "4"
    assert command.options == ("--standalone-ish", "x", "-m") and command.program == ("pkg.train", "--lr", "1e-3")
    plain = read_command(["python", "train.py", "--lr", "1e-3"], "torchrun")
    assert plain.form is None and plain.options == () and plain.program == ("train.py", "--lr", "1e-3")
    module = read_command(["python", "-m", "pkg.train"], "accelerate")
    assert module.program == ("-m", "pkg.train")
    accelerate = read_command(["accelerate", "launch", "--mixed_precision", "bf16", "--use_fsdp", "train.py"],
                              "accelerate")
    assert accelerate.options == ("--mixed_precision", "bf16", "--use_fsdp") and accelerate.program == ("train.py",)


@pytest.mark.parametrize(("command", "launcher", "refused"), [
    (["torchrun", "--nnodes", "2", "train.py"], "torchrun", "--nnodes"),
    (["torchrun", "--master_port=29501", "train.py"], "torchrun", "--master_port"),
    (["torchrun", "--max-restarts", "3", "train.py"], "torchrun", "--max-restarts"),
    (["torchrun", "--standalone", "train.py"], "torchrun", "--standalone"),
    (["accelerate", "launch", "--machine_rank", "1", "train.py"], "accelerate", "--machine_rank"),
    (["accelerate", "launch", "--num_processes", "8", "train.py"], "accelerate", "--num_processes"),
    (["deepspeed", "--hostfile", "hosts", "train.py"], "deepspeed", "--hostfile"),
    (["deepspeed", "--include", "n1:0,1", "train.py"], "deepspeed", "--include"),
])
def test_an_option_coord_sets_itself_is_refused_by_name(command, launcher, refused):
    with pytest.raises(CommandError, match=f"^{refused}: "):
        read_command(command, launcher)


def test_a_command_without_a_program_or_for_another_launcher_is_refused():
    with pytest.raises(CommandError, match="give the training script"):
        read_command(["torchrun", "--nproc-per-node", "2"], "torchrun")
    with pytest.raises(CommandError, match="needs a value"):
        read_command(["torchrun", "--nproc-per-node"], "torchrun")
    with pytest.raises(CommandError, match="runs accelerate but the job's launcher is torchrun"):
        read_command(["accelerate", "launch", "train.py"], "torchrun")
    with pytest.raises(CommandError, match="give the script first"):
        read_command(["python", "-u", "train.py"], "torchrun")


def test_coord_run_with_a_launchers_command_takes_that_launcher_and_checks_the_rest():
    spec = validate(JobSpec(name="j", command=["torchrun", "--nproc-per-node", "2", "train.py"]))
    assert spec.launcher == "torchrun"
    with pytest.raises(JobSpecError, match="^--rdzv-endpoint: coord runs a static rendezvous"):
        validate(JobSpec(name="j", command=["torchrun", "--rdzv-endpoint", "x:1", "train.py"]))
    with pytest.raises(JobSpecError, match="^--backend: for --launcher mlx, not torchrun"):
        validate(JobSpec(name="j", command=["python", "t.py"], launcher="torchrun", backend="ring"))
    with pytest.raises(JobSpecError, match="^--procs-per-node: for --launcher torchrun or accelerate or deepspeed "
                                           "or command, not mlx"):
        validate(JobSpec(name="j", command=["python", "t.py"], procs_per_node=2))
    with pytest.raises(JobSpecError, match="runs a program of your own"):
        validate(JobSpec(name="j", command=["python", "-m", "mlx_lm", "lora", "--iters", "3"], launcher="torchrun"))
    with pytest.raises(JobSpecError, match="--micro-batch goes with --global-batch"):
        validate(JobSpec(name="j", command=["python", "t.py"], launcher="torchrun", micro_batch=2))
    with pytest.raises(JobSpecError, match="--global-batch must be a whole number"):
        spec_from_fields({"name": "j", "command": ["python", "t.py"], "launcher": "torchrun", "global_batch": 0})


# --- the plan and each node's launch -------------------------------------------------


def test_local_nodes_meet_on_loopback_with_gloo_and_one_process_each():
    job = validate(JobSpec(name="j", command=["python", "train.py"], launcher="torchrun"))
    plan = _plan("torchrun", job)
    assert (plan.launcher, plan.backend, plan.order, plan.rendezvous_address) == ("torchrun", "gloo", ("a", "b"),
                                                                              "127.0.0.1")
    assert plan.procs_per_node == 1 and plan.world_size == 2
    assert plan.node_envs["a"] == {"COORD_TORCH_BACKEND": "gloo"}
    assert launcher_named("torchrun").capabilities.runs_on == "nodes"


def test_gpu_nodes_run_one_process_per_gpu_with_nccl_unless_the_job_says():
    job = validate(JobSpec(name="j", command=["python", "train.py"], launcher="torchrun"))
    assert _plan("torchrun", job, gpus=8).procs_per_node == 8 and _plan("torchrun", job, gpus=8).backend == "nccl"
    given = validate(JobSpec(name="j", command=["torchrun", "--nproc-per-node", "2", "train.py"]))
    assert _plan("torchrun", given, gpus=8).procs_per_node == 2
    option = validate(JobSpec(name="j", command=["python", "train.py"], launcher="torchrun", procs_per_node=4))
    assert _plan("torchrun", option, gpus=8).procs_per_node == 4


def test_a_node_without_torch_or_without_facts_has_no_plan():
    job = validate(JobSpec(name="j", command=["python", "train.py"], launcher="torchrun"))
    readings = NodeReadings({}, {"a": _facts(), "b": _facts(torch=None)})
    with pytest.raises(PlanError, match="torch is not installed in the Python of b"):
        torch_plan("torchrun", _cluster("a", "b"), readings, ["a", "b"], None, job)
    with pytest.raises(PlanError, match="no PyTorch facts from b") as lost:
        torch_plan("torchrun", _cluster("a", "b"), NodeReadings({}, {"a": _facts()}), ["a", "b"], None, job)
    assert lost.value.node == "b"  # waited for like a lost node


def test_torchrun_on_each_node_gets_the_fixed_world_and_no_restarts():
    job = validate(JobSpec(name="j", command=["torchrun", "--nproc-per-node", "2", "--redirects", "3", "train.py",
                                              "--lr", "1e-3"]))
    plan = _plan("torchrun", job)
    torchrun = launcher_named("torchrun")
    command = torchrun.rank_command(job, RankSlot(plan, 1, "run-1", 3), checkpoint_dir="/c", resume_file=None,
                                    start_step=0, batch=None)
    port = master_port("run-1", 3)
    assert command == ["python", "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "1",
                       "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                       "--max-restarts", "0", "--log-dir", "{rank_dir}/torchrun", "--redirects", "3", "train.py",
                       "--lr", "1e-3"]
    env = torchrun.rank_env(job, RankSlot(plan, 1, "run-1", 3), None)
    assert env["COORD_NODE_RANK"] == "1" and env["COORD_WORLD_SIZE"] == "4" and env["MASTER_PORT"] == str(port)


def test_each_attempt_has_its_own_port_in_the_runs_range_stable_across_a_restart():
    ports = {master_port("run-1", attempt) for attempt in range(20)}
    assert len(ports) > 15 and all(MASTER_PORTS[0] <= port < MASTER_PORTS[1] for port in ports)
    assert master_port("run-1", 2) == master_port("run-1", 2) != master_port("run-2", 2)


def test_accelerate_gets_a_config_per_node_over_the_users_own(tmp_path):
    (tmp_path / "acc.yaml").write_text("distributed_type: MULTI_GPU\nmixed_precision: bf16\nnum_machines: 9\n"
                                       "gradient_accumulation_steps: 4\n")
    job = validate(JobSpec(name="j", source=str(tmp_path), command=["accelerate", "launch", "--config_file",
                                                                    "acc.yaml", "--mixed_precision", "fp16",
                                                                    "train.py"]))
    assert job.launcher == "accelerate"
    plan = _plan("accelerate", job, nodes=("a", "b", "c"))
    accelerate = launcher_named("accelerate")
    slot = RankSlot(plan, 2, "run", 0)
    command = accelerate.rank_command(job, slot, checkpoint_dir="/c", resume_file=None, start_step=0, batch=None)
    assert command == ["python", "-m", "accelerate.commands.launch", "--config_file", "{rank_dir}/accelerate.yaml",
                       "--mixed_precision", "fp16", "train.py"]
    config = yaml.safe_load(accelerate.rank_files(job, slot, None)["accelerate.yaml"])
    assert config["machine_rank"] == 2 and config["num_machines"] == 3 and config["num_processes"] == 3
    assert config["main_process_ip"] == "127.0.0.1" and config["main_process_port"] == master_port("run", 0)
    # the user's own keys are kept, a GPU type on CPU nodes is the CPU's
    assert config["mixed_precision"] == "bf16" and config["gradient_accumulation_steps"] == 4
    assert config["distributed_type"] == "MULTI_GPU" and config["use_cpu"] is False  # started through torchrun
    assert accelerate.rank_env(job, slot, None)["ACCELERATE_USE_CPU"] == "true"  # its processes: MULTI_CPU, Gloo


def test_deepspeed_runs_its_runner_without_ssh_with_a_hostfile_of_the_nodes():
    job = validate(JobSpec(name="j", command=["deepspeed", "train.py", "--deepspeed_config", "ds.json"]))
    plan = _plan("deepspeed", job, gpus=4)
    deepspeed = launcher_named("deepspeed")
    slot = RankSlot(plan, 0, "run", 1)
    command = deepspeed.rank_command(job, slot, checkpoint_dir="/c", resume_file=None, start_step=0, batch=None)
    assert command[:5] == ["python", "-m", "deepspeed.launcher.runner", "--no_ssh", "--hostfile"]
    assert command[command.index("--node_rank") + 1] == "0" and command[command.index("--num_gpus") + 1] == "4"
    assert command[-3:] == ["train.py", "--deepspeed_config", "ds.json"]
    assert deepspeed.rank_files(job, slot, None) == {"hostfile": "node0 slots=4\nnode1 slots=4\n"}


def test_a_global_batch_is_kept_on_a_shrink_by_more_accumulation():
    job = validate(JobSpec(name="j", command=["python", "t.py"], launcher="torchrun", procs_per_node=2,
                           global_batch=48, micro_batch=4))
    torchrun = launcher_named("torchrun")
    split = torchrun.batch(job, 3)
    assert split == BatchSplit(24, 2, 3)  # 3 nodes × 2 processes × 4 examples, 2 micro-steps
    smaller = rebatch(split, 2)
    assert smaller.global_batch == 48 and smaller.per_rank <= split.per_rank
    plan = _plan("torchrun", job, nodes=("a", "b"))
    env = torchrun.rank_env(job, RankSlot(plan, 0, "run", 1), smaller)
    assert env["COORD_GLOBAL_BATCH"] == "48" and int(env["COORD_MICRO_BATCH"]) <= 4
    assert int(env["COORD_MICRO_BATCH"]) * 2 * 2 * int(env["COORD_GRAD_ACCUM"]) == 48
    unknown = validate(JobSpec(name="j", command=["python", "t.py"], launcher="torchrun", global_batch=48))
    with pytest.raises(CommandError, match="needs the processes per node"):
        torchrun.batch(unknown, 3)
    uneven = validate(JobSpec(name="j", command=["python", "t.py"], launcher="torchrun", procs_per_node=1,
                              global_batch=10, micro_batch=4))
    with pytest.raises(CommandError, match="not a whole number of micro-steps"):
        torchrun.batch(uneven, 2)


def test_nodes_that_share_a_hostname_but_not_a_network_do_not_meet_on_loopback():
    """Two Macs are both "MacBook-Pro.local" out of the box, and network namespaces share the machine's
    name: only the same network stack (boot and namespace, as each agent reads it) is one machine."""
    job = validate(JobSpec(name="j", command=["python", "train.py"], launcher="torchrun"))
    cluster = _cluster("a", "b", local=False)
    apart = {"a": {**_facts(hostname="mac"), "network_id": "boot1/net:[1]"},
             "b": {**_facts(hostname="mac"), "network_id": "boot1/net:[2]"}}
    plan = torch_plan("torchrun", cluster, NodeReadings({}, apart), ["a", "b"], None, job)
    assert plan.rendezvous_address == "a.lan"  # the cluster file's host for rank 0, resolved on each node
    together = {n: {**f, "network_id": "boot1/net:[1]"} for n, f in apart.items()}
    assert torch_plan("torchrun", cluster, NodeReadings({}, together), ["a", "b"], None, job).rendezvous_address == \
        "127.0.0.1"


# --- a plan's settings (coord run --plan) ---------------------------------------------------


def test_a_plans_accelerate_settings_lie_over_the_users_file_and_under_coords_machine_keys(tmp_path):
    (tmp_path / "acc.yaml").write_text("mixed_precision: fp16\ndynamo_backend: 'NO'\n")
    planned = {"distributed_type": "FSDP", "mixed_precision": "bf16", "num_machines": 7, "main_process_ip": "10.9.9.9",
               "fsdp_config": {"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_offload_params": False}}
    job = validate(JobSpec(name="j", source=str(tmp_path), command=["accelerate", "launch", "--config_file",
                                                                    "acc.yaml", "train.py"], launcher_config=planned))
    plan = _plan("accelerate", job, nodes=("a", "b"), gpus=2)
    accelerate = launcher_named("accelerate")
    config = yaml.safe_load(accelerate.rank_files(job, RankSlot(plan, 1, "run", 0), None)["accelerate.yaml"])
    assert config["distributed_type"] == "FSDP" and config["fsdp_config"]["fsdp_sharding_strategy"] == "SHARD_GRAD_OP"
    assert config["mixed_precision"] == "bf16" and config["dynamo_backend"] == "NO"  # the plan's, then the file's
    assert config["num_machines"] == 2 and config["machine_rank"] == 1 and config["main_process_ip"] == "127.0.0.1"


def test_a_plans_deepspeed_json_is_written_for_each_attempt_with_that_attempts_batch():
    planned = {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
               "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    job = validate(JobSpec(name="j", command=["python", "train.py"], launcher="deepspeed", procs_per_node=1,
                           global_batch=24, micro_batch=4, launcher_config=planned))
    deepspeed = launcher_named("deepspeed")
    slot = RankSlot(_plan("deepspeed", job, nodes=("a", "b", "c")), 0, "run", 0)
    first = json.loads(deepspeed.rank_files(job, slot, None)["ds_config.json"])
    assert first == planned  # three nodes: the plan's own batch
    assert deepspeed.rank_env(job, slot, None)["COORD_DEEPSPEED_CONFIG"] == "{rank_dir}/ds_config.json"
    # a node left out: the global batch kept, with more accumulation, and DeepSpeed's identity holds
    shrunk = rebatch(deepspeed.batch(job, 3), 2)
    second = json.loads(deepspeed.rank_files(job, RankSlot(_plan("deepspeed", job), 0, "run", 1), shrunk)
                        ["ds_config.json"])
    assert second["train_batch_size"] == 24 and second["zero_optimization"] == {"stage": 2}
    assert second["train_micro_batch_size_per_gpu"] * second["gradient_accumulation_steps"] * 2 == 24
    # without a plan, nothing of it
    bare = validate(JobSpec(name="j", command=["python", "train.py"], launcher="deepspeed"))
    assert "ds_config.json" not in deepspeed.rank_files(bare, slot, None)
    assert "COORD_DEEPSPEED_CONFIG" not in deepspeed.rank_env(bare, slot, None)


@pytest.mark.parametrize(("fields", "words"), [
    ({"launcher": "mlx", "command": ["python", "t.py"], "launcher_config": {"a": 1}},
     "--launcher-config: for --launcher accelerate or deepspeed, not mlx"),
    ({"launcher": "torchrun", "launcher_config": {"a": 1}}, "for --launcher accelerate or deepspeed, not torchrun"),
    ({"launcher": "deepspeed", "launcher_config": [1]}, "must be a mapping"),
    ({"launcher": "deepspeed", "launcher_config": {"a": float("nan")}}, "not finite"),
    ({"launcher": "deepspeed", "launcher_config": {"a": "x\x1b[31m"}}, "control character"),
    ({"launcher": "deepspeed", "launcher_config": {"": 1}}, "not a plain name"),
    ({"launcher": "deepspeed", "launcher_config": {"a": {"b": b"bytes"}}}, "not JSON"),
    ({"launcher": "deepspeed", "launcher_config": {"a": "x" * 70000}}, "larger than 64 KiB"),
    ({"launcher": "deepspeed", "launcher_config": {"a": [[[[[[[[[[1]]]]]]]]]]}}, "nested deeper"),
])
def test_a_launcher_config_off_the_wire_is_plain_json_for_a_launcher_that_reads_one(fields, words):
    with pytest.raises(JobSpecError, match=words):
        spec_from_fields({"name": "j", "command": ["python", "t.py"], **fields})
