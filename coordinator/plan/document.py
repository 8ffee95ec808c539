"""The version 2.0.0 training plan: what coord would run, derived from what it measured.

``build_plan(inputs)`` is a pure function of plain data the daemon already holds (node
facts, calibration records, the backend chosen from the measured links, the consistency
report, the pre-flight result, the launch command, past job timings) and the job's
options. The sections and field names follow the format (``../shared/formats``); coord
adds to every section:

- ``"sources"``: ``{field: where its value comes from}``: a measurement (which node,
  when, what was measured) or a stated rule (``"rule: total = per-rank × ranks × ..."``);
- ``"missing"``: ``{field: why it is not filled}``, for a format field coord cannot fill.

A section that cannot be filled at all is ``{"enabled": false, "reason": ...}``, and the
reason names the command that fills it. Nothing is guessed: no value without a source.
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any

from agent.qos import qos_for_platform
from coordinator.config.cluster_file import NodeConfig
from coordinator.jobs import robust
from coordinator.jobs.policy import MAX_BACKOFF_S, backoff, restart_delay
from coordinator.jobs.spec import REPLICA_HEAD, REPLICA_NONE, TRAINERS, JobSpec, is_mlx_lm
from coordinator.readiness.calibration import is_stale, train_rate, workload_shares

VERSION = "2.0.0"
SECTIONS = ("strategy", "batch_configuration", "distributed_config", "rdma_config", "checkpoint_strategy",
            "performance_targets", "verification_steps", "pre_rdma_sync", "hardware_calibration",
            "worker_consistency", "coordinator_chunking", "pre_flight_checklist")
FINE_TUNE_TYPES = ("lora", "dora", "full")
OPTIMIZERS = ("adam", "adamw", "muon", "sgd", "adafactor")  # what mlx_lm lora accepts
ADAM_FAMILY = ("adam", "adamw")
LR_SCALING_RULES = ("linear", "sqrt")
# gzip -6 was measured on real checkpoints and does not pay (bench/replication.py): copies are uncompressed.
COMPRESSIONS = ("none",)
#: The pre-flight layers under the names the plan format gives its checklist entries.
CHECKLIST_NAMES = {"health": "health_check", "hardware": "hardware_layer", "worker": "worker_layer",
                   "worker_consistency": "worker_consistency", "pre_rdma_sync": "pre_rdma_sync",
                   "checkpoint": "checkpoint_layer", "gradient": "gradient_layer",
                   "performance": "performance_layer"}
#: What the plan says about each trainer ``coord run --trainer`` offers, from its code.
TRAINER_FACTS = {
    "mlx_lm": {
        "name": "mlx-lm's trainer (mlx_lm/tuner/trainer.py)",
        "gradient_sync": "all-reduce mean of the gradients once per optimizer step (mlx.nn.average_gradients, "
                         "after the accumulation steps)",
        "async": False,
        "saving": "rank 0 saves inside the training loop (mx.save_safetensors); the other ranks wait for it at "
                  "the next gradient all-reduce",
        "contents": "trainable parameters only (the adapters, or every weight of a full fine-tune): no optimizer "
                    "state, so the optimizer's moments, the LR schedule and the data order start again at a resume",
        "sharding": "every micro-batch is split over the {ranks} ranks: rank r takes examples r, r + {ranks}, … of "
                    "it",
    },
    "coord": {
        "name": "coord's trainer (python -m agent.train, agent/trainer)",
        "gradient_sync": "all_sum over the ranks of the token-loss gradients and token counts, divided by the global "
                         "token count, once per optimizer step",
        "async": True,
        "saving": "the training thread copies the arrays to host memory; one background thread writes the file",
        "contents": "trainable parameters, the optimizer state, and the LR schedule position, RNG key and data "
                    "position: a resume continues exactly where the run stopped",
        "sharding": "each optimizer step's global batch is a fixed slice of a seeded shuffle; every micro-batch "
                    "is split over the {ranks} ranks in contiguous slices",
    },
}
#: mlx.launch's default port for the jaccl coordinator (rank 0).
JACCL_PORT = 32323
CALIBRATION_MODEL = "coord's calibration model, a 2-layer width-64 transformer at sequence length 32"
_JOB_DEFAULTS = {f.name: f.default for f in fields(JobSpec)}


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


@dataclass(frozen=True)
class MeasuredTimings:
    """Seconds measured on this cluster (see :func:`timings_from_events`); empty: none yet."""

    launch_to_first_step_s: tuple[float, ...] = ()
    recovery_s: tuple[float, ...] = ()  # a failed attempt seen → the next attempt's first step
    stop_s: tuple[float, ...] = ()  # stopping every rank of an attempt, confirmed
    checkpoint_place_s: tuple[float, ...] = ()  # copying the resume checkpoint to every node
    step_s: float | None = None  # seconds per optimizer step of this job, from its record
    checkpoint_save_s: float | None = None  # seconds one checkpoint write costs a step


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan is made from, as the daemon holds it. Only ``nodes`` is required:
    each input left out makes the sections that need it say why they are empty."""

    nodes: tuple[NodeConfig, ...]
    facts: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict)
    calibrations: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict)
    backend: Mapping[str, Any] | None = None  # choose_backend() / plan_backend()'s choice
    backend_error: str | None = None
    hostfile: Mapping[str, Any] | None = None  # coordinator.launch.hostfile.build_hostfile() document
    hostfile_path: str | None = None
    launch_argv: Sequence[str] | None = None  # the exact mlx.launch argv
    launch_env: Mapping[str, str] | None = None  # what coord adds to mlx.launch's environment
    training_command: Sequence[str] | None = None  # the job's command, as each rank runs it
    job_name: str | None = None
    consistency: Mapping[str, Any] | None = None  # coordinator.readiness.consistency.compare_nodes() of the code
    preflight: Mapping[str, Any] | None = None  # run_preflight()'s result
    sync_hook: str | None = None  # the cluster file's sync.hook
    keepalive_s: float | None = None  # the cluster file's ssh.keepalive_s
    timings: MeasuredTimings = MeasuredTimings()
    sizing: Mapping[str, Any] | None = None  # keys: per_rank_batch_size, checkpoint_bytes,
    #                                          memory_per_rank_bytes, source
    dataset: Mapping[str, Any] | None = None  # keys: examples, chunks, chunk_size, source,
    #                                           memory_management?, progress_reporting?
    options: JobOptions = JobOptions()
    # A job's replica checks (coordinator.jobs.fingerprints.comparison_summary) and its name
    replica_check: Mapping[str, Any] | None = None


