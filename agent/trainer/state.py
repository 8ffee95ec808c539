"""The trainer state a checkpoint carries in its safetensors metadata, and its checks.

A checkpoint's ``__metadata__`` holds one JSON string under ``coord.trainer_state``:
the format version, the global step, the optimizer (LR schedule) step, the RNG
key, the data position, the world size and batch split at save, and the options
that must not change on resume (they decide the model's trainable parameters,
the optimizer's update, or which examples each step consumes). A resume with
other values for those is refused, naming each difference.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, TypedDict, cast

if TYPE_CHECKING:
    from shared.agent_api.common import JsonObject

METADATA_KEY = "coord.trainer_state"
FORMAT = "coord-trainer-state"
VERSION = 1
#: Checkpoint tensors under this prefix are the optimizer state; the rest are model parameters.
OPTIMIZER_PREFIX = "__coord__.optimizer."

#: Options that a resume must keep (batch size and accumulation may change if the global batch stays).
FIXED_OPTIONS = ("fine_tune_type", "num_layers", "lora_parameters", "optimizer", "optimizer_config",
                 "learning_rate", "lr_schedule", "seed", "global_batch", "max_seq_length", "mask_prompt",
                 "train_examples")


class StateError(ValueError):
    """A checkpoint's trainer state that cannot be resumed from by this run."""


class RngState(TypedDict):
    mlx_key: list[int]  # two 32-bit halves


class _Skipped(TypedDict, total=False):  # (NotRequired is not in Python 3.10's typing, which nodes may run)
    skipped: int  # global batches passed over after rollbacks (absent: none, as before rollbacks existed)


class DataPosition(_Skipped):
    epoch: int
    index: int  # global batches of this epoch already consumed
    batches_per_epoch: int


class TrainerState(TypedDict):
    format: str
    version: int
    global_step: int
    optimizer_step: int
    rng: RngState
    data: DataPosition
    world_size: int
    batch_size: int
    grad_accumulation_steps: int
    trained_tokens: int
    options: JsonObject  # FIXED_OPTIONS' values, as JSON (a LoRA config is an object of its own)


def fixed_options(args: Any, global_batch: int, train_examples: int) -> JsonObject:
    """This run's values of FIXED_OPTIONS, normalised through JSON as they are stored.

    ``args`` is mlx_lm lora's options namespace."""
    optimizer = args.optimizer.lower()
    values = {
        "fine_tune_type": args.fine_tune_type,
        "num_layers": args.num_layers,
        "lora_parameters": args.lora_parameters if args.fine_tune_type != "full" else None,
        "optimizer": optimizer,
        "optimizer_config": (args.optimizer_config or {}).get(optimizer, {}),
        "learning_rate": args.learning_rate,
        "lr_schedule": args.lr_schedule,
        "seed": args.seed,
        "global_batch": global_batch,
        "max_seq_length": args.max_seq_length,
        "mask_prompt": bool(args.mask_prompt),
        "train_examples": train_examples,
    }
    normalised: JsonObject = json.loads(json.dumps(values))
    return normalised


def build(*, global_step: int, optimizer_step: int, mlx_key: list[int], epoch: int, index: int,
          batches_per_epoch: int, world_size: int, batch_size: int, grad_accumulation_steps: int,
          trained_tokens: int, options: JsonObject, skipped: int = 0) -> TrainerState:
    return {
        "format": FORMAT,
        "version": VERSION,
        "global_step": global_step,
        "optimizer_step": optimizer_step,
        "rng": {"mlx_key": [int(k) for k in mlx_key]},
        # The order itself is a pure function of (seed, epoch, global batch, data set): see data.py.
        "data": {"epoch": epoch, "index": index, "batches_per_epoch": batches_per_epoch, "skipped": skipped},
        "world_size": world_size,
        "batch_size": batch_size,
        "grad_accumulation_steps": grad_accumulation_steps,
        "trained_tokens": trained_tokens,
        "options": options,
    }


def encode(state: TrainerState) -> dict[str, str]:
    """The safetensors metadata entry for a state."""
    return {METADATA_KEY: json.dumps(state, sort_keys=True)}


def decode(metadata: dict[str, str], path: str) -> TrainerState | None:
    """The state in a checkpoint's metadata, or None for a file without one (plain mlx-lm adapters)."""
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        return None
    try:
        state = json.loads(raw)
    except ValueError as exc:
        raise StateError(f"{path}: {METADATA_KEY} is not valid JSON: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise StateError(f"{path}: {METADATA_KEY} is not a coord trainer state")
    if state.get("version") != VERSION:
        raise StateError(f"{path}: trainer state version {state.get('version')!r} is not supported "
                         f"(this trainer reads version {VERSION})")
    for key, kind in (("global_step", int), ("optimizer_step", int), ("rng", dict), ("data", dict),
                      ("options", dict), ("world_size", int), ("trained_tokens", int)):
        if not isinstance(state.get(key), kind):
            raise StateError(f"{path}: trainer state has no valid {key!r}")
    key = state["rng"].get("mlx_key")
    if not (isinstance(key, list) and len(key) == 2 and all(isinstance(k, int) and 0 <= k < 2**32 for k in key)):
        raise StateError(f"{path}: trainer state has no valid RNG key")
    # What a resume reads is checked above (the data position by check_data_position).
    return cast("TrainerState", state)


def check_compatible(state: TrainerState, options: JsonObject, path: str) -> None:
    """Refuse a checkpoint whose fixed options differ from this run's."""
    saved = state["options"]
    differences = [f"{name}: checkpoint {saved.get(name)!r}, this run {options.get(name)!r}"
                   for name in FIXED_OPTIONS if saved.get(name) != options.get(name)]
    if differences:
        raise StateError(f"{path} was written with other training options; an exact resume needs the same "
                         "ones (batch size and accumulation may change if the global batch stays):\n  "
                         + "\n  ".join(differences))


def check_data_position(state: TrainerState, batches_per_epoch: int, path: str) -> None:
    """The saved data position must be where this run's order puts the saved step."""
    data = state["data"]
    skipped = data.get("skipped", 0)
    if not isinstance(skipped, int) or isinstance(skipped, bool) or skipped < 0:
        raise StateError(f"{path}: data position has no valid count of skipped batches: {skipped!r}")
    expected = divmod(state["global_step"] + skipped, batches_per_epoch)
    if (data.get("epoch"), data.get("index")) != expected or data.get("batches_per_epoch") != batches_per_epoch:
        raise StateError(f"{path}: data position epoch {data.get('epoch')}, index {data.get('index')} "
                         f"({data.get('batches_per_epoch')} batches per epoch) does not match step "
                         f"{state['global_step']} with {batches_per_epoch} batches per epoch")
