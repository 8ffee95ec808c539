"""How much memory one rank of a fine-tune needs.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from coordinator.plan.model_shape import DTYPE_BYTES, ModelShape, SizingError, int_or_none, stored_text

FINE_TUNE_TYPES = ("full", "lora", "dora")
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


class ComponentDict(TypedDict):
    name: str
    bytes: int
    rule: str


class EstimateDict(TypedDict):
    """:meth:`MemoryEstimate.as_dict`."""

    fine_tune_type: str
    train_dtype: str
    batch_size: int
    seq_len: int
    grad_checkpoint: bool
    trainable_parameters: int
    total_bytes: int
    components: list[ComponentDict]


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

    def as_dict(self) -> EstimateDict:
        return {
            "fine_tune_type": self.fine_tune_type, "train_dtype": self.train_dtype,
            "batch_size": self.batch_size, "seq_len": self.seq_len, "grad_checkpoint": self.grad_checkpoint,
            "trainable_parameters": self.trainable_parameters, "total_bytes": self.total_bytes,
            "components": [{"name": c.name, "bytes": c.bytes, "rule": c.rule} for c in self.components],
        }


@dataclass(frozen=True)
class TrainingSetup:
    fine_tune_type: str
    batch_size: int
    seq_len: int
    lora_rank: int
    lora_layers: int
    optimizer: str
    grad_checkpoint: bool
    train_dtype: str


@dataclass(frozen=True)
class Stage:
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
    setup = training_setup(shape, fine_tune_type, batch_size, seq_len, lora_rank, lora_layers, optimizer,
                   grad_checkpoint, train_dtype)
    return estimate_stage(shape, setup, Stage(0, shape.num_layers, embedding=True, head=True))


def training_setup(shape: ModelShape, fine_tune_type: str, batch_size: int, seq_len: int, lora_rank: int,
           lora_layers: int, optimizer: str, grad_checkpoint: bool, train_dtype: str | None) -> TrainingSetup:
    if fine_tune_type not in FINE_TUNE_TYPES:
        raise SizingError(f"fine_tune_type must be one of {', '.join(FINE_TUNE_TYPES)}, got {fine_tune_type!r}")
    if optimizer not in OPTIMIZER_STATE_COPIES:
        raise SizingError(f"optimizer must be one of {', '.join(OPTIMIZER_STATE_COPIES)}, got {optimizer!r}")
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("lora_rank", lora_rank)):
        if int_or_none(value) is None or value <= 0:
            raise SizingError(f"{name} must be a positive integer, got {value!r}")
    if int_or_none(lora_layers) is None or lora_layers == 0 or lora_layers < -1:
        raise SizingError(f"lora_layers must be -1 (every block) or a positive integer, got {lora_layers!r}")
    if fine_tune_type != "full" and lora_layers > shape.num_layers:
        raise SizingError(f"lora_layers is {lora_layers} but the model has {shape.num_layers} blocks")
    full = fine_tune_type == "full"
    dtype = train_dtype or (FULL_FINE_TUNE_DTYPE if full else ADAPTER_DTYPE)
    if dtype not in DTYPE_BYTES:
        raise SizingError(f"train_dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return TrainingSetup(fine_tune_type, batch_size, seq_len, lora_rank, lora_layers, optimizer, grad_checkpoint, dtype)


def estimate_stage(shape: ModelShape, setup: TrainingSetup, stage: Stage) -> MemoryEstimate:
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


def _weights(shape: ModelShape, setup: TrainingSetup, parameters: int, train_bytes: int) -> Component:
    if setup.fine_tune_type == "full":
        return Component("weights", parameters * train_bytes,
                         f"{parameters:,} parameters × {train_bytes} B ({setup.train_dtype}, the width the weights "
                         "are trained in)")
    stored = shape.stored_bytes_per_parameter
    return Component("weights", round(parameters * stored),
                     f"{parameters:,} frozen parameters × {stored:.3g} B as stored ({stored_text(shape)})")




def _activation_components(shape: ModelShape, setup: TrainingSetup, stage: Stage, trained: int, dtype: str,
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


def _trained_blocks(shape: ModelShape, setup: TrainingSetup, stage: Stage) -> int:
    """Blocks of the stage that train; the backward pass goes through exactly these."""
    lowest = 0 if setup.fine_tune_type == "full" or setup.lora_layers == -1 else shape.num_layers - setup.lora_layers
    return max(0, stage.stop - max(stage.first, lowest))


def _adapter_parameters_per_block(shape: ModelShape, setup: TrainingSetup) -> int:
    # (in, out) of q, k, v, o, gate, up, down: rank × (in + out) values each.
    h, q, kv, i = shape.hidden_size, shape.q_width, shape.kv_width, shape.intermediate_size
    ends = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    magnitudes = (q + 2 * kv + h + 2 * i + h) if setup.fine_tune_type == "dora" else 0  # one per output
    return setup.lora_rank * ends + magnitudes


def _outside_parameters(shape: ModelShape, stage: Stage) -> int:
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
