"""Which of the cluster's Macs can hold a fine-tune, and what to do where none can.

The model's shape is :mod:`coordinator.plan.model_shape`; the memory one rank needs, by
component with its rule, is :mod:`coordinator.plan.memory_estimate`.

A node can use ``usable_fraction`` of its memory: macOS wires at most about 75% of
unified memory to the GPU by default (``sudo sysctl iogpu.wired_limit_mb=N`` raises the
limit until the next reboot); a node that is not a Mac is given 90% (MLX's CPU backend has
no wired limit; a tenth is left to the OS).

MLX has no FSDP/ZeRO-style sharding for training: each data-parallel rank holds a whole
replica. Where no node can, the honest answers are LoRA, or a pipeline split of the
blocks in proportion to each node's usable memory (the weaker node never takes more
blocks), or "not trainable on this cluster" with the numbers that say why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from coordinator.plan.memory_estimate import EstimateDict, Stage, estimate_memory, estimate_stage, training_setup
from coordinator.plan.model_shape import DTYPE_BYTES, ModelShape, ModelShapeDict, SizingError, int_or_none, stored_text

GIB = 2**30

MACOS_GPU_FRACTION = 0.75
OTHER_OS_FRACTION = 0.90

# --- which nodes can hold it ----------------------------------------------------------------

FITS, NEEDS_GRAD_CHECKPOINT, DOES_NOT_FIT = "fits", "needs_grad_checkpoint", "does_not_fit"
#: The largest per-rank batch :func:`fit_nodes` looks for.
MAX_BATCH_SEARCH = 64
PIPELINE_NOTE = ("mlx-lm's trainer has no pipeline mode: this split needs a training script that runs its blocks "
                 "on each node in turn and sends activations and their gradients between the ranks")


class SizingRequest(TypedDict):
    """What :func:`fit_nodes` was asked to size: :func:`estimate_memory`'s arguments."""

    fine_tune_type: str
    batch_size: int
    seq_len: int
    lora_rank: int
    lora_layers: int
    optimizer: str
    train_dtype: str | None


class NodeVerdict(TypedDict):
    name: str
    total_bytes: int
    usable_bytes: int
    usable_rule: str
    verdict: str  # FITS | NEEDS_GRAD_CHECKPOINT | DOES_NOT_FIT
    need_bytes: int  # with gradient checkpointing unless it fits without
    headroom_bytes: int


class ReplicaFit(TypedDict):
    """One data-parallel replica against every node."""

    estimate: EstimateDict
    estimate_checkpointed: EstimateDict
    nodes: list[NodeVerdict]
    replicas: list[str]  # the nodes that hold a replica
    grad_checkpoint: bool  # one node that needs it sets it for all
    largest_batch_size: int | None  # the largest per-rank batch every replica holds, up to MAX_BATCH_SEARCH
    largest_batch_bytes: int | None  # its memory per rank


class LoraFit(ReplicaFit):
    request: SizingRequest


class PipelineStage(TypedDict):
    node: str
    first_block: int
    last_block: int
    blocks: int
    need_bytes: int
    usable_bytes: int
    fits: bool


class Pipeline(TypedDict):
    fine_tune_type: str
    grad_checkpoint: bool
    fits: bool
    stages: list[PipelineStage]
    note: str
    detail: str


class Recommendation(TypedDict):
    kind: str  # "data_parallel" | "lora" | "pipeline" | "not_trainable"
    detail: str


class KindSummary(TypedDict):
    need_bytes: int
    need_bytes_grad_checkpoint: int
    train_dtype: str
    replicas: list[str]
    grad_checkpoint: bool


class FitPlan(ReplicaFit):
    """:func:`fit_nodes`'s answer: the requested replica's fit (the keys of :class:`ReplicaFit`) and the rest."""

    model: ModelShapeDict
    request: SizingRequest
    lora: LoraFit | None  # for LoRA, when a full fine-tune fits on no node
    pipeline: Pipeline | None
    by_fine_tune_type: dict[str, KindSummary]  # "lora" and "full", always both
    notes: list[str]
    recommendation: Recommendation


