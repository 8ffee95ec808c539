"""How much memory a fine-tune needs, and which of the cluster's Macs can hold it.

The model's shape comes from its ``config.json`` and the headers of its ``*.safetensors``
files (only the 8-byte length and the JSON header of each file are read, never a
tensor); a directory with no weights (a synthetic config) is counted from the config
alone, and :attr:`ModelShape.source` says which was used.

The estimate follows what MLX and mlx-lm do, component by component, each with the rule
that produced it (:class:`Component`):

- **weights**: every parameter at its training width. A full fine-tune is sized in
  float32: bfloat16 keeps 8 significant bits, so an Adam step of about the learning rate
  (1e-5) on a weight of 0.02 is less than half a bfloat16 step (1.2e-4) and rounds away
  (checked with MLX: ``0.02 - 1e-5 == 0.02`` in bfloat16). Convert the model first
  (``mlx_lm.convert --dtype float32``); ``train_dtype`` sizes another choice. LoRA keeps
  the base weights as stored and the adapters in float32 (mlx-lm creates them so).
- **gradients**: one per trainable parameter, in its dtype. mlx-lm's full fine-tune
  unfreezes the transformer blocks only (``model.layers``), not the embedding, the final
  norm or the LM head; LoRA trains ``r·(in + out)`` values per adapted linear, and mlx-lm
  adapts every linear of the top ``--num-layers`` blocks.
- **optimizer state**: MLX's optimizers keep their state in the parameter's own dtype
  (``zeros_like``): Adam and AdamW two moments, SGD and Muon one, Adafactor (no first
  moment by default) only a row and a column per matrix, counted as none.
- **optimizer update**: mlx-lm's compiled step writes the new weights before the old ones
  are released, about one more copy of the trainable weights at the peak (measured with
  mlx 0.32.4 on the CPU backend: 1 to 2 bytes per bfloat16 trainable parameter).
- **activations**: what the backward pass keeps, per token and per block it goes through
  (every block for a full fine-tune, the adapted blocks for LoRA), in values::

      4·hidden            block input, its norm, the residual sum and its norm
      + 2·q_width         queries, and the attention output (o_proj's input)
      + 2·kv_width        keys and values
      + 4·intermediate    gate and up outputs, the SiLU, and down_proj's input

  (checked with mlx 0.32.4 on the CPU backend: 29–48 KB per token per block measured for a
  bfloat16 width-1024 llama at batch 1–8 and 128–512 tokens, against 35.8 KB from this
  rule). With gradient checkpointing (mlx-lm's ``--grad-checkpoint`` wraps every block)
  only each block's input is kept, plus one block's full set while it is recomputed.
- **logits**: the LM head's output and its gradient, 2·vocab values per token.
- **attention scores**: the scores and probabilities of one block (batch × heads ×
  seq²), alive while that block's attention is differentiated.

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

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared import safetensors_header

GIB = 2**30

FINE_TUNE_TYPES = ("full", "lora", "dora")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_DTYPE = "bfloat16"  # what most published checkpoints hold; used only when nothing says otherwise
ADAPTER_DTYPE = "float32"  # mlx-lm creates lora_a/lora_b in MLX's default float32
FULL_FINE_TUNE_DTYPE = "float32"  # see the module docstring: bfloat16 loses fine-tuning updates

#: Copies of each trainable parameter an optimizer keeps (mlx.optimizers ``init_single``).
OPTIMIZER_STATE_COPIES = {"adam": 2, "adamw": 2, "sgd": 1, "muon": 1, "adafactor": 0}
#: Extra copies of the trainable weights alive while the compiled step updates them.
OPTIMIZER_UPDATE_COPIES = 1

#: Activation values kept per token per block, as multiples of the block's widths.
HIDDEN_VALUES_PER_TOKEN = 4
Q_WIDTH_VALUES_PER_TOKEN = 2
KV_WIDTH_VALUES_PER_TOKEN = 2
INTERMEDIATE_VALUES_PER_TOKEN = 4
#: LM-head values kept per token: the logits and their gradient.
LOGIT_VALUES_PER_TOKEN = 2
#: Attention arrays of one block alive in its backward pass: scores and probabilities.
ATTENTION_SCORE_ARRAYS = 2
#: Linears mlx-lm adapts in a block: q, k, v, o, gate, up, down.
LORA_LINEARS = 7

MACOS_GPU_FRACTION = 0.75
OTHER_OS_FRACTION = 0.90

_SAFETENSORS_FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_LAYER_TENSOR = re.compile(r"(?:^|\.)layers\.\d+\.")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


class SizingError(ValueError):
    """A model directory or request that cannot be sized, with the reason."""


# --- the model's shape ----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype: str  # the floating dtype the weights (or a quantized model's scales) are stored in
    quantization_bits: int | None
    parameter_count: int
    layer_parameter_count: int  # all transformer blocks together
    weight_bytes: int  # the weights as stored
    source: str

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def block_parameters(self) -> float:
        return self.layer_parameter_count / self.num_layers

    @property
    def stored_bytes_per_parameter(self) -> float:
        return self.weight_bytes / self.parameter_count

    def as_dict(self) -> dict[str, Any]:
        return {
            "parameters": self.parameter_count, "layer_parameters": self.layer_parameter_count,
            "layers": self.num_layers, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "attention_heads": self.num_attention_heads,
            "kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings, "dtype": self.dtype,
            "quantization_bits": self.quantization_bits, "weight_bytes": self.weight_bytes, "source": self.source,
        }


def read_model_shape(model_dir: str | Path) -> ModelShape:
    """The shape of the model in ``model_dir`` (its config.json and safetensors headers)."""
    directory = Path(model_dir)
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except OSError as error:
        raise SizingError(f"cannot read {config_path}: {error.strerror or error}") from error
    except ValueError as error:
        raise SizingError(f"{config_path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise SizingError(f"{config_path} must hold a JSON object")
    files = sorted(directory.glob("*.safetensors"))
    headers = [read_safetensors_header(path) for path in files]
    return shape_from_config(config, headers, where=str(config_path))


def read_safetensors_header(path: str | Path) -> dict[str, dict[str, Any]]:
    """``{tensor name: {"dtype", "shape", "data_offsets"}}`` from a safetensors file's header."""
    try:
        return safetensors_header.tensor_entries(safetensors_header.read_header(path), path)
    except safetensors_header.HeaderError as error:
        raise SizingError(str(error)) from error


