"""The PyTorch plan over plain data: bytes per GPU under each strategy, the strategy, precision, batch and
learning rate chosen from the nodes' facts, and the Accelerate YAML and DeepSpeed JSON it writes, read
back with a YAML parser and, where a Python with them is given (COORD_TEST_TORCH_PYTHON) or this one has
them, with Accelerate's and DeepSpeed's own config classes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml

from coordinator.plan.model_shape import shape_from_config
from coordinator.plan.torch_configs import accelerate_configs, deepspeed_config, launcher_files
from coordinator.plan.torch_memory import STRATEGIES, TorchSetup, strategy_memory
from coordinator.plan.torch_plan import TorchPlanError, TorchRequest, build_torch_plan
from tests.unit.test_torch_checks import H100, node

GIB = 2**30
LLAMA_7B = shape_from_config({"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 11008,
                              "num_attention_heads": 32, "vocab_size": 32000})
LLAMA_70B = shape_from_config({"hidden_size": 8192, "num_hidden_layers": 80, "intermediate_size": 28672,
                               "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256})
TINY = shape_from_config({"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 688,
                          "num_attention_heads": 4, "vocab_size": 1000})
V100 = {"index": 0, "name": "Tesla V100-SXM2-32GB", "memory_total_bytes": 32 * GIB, "memory_used_bytes": 0,
        "compute_capability": None}


def cluster(nodes: int = 2, gpus: int = 8, **changes):
    return {f"n{i}": node(gpus=gpus, **changes) for i in range(nodes)}


def plan(shape=LLAMA_7B, facts=None, **request):
    facts = facts or cluster()
    return build_torch_plan(shape, facts, list(facts), TorchRequest(**{"launcher": "deepspeed", **request}))


# --- bytes per GPU -----------------------------------------------------------------------------


def test_every_strategy_holds_16_bytes_of_state_per_parameter_split_as_it_shards():
    psi, setup = LLAMA_7B.parameter_count, TorchSetup(world=16, micro_batch=1, seq_len=2048, precision="bf16")
    rows = {name: strategy_memory(LLAMA_7B, setup, name) for name in STRATEGIES}
    ddp = rows["DDP"]
    assert (ddp["params"], ddp["grads"], ddp["optimizer"]) == (4 * psi, 4 * psi, 8 * psi)
    zero2 = rows["ZeRO-2"]
    assert (zero2["params"], zero2["grads"], zero2["optimizer"]) == (2 * psi, 2 * psi // 16, 12 * psi // 16)
    assert rows["ZeRO-3"]["params"] < zero2["params"] and rows["FSDP-FULL_SHARD"]["params"] < \
        rows["FSDP-SHARD_GRAD_OP"]["params"]
    assert rows["ZeRO-3+offload"]["optimizer"] == 0 and rows["ZeRO-3+offload"]["host_bytes_per_rank"] == 14 * psi // 16
    assert rows["FSDP-FULL_SHARD+offload"]["host_bytes_per_rank"] == 16 * psi // 16
    assert len({row["activations"] for row in rows.values()}) == 1  # the same micro-batch everywhere
    assert all(row["rules"]["params"] and row["rules"]["activations"] for row in rows.values())


def test_activation_checkpointing_keeps_one_input_per_block():
    full = TorchSetup(world=1, micro_batch=4, seq_len=2048, precision="bf16")
    checkpointed = TorchSetup(world=1, micro_batch=4, seq_len=2048, precision="bf16", activation_checkpointing=True)
    assert strategy_memory(LLAMA_7B, checkpointed, "DDP")["activations"] < \
        strategy_memory(LLAMA_7B, full, "DDP")["activations"] / 4


# --- the choice --------------------------------------------------------------------------------


def test_a_model_that_fits_one_gpu_trains_with_ddp():
    found = plan(TINY, launcher="accelerate")
    assert found["strategy"] == "DDP" and not found["activation_checkpointing"] and found["offload"] is None
    assert found["reason"].startswith("DDP: ") and "fits the 72.0 GiB usable" in found["reason"]


@pytest.mark.parametrize(("launcher", "strategy"), [("accelerate", "FSDP-SHARD_GRAD_OP"), ("deepspeed", "ZeRO-2")])
def test_a_model_too_big_for_ddp_is_sharded(launcher, strategy):
    found = plan(LLAMA_7B, launcher=launcher)
    assert found["strategy"] == strategy and "DDP needs" in found["reason"]
    assert {row["strategy"]: row["fits"] for row in found["memory"]}["DDP"] is False


def test_offload_only_when_nothing_else_fits_and_nvme_when_host_memory_cannot_hold_it():
    two = plan(LLAMA_70B, cluster(2), seq_len=4096)
    assert two["strategy"] == "ZeRO-3+offload" and two["offload"] == "cpu" and two["activation_checkpointing"]
    one = plan(LLAMA_70B, cluster(1), seq_len=4096)
    assert one["offload"] == "nvme" and "host memory cannot hold" in one["reason"]
    fsdp = plan(LLAMA_70B, cluster(1), seq_len=4096, launcher="accelerate")
    assert fsdp["strategy"] is None and "coord plan --launcher deepspeed" in fsdp["reason"]
    assert launcher_files(fsdp, "10.0.0.1", 29500) == {}


def test_a_gpu_in_use_by_another_process_shrinks_what_every_rank_can_use():
    facts = cluster(2)
    facts["n1"]["gpus"][3] = {**H100, "index": 3, "memory_used_bytes": 40 * GIB}
    found = plan(TINY, facts)
    assert found["usable_bytes_per_rank"] == int(80 * GIB * 0.9) - 40 * GIB


def test_nodes_without_gpus_are_left_out_where_others_have_them_and_cpus_train_in_fp32():
    mixed = plan(TINY, {"n0": node(gpus=8), "n1": node(gpus=0)})
    assert [n["node"] for n in mixed["nodes"]] == ["n0"] and mixed["left_out"] == {"n1": "no GPU"}
    cpus = plan(TINY, {"n0": node(gpus=0, memory_gib=64), "n1": node(gpus=0, memory_gib=32)}, launcher="accelerate")
    assert cpus["precision"] == "fp32" and cpus["world"] == 2
    assert cpus["usable_bytes_per_rank"] == int(32 * GIB * 0.9)
    assert accelerate_configs(cpus, "10.0.0.1", 29500)["n1"]["distributed_type"] == "MULTI_CPU"


@pytest.mark.parametrize(("gpus", "precision"), [([H100], "bf16"), ([H100, V100], "fp16"),
                                                 ([{**H100, "name": "Mystery GPU", "compute_capability": None}],
                                                  "fp16")])
def test_bf16_only_where_every_gpu_has_it(gpus, precision):
    found = plan(TINY, {"n0": node() | {"gpus": gpus}})
    assert found["precision"] == precision
    if precision == "fp16":
        assert "loss scaling" in found["sources"]["precision"]


# --- batch and learning rate ---------------------------------------------------------------------


def test_accumulation_reaches_the_target_global_batch_and_the_rate_scales_linearly():
    found = plan(TINY, micro_batch=4, global_batch=512, learning_rate=1e-4)
    assert found["batch"] == {"micro_batch": 4, "gradient_accumulation_steps": 8, "world": 16, "global_batch": 512,
                              "target_global_batch": 512}
    assert found["learning_rate"] == {"base": 1e-4, "base_batch": 4, "scaled": pytest.approx(1e-4 * 512 / 4)}
    assert "linear scaling" in found["sources"]["learning_rate"]
    rounded = plan(TINY, micro_batch=4, global_batch=500)
    assert rounded["batch"]["gradient_accumulation_steps"] == 8 and rounded["batch"]["global_batch"] == 512
    assert "is not a multiple of 64" in rounded["sources"]["batch"]
    with pytest.raises(TorchPlanError, match="gradient_accumulation_steps 3 does not give the global batch 512"):
        plan(TINY, micro_batch=4, global_batch=512, gradient_accumulation_steps=3)


def test_without_a_micro_batch_the_largest_that_fits_and_stays_under_the_target():
    assert plan(TINY)["batch"]["micro_batch"] == 64
    assert plan(TINY, global_batch=64)["batch"]["micro_batch"] == 4  # 64 / 16 GPUs
    assert plan(LLAMA_7B)["batch"]["micro_batch"] < 64
    assert plan(TINY)["learning_rate"] is None


@pytest.mark.parametrize("bad", [{"launcher": "mlx"}, {"micro_batch": 0}, {"learning_rate": -1.0},
                                 {"global_batch": True}])
def test_bad_options_are_refused_by_name(bad):
    with pytest.raises(TorchPlanError, match=next(iter(bad))):
        plan(TINY, **bad)


# --- the files ------------------------------------------------------------------------------------


def test_accelerate_gets_one_yaml_per_node_that_differ_only_in_machine_rank():
    found = plan(LLAMA_7B, launcher="accelerate", global_batch=256)
    files = launcher_files(found, "10.0.0.1", 29511)
    assert sorted(files) == ["accelerate-n0.yaml", "accelerate-n1.yaml"]
    first, second = (yaml.safe_load(files[name]) for name in sorted(files))
    assert first == accelerate_configs(found, "10.0.0.1", 29511)["n0"]
    assert (first["machine_rank"], second["machine_rank"]) == (0, 1)
    assert {k: v for k, v in first.items() if k != "machine_rank"} == {k: v for k, v in second.items()
                                                                       if k != "machine_rank"}
    assert first["num_machines"] == 2 and first["num_processes"] == 16 and first["main_process_port"] == 29511
    assert first["distributed_type"] == "FSDP" and first["mixed_precision"] == "bf16"
    assert first["fsdp_config"]["fsdp_sharding_strategy"] == "SHARD_GRAD_OP"
    ddp = accelerate_configs(plan(TINY, launcher="accelerate"), "10.0.0.1", 29500)["n0"]
    assert ddp["distributed_type"] == "MULTI_GPU" and "fsdp_config" not in ddp


def test_deepspeeds_json_has_its_stage_precision_offload_and_a_consistent_batch():
    offloaded = plan(LLAMA_70B, cluster(2), seq_len=4096, global_batch=1024)
    config = json.loads(launcher_files(offloaded, "10.0.0.1", 29500)["ds_config.json"])
    batch = offloaded["batch"]
    assert config["train_batch_size"] == batch["micro_batch"] * batch["gradient_accumulation_steps"] * 16
    assert config["zero_optimization"]["stage"] == 3 and config["bf16"] == {"enabled": True}
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    nvme = deepspeed_config(plan(LLAMA_70B, cluster(1), seq_len=4096))
    assert nvme["zero_optimization"]["offload_param"]["device"] == "nvme"
    fp16 = deepspeed_config(plan(TINY, {"n0": node() | {"gpus": [V100]}}))
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0 and fp16["zero_optimization"] == {"stage": 0}


def _python_with(module: str) -> str | None:
    given = os.environ.get("COORD_TEST_TORCH_PYTHON")
    if given:
        return given
    return sys.executable if importlib.util.find_spec(module) else None


ACCELERATE_CHECK = """\
import os, sys
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_multi_gpu_env
config = ClusterConfig.from_yaml_file(sys.argv[1])
args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", sys.argv[1], "train.py"]))
os.environ.update(prepare_multi_gpu_env(args))
os.environ.update(FSDP_SYNC_MODULE_STATES="false", FSDP_CPU_RAM_EFFICIENT_LOADING="false")  # no GPU here
plugin = FullyShardedDataParallelPlugin()
print(config.distributed_type.value, config.machine_rank, config.num_processes, plugin.sharding_strategy.name)
"""

DEEPSPEED_CHECK = """\
import json, os, socket, sys
import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig
with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
deepspeed.init_distributed(dist_backend="gloo")
class DataParallel:  # the plan's world, as a model-parallel unit tells DeepSpeed
    def get_data_parallel_world_size(self):
        return int(sys.argv[2])