class PlanSizing(TypedDict):
    """What the plan document takes from a sizing (``PlanInputs.sizing``)."""

    per_rank_batch_size: int | None
    checkpoint_bytes: int | None
    checkpoint_bytes_with_optimizer: int | None
    memory_per_rank_bytes: int | None
    source: str


@dataclass(frozen=True)
class NodeMemory:
    name: str
    total_bytes: int
    usable_fraction: float = MACOS_GPU_FRACTION
    usable_rule: str = (f"macOS wires at most about {MACOS_GPU_FRACTION:.0%} of unified memory to the GPU by "
                        "default (sysctl iogpu.wired_limit_mb raises it)")
    measured_bytes: int | None = None  # what MLX said its GPU can use (coord calibrate), over the rule

    @property
    def usable_bytes(self) -> int:
        if self.measured_bytes:
            return self.measured_bytes
        return int(self.total_bytes * self.usable_fraction)


def nodes_from_facts(facts_by_node: Mapping[str, Mapping[str, Any]],
                     gpu_memory: Mapping[str, tuple[int, str]] | None = None) -> tuple[list[NodeMemory], list[str]]:
    """Node memories from agent facts (``memory_bytes``, ``os``), and the nodes whose memory is unknown.

    ``gpu_memory`` is {node: (bytes, where it was read)} from a current GPU calibration: on a Mac
    Metal's recommended working set (which follows iogpu.wired_limit_mb), on a CUDA node the
    card's own memory. Where it is known it replaces the rule of thumb.
    """
    nodes, unknown = [], []
    for name, facts in facts_by_node.items():
        total = int_or_none((facts or {}).get("memory_bytes"))
        measured = (gpu_memory or {}).get(name)
        if not total:
            unknown.append(name)
        elif measured and int_or_none(measured[0]):
            nodes.append(NodeMemory(name, total, 1.0, f"measured: {measured[1]}", measured_bytes=int(measured[0])))
        elif (facts or {}).get("os") == "macOS":
            nodes.append(NodeMemory(name, total))
        else:
            nodes.append(NodeMemory(name, total, OTHER_OS_FRACTION,
                                    f"not a Mac: {OTHER_OS_FRACTION:.0%} of memory (MLX's CPU backend has no GPU "
                                    "wired limit; the rest is left to the OS)"))
    return nodes, unknown


def fit_nodes(shape: ModelShape, nodes: Sequence[NodeMemory], fine_tune_type: str = "full", batch_size: int = 4,
              seq_len: int = 2048, lora_rank: int = 8, lora_layers: int = 16, optimizer: str = "adam",
              train_dtype: str | None = None) -> FitPlan:
    """Which nodes can hold a data-parallel replica, and what to do where none can (plain data:
    :class:`FitPlan`)."""
    if not nodes:
        raise SizingError("no nodes with a known memory size to fit the model on")
    request: SizingRequest = {"fine_tune_type": fine_tune_type, "batch_size": batch_size, "seq_len": seq_len,
                              "lora_rank": lora_rank, "lora_layers": lora_layers, "optimizer": optimizer,
                              "train_dtype": train_dtype}
    replica = _replica_fit(shape, nodes, request)
    lora, pipeline, recommendation = _fallbacks(shape, nodes, request, replica)
    return {"model": shape.as_dict(), "request": request, **replica, "lora": lora, "pipeline": pipeline,
            "by_fine_tune_type": _both_kinds(shape, nodes, request, replica),
            "notes": _notes(shape, request, replica["estimate"]), "recommendation": recommendation}


