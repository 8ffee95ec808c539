"""The launcher files a PyTorch plan writes: Accelerate's config YAML (one per node: only
``machine_rank`` differs) and DeepSpeed's JSON, from :func:`coordinator.plan.torch_plan.build_torch_plan`.

The YAML is written by hand (coord has no YAML library): flat ``key: value`` lines and one nested
``fsdp_config`` block, every string quoted as JSON (which YAML reads as the same string). The keys
are Accelerate's own (``accelerate config``'s ``ClusterConfig``); the DeepSpeed keys are those of
its configuration documentation (``train_batch_size`` = micro-batch × accumulation × world, which
DeepSpeed checks).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.launch.registry import gpu_plan_of
from coordinator.plan.torch_plan import TorchPlan

#: Where DeepSpeed swaps to under NVMe offload: relative to the node's workdir, where ranks start.
NVME_PATH = ".coord/nvme-offload"
ACCELERATE_MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


def accelerate_configs(plan: TorchPlan, master_address: str, master_port: int) -> dict[str, dict[str, Any]]:
    """Each node's Accelerate config, by node, in rank order."""
    nodes = plan["nodes"]
    strategy = plan.get("strategy") or ""
    cpu = nodes[0]["device"] == "CPU"
    if cpu:
        distributed = "MULTI_CPU" if plan["world"] > 1 else "NO"
    elif strategy.startswith("FSDP"):
        distributed = "FSDP"
    else:
        distributed = "MULTI_GPU" if plan["world"] > 1 else "NO"
    common: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": distributed,
        "downcast_bf16": "no", "main_process_ip": master_address, "main_process_port": master_port,
        "main_training_function": "main", "mixed_precision": ACCELERATE_MIXED_PRECISION[plan["precision"]],
        "num_machines": len(nodes), "num_processes": plan["world"], "rdzv_backend": "static", "same_network": True,
        "use_cpu": cpu}
    if not cpu:
        common["gpu_ids"] = "all"
    if distributed == "FSDP":
        common["fsdp_config"] = {
            "fsdp_activation_checkpointing": bool(plan.get("activation_checkpointing")),
            # The blocks to wrap are the model's own _no_split_modules (transformers sets them), so no
            # class name is guessed here; a model without them needs fsdp_transformer_layer_cls_to_wrap.
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_backward_prefetch": "BACKWARD_PRE",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_forward_prefetch": False,
            "fsdp_offload_params": plan.get("offload") == "cpu",
            "fsdp_sharding_strategy": "SHARD_GRAD_OP" if strategy == "FSDP-SHARD_GRAD_OP" else "FULL_SHARD",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_sync_module_states": True,
            "fsdp_use_orig_params": True,
        }
    return {node["node"]: {**common, "machine_rank": rank} for rank, node in enumerate(nodes)}


def deepspeed_config(plan: TorchPlan) -> dict[str, Any]:
    """DeepSpeed's JSON for the plan's ZeRO stage (DDP is stage 0), precision, offload and batch."""
    strategy, batch = plan.get("strategy") or "", plan["batch"]
    stage = 3 if strategy.startswith("ZeRO-3") else 2 if strategy == "ZeRO-2" else 0
    zero: dict[str, Any] = {"stage": stage}
    if stage:
        zero.update(overlap_comm=True, contiguous_gradients=True)
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    offload = plan.get("offload")
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    elif offload == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": NVME_PATH, "pin_memory": True}
        zero["offload_param"] = {"device": "nvme", "nvme_path": NVME_PATH, "pin_memory": True}
    config: dict[str, Any] = {
        "train_batch_size": batch["global_batch"],
        "train_micro_batch_size_per_gpu": batch["micro_batch"],
        "gradient_accumulation_steps": batch["gradient_accumulation_steps"],
        "zero_optimization": zero,
        "bf16": {"enabled": plan["precision"] == "bf16"},
        "fp16": {"enabled": plan["precision"] == "fp16"},
    }
    if plan["precision"] == "fp16":
        # Dynamic loss scaling (loss_scale 0): fp16's range is too narrow for small gradients otherwise.
        config["fp16"].update(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2,
                              min_loss_scale=1)
    return config


def launcher_files(plan: TorchPlan, master_address: str, master_port: int) -> dict[str, str]:
    """{file name: its text} for the plan's launcher; nothing when no strategy fits."""
    if not plan.get("strategy"):
        return {}
    kind = gpu_plan_of(plan["launcher"])
    if kind.config == "json":
        return {kind.config_file(""): json.dumps(deepspeed_config(plan), indent=2) + "\n"}
    return {kind.config_file(node): to_yaml(config)
            for node, config in accelerate_configs(plan, master_address, master_port).items()}


def to_yaml(config: Mapping[str, Any], indent: str = "") -> str:
    """A mapping of scalars (and mappings of scalars) as YAML, keys sorted as ``accelerate config`` writes them."""
    lines = []
    for key, value in sorted(config.items()):
        if isinstance(value, Mapping):
            lines.append(f"{indent}{key}:\n" + to_yaml(value, indent + "  ").rstrip("\n"))
        else:
            lines.append(f"{indent}{key}: {_scalar(value)}")
    return "\n".join(lines) + "\n"


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a YAML double-quoted string
    if isinstance(value, Sequence):
        return json.dumps(list(value))
    raise TypeError(f"no YAML for {type(value).__name__}")


class TorchPlanSection(TorchPlan, total=False):
    """The plan's ``pytorch`` section: the plan, the rendezvous its files name, and the files."""

    master_address: str
    master_port: int
    files: dict[str, str]  # file name -> its text, written by the CLI (coord plan --config-dir)


def torch_plan_section(plan: TorchPlan, master_address: str, master_port: int) -> TorchPlanSection:
    section: TorchPlanSection = {**plan, "master_address": master_address, "master_port": master_port,
                                 "files": launcher_files(plan, master_address, master_port)}
    return section