# --- options ----------------------------------------------------------------------------------


def resolve_options(options: JobOptions, nodes: Sequence[str],
                    sizing: Mapping[str, Any] | None = None) -> dict[str, tuple[Any, str]]:
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
    if sizing and _positive_int(sizing.get("per_rank_batch_size")):
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
    choice("trainer", TRAINERS)
    choice("replica", (REPLICA_HEAD, REPLICA_NONE, *nodes))
    for name in ("per_rank_batch_size", "gradient_accumulation_steps", "base_batch_size", "save_every", "keep",
                 "min_nodes"):
        value = getattr(options, name)
        if value is not None and not _positive_int(value):
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


# --- measured timings -------------------------------------------------------------------------

_FAILED_OUTCOMES = ("rank_failed", "node_lost", "hung", "launch_failed")


def timings_from_events(events: Sequence[Mapping[str, Any]]) -> MeasuredTimings:
    """Launch, recovery, stop and checkpoint-placement seconds from the daemon's job events
    (``StateStore.recent_events``, oldest first). A recovery runs from an attempt that
    ended in failure to the first step of that job's next attempt. Events name their job
    in the message prefix (``"JOB: ..."``; job names cannot hold ``": "``)."""
    launch, recovery, stopping, placing, held, steps = [], [], [], [], [], []
    failed_at: dict[str, float] = {}
    for event in events:
        kind, data = event.get("kind", ""), event.get("data") or {}
        job = str(event.get("message", "")).split(": ", 1)[0]
        if kind == "job.first_step":
            if isinstance(data.get("seconds"), (int, float)):
                launch.append(float(data["seconds"]))
            if job in failed_at:
                recovery.append(round(event["ts"] - failed_at.pop(job), 3))
        elif kind == "job.attempt_ended" and data.get("outcome") in _FAILED_OUTCOMES:
            failed_at[job] = event["ts"]
        elif kind in ("job.failed", "job.stopped", "job.succeeded"):
            failed_at.pop(job, None)
        elif kind == "job.stopped_ranks" and isinstance(data.get("seconds"), (int, float)):
            stopping.append(float(data["seconds"]))
        elif kind == "job.checkpoint_placed" and isinstance(data.get("seconds"), (int, float)):
            placing.append(float(data["seconds"]))
        elif kind == "job.checkpoint_saved" and isinstance(data.get("blocking_seconds"), (int, float)):
            # coord's trainer: what a save held training, and the step time when it did
            held.append(float(data["blocking_seconds"]))
            if isinstance(data.get("step_seconds"), (int, float)) and data["step_seconds"] > 0:
                steps.append(float(data["step_seconds"]))
    return MeasuredTimings(tuple(launch), tuple(recovery), tuple(stopping), tuple(placing),
                           step_s=statistics.median(steps) if steps else None,
                           checkpoint_save_s=statistics.median(held) if held else None)


# --- what several sections share --------------------------------------------------------------


def rank_order(inputs: PlanInputs) -> tuple[list[str], str]:
    """The nodes in rank order, and why that order."""
    choice = inputs.backend
    if choice and choice.get("ok") and choice.get("order"):
        return list(choice["order"]), f"rank order of the {choice['backend']} backend chosen from the measured links"
    return [node.name for node in inputs.nodes], "cluster file order (no backend chosen yet)"


def usable_calibrations(inputs: PlanInputs, order: Sequence[str]) -> tuple[dict[str, Mapping], dict[str, str]]:
    """({node: current calibration record with a training rate}, {node: why it has none})."""
    usable, lacking = {}, {}
    for name in order:
        record, facts = inputs.calibrations.get(name), inputs.facts.get(name)
        if not record:
            lacking[name] = "no calibration yet"
            continue
        if facts is None:
            lacking[name] = "its facts are unknown, so its calibration cannot be checked: is the node up?"
            continue
        stale, why = is_stale(record, facts, refresh=False)
        if stale:
            lacking[name] = why
        elif train_rate(record) is None:
            lacking[name] = "its calibration has no training-step rate"
        else:
            usable[name] = record
    return usable, lacking


def calibration_source(name: str, record: Mapping[str, Any]) -> str:
    result = record.get("result") or {}
    return (f"calibration {utc(record.get('measured_at'))} on {name}: {train_rate(record):.4g} samples/s "
            f"({result.get('device') or 'device unknown'})")


def split_batch(batch: int, shares: Mapping[str, float]) -> dict[str, int]:
    """``batch`` samples split by ``shares`` in whole samples (largest remainders first)."""
    exact = {name: batch * share for name, share in shares.items()}
    split = {name: math.floor(value) for name, value in exact.items()}
    left = batch - sum(split.values())
    for name in sorted(exact, key=lambda n: exact[n] - split[n], reverse=True)[:left]:
        split[name] += 1
    return split


def scale_learning_rate(base_rate: float, total_batch: int, base_batch: int, rule: str) -> float:
    """``linear``: base × total / base batch (Goyal et al., 2017); ``sqrt``: base × √(total /
    base batch), the rule for Adam-family optimizers (Malladi et al., 2022)."""
    factor = total_batch / base_batch
    scaled = base_rate * (math.sqrt(factor) if rule == "sqrt" else factor)
    return float(f"{scaled:.6g}")


