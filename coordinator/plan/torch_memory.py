"""How much memory one GPU needs to train a model under each PyTorch strategy: DDP, FSDP
(SHARD_GRAD_OP, FULL_SHARD, FULL_SHARD with CPU offload) and DeepSpeed ZeRO (stage 2, stage 3,
stage 3 with CPU or NVMe offload), component by component, each with its rule.

Pure arithmetic over the model's shape (:mod:`coordinator.plan.model_shape`, read from config.json
and safetensors headers) and the training set-up. Ψ is the parameter count, N the number of GPUs
the states are sharded over, and Adam keeps two states per parameter. The rules:

- **mixed precision** (bf16 or fp16): torch's autocast in DDP and FSDP keeps fp32 parameters (4 B),
  fp32 gradients (4 B) and Adam's two fp32 moments (8 B): 16 B per parameter. FSDP with
  ``mixed_precision`` keeps the same fp32 shards and gathers a unit's parameters in the compute
  dtype (2 B) to run it. DeepSpeed keeps the parameters and gradients in the compute dtype (2 B
  each) and an fp32 master copy with the two moments in its optimizer (12 B): 16 B again, split
  otherwise (the ZeRO paper's accounting, K = 12).
- **fp32** (CPU): 4 B parameters, 4 B gradients, 8 B of Adam moments.
- **sharding**: ZeRO-2 and FSDP SHARD_GRAD_OP shard gradients and optimizer state over N and keep
  whole parameters (FSDP: the gathered compute-dtype copy lives from a unit's forward to its
  backward); ZeRO-3 and FULL_SHARD shard all three, and hold the gathered parameters of two
  transformer blocks at a time (the one running and the one prefetched) and one block's full
  gradient before it is reduce-scattered.
- **offload**: the sharded states live in host memory (CPU) or on NVMe, and the GPU holds what
  is being computed: the gathered blocks, their gradients, the activations.
- **activations** are :mod:`coordinator.plan.memory_estimate`'s rule per token and block (block
  inputs, norms, attention and MLP intermediates), the logits and their gradient, and the
  attention scores of one block (an upper bound: a fused attention kernel such as SDPA's flash
  path keeps none); with activation checkpointing, each block's input plus one block recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypedDict

from coordinator.plan.memory_estimate import (
    ATTENTION_SCORE_ARRAYS,
    LOGIT_VALUES_PER_TOKEN,
    block_activation_values,
)
from coordinator.plan.model_shape import ModelShape

Precision = Literal["bf16", "fp16", "fp32"]
STRATEGIES = ("DDP", "FSDP-SHARD_GRAD_OP", "FSDP-FULL_SHARD", "FSDP-FULL_SHARD+offload", "ZeRO-2", "ZeRO-3",
              "ZeRO-3+offload")
ADAM_STATES = 2
#: Transformer blocks whose gathered parameters a fully sharded GPU holds at once: the one being
#: computed and the one prefetched (FSDP's BACKWARD_PRE, DeepSpeed's prefetch bucket).
LIVE_BLOCKS = 2


class StrategyMemory(TypedDict):
    """One strategy's bytes per GPU, by component, and what it keeps off the GPU."""

    strategy: str
    params: int
    grads: int
    optimizer: int
    activations: int
    total: int
    host_bytes_per_rank: int  # what an offloading strategy keeps in host memory (0 for the others)
    rules: dict[str, str]  # component -> the rule behind its number


@dataclass(frozen=True)
class TorchSetup:
    """What the estimate is for."""

    world: int  # GPUs (or CPU ranks) the states are sharded over
    micro_batch: int  # examples per GPU per forward
    seq_len: int
    precision: Precision
    activation_checkpointing: bool = False