def _fallbacks(shape: ModelShape, nodes: Sequence[NodeMemory], request: SizingRequest,
               replica: ReplicaFit) -> tuple[LoraFit | None, Pipeline | None, Recommendation]:
    """(LoRA's fit, the pipeline split, the recommendation): data parallel where a node holds a
    replica; else LoRA, a pipeline split, a LoRA pipeline split, or not trainable."""
    if replica["replicas"]:
        return None, None, _data_parallel_recommendation(replica)
    lora: LoraFit | None = None
    if request["fine_tune_type"] == "full":
        lora_request: SizingRequest = {**request, "fine_tune_type": "lora", "train_dtype": None}
        lora = {"request": lora_request, **_replica_fit(shape, nodes, lora_request)}
    pipeline = _pipeline_or_none(shape, nodes, request)
    if lora is not None and lora["replicas"]:
        return lora, pipeline, {"kind": "lora", "detail": _lora_detail(replica, lora)}
    if pipeline is not None and pipeline["fits"]:
        return lora, pipeline, {"kind": "pipeline", "detail": pipeline["detail"]}
    lora_pipeline = _pipeline_or_none(shape, nodes, lora["request"]) if lora is not None else None
    if lora_pipeline is not None and lora_pipeline["fits"]:
        return lora, lora_pipeline, {"kind": "pipeline", "detail": "LoRA, " + lora_pipeline["detail"]}
    return lora, pipeline, {"kind": "not_trainable", "detail": _not_trainable_detail(
        replica, lora, [pipeline, lora_pipeline], nodes)}


def _both_kinds(shape: ModelShape, nodes: Sequence[NodeMemory], request: SizingRequest,
                requested: ReplicaFit) -> dict[str, KindSummary]:
    """LoRA and full fine-tuning side by side, whichever was asked for: the memory one replica
    needs (without and with gradient checkpointing) and the nodes that hold one."""
    out: dict[str, KindSummary] = {}
    for kind in ("lora", "full"):
        if kind == request["fine_tune_type"]:
            fit = requested
        else:
            fit = _replica_fit(shape, nodes, {**request, "fine_tune_type": kind, "train_dtype": None})
        out[kind] = {"need_bytes": fit["estimate"]["total_bytes"],
                     "need_bytes_grad_checkpoint": fit["estimate_checkpointed"]["total_bytes"],
                     "train_dtype": fit["estimate"]["train_dtype"], "replicas": fit["replicas"],
                     "grad_checkpoint": fit["grad_checkpoint"]}
    return out


def _replica_fit(shape: ModelShape, nodes: Sequence[NodeMemory], request: SizingRequest) -> ReplicaFit:
    plain = estimate_memory(shape, **request, grad_checkpoint=False)
    checkpointed = estimate_memory(shape, **request, grad_checkpoint=True)
    verdicts = [_node_verdict(node, plain.total_bytes, checkpointed.total_bytes) for node in nodes]
    holders = [v for v in verdicts if v["verdict"] != DOES_NOT_FIT]
    # --grad-checkpoint is one flag for the whole job: one node that needs it sets it for all.
    checkpoint = any(v["verdict"] == NEEDS_GRAD_CHECKPOINT for v in holders)
    largest = _largest_batch(shape, request, checkpoint, min(v["usable_bytes"] for v in holders)) if holders else None
    return {"estimate": plain.as_dict(), "estimate_checkpointed": checkpointed.as_dict(), "nodes": verdicts,
            "replicas": [v["name"] for v in holders], "grad_checkpoint": checkpoint,
            "largest_batch_size": largest[0] if largest else None,
            "largest_batch_bytes": largest[1] if largest else None}


def _node_verdict(node: NodeMemory, plain: int, checkpointed: int) -> NodeVerdict:
    usable = node.usable_bytes
    if plain <= usable:
        verdict, need = FITS, plain
    elif checkpointed <= usable:
        verdict, need = NEEDS_GRAD_CHECKPOINT, checkpointed
    else:
        verdict, need = DOES_NOT_FIT, checkpointed
    return {"name": node.name, "total_bytes": node.total_bytes, "usable_bytes": usable,
            "usable_rule": node.usable_rule, "verdict": verdict, "need_bytes": need, "headroom_bytes": usable - need}


def _largest_batch(shape: ModelShape, request: SizingRequest, checkpoint: bool,
                   usable: int) -> tuple[int, int] | None:
    """(per-rank batch, its bytes) for the largest batch up to MAX_BATCH_SEARCH that fits ``usable``."""
    fitting = None
    for batch in range(1, MAX_BATCH_SEARCH + 1):
        batch_request: SizingRequest = {**request, "batch_size": batch}
        need = estimate_memory(shape, **batch_request, grad_checkpoint=checkpoint).total_bytes
        if need > usable:
            break
        fitting = (batch, need)
    return fitting