def expected_recovery(inputs: PlanInputs) -> tuple[float | None, str]:
    """Seconds from a failure being seen to training again, and how that was found."""
    timings = inputs.timings
    if timings.recovery_s:
        return (round(statistics.median(timings.recovery_s), 1),
                f"measured: median of {_count(timings.recovery_s, 'recovery', 'recoveries')} on this cluster "
                "(failed attempt seen → first step of the next attempt)")
    if not timings.launch_to_first_step_s:
        return None, ("no job has reached its first step on this cluster yet; run one (coord run, or coord demo "
                      "on this machine) and the plan uses the measured launch and recovery times")
    total = restart_delay(0)
    parts = ["first restart at once (coord's restart policy)" if not total else
             f"first restart backoff {total:g} s (coord's restart policy)"]
    for measured, what in ((timings.stop_s, "stopping every rank"), (timings.checkpoint_place_s,
                                                                     "copying the checkpoint to every node"),
                           (timings.launch_to_first_step_s, "launch to first step")):
        if measured:
            total += statistics.median(measured)
            parts.append(f"{what} {statistics.median(measured):.1f} s (median of {_count(measured, 'run', 'runs')})")
        else:
            parts.append(f"{what} not included (not measured yet)")
    return round(total, 1), "estimate: " + " + ".join(parts)


def trainer_of(inputs: PlanInputs, options: Mapping[str, tuple[Any, str]]) -> tuple[dict[str, Any] | None, str]:
    """(TRAINER_FACTS of the trainer the ranks run, why that one); None for a script of the user's own."""
    command = list(inputs.training_command or [])
    if command and not is_mlx_lm(command):
        return None, "the training command is a script of its own, not mlx_lm lora"
    if "agent.train" in command[:3]:
        return TRAINER_FACTS["coord"], "the training command runs agent.train"
    trainer, source = options["trainer"]
    facts = TRAINER_FACTS[trainer]
    if not command:
        source += "; no training command given, so mlx_lm lora's options are assumed"
    return facts, f"{facts['name']}; {source}"


def utc(timestamp: Any) -> str:
    if not isinstance(timestamp, (int, float)):
        return "(time unknown)"
    return time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(timestamp))


