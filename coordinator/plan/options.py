"""A plan's job options: what the user asked for, checked, and every option's value with where it comes from
(given, or the default of the tool that applies it)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeGuard

from coordinator.jobs.spec import REPLICA_HEAD, REPLICA_NONE, JobSpec
from coordinator.launch.trainers import TRAINERS

FINE_TUNE_TYPES = ("lora", "dora", "full")
OPTIMIZERS = ("adam", "adamw", "muon", "sgd", "adafactor")  # what mlx_lm lora accepts
ADAM_FAMILY = ("adam", "adamw")
LR_SCALING_RULES = ("linear", "sqrt")
# gzip -6 was measured on real checkpoints and does not pay (bench/replication.py): copies are uncompressed.
COMPRESSIONS = ("none",)
_JOB_DEFAULTS = {f.name: f.default for f in fields(JobSpec)}

#: {option: (value, where it comes from)}, for every field of :class:`JobOptions` (values of several types).
ResolvedOptions = dict[str, tuple[Any, str]]


class PlanInputError(ValueError):
    """A job option the plan cannot use; the message names the option."""


@dataclass(frozen=True)
class JobOptions:
    """What the user asked for; ``None`` means "not given", and the plan says which
    default it used instead (mlx-lm's or coord run's, named in the sources)."""

    fine_tune_type: str | None = None
    per_rank_batch_size: int | None = None  # None: the sizing result's, else the batch section says why not
    gradient_accumulation_steps: int | None = None
    learning_rate: float | None = None  # the base rate, before scaling
    base_batch_size: int | None = None  # the batch the base rate was tuned for; None: one rank's batch
    optimizer: str | None = None
    lr_scaling: str | None = None  # "linear" | "sqrt" (Adam family only)
    warmup_steps: int | None = None
    save_every: int | None = None
    keep: int | None = None
    max_restarts: int | None = None
    trainer: str | None = None  # "mlx_lm" | "coord" (exact resume)
    replica: str | None = None  # where each checkpoint is copied: "head", "none" or a node's name
    min_nodes: int | None = None  # elastic shrink down to this many nodes; None: every node
    node_timeout: float | None = None  # seconds a lost node is waited for before it may be left out
    compression: str | None = None
    force: bool = False  # launch despite a failed pre-flight


def resolve_options(options: JobOptions, nodes: Sequence[str],
                    sizing: Mapping[str, Any] | None = None) -> ResolvedOptions:
    """Every option's value and its source: given, or the default of the tool that applies it."""
    validate_options(options, nodes)
    defaults: dict[str, tuple[Any, str]] = {
        "fine_tune_type": ("lora", "mlx-lm's default --fine-tune-type lora"),
        "gradient_accumulation_steps": (1, "mlx-lm's default --grad-accumulation-steps 1"),
        "learning_rate": (1e-5, "mlx-lm's default --learning-rate 1e-5"),
        "optimizer": ("adam", "mlx-lm's default --optimizer adam"),
        "lr_scaling": ("linear", "coord's default rule (linear scaling)"),
        "warmup_steps": (0, "not given: no warmup (mlx-lm has none unless its lr_schedule sets one)"),
        "save_every": (_JOB_DEFAULTS["save_every"], f"coord run's default --save-every {_JOB_DEFAULTS['save_every']}"),
        "keep": (_JOB_DEFAULTS["keep"], f"coord run's default --keep {_JOB_DEFAULTS['keep']}"),
        "max_restarts": (_JOB_DEFAULTS["max_restarts"],
                         f"coord run's default --max-restarts {_JOB_DEFAULTS['max_restarts']}"),
        "compression": ("none", "measured: gzip -6 saves 7.7% of a real 42 MB mlx-lm checkpoint at 30 MB/s and "
                                "8.6% of a 126 MB one of coord's trainer at 21 MB/s, so it pays only on links "
                                "slower than about 2 MB/s (bench/replication.py); checkpoints and "
                                "their replicas stay uncompressed safetensors"),
        "trainer": (_JOB_DEFAULTS["trainer"], f"coord run's default --trainer {_JOB_DEFAULTS['trainer']}"),
        "replica": (_JOB_DEFAULTS["replica"], f"coord run's default --replica {_JOB_DEFAULTS['replica']}"),
        "min_nodes": (None, "coord run's default: every node, no elastic shrink"),
        "node_timeout": (_JOB_DEFAULTS["node_timeout"],
                         f"coord run's default --node-timeout {_JOB_DEFAULTS['node_timeout']:g}"),
        "base_batch_size": (None, "rule: the base rate is for one rank's batch (no accumulation)"),
        "per_rank_batch_size": (None, "not given, and no model was sized"),
    }
    if sizing and positive_int(sizing.get("per_rank_batch_size")):
        defaults["per_rank_batch_size"] = (int(sizing["per_rank_batch_size"]),
                                           f"sizing: {sizing.get('source') or 'largest batch that fits every node'}")
    resolved = {}
    for name, (default, source) in defaults.items():
        given = getattr(options, name)
        resolved[name] = (given, f"job option {name} = {given}") if given is not None else (default, source)
    resolved["force"] = (options.force, "job option force" if options.force else "coord run's default (no --force)")
    return resolved


def validate_options(options: JobOptions, nodes: Sequence[str]) -> None:
    """Refuse options no trainer could follow, naming the option."""
    def choice(name: str, allowed: Sequence[str]) -> None:
        value = getattr(options, name)
        if value is not None and value not in allowed:
            raise PlanInputError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")

    choice("fine_tune_type", FINE_TUNE_TYPES)
    choice("optimizer", OPTIMIZERS)
    choice("lr_scaling", LR_SCALING_RULES)
    choice("compression", COMPRESSIONS)
    choice("trainer", tuple(TRAINERS))
    choice("replica", (REPLICA_HEAD, REPLICA_NONE, *nodes))
    for name in ("per_rank_batch_size", "gradient_accumulation_steps", "base_batch_size", "save_every", "keep",
                 "min_nodes"):
        value = getattr(options, name)
        if value is not None and not positive_int(value):
            raise PlanInputError(f"{name} must be a whole number ≥ 1, got {value!r}")
    for name in ("warmup_steps", "max_restarts"):
        value = getattr(options, name)
        if value is not None and not _whole_number(value, 0):
            raise PlanInputError(f"{name} must be a whole number ≥ 0, got {value!r}")
    if options.min_nodes is not None and options.min_nodes > len(nodes):
        raise PlanInputError(f"min_nodes {options.min_nodes} is more than the {len(nodes)} nodes of the cluster")
    for name in ("learning_rate", "node_timeout"):
        value = getattr(options, name)
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and math.isfinite(value) and value > 0):
            raise PlanInputError(f"{name} must be a number > 0, got {value!r}")
    if options.lr_scaling == "sqrt" and (options.optimizer or "adam") not in ADAM_FAMILY:
        raise PlanInputError(f"lr_scaling 'sqrt' is for Adam-family optimizers ({', '.join(ADAM_FAMILY)}); "
                             f"{options.optimizer} scales linearly")


def _whole_number(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def positive_int(value: Any) -> TypeGuard[int]:
    return _whole_number(value, 1)