def shape_from_config(config: Mapping[str, Any], headers: Sequence[Mapping[str, Mapping[str, Any]]] = (),
                      where: str = "config.json") -> ModelShape:
    """Build the shape from a parsed config.json and the models' safetensors headers (may be none)."""
    text = _language_config(config)
    if any(_int_or_none(text.get(key)) not in (None, 0, 1) for key in _EXPERT_KEYS):
        raise SizingError(f"{where}: mixture-of-experts models are not sized yet (only dense transformers)")
    hidden = _required_int(text, "hidden_size", where)
    layers = _required_int(text, "num_hidden_layers", where)
    intermediate = _required_int(text, "intermediate_size", where)
    heads = _required_int(text, "num_attention_heads", where)
    vocab = _required_int(text, "vocab_size", where)
    kv_heads = _int_or_none(text.get("num_key_value_heads")) or heads
    head_dim = _int_or_none(text.get("head_dim")) or hidden // heads
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    bits = _quantization_bits(config)
    counted_total, counted_layers = count_parameters(
        hidden=hidden, layers=layers, intermediate=intermediate, q_width=heads * head_dim,
        kv_width=kv_heads * head_dim, vocab=vocab, tied=tied, attention_bias=bool(text.get("attention_bias")))
    config_dtype = _config_dtype(config)
    if headers:
        total, layer_total, weight_bytes, stored_dtype = _count_headers(headers)
        files = f"{len(headers)} safetensors header{'s' if len(headers) != 1 else ''}"
        if bits is not None:
            # Packed uint32 weights hold 32/bits values each: the config counts them exactly.
            total, layer_total = counted_total, counted_layers
            source = f"parameters computed from {where} ({bits}-bit quantized weights); weight bytes from {files}"
        else:
            source = f"parameters and dtype from {files}"
        dtype = stored_dtype or config_dtype or DEFAULT_DTYPE
    else:
        total, layer_total = counted_total, counted_layers
        dtype = config_dtype or DEFAULT_DTYPE
        weight_bytes = round(total * _stored_bytes_per_parameter(dtype, bits, config))
        source = (f"computed from {where} (no *.safetensors); dtype "
                  + (f"{dtype} from the config" if config_dtype else f"assumed {dtype}"))
    return ModelShape(hidden_size=hidden, num_layers=layers, intermediate_size=intermediate,
                      num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                      tie_word_embeddings=tied, dtype=dtype, quantization_bits=bits, parameter_count=total,
                      layer_parameter_count=layer_total, weight_bytes=weight_bytes, source=source)