config = DeepSpeedConfig(json.load(open(sys.argv[1])), mpu=DataParallel())
print(config.train_batch_size, config.zero_optimization_stage, config.bfloat16_config.enabled)
"""


def test_accelerates_own_config_class_reads_the_yaml(tmp_path):
    python = _python_with("accelerate")
    if python is None:
        pytest.skip("accelerate is not installed here (set COORD_TEST_TORCH_PYTHON to a Python with it)")
    path = tmp_path / "accelerate-n1.yaml"
    path.write_text(launcher_files(plan(LLAMA_7B, launcher="accelerate"), "10.0.0.1", 29500)["accelerate-n1.yaml"])
    done = subprocess.run([python, "-c", ACCELERATE_CHECK, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-4:] == ["FSDP", "1", "16", "SHARD_GRAD_OP"]


def test_deepspeeds_own_config_class_checks_the_json(tmp_path):
    python = _python_with("deepspeed")
    if python is None:
        pytest.skip("deepspeed is not installed here (set COORD_TEST_TORCH_PYTHON to a Python with it)")
    path = tmp_path / "ds_config.json"
    path.write_text(launcher_files(plan(LLAMA_70B, cluster(2), seq_len=4096, global_batch=1024),
                                   "10.0.0.1", 29500)["ds_config.json"])
    run = [python, "-c", DEEPSPEED_CHECK, str(path)]
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    from agent.torch_locks import clear_stale_locks

    clear_stale_locks()  # as a node's agent does before a rank: a build killed earlier left its lock
    done = subprocess.run([*run, "16"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["1024", "3", "True"]
    wrong = subprocess.run([*run, "8"], capture_output=True, text=True, timeout=300, env=env)  # DeepSpeed checks it
    assert wrong.returncode != 0 and "train_batch_size is not equal" in wrong.stderr