# --- pipeline ---------------------------------------------------------------------------------


def split_layers(num_layers: int, usable: Sequence[int]) -> list[int]:
    """Blocks per node in proportion to its usable memory, at least one each: largest remainders
    get the leftover blocks, larger nodes first, so a node with less memory never takes more."""
    if len(usable) > num_layers:
        raise SizingError(f"{len(usable)} nodes but only {num_layers} blocks to split")
    total = sum(usable)
    quotas = [num_layers * size / total for size in usable]
    counts = [max(1, math.floor(quota)) for quota in quotas]
    by_claim = sorted(range(len(usable)), key=lambda k: (quotas[k] - counts[k], usable[k]), reverse=True)
    for k in by_claim[:num_layers - sum(counts)]:
        counts[k] += 1
    while sum(counts) > num_layers:  # only when the one-block minimum overshot
        k = max((k for k in range(len(usable)) if counts[k] > 1), key=lambda k: (counts[k] - quotas[k], counts[k]))
        counts[k] -= 1
    return counts


def _pipeline_or_none(shape: ModelShape, nodes: Sequence[NodeMemory], request: SizingRequest) -> Pipeline | None:
    if len(nodes) < 2 or len(nodes) > shape.num_layers:
        return None
    counts = split_layers(shape.num_layers, [node.usable_bytes for node in nodes])
    best: Pipeline | None = None
    for checkpoint in (False, True):
        setup = training_setup(shape, **request, grad_checkpoint=checkpoint)
        stages: list[PipelineStage] = []
        first = 0
        for index, (node, count) in enumerate(zip(nodes, counts, strict=True)):
            stage = Stage(first, first + count, embedding=index == 0, head=index == len(nodes) - 1)
            need = estimate_stage(shape, setup, stage).total_bytes
            stages.append({"node": node.name, "first_block": first, "last_block": first + count - 1,
                           "blocks": count, "need_bytes": need, "usable_bytes": node.usable_bytes,
                           "fits": need <= node.usable_bytes})
            first += count
        fits = all(s["fits"] for s in stages)
        best = {"fine_tune_type": request["fine_tune_type"], "grad_checkpoint": checkpoint, "fits": fits,
                "stages": stages, "note": PIPELINE_NOTE, "detail": _pipeline_detail(stages, checkpoint, fits)}
        if best["fits"]:
            break
    return best


def _pipeline_detail(stages: Sequence[PipelineStage], grad_checkpoint: bool, fits: bool) -> str:
    parts = [f"{s['node']} blocks {s['first_block']}–{s['last_block']} ({_gib(s['need_bytes'])} of "
             f"{_gib(s['usable_bytes'])})" for s in stages]
    head = "pipeline split in proportion to usable memory" + (
        ", with gradient checkpointing" if grad_checkpoint else "")
    if fits:
        return f"{head}: " + "; ".join(parts)
    short = [s["node"] for s in stages if not s["fits"]]
    return f"{head} does not fit ({', '.join(short)} short): " + "; ".join(parts)


# --- words ------------------------------------------------------------------------------------


def _data_parallel_recommendation(replica: ReplicaFit) -> Recommendation:
    estimate = replica["estimate"]
    checkpointed = replica["estimate_checkpointed"]
    need = checkpointed if replica["grad_checkpoint"] else estimate
    detail = (f"{', '.join(replica['replicas'])} each hold a {estimate['fine_tune_type']} fine-tune replica "
              f"({_gib(need['total_bytes'])} per rank"
              + (", with --grad-checkpoint" if replica["grad_checkpoint"] else "") + ")")
    left_out = [v for v in replica["nodes"] if v["verdict"] == DOES_NOT_FIT]
    if left_out:
        detail += "; left out: " + ", ".join(f"{v['name']} ({_gib(v['usable_bytes'])} usable)" for v in left_out)
    return {"kind": "data_parallel", "detail": detail}