def count_parameters(*, hidden: int, layers: int, intermediate: int, q_width: int, kv_width: int, vocab: int,
                     tied: bool, attention_bias: bool = False) -> tuple[int, int]:
    """(all parameters, those in the transformer blocks) of a llama-style dense model.

    A block: q and o projections (hidden × q_width each), k and v (hidden × kv_width each),
    a gated MLP (3 × hidden × intermediate) and two norms (hidden each); per-head q/k norms
    (Qwen3) are left out, under 0.01% of a block. Outside the blocks: the embedding, the LM
    head unless tied, and the final norm.
    """
    attention = 2 * hidden * q_width + 2 * hidden * kv_width
    if attention_bias:
        attention += q_width + 2 * kv_width
    block = attention + 3 * hidden * intermediate + 2 * hidden
    in_blocks = layers * block
    embedding = vocab * hidden
    return in_blocks + embedding + (0 if tied else embedding) + hidden, in_blocks


def _count_headers(headers: Sequence[Mapping[str, Mapping[str, Any]]]) -> tuple[int, int, int, str | None]:
    total = in_layers = weight_bytes = 0
    float_bytes: dict[str, int] = {}
    for header in headers:
        for name, entry in header.items():
            count = math.prod(int(n) for n in entry["shape"])
            start, end = entry["data_offsets"]
            size = int(end) - int(start)
            total += count
            weight_bytes += size
            if _LAYER_TENSOR.search(name):
                in_layers += count
            dtype = _SAFETENSORS_FLOAT_DTYPES.get(entry["dtype"])
            if dtype is not None:
                float_bytes[dtype] = float_bytes.get(dtype, 0) + size
    stored = max(float_bytes, key=float_bytes.__getitem__) if float_bytes else None
    return total, in_layers, weight_bytes, stored


def _language_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    # Multimodal checkpoints nest the language model's shape under text_config.
    nested = config.get("text_config")
    if "hidden_size" not in config and isinstance(nested, dict):
        return nested
    return config


def _quantization_bits(config: Mapping[str, Any]) -> int | None:
    for key in ("quantization", "quantization_config"):
        section = config.get(key)
        if isinstance(section, dict) and _int_or_none(section.get("bits")):
            return int(section["bits"])
    return None


def _config_dtype(config: Mapping[str, Any]) -> str | None:
    for section in (config, _language_config(config)):
        for key in ("torch_dtype", "dtype"):
            value = section.get(key)
            if value in DTYPE_BYTES:
                return value
    return None


def _stored_bytes_per_parameter(dtype: str, bits: int | None, config: Mapping[str, Any]) -> float:
    if bits is None:
        return DTYPE_BYTES[dtype]
    # MLX quantization: `bits` per value plus a scale and a bias (in `dtype`) per group.
    section = config.get("quantization") or config.get("quantization_config") or {}
    group = _int_or_none(section.get("group_size")) or 64
    return bits / 8 + 2 * DTYPE_BYTES[dtype] / group


def _required_int(config: Mapping[str, Any], key: str, where: str) -> int:
    value = _int_or_none(config.get(key))
    if value is None or value <= 0:
        raise SizingError(f"{where}: {key} must be a positive integer, got {config.get(key)!r}")
    return value


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# --- the estimate ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Component:
    name: str
    bytes: int
    rule: str