def _whole_number(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _positive_int(value: Any) -> bool:
    return _whole_number(value, 1)


def _count(items: Sequence[Any], one: str, many: str) -> str:
    return f"{len(items)} {one if len(items) == 1 else many}"


def disabled_section(reason: str, **extra: Any) -> dict[str, Any]:
    return {"enabled": False, "reason": reason, **extra}


class Section:
    """A section being filled: each value with its source, each unfillable field with why."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.sources: dict[str, str] = {}
        self.missing: dict[str, str] = {}

    def put(self, name: str, value: Any, source: str) -> None:
        self.values[name] = value
        self.sources[name] = source

    def lack(self, name: str, why: str) -> None:
        self.missing[name] = why

    def done(self, *, flagged: bool = False) -> dict[str, Any]:
        """The section; ``flagged`` sections carry ``"enabled": true`` as the format shows them."""
        if not self.sources:
            reasons = "; ".join(f"{name}: {why}" for name, why in self.missing.items())
            return disabled_section(reasons or "nothing measured")
        out = {**({"enabled": True} if flagged else {}), **self.values, "sources": self.sources}
        if self.missing:
            out["missing"] = self.missing
        return out


# --- the sections -----------------------------------------------------------------------------


def strategy_section(inputs: PlanInputs, options: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    if not inputs.nodes:
        return disabled_section("no nodes in the cluster file")
    order, order_source = rank_order(inputs)
    fine_tune, fine_tune_source = options["fine_tune_type"]
    section = Section()
    section.put("approach", f"MLX data parallel, {fine_tune} fine-tune: one rank per node, every rank holds the "
                f"whole model; {_transport_text(inputs)}",
                f"{fine_tune_source}; backend: {_backend_source(inputs)}")
    section.put("total_gpus", len(order), f"rule: one MLX rank per node × {len(order)} nodes (a 'gpu' of the "
                "format is an MLX rank here)")
    section.put("nodes", len(order), "cluster file: " + ", ".join(order))
    section.put("gpus_per_node", 1, "rule: coord's hostfile lists each node once, so mlx.launch starts one rank "
                "per node, which uses all of the node's GPU (or CPU)")
    section.put("rank_order", order, order_source)
    section.put("fine_tune_type", fine_tune, fine_tune_source)
    return section.done()


def batch_section(inputs: PlanInputs, options: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    per_rank, per_rank_source = options["per_rank_batch_size"]
    if per_rank is None:
        return disabled_section("no per-rank batch size: give one (per_rank_batch_size) or a model to size "
                         "(coord plan --model DIR)")
    ranks = len(rank_order(inputs)[0])
    accumulation, accumulation_source = options["gradient_accumulation_steps"]
    step_batch = per_rank * ranks
    total = step_batch * accumulation
    base_rate, base_rate_source = options["learning_rate"]
    base_batch, base_batch_source = options["base_batch_size"]
    base_batch = base_batch or per_rank
    rule, rule_source = options["lr_scaling"]
    optimizer, optimizer_source = options["optimizer"]
    section = Section()
    section.put("per_gpu_batch_size", per_rank, per_rank_source)
    section.put("total_batch_size", total,
                f"rule: total = per-rank × ranks × accumulation = {per_rank} × {ranks} × {accumulation}")
    section.put("gradient_accumulation_steps", accumulation, accumulation_source)
    formula = (f"{base_rate:g} × {total} / {base_batch}" if rule == "linear"
               else f"{base_rate:g} × √({total} / {base_batch})")
    section.put("learning_rate", scale_learning_rate(base_rate, total, base_batch, rule),
                f"rule: {rule} scaling of the base rate to the total batch: {formula}")
    section.put("base_learning_rate", base_rate, base_rate_source)
    section.put("base_batch_size", base_batch, base_batch_source)
    section.put("lr_scaling", rule, rule_source)
    section.put("optimizer", optimizer, optimizer_source)
    section.put("mlx_lm_batch_size", step_batch,
                f"rule: mlx-lm splits its --batch-size over the ranks (rank r takes examples r, r + {ranks}, "
                f"r + {2 * ranks}, … of each batch, so it must be divisible by {ranks}): per-rank × ranks = "
                f"{per_rank} × {ranks}")
    warmup, warmup_source = options["warmup_steps"]
    section.put("warmup_steps", warmup, warmup_source + "; mlx-lm takes it as lr_schedule.warmup in its --config file")
    examples = (inputs.dataset or {}).get("examples")
    if _positive_int(examples):
        section.put("warmup_epochs", round(warmup * total / examples, 4),
                    f"rule: warmup steps × total batch / examples = {warmup} × {total} / {examples} "
                    f"({inputs.dataset.get('source') or 'data set'})")
    else:
        section.lack("warmup_epochs", "the number of training examples is unknown (coord plan --data DIR)")
    return section.done()


def distributed_section(inputs: PlanInputs, options: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    if not inputs.launch_argv:
        return disabled_section(f"no launch command: {inputs.backend_error or 'no hostfile could be written'} "
                         "(coord hostfile says why)")
    order, _ = rank_order(inputs)
    backend = (inputs.backend or {}).get("backend") or (inputs.hostfile or {}).get("backend")
    mlx_version = _common_fact(inputs, order, "mlx_version")
    section = Section()
    section.put("mlx_launch_command", shlex.join(inputs.launch_argv),
                "coord's launcher: mlx.launch (run as coordinator.launch.mlx_launch where the head's Python has mlx: "
                "the same main(), without its busy output loops) with the hostfile coord writes; each rank runs "
                "its node's rank "
                "script (~/.coord/jobs/JOB/rank-$MLX_RANK.sh), which enters the node's workdir and runs the "
                "training command with the node's Python")
    if inputs.hostfile_path:
        section.put("hostfile", inputs.hostfile_path, f"coord hostfile ({backend} backend, from the measured links)")
    if inputs.launch_env:
        section.put("launch_environment", dict(inputs.launch_env),
                    "coord: its ssh wrapper first on PATH, so ranks reach nodes with the cluster file's ssh settings")
    if inputs.training_command:
        section.put("training_command", shlex.join(inputs.training_command),
                    "the job's command; a leading 'python' is each node's own Python")
    section.put("ranks", [_rank_entry(inputs, rank, name) for rank, name in enumerate(order)],
                "cluster file: each node's user, host, Python and workdir")
    trainer, trainer_source = trainer_of(inputs, options)
    if trainer is None:
        section.lack("gradient_sync", f"the training script syncs its gradients itself ({trainer_source})")
    else:
        section.put("gradient_sync", trainer["gradient_sync"],
                    f"{trainer_source}; mlx-lm {_common_fact(inputs, order, 'mlx_lm_version')} on the nodes")
    unified, unified_source = _unified_memory(inputs, order)
    if unified is None:
        section.lack("unified_memory", unified_source)
    else:
        section.put("unified_memory", unified, unified_source)
    if backend:
        section.put("mlx_env_vars", mlx_rank_environment(backend, inputs.hostfile),
                    f"mlx.launch of mlx {mlx_version} for the {backend} backend, the hostfile's envs, and coord's "
                    "rank script")
    else:
        section.lack("mlx_env_vars", "no backend chosen yet")
    return section.done()


def mlx_rank_environment(backend: str, hostfile: Mapping[str, Any] | None) -> dict[str, str]:
    """What every rank finds in its environment, by who sets it (mlx 0.32's launcher)."""
    env = {"MLX_RANK": "this rank's index, 0 … ranks − 1 (mlx.launch)"}
    if backend == "ring":
        env["MLX_HOSTFILE"] = "a file with every rank's ip:port for the TCP ring (written by mlx.launch)"
    else:
        env["MLX_JACCL_COORDINATOR"] = f"rank 0's address:{JACCL_PORT}, where the ranks meet (mlx.launch)"
        env["MLX_IBV_DEVICES"] = "a file with the RDMA device each rank uses toward each other rank (mlx.launch)"
        if backend == "jaccl-ring":
            env["MLX_JACCL_RING"] = "1 (mlx.launch: RDMA links form a ring, not a mesh)"
    for entry in (hostfile or {}).get("envs") or []:
        name, value = entry.split("=", 1)
        env[name] = f"{value} (the hostfile's envs)"
    env["TMPDIR"] = "<workdir>/.coord/tmp: one per node, so MLX's compiled CPU kernels never collide (coord)"
    env["COORD_RANK"] = ("this rank (coord); COORD_JOB, COORD_ATTEMPT, COORD_CHECKPOINT_DIR and the rest: "
                         "see docs/script-contract.md")
    return env


def rdma_section(inputs: PlanInputs) -> dict[str, Any]:
    order, _ = rank_order(inputs)
    versions = {name: (inputs.facts.get(name) or {}).get("os_version") for name in order}
    choice = inputs.backend
    if not choice:
        return disabled_section(f"no backend chosen: {inputs.backend_error or 'no topology measured'} (coord hostfile)")
    fixes = [dict(fix) for fix in choice.get("fixes") or []]
    if choice.get("transport") != "rdma":
        why = (choice.get("error") or "; ".join(choice.get("reasons") or [])
               or f"the {choice.get('backend')} backend does not use RDMA")
        extra = {"backend": choice.get("backend"), "os_versions": versions, "fixes": fixes}
        if fixes:
            extra["setup"] = "; ".join(f"{fix['node']}: {fix['instruction']}" for fix in fixes)
        return disabled_section(why, **extra)
    links = rdma_links(choice)
    speeds = sorted({link["speed_gbps"] for link in links if link["speed_gbps"]})
    generations = sorted({link["generation"] for link in links if link["generation"]})
    section = Section()
    section.put("platform", ", ".join(f"{_platform_of(inputs, name)} on {name}" for name in order)
                + "; " + (", ".join(f"Thunderbolt {g}" for g in generations) or "Thunderbolt")
                + (f" at {', '.join(f'{s:g}' for s in speeds)} Gb/s" if speeds else ""),
                "node facts (sw_vers) and system_profiler SPThunderboltDataType on each node")
    section.put("os_versions", versions, "node facts (sw_vers)")
    section.put("backend", choice["backend"], "coord topology: " + "; ".join(choice.get("reasons") or []))
    section.put("links", links, "topology: cables with reciprocal Thunderbolt domain UUIDs and an active RDMA "
                "port at both ends (ibv_devinfo)")
    section.put("env_vars", {name: value for name, value in
                             (entry.split("=", 1) for entry in (inputs.hostfile or {}).get("envs") or [])},
                "the hostfile's envs (coord sets none of its own for RDMA)")
    section.put("setup", "; ".join(f"{fix['node']}: {fix['instruction']}" for fix in fixes)
                or "nothing to do: RDMA is enabled and active on every link in use",
                "coord topology: rdma_ctl status, macOS version and Thunderbolt Bridge state on each node")
    section.lack("expected_speedup", "not measured: coord does not time the same job over TCP and RDMA")
    return section.done(flagged=True)


def rdma_links(choice: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each RDMA pair once: the two nodes, their devices, the cable's speed and generation."""
    links, seen = [], set()
    for host in choice.get("hosts") or []:
        for peer, toward in (host.get("toward") or {}).items():
            pair = tuple(sorted((host["node"], peer)))
            if not toward or not toward.get("rdma_device") or pair in seen:
                continue
            seen.add(pair)
            links.append({"nodes": [host["node"], peer],
                          "devices": [toward["rdma_device"], toward.get("peer_rdma_device")],
                          "speed_gbps": toward.get("speed_gbps"), "generation": toward.get("generation"),
                          "ip_link": toward.get("kind")})
    return links


def checkpoint_section(inputs: PlanInputs, options: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    if not inputs.nodes:
        return disabled_section("no nodes in the cluster file")
    order, _ = rank_order(inputs)
    rank0 = next(node for node in inputs.nodes if node.name == order[0])
    save_every, save_source = options["save_every"]
    keep, keep_source = options["keep"]
    restarts, restarts_source = options["max_restarts"]
    job = inputs.job_name or "JOB"
    trainer, trainer_source = trainer_of(inputs, options)
    section = Section()
    section.put("approach", f"resume from the newest valid checkpoint: a failed rank, lost node or hang stops every "
                f"rank on every node; the newest checkpoint whose SHA256 and safetensors header check out is used "
                f"from each node's own copy where the node holds one, copied only to the nodes that lack it, and "
                f"the job relaunches from its step (at most {restarts} restarts: the first at once, later ones "
                f"after {backoff(0):g} s doubling to {MAX_BACKOFF_S:g} s)", f"coord's supervisor; {restarts_source}")
    if trainer is None:
        section.lack("async", f"the training script writes its own checkpoints into COORD_CHECKPOINT_DIR "
                     f"({trainer_source})")
    else:
        section.put("async", trainer["async"], f"{trainer['saving']}: {trainer_source}")
        section.put("contents", trainer["contents"], trainer_source)
    section.put("compression", options["compression"][0], options["compression"][1])
    every_rank = options["trainer"][0] == "coord" and trainer is not None
    if every_rank:
        section.put("storage", f"every node: <workdir>/checkpoints/{job}/attempt-N/NNNNNNN_adapters.safetensors "
                    f"(rank 0's on {rank0.name}:{rank0.workdir})",
                    "coord's trainer: every rank writes the same file in its own node's workdir, one directory per "
                    "attempt; each copy is validated by its own SHA256 on its node")
    else:
        section.put("storage", f"{rank0.name}:{rank0.workdir}/checkpoints/{job}/attempt-N/NNNNNNN_adapters.safetensors",
                    "coord: rank 0 writes them in its node's workdir, one directory per attempt")
    replica, replica_source = options["replica"]
    section.put("replica", replica_text(replica, job), f"{replica_source}; coord's replicator "
                "(coordinator/jobs/replica.py)")
    section.put("frequency", f"every {save_every} steps", save_source)
    section.put("retention", f"last {keep} valid checkpoints", keep_source)
    with_optimizer = options["trainer"][0] == "coord" and trainer is not None
    size = (inputs.sizing or {}).get("checkpoint_bytes_with_optimizer" if with_optimizer else "checkpoint_bytes")
    section.put("copies", copies_text(trainer is not None and every_rank, options["trainer"][0], replica, keep),
                "coord's catalog (coordinator/jobs/catalog.py)")
    if _positive_int(size):
        section.put("checkpoint_bytes", size, f"sizing: {inputs.sizing.get('source') or 'trainable parameters'}"
                    + ("; plus the optimizer state coord's trainer saves" if with_optimizer else ""))
        on_every_node = every_rank or (replica != REPLICA_NONE and options["trainer"][0] == "mlx_lm"
                                       and trainer is not None)
        if on_every_node:
            section.put("disk_bytes_per_node", keep * size,
                        f"{keep} kept checkpoints x {size} bytes, on every node (retention removes every node's copy "
                        "of a checkpoint it removes)")
        if every_rank:
            section.put("host_memory_bytes_per_rank", size,
                        "coord's trainer: each rank copies the step's arrays (weights and optimizer state) to host "
                        "memory while its file is written, one save at a time")
    seconds, how = expected_recovery(inputs)
    if seconds is None:
        section.lack("expected_recovery_time", how)
    else:
        section.put("expected_recovery_time", f"{seconds:g} s", how)
        section.put("expected_recovery_seconds", seconds, how)
    return section.done()


def copies_text(every_rank: bool, trainer: str, replica: str, keep: int) -> str:
    """Where a checkpoint has copies, and what a resume copies."""
    if every_rank:
        return (f"every node holds its own copy of each of the last {keep} checkpoints (the ranks of a data parallel "
                "job hold the same weights, so their files are byte-identical): a resume copies nothing, except to "
                "a node that lacks the checkpoint (new, or down when it was written); "
                f"{keep} x the checkpoint size of disk on every node")
    if trainer == "mlx_lm" and replica != REPLICA_NONE:
        return ("rank 0 writes each checkpoint; the newest is copied in the background to every other node of the "
                "attempt (one verified stream), so a resume usually copies nothing; "
                f"at most {keep} x the checkpoint size of disk on every node")
    return "rank 0 writes each checkpoint; a resume copies it to every other node before the relaunch"


def replica_text(replica: str, job: str) -> str:
    if replica == REPLICA_NONE:
        return ("none: a checkpoint lives only on rank 0's node (with coord's trainer: on every node, each rank's "
                f"own copy) until a resume copies it to the nodes that lack it (<workdir>/checkpoints/{job}/replica/)")
    where = (f"the head's state directory (replicas/{job}/)" if replica == REPLICA_HEAD
             else f"{replica}'s workdir (checkpoints/{job}/replica/)")
    return (f"{replica}: each validated checkpoint is copied in the background to {where}, its SHA256 checked on "
            "arrival; a resume falls back to it when rank 0's copy is lost (when the head is a node's own machine "
            "and another node holds its own copy, that copy protects it and the head's is not made)")


def performance_section(inputs: PlanInputs, options: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    order, _ = rank_order(inputs)
    usable, lacking = usable_calibrations(inputs, order)
    section = Section()
    if lacking:
        section.lack("throughput", "no current calibration (coord calibrate): "
                     + "; ".join(f"{name}: {why}" for name, why in lacking.items()))
    else:
        rates = {name: train_rate(usable[name]) for name in order}
        slowest = min(rates, key=rates.get)
        equal = len(order) * rates[slowest]
        measured = "; ".join(calibration_source(name, usable[name]) for name in order)
        section.put("throughput", f"{equal:,.0f} samples/s of {CALIBRATION_MODEL}; a larger model is slower in "
                    "proportion to its compute per sample",
                    f"rule: equal split (mlx-lm) paces every step at the slowest rank: ranks × slowest rate = "
                    f"{len(order)} × {rates[slowest]:.4g} ({slowest}); gradient sync not included; {measured}")
        section.put("throughput_samples_per_s", round(equal, 2), "rule: ranks × slowest rate, as for throughput")
        section.put("throughput_if_split_by_rate", round(sum(rates.values()), 2),
                    "rule: sum of the measured rates, if each rank's batch were proportional to its rate")
    section.lack("gpu_utilization", "not measured: coord does not sample GPU utilization")
    save_every = options["save_every"][0]
    timings = inputs.timings
    if timings.checkpoint_save_s is not None and timings.step_s:
        overhead = timings.checkpoint_save_s / (save_every * timings.step_s + timings.checkpoint_save_s)
        section.put("checkpoint_overhead", f"{overhead:.1%}",
                    f"rule: save time / (save_every × step time + save time) = {timings.checkpoint_save_s:.2f} / "
                    f"({save_every} × {timings.step_s:.3f} + {timings.checkpoint_save_s:.2f}), measured")
    else:
        section.lack("checkpoint_overhead", "needs a measured checkpoint write time and step time from a run of "
                     "this job")
    return section.done()


def verification_steps(inputs: PlanInputs, options: dict[str, tuple[Any, str]]) -> list[str]:
    """What to check before and after the launch, with the commands that do it."""
    order, _ = rank_order(inputs)
    steps = [f"coord status --check: all {len(order)} nodes up ({', '.join(order)})",
             "coord sync: every node holds the same code, data and model files (SHA256; data line counts)"]
    preflight = inputs.preflight
    if preflight is None:
        steps.append("coord preflight: not run yet")
    else:
        checks = preflight.get("checks") or []
        steps.append(f"coord preflight: {len(checks)} checks over {len(preflight.get('layers') or {})} layers, "
                     f"now {preflight.get('status')}")
        steps += [f"fix {check['name']}: {check['fix_command']}" for check in checks
                  if check.get("status") == "fail" and check.get("fix_command")]
    _, lacking = usable_calibrations(inputs, order)
    if lacking:
        steps.append(f"coord calibrate: no current calibration for {', '.join(lacking)}")
    save_every = options["save_every"][0]
    steps.append(f"after step {save_every}: coord status shows the first checkpoint validated")
    steps.append("after the launch: coord logs --rank 0 JOB shows the loss falling on every attempt")
    return steps


def pre_rdma_sync_section(inputs: PlanInputs, options: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    if inputs.preflight is None:
        return disabled_section("pre-flight has not run: coord preflight")
    checks = [check for check in inputs.preflight.get("checks") or []
              if check.get("layer") in ("pre_rdma_sync", "worker_consistency")]
    if not checks:
        return disabled_section("pre-flight reported no sync or consistency checks")
    failing = [check for check in checks if check["status"] != "pass"]
    status = "fail" if any(c["status"] == "fail" for c in checks) else "warn" if failing else "pass"
    section = Section()
    section.put("sync_script", inputs.sync_hook or "coord sync (built in: hash every node, send what differs, "
                "verify each file's SHA256)", "cluster file sync.hook" if inputs.sync_hook else
                "cluster file: no sync.hook, so coord's own sync is the only step")
    section.put("validation_checks", [check["name"] for check in checks], "coord preflight checks of these layers")
    section.put("block_on_failure", not options["force"][0], "coord run refuses a failed pre-flight unless --force; "
                + options["force"][1])
    section.put("sync_status", status, "worst status of those checks (coord preflight)")
    section.put("sync_output", "; ".join(f"{c['name']}: {c['detail']}" for c in failing or checks),
                "coord preflight check details")
    return section.done()


def hardware_section(inputs: PlanInputs, options: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    order, _ = rank_order(inputs)
    usable, lacking = usable_calibrations(inputs, order)
    if not usable:
        return disabled_section("no current calibration: coord calibrate ("
                         + "; ".join(f"{name}: {why}" for name, why in lacking.items()) + ")")
    rates = {name: train_rate(usable[name]) for name in order if name in usable}
    shares = workload_shares({name: rates.get(name) for name in order})
    measured = "; ".join(calibration_source(name, usable[name]) for name in rates)
    section = Section()
    section.put("measured_performance", rates, f"training-step rate in samples/s of {CALIBRATION_MODEL}: {measured}")
    section.put("workload_distribution", {name: round(share, 4) for name, share in shares["shares"].items()},
                f"rule ({shares['policy']}): {shares['reason']}")
    section.put("measurements", {name: _measurement(usable[name]) for name in rates},
                "coord calibrate: each node's stored result (matmul, memory bandwidth, training step)")
    per_rank = options["per_rank_batch_size"][0]
    if per_rank is not None:
        step_batch = per_rank * len(order)
        section.put("batch_split", split_batch(step_batch, shares["shares"]),
                    f"rule: the step's {step_batch} samples split by the shares in whole samples; mlx-lm splits "
                    "equally whatever the rates, so this split needs a script that feeds each rank its own batch")
    if len(rates) >= robust.MIN_ITEMS:
        section.put("rate_outliers", robust.outliers(rates), "robust: Krum score of the rates (coordinator/plan/"
                    "robust.py: > 3 robust deviations above the median and more than 10% apart)")
    section.put("calibration_notes", shares["reason"] + (
        "; not calibrated: " + "; ".join(f"{name}: {why}" for name, why in lacking.items()) if lacking else ""),
        "coord calibrate's share policy")
    systems = {name: (inputs.facts.get(name) or {}).get("os") for name in order}
    qos = {name: qos_for_platform(system or "") for name, system in systems.items()}
    groups: dict[str, list[str]] = {}
    for name, q in qos.items():
        groups.setdefault(q["qos"] or q["reason"], []).append(name)
    section.put("macos_qos_api", "; ".join(f"{', '.join(names)}: {what}" for what, names in groups.items()),
                "coord's trainers (mlx_lm lora run by coord, and --trainer coord) set it on each rank's training "
                "thread; a script of your own gets it by calling agent.qos.set_user_interactive_qos() on its "
                "training thread: "
                + "; ".join(sorted({q["reason"] for q in qos.values()})))
    return section.done()


def consistency_section(inputs: PlanInputs) -> dict[str, Any]:
    report = inputs.consistency
    if report is None:
        return disabled_section("no consistency report: coord sync or coord preflight compares every node's code")
    hashes = dict(report.get("hashes") or {})
    majority, divergent = robust.majority_fingerprint(hashes)
    checks = [check["name"] for check in (inputs.preflight or {}).get("checks") or []
              if check.get("layer") == "worker_consistency"]
    section = Section()
    section.put("validation_checks", ["code_tree_sha256", "agreement_ratio_threshold", *checks],
                "coord sync's manifest comparison" + (" and coord preflight" if checks else ""))
    if majority is None:
        section.lack("script_hash", f"no code tree is held by a majority of the {len(hashes)} nodes")
    else:
        section.put("script_hash", majority, f"SHA256 tree hash of the code held by {len(hashes) - len(divergent)}"
                    f"/{len(hashes)} nodes")
    section.put("hashes", hashes, "SHA256 tree hash of each node's code (coord sync manifests)")
    section.put("is_consistent", report.get("status") == "pass", f"coord consistency: {report.get('detail')}")
    section.put("agreement_ratio", report.get("ratio"), "share of nodes holding the majority tree")
    section.put("consistency_threshold", report.get("threshold"), "cluster file sync.threshold")
    order, _ = rank_order(inputs)
    usable, _ = usable_calibrations(inputs, order)
    rates = {name: train_rate(record) for name, record in usable.items()}
    training = training_fingerprints(inputs.replica_check)
    section.put("byzantine_detection", {
        "enabled": True,
        "divergent_workers": divergent,
        "rate_outliers": robust.outliers(rates) if len(rates) >= robust.MIN_ITEMS else [],
        "krum_aggregation": "not used for training: ranks average gradients by all-reduce; Krum-style scores "
                            "only find replicas that differ (fingerprints by majority, rates by Krum score)",
        "training_fingerprints": training,
    }, "robust.majority_fingerprint over the code hashes; robust.outliers over the calibration rates"
       + ("; the weight fingerprints of job " + str(training["job"]) + "'s ranks, compared by majority as it trained"
          if training["enabled"] else ""))
    return section.done()


def training_fingerprints(check: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a job's replica checks found while it trained (coord's trainer, --fingerprint-every N)."""
    if not check or not check.get("steps_compared"):
        return {"enabled": False, "reason": "no job has compared its ranks' weights yet: coord's trainer does it "
                                            "with --fingerprint-every N (coord run --trainer coord)"}
    return {"enabled": True, "job": check.get("job"), "steps_compared": check["steps_compared"],
            "last_step": check.get("last_step"), "last_agreed_step": check.get("last_agreed"),
            "divergences": [f"attempt {d.get('attempt')}: {d.get('detail')} ({', '.join(d.get('nodes') or [])})"
                            for d in check.get("divergences") or []]}


def chunking_section(inputs: PlanInputs) -> dict[str, Any]:
    dataset = inputs.dataset
    if not dataset:
        return disabled_section("no data set given: coord plan --data DIR")
    source = f"data set report: {dataset.get('source') or 'the data directory'}"
    examples, size = dataset.get("examples"), dataset.get("chunk_size")
    if _positive_int(examples) and _positive_int(size) and examples < size and not dataset.get("chunks"):
        return disabled_section(f"{examples} examples: below the {size:,} at which coord validates and counts a "
                                f"data set in chunks, so it is read in one pass ({source})", examples=examples,
                                chunk_size=size)
    section = Section()
    for name, key in (("chunk_size", "chunk_size"), ("num_chunks", "chunks"), ("examples", "examples")):
        if _positive_int(dataset.get(key)):
            section.put(name, dataset[key], source)
        else:
            section.lack(name, "the data set report does not give it")
    for name in ("memory_management", "progress_reporting"):
        if dataset.get(name) is not None:
            section.put(name, dataset[name], source)
        else:
            section.lack(name, "the data set report does not give it")
    return section.done(flagged=True)


def checklist_section(inputs: PlanInputs, options: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    preflight = inputs.preflight
    if preflight is None:
        return disabled_section("pre-flight has not run: coord preflight")
    checks = preflight.get("checks") or []
    layers = [layer for layer in CHECKLIST_NAMES if any(c.get("layer") == layer for c in checks)]
    entries = []
    for layer in layers:
        own = [c for c in checks if c.get("layer") == layer]
        bad = [c for c in own if c["status"] != "pass"]
        status = "fail" if any(c["status"] == "fail" for c in own) else "warn" if bad else "pass"
        entry = {"name": CHECKLIST_NAMES[layer], "status": status, "checks": [c["name"] for c in own]}
        if bad:
            entry["detail"] = "; ".join(f"{c['name']}: {c['detail']}" for c in bad)
            fixes = [c["fix_command"] for c in bad if c.get("fix_command")]
            if fixes:
                entry["fix_command"] = "; ".join(fixes)
        entries.append(entry)
    section = Section()
    section.put("checks", entries, "coord preflight, grouped by layer (worst status of each layer's checks)")
    section.put("validation_layers", layers, "the layers coord preflight checked")
    section.put("block_on_failure", not options["force"][0], "coord run refuses a failed pre-flight unless --force; "
                + options["force"][1])
    section.put("overall_status", preflight.get("status"), "coord preflight")
    return section.done()


# --- the document -----------------------------------------------------------------------------


def build_plan(inputs: PlanInputs) -> dict[str, Any]:
    """The version 2.0.0 plan document; raises PlanInputError for unusable job options."""
    options = resolve_options(inputs.options, [node.name for node in inputs.nodes], inputs.sizing)
    return {
        "version": VERSION,
        "strategy": strategy_section(inputs, options),
        "batch_configuration": batch_section(inputs, options),
        "distributed_config": distributed_section(inputs, options),
        "rdma_config": rdma_section(inputs),
        "checkpoint_strategy": checkpoint_section(inputs, options),
        "performance_targets": performance_section(inputs, options),
        "verification_steps": verification_steps(inputs, options),
        "pre_rdma_sync": pre_rdma_sync_section(inputs, options),
        "hardware_calibration": hardware_section(inputs, options),
        "worker_consistency": consistency_section(inputs),
        "coordinator_chunking": chunking_section(inputs),
        "pre_flight_checklist": checklist_section(inputs, options),
    }


def load_schema(name: str = "plan-v2.0.0") -> dict[str, Any]:
    """A JSON Schema shipped with coord: plan-v2.0.0, orchestration-input, orchestration-output."""
    text = resources.files("coordinator.plan").joinpath("schemas", f"{name}.schema.json").read_text("utf-8")
    return json.loads(text)


# --- small readers ----------------------------------------------------------------------------


def _transport_text(inputs: PlanInputs) -> str:
    choice = inputs.backend
    if not choice or not choice.get("ok"):
        return f"backend not chosen yet ({inputs.backend_error or 'no topology measured'})"
    transport = {"rdma": "RDMA over Thunderbolt", "tcp": "TCP"}.get(choice.get("transport"), "no network")
    return f"gradients averaged by all-reduce over {choice['backend']} ({transport})"


def _backend_source(inputs: PlanInputs) -> str:
    choice = inputs.backend
    if not choice:
        return inputs.backend_error or "not chosen"
    return "; ".join(choice.get("reasons") or []) or str(choice.get("backend"))


def _common_fact(inputs: PlanInputs, order: Sequence[str], key: str) -> str:
    values = sorted({str(value) for name in order if (value := (inputs.facts.get(name) or {}).get(key))})
    return "/".join(values) or "unknown"


def _platform_of(inputs: PlanInputs, name: str) -> str:
    facts = inputs.facts.get(name) or {}
    return f"{facts.get('os') or 'OS unknown'} {facts.get('os_version') or ''}".strip()


def _unified_memory(inputs: PlanInputs, order: Sequence[str]) -> tuple[bool | None, str]:
    gpus = {name: (inputs.facts.get(name) or {}).get("gpu") for name in order}
    if any(gpu is None for gpu in gpus.values()):
        return None, "GPU backend unknown on " + ", ".join(n for n, g in gpus.items() if g is None)
    if all(gpu == "metal" for gpu in gpus.values()):
        return True, "node facts: Metal on every node (Apple silicon: CPU and GPU share one memory)"
    if any(gpu == "cuda" for gpu in gpus.values()):
        return False, "node facts: CUDA on " + ", ".join(n for n, g in gpus.items() if g == "cuda") + \
            " (device memory apart from the host's)"
    return None, "no GPU on " + ", ".join(n for n, g in gpus.items() if g == "none") + \
        ": MLX runs on the CPU there, so there is no device memory to unify"


def _rank_entry(inputs: PlanInputs, rank: int, name: str) -> dict[str, Any]:
    node = next(node for node in inputs.nodes if node.name == name)
    return {"rank": rank, "node": name, "address": node.address, "python": node.python, "workdir": node.workdir}


def _measurement(record: Mapping[str, Any]) -> dict[str, Any]:
    result = record.get("result") or {}
    gflops = result.get("matmul_gflops") or {}
    return {"measured_at": utc(record.get("measured_at")), "device": result.get("device"),
            "train_samples_per_s": result.get("train_samples_per_s"),
            "matmul_gflops_float32": gflops.get("float32"), "matmul_gflops_bfloat16": gflops.get("bfloat16"),
            "memory_bandwidth_gbps": result.get("memory_bandwidth_gbps"),
            "peak_memory_bytes": result.get("peak_memory_bytes")}