def strategy_memory(shape: ModelShape, setup: TorchSetup, strategy: str) -> StrategyMemory:
    """The bytes one GPU holds under ``strategy`` (one of STRATEGIES), by component."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if setup.world < 1 or setup.micro_batch < 1 or setup.seq_len < 1:
        raise ValueError("world, micro_batch and seq_len must be at least 1")
    states = _deepspeed(shape, setup, strategy) if strategy.startswith("ZeRO") else _torch(shape, setup, strategy)
    params, grads, optimizer, host, rules = states
    activations, rules["activations"] = activation_bytes(shape, setup)
    return {"strategy": strategy, "params": params, "grads": grads, "optimizer": optimizer,
            "activations": activations, "total": params + grads + optimizer + activations,
            "host_bytes_per_rank": host, "rules": rules}


_States = tuple[int, int, int, int, dict[str, str]]  # params, grads, optimizer, host bytes, rules


def _torch(shape: ModelShape, setup: TorchSetup, strategy: str) -> _States:
    """DDP and FSDP: fp32 parameters, gradients and Adam moments; FSDP gathers in the compute dtype."""
    psi, n, compute = shape.parameter_count, setup.world, _compute_bytes(setup)
    block, (live, live_rule) = round(shape.block_parameters), _live(shape, setup)
    optimizer_rule = f"{ADAM_STATES} Adam moments × {psi:,} × 4 B (fp32)"
    if strategy == "DDP":
        cast = "; autocast casts per operation" if setup.precision != "fp32" else ""
        return (4 * psi, 4 * psi, ADAM_STATES * 4 * psi, 0,
                {"params": f"{psi:,} × 4 B (fp32{cast}), a whole replica", "grads": f"{psi:,} × 4 B (fp32)",
                 "optimizer": optimizer_rule})
    shard = f"{psi:,} × 4 B / {n} GPUs (fp32 shard)"
    optimizer, optimizer_rule = ADAM_STATES * 4 * psi // n, optimizer_rule + f" / {n} GPUs"
    if strategy == "FSDP-SHARD_GRAD_OP":
        return (4 * psi // n + compute * psi, 4 * psi // n, optimizer, 0,
                {"params": f"{shard} + {psi:,} × {compute} B gathered, kept from forward to backward",
                 "grads": f"{psi:,} × 4 B / {n} GPUs (reduce-scattered)", "optimizer": optimizer_rule})
    grads_rule = f"one block's {block:,} gradients × {compute} B before they are reduce-scattered"
    if strategy == "FSDP-FULL_SHARD":
        return (4 * psi // n + live, 4 * psi // n + block * compute, optimizer, 0,
                {"params": f"{shard} + {live_rule}", "grads": f"{psi:,} × 4 B / {n} GPUs + {grads_rule}",
                 "optimizer": optimizer_rule})
    return (live, block * compute, 0, 16 * psi // n,  # FSDP-FULL_SHARD+offload
            {"params": f"{live_rule}; the fp32 shards live in host memory", "grads": f"{grads_rule}; the shards "
             "live in host memory", "optimizer": "none: the optimizer steps on the CPU",
             "host": f"{psi:,} × 16 B / {n} ranks: each rank's parameters, gradients and Adam state"})


def _deepspeed(shape: ModelShape, setup: TorchSetup, strategy: str) -> _States:
    """ZeRO: parameters and gradients in the compute dtype, an fp32 master copy and the moments in the
    optimizer (12 B; 8 B in fp32, where the parameters are their own master)."""
    psi, n, compute = shape.parameter_count, setup.world, _compute_bytes(setup)
    block, (live, live_rule) = round(shape.block_parameters), _live(shape, setup)
    per_state = 12 if setup.precision != "fp32" else 8
    what = "fp32 master, 2 Adam moments" if per_state == 12 else "2 Adam moments"
    optimizer_rule = f"{psi:,} × {per_state} B ({what}) / {n} GPUs"
    grads_rule = f"{psi:,} × {compute} B / {n} GPUs (partitioned)"
    if strategy == "ZeRO-2":
        return (compute * psi, compute * psi // n, per_state * psi // n, 0,
                {"params": f"{psi:,} × {compute} B ({setup.precision}), whole on every GPU", "grads": grads_rule,
                 "optimizer": optimizer_rule})
    if strategy == "ZeRO-3":
        return (compute * psi // n + live, compute * psi // n + block * compute, per_state * psi // n, 0,
                {"params": f"{psi:,} × {compute} B / {n} GPUs + {live_rule}",
                 "grads": f"{grads_rule} + one block's {block:,} × {compute} B before reduce-scatter",
                 "optimizer": optimizer_rule})
    return (live, block * compute, 0, (per_state + compute) * psi // n,  # ZeRO-3+offload
            {"params": f"{live_rule}; the partitions live in host memory (offload_param)",
             "grads": f"one block's {block:,} × {compute} B before they go to host memory",
             "optimizer": "none: the optimizer steps on the CPU (offload_optimizer)",
             "host": f"{psi:,} × ({per_state} + {compute}) B / {n} ranks: optimizer state and parameters, per rank"})


def _compute_bytes(setup: TorchSetup) -> int:
    return 4 if setup.precision == "fp32" else 2


def _live(shape: ModelShape, setup: TorchSetup) -> tuple[int, str]:
    block, compute = round(shape.block_parameters), _compute_bytes(setup)
    return (LIVE_BLOCKS * block * compute,
            f"{LIVE_BLOCKS} blocks × {block:,} parameters × {compute} B gathered (the one running, one prefetched)")


def activation_bytes(shape: ModelShape, setup: TorchSetup) -> tuple[int, str]:
    """One GPU's activations for its micro-batch, in the compute dtype, with the rule."""
    item = 4 if setup.precision == "fp32" else 2
    tokens = setup.micro_batch * setup.seq_len
    per_block = block_activation_values(shape)
    layers = shape.num_layers
    if setup.activation_checkpointing:
        values = layers * shape.hidden_size + per_block
        kept = f"({layers} block inputs × {shape.hidden_size:,} + one block's {per_block:,} recomputed)"
    else:
        values = layers * per_block
        kept = f"{layers} blocks × {per_block:,}"
    logits = LOGIT_VALUES_PER_TOKEN * shape.vocab_size
    scores = ATTENTION_SCORE_ARRAYS * setup.micro_batch * shape.num_attention_heads * setup.seq_len ** 2
    total = tokens * (values + logits) * item + scores * item
    rule = (f"{setup.micro_batch} × {setup.seq_len} tokens × ({kept} + {logits:,} logit) values × {item} B, + "
            f"{ATTENTION_SCORE_ARRAYS} × {setup.micro_batch} × {shape.num_attention_heads} heads × {setup.seq_len}² "
            f"attention scores × {item} B (an upper bound: a fused attention kernel keeps none)")
    return total, rule