@dataclass(frozen=True)
class MemoryEstimate:
    fine_tune_type: str
    train_dtype: str
    batch_size: int
    seq_len: int
    grad_checkpoint: bool
    trainable_parameters: int
    components: tuple[Component, ...]

    @property
    def total_bytes(self) -> int:
        return sum(component.bytes for component in self.components)

    def as_dict(self) -> dict[str, Any]:
        return {
            "fine_tune_type": self.fine_tune_type, "train_dtype": self.train_dtype,
            "batch_size": self.batch_size, "seq_len": self.seq_len, "grad_checkpoint": self.grad_checkpoint,
            "trainable_parameters": self.trainable_parameters, "total_bytes": self.total_bytes,
            "components": [{"name": c.name, "bytes": c.bytes, "rule": c.rule} for c in self.components],
        }


@dataclass(frozen=True)
class _Setup:
    fine_tune_type: str
    batch_size: int
    seq_len: int
    lora_rank: int
    lora_layers: int
    optimizer: str
    grad_checkpoint: bool
    train_dtype: str


@dataclass(frozen=True)
class _Stage:
    """The blocks one process holds, and whether it also holds the embedding and the head."""
    first: int
    stop: int
    embedding: bool
    head: bool


def estimate_memory(shape: ModelShape, fine_tune_type: str = "full", batch_size: int = 4, seq_len: int = 2048,
                    lora_rank: int = 8, lora_layers: int = 16, optimizer: str = "adam",
                    grad_checkpoint: bool = False, train_dtype: str | None = None) -> MemoryEstimate:
    """Peak memory of one data-parallel rank, by component, each with its rule.

    ``batch_size`` is the examples one rank holds per step: mlx-lm splits ``--batch-size``
    over the ranks. ``lora_layers`` is mlx-lm's ``--num-layers`` (-1: every block); a full
    fine-tune is sized for every block (coord passes ``--num-layers -1``). ``train_dtype``
    (default: float32 for a full fine-tune, the adapters' float32 for LoRA) is the width
    of the trainable weights, their gradients and optimizer state.
    """
    setup = _setup(shape, fine_tune_type, batch_size, seq_len, lora_rank, lora_layers, optimizer,
                   grad_checkpoint, train_dtype)
    return _estimate_stage(shape, setup, _Stage(0, shape.num_layers, embedding=True, head=True))