def _lora_detail(full: ReplicaFit, lora: ReplicaFit) -> str:
    return (f"no node holds a full fine-tune ({_gib(full['estimate_checkpointed']['total_bytes'])} even with "
            f"gradient checkpointing; the largest node has {_gib(_largest_usable(full))} usable); LoRA needs "
            f"{_gib(_replica_need(lora))} and fits {', '.join(lora['replicas'])}"
            + (" with --grad-checkpoint" if lora["grad_checkpoint"] else ""))


def _not_trainable_detail(full: ReplicaFit, lora: ReplicaFit | None,
                          pipelines: Sequence[Pipeline | None], nodes: Sequence[NodeMemory]) -> str:
    kind = full["estimate"]["fine_tune_type"]
    parts = [f"a {kind} fine-tune needs {_gib(full['estimate_checkpointed']['total_bytes'])} per replica even "
             f"with gradient checkpointing; the largest node has {_gib(_largest_usable(full))} usable"]
    if lora is not None:
        parts.append(f"LoRA needs {_gib(lora['estimate_checkpointed']['total_bytes'])}")
    tried = [p for p in pipelines if p is not None]
    if not tried:
        parts.append("one node: no pipeline split" if len(nodes) < 2 else "more nodes than blocks to split")
    parts.extend(f"{p['fine_tune_type']}: {p['detail']}" for p in tried)
    parts.append(f"the {len(nodes)} node(s) hold {_gib(sum(n.usable_bytes for n in nodes))} usable together, and "
                 "MLX cannot shard one replica's weights and optimizer state across nodes")
    return "not trainable on this cluster: " + "; ".join(parts)


def _notes(shape: ModelShape, request: SizingRequest, estimate: EstimateDict) -> list[str]:
    notes = [f"model shape: {shape.source}"]
    if request["fine_tune_type"] == "full" and estimate["train_dtype"] == "float32" and shape.dtype != "float32":
        dequantize = " --dequantize" if shape.quantization_bits is not None else ""
        notes.append(f"sized in float32: the model is {stored_text(shape)}, and a full fine-tune in bfloat16 loses "
                     "updates smaller than half a bfloat16 step; convert it first with mlx_lm.convert --hf-path "
                     f"MODEL --mlx-path MODEL-f32{dequantize} --dtype float32")
    return notes


def _replica_need(fit: ReplicaFit) -> int:
    return (fit["estimate_checkpointed"] if fit["grad_checkpoint"] else fit["estimate"])["total_bytes"]


def _largest_usable(fit: ReplicaFit) -> int:
    return max(v["usable_bytes"] for v in fit["nodes"])


def _gib(size: int) -> str:
    return f"{size / GIB:.1f} GiB"


def sizing_summary(plan: FitPlan) -> PlanSizing:
    """The keys the plan document takes (``PlanInputs.sizing``), from :func:`fit_nodes`'s result:
    the largest per-rank batch every replica holds, its memory, and the checkpoint size."""
    kind = plan["recommendation"]["kind"]
    fit: ReplicaFit | None = plan["lora"] if kind == "lora" else plan
    # (a "lora" recommendation always comes with LoRA's fit)
    if kind not in ("data_parallel", "lora") or fit is None or fit["largest_batch_size"] is None:
        return {"per_rank_batch_size": None, "checkpoint_bytes": None, "checkpoint_bytes_with_optimizer": None,
                "memory_per_rank_bytes": None,
                "source": f"coord plan sizing: {plan['recommendation']['detail']}"}
    estimate = fit["estimate"]
    item = DTYPE_BYTES[estimate["train_dtype"]]
    weights = estimate["trainable_parameters"] * item
    optimizer = sum(c["bytes"] for c in estimate["components"] if c["name"] == "optimizer_state")
    return {"per_rank_batch_size": fit["largest_batch_size"],
            "checkpoint_bytes": weights,
            # coord's trainer also saves the optimizer's state, so that a resume is exact
            "checkpoint_bytes_with_optimizer": weights + optimizer,
            "memory_per_rank_bytes": fit["largest_batch_bytes"],
            "source": (f"coord plan sizing ({plan['model']['source']}): largest per-rank batch that fits "
                       f"{', '.join(fit['replicas'])}" + (" with --grad-checkpoint" if fit["grad_checkpoint"] else "")
                       + f"; checkpoint = trainable parameters × {item} B")}
