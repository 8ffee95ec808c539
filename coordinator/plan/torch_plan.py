"""The PyTorch plan (``coord plan --launcher accelerate|deepspeed``): which strategy, precision, batch
and learning rate a model trains with on this cluster's GPUs, from what the nodes measured (their
``torch_facts``: GPUs and their memory, RAM) and the model's shape (config.json, safetensors headers).

Pure: the daemon gathers the facts (``coordinator/commands/plan.py``), this decides, and
:mod:`coordinator.plan.torch_configs` writes the launcher's files. Its rules, each stated in the
plan beside the value it gives:

- **usable memory** per GPU: 90% of its memory less what another process already uses (a tenth
  for the CUDA context, NCCL's buffers and the caching allocator's fragmentation); every rank holds
  the same share, so the smallest GPU sizes them all. A CPU-only cluster runs one rank per node with
  90% of its RAM.
- **strategy**: the first of the launcher's ladder whose bytes per GPU (:mod:`coordinator.plan
  .torch_memory`) fit: DDP, then FSDP SHARD_GRAD_OP and FULL_SHARD (Accelerate) or ZeRO-2 and
  ZeRO-3 (DeepSpeed); then the same with activation checkpointing; offload (CPU, then NVMe for
  DeepSpeed) only when nothing else fits, and only where host memory holds what it moves there.
- **precision**: bf16 where every GPU has it (compute capability 8.0 or later), fp16 with dynamic
  loss scaling otherwise (its range is too narrow for gradients without it), fp32 on CPUs.
- **batch**: gradient accumulation = target global batch / (per-GPU micro-batch × GPUs), rounded
  up (the global batch is then said as it comes out); without a target, one micro-batch per GPU.
  Without a micro-batch, the largest power of two up to 64 that fits under the chosen strategy.
- **learning rate**: scaled linearly with the global batch (Goyal et al., 2017: lr × global /
  base batch), the base batch being one GPU's micro-batch unless given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

from coordinator.launch.registry import gpu_plan_of
from coordinator.launch.torch_env import bf16_capable
from coordinator.plan.model_shape import ModelShape, ModelShapeDict
from coordinator.plan.torch_memory import STRATEGIES, Precision, StrategyMemory, TorchSetup, strategy_memory
from shared.agent_api.torch import TorchFactsReply

GIB = 2**30
USABLE_FRACTION = 0.90
MAX_MICRO_BATCH = 64


class TorchPlanError(ValueError):
    """Options the PyTorch plan cannot follow; the message names the option."""


@dataclass(frozen=True)
class TorchRequest:
    """What the user asked of the plan (None: not given)."""

    launcher: str
    seq_len: int = 2048
    micro_batch: int | None = None
    global_batch: int | None = None
    gradient_accumulation_steps: int | None = None
    learning_rate: float | None = None
    base_batch: int | None = None


class NodeDevices(TypedDict):
    node: str
    processes: int  # ranks on this node: one per GPU (one per node without GPUs)
    device: str  # "NVIDIA H100 80GB HBM3 × 8", or "CPU"
    usable_bytes: int  # per rank
    memory_bytes: int | None  # the node's RAM


class MemoryRow(StrategyMemory):
    fits: bool
    host_fits: bool  # what it keeps in host memory fits every node's RAM (always true without offload)


class BatchPlan(TypedDict):
    micro_batch: int
    gradient_accumulation_steps: int
    world: int
    global_batch: int
    target_global_batch: int | None


class LearningRate(TypedDict):
    base: float
    base_batch: int
    scaled: float


class TorchPlan(TypedDict, total=False):
    """The plan's ``pytorch`` section; without a strategy that fits, ``strategy`` is None and
    ``reason`` says why, with the numbers."""

    launcher: str
    model: ModelShapeDict
    nodes: list[NodeDevices]
    left_out: dict[str, str]  # nodes not planned on, and why
    world: int
    usable_bytes_per_rank: int
    precision: Precision
    strategy: str | None
    activation_checkpointing: bool
    offload: str | None  # "cpu" | "nvme" | None
    reason: str
    memory: list[MemoryRow]  # every strategy, for the chosen micro-batch and checkpointing
    batch: BatchPlan
    learning_rate: LearningRate | None
    sources: dict[str, str]
    notes: list[str]


def build_torch_plan(shape: ModelShape, facts: Mapping[str, TorchFactsReply], order: Sequence[str],
                     request: TorchRequest) -> TorchPlan:
    """The plan for ``shape`` on the nodes of ``order`` (rank order) whose facts are known."""
    _validate(request)
    nodes, left_out = plan_nodes(facts, order)
    if not nodes:
        raise TorchPlanError("no node to plan on: " + "; ".join(f"{n}: {why}" for n, why in left_out.items()))
    world = sum(n["processes"] for n in nodes)
    usable = min(n["usable_bytes"] for n in nodes)
    precision, precision_source = choose_precision(facts, [n["node"] for n in nodes])
    sources = {"usable_bytes_per_rank": _usable_source(nodes, facts), "precision": precision_source}
    plan: TorchPlan = {"launcher": request.launcher, "model": shape.as_dict(), "nodes": nodes, "left_out": left_out,
                       "world": world, "usable_bytes_per_rank": usable, "precision": precision, "sources": sources,
                       "notes": []}
    micro = request.micro_batch or 1
    strategy, checkpointing, offload, reason = choose_strategy(shape, nodes, request, world, micro, precision)
    if strategy is not None and request.micro_batch is None:
        micro = largest_micro_batch(shape, nodes, request, world, precision, strategy, checkpointing)
        sources["micro_batch"] = (f"the largest power of two up to {MAX_MICRO_BATCH} that fits under {strategy}"
                                  + (f" and gives no more than the target global batch {request.global_batch}"
                                     if request.global_batch else ""))
    elif request.micro_batch is not None:
        sources["micro_batch"] = f"job option per_rank_batch_size = {micro}"
    setup = TorchSetup(world=world, micro_batch=micro, seq_len=request.seq_len, precision=precision,
                       activation_checkpointing=checkpointing)
    plan["memory"] = [_row(shape, setup, name, usable, nodes) for name in STRATEGIES]
    if strategy is not None:  # said with the numbers of the micro-batch chosen
        reason = _chosen(next(row for row in plan["memory"] if row["strategy"] == strategy), setup, usable,
                         offload) + reason
    plan["strategy"], plan["activation_checkpointing"], plan["offload"] = strategy, checkpointing, offload
    plan["reason"] = reason
    plan["batch"], batch_source = plan_batch(request, micro, world)
    sources["batch"] = batch_source
    plan["learning_rate"], sources["learning_rate"] = scale_learning_rate(request, plan["batch"])
    if left_out:
        plan["notes"].append("not planned on: " + "; ".join(f"{n} ({why})" for n, why in sorted(left_out.items())))
    return plan


def _validate(request: TorchRequest) -> None:
    try:
        gpu_plan_of(request.launcher)
    except KeyError as exc:
        raise TorchPlanError(exc.args[0]) from None
    for name in ("seq_len", "micro_batch", "global_batch", "gradient_accumulation_steps", "base_batch"):
        value = getattr(request, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise TorchPlanError(f"{name} must be a whole number ≥ 1, got {value!r}")
    rate = request.learning_rate
    if rate is not None and not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise TorchPlanError(f"learning_rate must be a number > 0, got {rate!r}")


def plan_nodes(facts: Mapping[str, TorchFactsReply], order: Sequence[str]) -> tuple[list[NodeDevices], dict[str, str]]:
    """The nodes to plan on, each with its ranks and usable memory per rank; the others with why.

    Where any node has GPUs, only the nodes with GPUs (NCCL needs one on every rank)."""
    known = [name for name in order if name in facts]
    left_out = {name: "no PyTorch facts from it" for name in order if name not in facts}
    with_gpus = [name for name in known if facts[name]["gpus"]]
    if with_gpus:
        left_out.update({name: "no GPU" for name in known if name not in with_gpus})
        return [_gpu_node(name, facts[name]) for name in with_gpus], left_out
    return [_cpu_node(name, facts[name]) for name in known if facts[name].get("memory_bytes")], {
        **left_out, **{name: "its memory is unknown" for name in known if not facts[name].get("memory_bytes")}}


def _gpu_node(name: str, fact: TorchFactsReply) -> NodeDevices:
    gpus = fact["gpus"]
    usable = min(int(g["memory_total_bytes"] * USABLE_FRACTION) - (g["memory_used_bytes"] or 0) for g in gpus)
    names = sorted({g["name"] for g in gpus})
    return {"node": name, "processes": len(gpus), "device": f"{' / '.join(names)} × {len(gpus)}",
            "usable_bytes": max(usable, 0), "memory_bytes": fact.get("memory_bytes")}


def _cpu_node(name: str, fact: TorchFactsReply) -> NodeDevices:
    memory = fact.get("memory_bytes") or 0
    return {"node": name, "processes": 1, "device": "CPU", "usable_bytes": int(memory * USABLE_FRACTION),
            "memory_bytes": memory}


def _usable_source(nodes: Sequence[NodeDevices], facts: Mapping[str, TorchFactsReply]) -> str:
    smallest = min(nodes, key=lambda n: n["usable_bytes"])
    if smallest["device"] == "CPU":
        return (f"rule: {USABLE_FRACTION:.0%} of the RAM of the smallest node, {smallest['node']} "
                f"({(smallest['memory_bytes'] or 0) / GIB:.1f} GiB), one rank per node")
    return (f"rule: {USABLE_FRACTION:.0%} of each GPU's memory less what is in use, the smallest of all "
            f"({smallest['node']}: {smallest['device']}, {facts[smallest['node']]['gpu_source']})")


def choose_precision(facts: Mapping[str, TorchFactsReply], nodes: Sequence[str]) -> tuple[Precision, str]:
    gpus = [(name, g) for name in nodes for g in facts[name]["gpus"]]
    if not gpus:
        return "fp32", "rule: fp32 on CPUs (no GPU: mixed precision gains nothing there)"
    verdicts = {(name, g["name"]): bf16_capable(g) for name, g in gpus}
    old = sorted({f"{gpu} on {name}" for (name, gpu), ok in verdicts.items() if ok is False})
    unknown = sorted({f"{gpu} on {name}" for (name, gpu), ok in verdicts.items() if ok is None})
    if old:
        return "fp16", (f"rule: fp16 with dynamic loss scaling, as {', '.join(old)} has no bf16 (compute "
                        "capability below 8.0)")
    if unknown:
        return "fp16", (f"rule: fp16 with dynamic loss scaling: bf16 support of {', '.join(unknown)} is unknown "
                        "(no compute_cap from nvidia-smi, a name coord does not know)")
    return "bf16", "rule: bf16, as every GPU has it (compute capability 8.0 or later, from nvidia-smi)"


def choose_strategy(shape: ModelShape, nodes: Sequence[NodeDevices], request: TorchRequest, world: int,
                    micro: int, precision: Precision) -> tuple[str | None, bool, str | None, str]:
    """(strategy, activation checkpointing, offload device, why): with a strategy, why the ones before
    it were passed over (``" (DDP needs 110.5 GiB)"``, or ""); without, why nothing fits, with the numbers."""
    usable = min(n["usable_bytes"] for n in nodes)
    kind = gpu_plan_of(request.launcher)
    tried: list[str] = []
    for checkpointing in (False, True):
        setup = TorchSetup(world, micro, request.seq_len, precision, checkpointing)
        for name in kind.ladder:
            need = strategy_memory(shape, setup, name)["total"]
            if need <= usable:
                return name, checkpointing, None, f" ({'; '.join(tried)})" if tried else ""
            tried.append(f"{name}{' + checkpointing' if checkpointing else ''} needs {need / GIB:.1f} GiB")
    setup = TorchSetup(world, micro, request.seq_len, precision, True)
    offloaded = strategy_memory(shape, setup, kind.offload)
    summary = "; ".join(tried)
    if offloaded["total"] > usable:
        return None, True, None, (f"nothing fits {usable / GIB:.1f} GiB per GPU, not even {offloaded['strategy']} "
                                  f"with checkpointing ({offloaded['total'] / GIB:.1f} GiB): {summary}")
    short = _host_short(offloaded, nodes)
    if not short:
        return offloaded["strategy"], True, "cpu", f", as nothing fits on the GPUs alone ({summary})"
    if kind.nvme_offload:
        return offloaded["strategy"], True, "nvme", (
            f", as host memory cannot hold {offloaded['host_bytes_per_rank'] / GIB:.1f} GiB per rank ({short}) and "
            f"nothing fits on the GPUs alone ({summary})")
    return None, True, None, (f"nothing fits: {summary}; CPU offload needs {offloaded['host_bytes_per_rank'] / GIB:.1f}"
                              f" GiB of host memory per rank ({short}); FSDP has no NVMe offload: "
                              "coord plan --launcher deepspeed")


def _chosen(row: StrategyMemory, setup: TorchSetup, usable: int, offload: str | None) -> str:
    how = " with activation checkpointing" if setup.activation_checkpointing else ""
    where = f" to {'NVMe' if offload == 'nvme' else 'CPU'}" if offload else ""
    text = (f"{row['strategy']}{where}{how}: {row['total'] / GIB:.1f} GiB per GPU at micro-batch {setup.micro_batch} "
            f"fits the {usable / GIB:.1f} GiB usable")
    if offload:
        text += f", with {row['host_bytes_per_rank'] / GIB:.1f} GiB per rank moved to {where.strip()[3:]}"
    return text


def _host_short(memory: StrategyMemory, nodes: Sequence[NodeDevices]) -> str:
    """The nodes whose RAM cannot hold what an offloading strategy moves there, said; '' when all can."""
    short = [f"{n['node']} has {(n['memory_bytes'] or 0) / GIB:.0f} GiB for {n['processes']} ranks"
             for n in nodes if n["memory_bytes"] is None
             or memory["host_bytes_per_rank"] * n["processes"] > USABLE_FRACTION * n["memory_bytes"]]
    return "; ".join(short)


def _row(shape: ModelShape, setup: TorchSetup, name: str, usable: int, nodes: Sequence[NodeDevices]) -> MemoryRow:
    memory = strategy_memory(shape, setup, name)
    return {**memory, "fits": memory["total"] <= usable,
            "host_fits": not memory["host_bytes_per_rank"] or not _host_short(memory, nodes)}


def largest_micro_batch(shape: ModelShape, nodes: Sequence[NodeDevices], request: TorchRequest, world: int,
                        precision: Precision, strategy: str, checkpointing: bool) -> int:
    usable = min(n["usable_bytes"] for n in nodes)
    limit = MAX_MICRO_BATCH
    if request.global_batch is not None:
        limit = max(1, min(limit, request.global_batch // world))
    best, candidate = 1, 2
    while candidate <= limit:
        setup = TorchSetup(world, candidate, request.seq_len, precision, checkpointing)
        if strategy_memory(shape, setup, strategy)["total"] > usable:
            break
        best, candidate = candidate, candidate * 2
    return best


def plan_batch(request: TorchRequest, micro: int, world: int) -> tuple[BatchPlan, str]:
    target, accum = request.global_batch, request.gradient_accumulation_steps
    if target is not None:
        needed = math.ceil(target / (micro * world))
        if accum is not None and accum != needed:
            raise TorchPlanError(f"gradient_accumulation_steps {accum} does not give the global batch {target} "
                                 f"with {micro} per GPU on {world} GPUs (it would take {needed}): give one of them")
        accum = needed
        rule = f"rule: accumulation = ⌈target {target} / ({micro} per GPU × {world} GPUs)⌉ = {accum}"
        if micro * accum * world != target:
            rule += f"; {target} is not a multiple of {micro * world}, so the global batch is {micro * accum * world}"
    else:
        accum = accum or 1
        rule = (f"rule: global = {micro} per GPU × {accum} accumulation × {world} GPUs (no target global batch: "
                "coord plan --global-batch-size N)")
    return {"micro_batch": micro, "gradient_accumulation_steps": accum, "world": world,
            "global_batch": micro * accum * world, "target_global_batch": target}, rule


def scale_learning_rate(request: TorchRequest, batch: BatchPlan) -> tuple[LearningRate | None, str]:
    if request.learning_rate is None:
        return None, "not given (coord plan --learning-rate LR): nothing to scale"
    base = request.base_batch or batch["micro_batch"]
    scaled = request.learning_rate * batch["global_batch"] / base
    return ({"base": request.learning_rate, "base_batch": base, "scaled": scaled},
            f"rule: linear scaling (Goyal et al., 2017): {request.learning_rate:g} × global {batch['global_batch']} / "
            f"base {base}" + ("" if request.base_batch else " (one GPU's micro-batch: --base-batch-size not given)"))