def _setup(shape: ModelShape, fine_tune_type: str, batch_size: int, seq_len: int, lora_rank: int,
           lora_layers: int, optimizer: str, grad_checkpoint: bool, train_dtype: str | None) -> _Setup:
    if fine_tune_type not in FINE_TUNE_TYPES:
        raise SizingError(f"fine_tune_type must be one of {', '.join(FINE_TUNE_TYPES)}, got {fine_tune_type!r}")
    if optimizer not in OPTIMIZER_STATE_COPIES:
        raise SizingError(f"optimizer must be one of {', '.join(OPTIMIZER_STATE_COPIES)}, got {optimizer!r}")
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("lora_rank", lora_rank)):
        if _int_or_none(value) is None or value <= 0:
            raise SizingError(f"{name} must be a positive integer, got {value!r}")
    if _int_or_none(lora_layers) is None or lora_layers == 0 or lora_layers < -1:
        raise SizingError(f"lora_layers must be -1 (every block) or a positive integer, got {lora_layers!r}")
    if fine_tune_type != "full" and lora_layers > shape.num_layers:
        raise SizingError(f"lora_layers is {lora_layers} but the model has {shape.num_layers} blocks")
    full = fine_tune_type == "full"
    dtype = train_dtype or (FULL_FINE_TUNE_DTYPE if full else ADAPTER_DTYPE)
    if dtype not in DTYPE_BYTES:
        raise SizingError(f"train_dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return _Setup(fine_tune_type, batch_size, seq_len, lora_rank, lora_layers, optimizer, grad_checkpoint, dtype)


def _estimate_stage(shape: ModelShape, setup: _Setup, stage: _Stage) -> MemoryEstimate:
    full = setup.fine_tune_type == "full"
    train_bytes = DTYPE_BYTES[setup.train_dtype]
    activation_dtype = setup.train_dtype if full else shape.dtype
    activation_bytes = DTYPE_BYTES[activation_dtype]
    blocks = stage.stop - stage.first
    trained = _trained_blocks(shape, setup, stage)
    parameters = round(blocks * shape.block_parameters) + _outside_parameters(shape, stage)
    trainable = round(trained * (shape.block_parameters if full else _adapter_parameters_per_block(shape, setup)))
    components = [_weights(shape, setup, parameters, train_bytes)]
    if not full:
        components.append(Component(
            "adapters", trainable * train_bytes,
            f"{trainable:,} {setup.fine_tune_type} parameters × {train_bytes} B ({setup.train_dtype}): rank "
            f"{setup.lora_rank} × (in + out) for each of the {LORA_LINEARS} linears of {trained} blocks"))
    what = (f"mlx-lm's full fine-tune trains the {trained} blocks, not the embedding or the head" if full
            else f"the {setup.fine_tune_type} adapters only")
    components.append(Component("gradients", trainable * train_bytes,
                                f"{trainable:,} trainable × {train_bytes} B, one gradient each ({what})"))
    copies = OPTIMIZER_STATE_COPIES[setup.optimizer]
    components.append(Component(
        "optimizer_state", copies * trainable * train_bytes,
        f"{copies} × {trainable:,} × {train_bytes} B: {setup.optimizer} keeps {copies} value(s) per trainable "
        "parameter in the parameter's dtype (mlx.optimizers zeros_like; Adafactor's factored rows and columns "
        "are negligible)"))
    components.append(Component(
        "optimizer_update", OPTIMIZER_UPDATE_COPIES * trainable * train_bytes,
        f"{OPTIMIZER_UPDATE_COPIES} × {trainable:,} × {train_bytes} B: the compiled step writes the new weights "
        "before the old ones are released"))
    components.extend(_activation_components(shape, setup, stage, trained, activation_dtype, activation_bytes))
    return MemoryEstimate(fine_tune_type=setup.fine_tune_type, train_dtype=setup.train_dtype,
                          batch_size=setup.batch_size, seq_len=setup.seq_len, grad_checkpoint=setup.grad_checkpoint,
                          trainable_parameters=trainable, components=tuple(components))


def _weights(shape: ModelShape, setup: _Setup, parameters: int, train_bytes: int) -> Component:
    if setup.fine_tune_type == "full":
        return Component("weights", parameters * train_bytes,
                         f"{parameters:,} parameters × {train_bytes} B ({setup.train_dtype}, the width the weights "
                         "are trained in)")
    stored = shape.stored_bytes_per_parameter
    return Component("weights", round(parameters * stored),
                     f"{parameters:,} frozen parameters × {stored:.3g} B as stored ({_stored_text(shape)})")


def _stored_text(shape: ModelShape) -> str:
    if shape.quantization_bits is None:
        return shape.dtype
    return f"{shape.quantization_bits}-bit quantized, scales in {shape.dtype}"


def _activation_components(shape: ModelShape, setup: _Setup, stage: _Stage, trained: int, dtype: str,
                           item: int) -> list[Component]:
    tokens = setup.batch_size * setup.seq_len
    per_block = block_activation_values(shape)
    token_text = f"{setup.batch_size} × {setup.seq_len} tokens"
    if setup.grad_checkpoint:
        values = trained * shape.hidden_size + (per_block if trained else 0)
        rule = (f"{token_text} × ({trained} blocks × {shape.hidden_size:,} block-input values + {per_block:,} "
                f"values of the block being recomputed) × {item} B ({dtype}): gradient checkpointing")
    else:
        values = trained * per_block
        rule = (f"{token_text} × {trained} blocks × {per_block:,} values × {item} B ({dtype}); per block and "
                "token: 4·hidden + 2·q_width + 2·kv_width + 4·intermediate")
    out = [Component("activations", tokens * values * item, rule)]
    if stage.head:
        out.append(Component("logits", tokens * LOGIT_VALUES_PER_TOKEN * shape.vocab_size * item,
                             f"{token_text} × {LOGIT_VALUES_PER_TOKEN} × {shape.vocab_size:,} vocab × {item} B: "
                             "the logits and their gradient"))
    if trained:
        scores = ATTENTION_SCORE_ARRAYS * setup.batch_size * shape.num_attention_heads * setup.seq_len ** 2
        out.append(Component("attention_scores", scores * item,
                             f"{ATTENTION_SCORE_ARRAYS} × {setup.batch_size} × {shape.num_attention_heads} heads × "
                             f"{setup.seq_len}² × {item} B: scores and probabilities of the block being "
                             "differentiated"))
    return out


def block_activation_values(shape: ModelShape) -> int:
    """Values one block keeps per token for its backward pass (see the module docstring)."""
    return (HIDDEN_VALUES_PER_TOKEN * shape.hidden_size + Q_WIDTH_VALUES_PER_TOKEN * shape.q_width
            + KV_WIDTH_VALUES_PER_TOKEN * shape.kv_width + INTERMEDIATE_VALUES_PER_TOKEN * shape.intermediate_size)


def _trained_blocks(shape: ModelShape, setup: _Setup, stage: _Stage) -> int:
    """Blocks of the stage that train; the backward pass goes through exactly these."""
    lowest = 0 if setup.fine_tune_type == "full" or setup.lora_layers == -1 else shape.num_layers - setup.lora_layers
    return max(0, stage.stop - max(stage.first, lowest))


def _adapter_parameters_per_block(shape: ModelShape, setup: _Setup) -> int:
    # (in, out) of q, k, v, o, gate, up, down: rank × (in + out) values each.
    h, q, kv, i = shape.hidden_size, shape.q_width, shape.kv_width, shape.intermediate_size
    ends = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    magnitudes = (q + 2 * kv + h + 2 * i + h) if setup.fine_tune_type == "dora" else 0  # one per output
    return setup.lora_rank * ends + magnitudes


def _outside_parameters(shape: ModelShape, stage: _Stage) -> int:
    """Parameters outside the blocks that a stage holds."""
    if stage.embedding and stage.head:
        return shape.parameter_count - shape.layer_parameter_count
    embedding = shape.vocab_size * shape.hidden_size
    if stage.embedding:
        return embedding
    if stage.head:
        # The LM head (a copy of the embedding when tied) and the final norm.
        return embedding + shape.hidden_size
    return 0


# --- which nodes can hold it ----------------------------------------------------------------

FITS, NEEDS_GRAD_CHECKPOINT, DOES_NOT_FIT = "fits", "needs_grad_checkpoint", "does_not_fit"
#: The largest per-rank batch :func:`fit_nodes` looks for.
MAX_BATCH_SEARCH = 64
PIPELINE_NOTE = ("mlx-lm's trainer has no pipeline mode: this split needs a training script that runs its blocks "
                 "on each node in turn and sends activations and their gradients between the ranks")


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
        total = _int_or_none((facts or {}).get("memory_bytes"))
        measured = (gpu_memory or {}).get(name)
        if not total:
            unknown.append(name)
        elif measured and _int_or_none(measured[0]):
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
              train_dtype: str | None = None) -> dict[str, Any]:
    """Which nodes can hold a data-parallel replica, and what to do where none can.

    Returns plain data::

        {"model": ModelShape.as_dict(), "request": {...the arguments...},
         "estimate": MemoryEstimate.as_dict(), "estimate_checkpointed": ...,
         "nodes": [{"name", "total_bytes", "usable_bytes", "usable_rule",
                    "verdict": "fits" | "needs_grad_checkpoint" | "does_not_fit",
                    "need_bytes" (with checkpointing unless it fits without), "headroom_bytes"}],
         "replicas": [node names that hold a replica], "grad_checkpoint": bool,
         "largest_batch_size": the largest per-rank batch every replica holds (with the plan's
                               checkpointing, up to MAX_BATCH_SEARCH) | None,
         "largest_batch_bytes": its memory per rank | None,
         "lora": {"request", and the keys above from "estimate" to "largest_batch_bytes"} for
                 LoRA, when a full fine-tune fits on no node | None,
         "pipeline": {"fine_tune_type", "grad_checkpoint", "fits", "stages": [...], "detail", "note"} | None,
         "recommendation": {"kind": "data_parallel" | "lora" | "pipeline" | "not_trainable", "detail"},
         "by_fine_tune_type": {"lora" | "full": {"need_bytes", "need_bytes_grad_checkpoint",
                               "train_dtype", "replicas", "grad_checkpoint"}} (both, always),
         "notes": [str]}
    """
    if not nodes:
        raise SizingError("no nodes with a known memory size to fit the model on")
    request = {"fine_tune_type": fine_tune_type, "batch_size": batch_size, "seq_len": seq_len,
               "lora_rank": lora_rank, "lora_layers": lora_layers, "optimizer": optimizer, "train_dtype": train_dtype}
    replica = _replica_fit(shape, nodes, request)
    plan: dict[str, Any] = {"model": shape.as_dict(), "request": request, **replica, "lora": None, "pipeline": None,
                            "by_fine_tune_type": _both_kinds(shape, nodes, request, replica),
                            "notes": _notes(shape, request, replica["estimate"])}
    if replica["replicas"]:
        plan["recommendation"] = _data_parallel_recommendation(replica)
        return plan
    lora = None
    if fine_tune_type == "full":
        lora_request = {**request, "fine_tune_type": "lora", "train_dtype": None}
        lora = {"request": lora_request, **_replica_fit(shape, nodes, lora_request)}
    plan["lora"] = lora
    plan["pipeline"] = _pipeline_or_none(shape, nodes, request)
    if lora is not None and lora["replicas"]:
        plan["recommendation"] = {"kind": "lora", "detail": _lora_detail(replica, lora)}
        return plan
    if plan["pipeline"] is not None and plan["pipeline"]["fits"]:
        plan["recommendation"] = {"kind": "pipeline", "detail": plan["pipeline"]["detail"]}
        return plan
    lora_pipeline = _pipeline_or_none(shape, nodes, lora["request"]) if lora is not None else None
    if lora_pipeline is not None and lora_pipeline["fits"]:
        plan["pipeline"] = lora_pipeline
        plan["recommendation"] = {"kind": "pipeline", "detail": "LoRA, " + lora_pipeline["detail"]}
        return plan
    plan["recommendation"] = {"kind": "not_trainable", "detail": _not_trainable_detail(
        replica, lora, [plan["pipeline"], lora_pipeline], nodes)}
    return plan


def _both_kinds(shape: ModelShape, nodes: Sequence[NodeMemory], request: Mapping[str, Any],
                requested: Mapping[str, Any]) -> dict[str, Any]:
    """LoRA and full fine-tuning side by side, whichever was asked for: the memory one replica
    needs (without and with gradient checkpointing) and the nodes that hold one."""
    out = {}
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


def _replica_fit(shape: ModelShape, nodes: Sequence[NodeMemory], request: Mapping[str, Any]) -> dict[str, Any]:
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


def _node_verdict(node: NodeMemory, plain: int, checkpointed: int) -> dict[str, Any]:
    usable = node.usable_bytes
    if plain <= usable:
        verdict, need = FITS, plain
    elif checkpointed <= usable:
        verdict, need = NEEDS_GRAD_CHECKPOINT, checkpointed
    else:
        verdict, need = DOES_NOT_FIT, checkpointed
    return {"name": node.name, "total_bytes": node.total_bytes, "usable_bytes": usable,
            "usable_rule": node.usable_rule, "verdict": verdict, "need_bytes": need, "headroom_bytes": usable - need}


def _largest_batch(shape: ModelShape, request: Mapping[str, Any], checkpoint: bool,
                   usable: int) -> tuple[int, int] | None:
    """(per-rank batch, its bytes) for the largest batch up to MAX_BATCH_SEARCH that fits ``usable``."""
    fitting = None
    for batch in range(1, MAX_BATCH_SEARCH + 1):
        need = estimate_memory(shape, **{**request, "batch_size": batch}, grad_checkpoint=checkpoint).total_bytes
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


def _pipeline_or_none(shape: ModelShape, nodes: Sequence[NodeMemory], request: Mapping[str, Any]) -> dict | None:
    if len(nodes) < 2 or len(nodes) > shape.num_layers:
        return None
    counts = split_layers(shape.num_layers, [node.usable_bytes for node in nodes])
    best = None
    for checkpoint in (False, True):
        setup = _setup(shape, **request, grad_checkpoint=checkpoint)
        stages, first = [], 0
        for index, (node, count) in enumerate(zip(nodes, counts, strict=True)):  # a count per node
            stage = _Stage(first, first + count, embedding=index == 0, head=index == len(nodes) - 1)
            need = _estimate_stage(shape, setup, stage).total_bytes
            stages.append({"node": node.name, "first_block": first, "last_block": first + count - 1,
                           "blocks": count, "need_bytes": need, "usable_bytes": node.usable_bytes,
                           "fits": need <= node.usable_bytes})
            first += count
        best = {"fine_tune_type": request["fine_tune_type"], "grad_checkpoint": checkpoint,
                "fits": all(s["fits"] for s in stages), "stages": stages, "note": PIPELINE_NOTE}
        if best["fits"]:
            break
    best["detail"] = _pipeline_detail(best)
    return best


def _pipeline_detail(pipeline: Mapping[str, Any]) -> str:
    parts = [f"{s['node']} blocks {s['first_block']}–{s['last_block']} ({_gib(s['need_bytes'])} of "
             f"{_gib(s['usable_bytes'])})" for s in pipeline["stages"]]
    head = "pipeline split in proportion to usable memory" + (
        ", with gradient checkpointing" if pipeline["grad_checkpoint"] else "")
    if pipeline["fits"]:
        return f"{head}: " + "; ".join(parts)
    short = [s["node"] for s in pipeline["stages"] if not s["fits"]]
    return f"{head} does not fit ({', '.join(short)} short): " + "; ".join(parts)


# --- words ------------------------------------------------------------------------------------


def _data_parallel_recommendation(replica: Mapping[str, Any]) -> dict[str, Any]:
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


def _lora_detail(full: Mapping[str, Any], lora: Mapping[str, Any]) -> str:
    return (f"no node holds a full fine-tune ({_gib(full['estimate_checkpointed']['total_bytes'])} even with "
            f"gradient checkpointing; the largest node has {_gib(_largest_usable(full))} usable); LoRA needs "
            f"{_gib(_replica_need(lora))} and fits {', '.join(lora['replicas'])}"
            + (" with --grad-checkpoint" if lora["grad_checkpoint"] else ""))


def _not_trainable_detail(full: Mapping[str, Any], lora: Mapping[str, Any] | None,
                          pipelines: Sequence[Mapping[str, Any] | None], nodes: Sequence[NodeMemory]) -> str:
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


def _notes(shape: ModelShape, request: Mapping[str, Any], estimate: Mapping[str, Any]) -> list[str]:
    notes = [f"model shape: {shape.source}"]
    if request["fine_tune_type"] == "full" and estimate["train_dtype"] == "float32" and shape.dtype != "float32":
        dequantize = " --dequantize" if shape.quantization_bits is not None else ""
        notes.append(f"sized in float32: the model is {_stored_text(shape)}, and a full fine-tune in bfloat16 loses "
                     "updates smaller than half a bfloat16 step; convert it first with mlx_lm.convert --hf-path "
                     f"MODEL --mlx-path MODEL-f32{dequantize} --dtype float32")
    return notes


def _replica_need(fit: Mapping[str, Any]) -> int:
    return (fit["estimate_checkpointed"] if fit["grad_checkpoint"] else fit["estimate"])["total_bytes"]


def _largest_usable(fit: Mapping[str, Any]) -> int:
    return max(v["usable_bytes"] for v in fit["nodes"])


def _gib(size: int) -> str:
    return f"{size / GIB:.1f} GiB"


def sizing_summary(plan: Mapping[str, Any]) -> dict[str, Any]:
    """The keys the plan document takes (``PlanInputs.sizing``), from :func:`fit_nodes`'s result:
    the largest per-rank batch every replica holds, its memory, and the checkpoint size."""
    kind = plan["recommendation"]["kind"]
    fit = plan["lora"] if kind == "lora" else plan
    if kind not in ("data_parallel", "lora") or fit["largest_batch_size"] is None:
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
