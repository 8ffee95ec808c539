"""The orchestration form of a plan: its input context and its output document.

The input (``schemas/orchestration-input.schema.json``: ``modelConfig``, ``dataConfig``,
``clusterConfig``, ``trainingConfig``) is a request: it is checked against the schema,
and where it asks for what the measured cluster cannot give (more nodes, several ranks
per node, another framework) the output says so in ``requestNotes`` instead of obeying.
The output (``schemas/orchestration-output.schema.json``) is built from the same
:class:`~coordinator.plan.inputs.PlanInputs` as the v2.0.0 plan, with the same
``sources``/``missing`` provenance in every section.
"""

from __future__ import annotations

import functools
import json
import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, NotRequired, TypedDict

import jsonschema

from coordinator.jobs.hang import (
    COMPILE_S,
    FIRST_STEP_UNKNOWN_S,
    HANG_FLOOR_S,
    HANG_GAP_MULTIPLE,
    STOPPED_GRACE_S,
    training_allowance,
)
from coordinator.jobs.rank_watch import HOLD_S
from coordinator.jobs.supervisor import CHECKPOINT_POLL_S, NODE_WAIT_S
from coordinator.launch.registry import LAUNCHERS, capabilities, planners_of
from coordinator.plan.document import JsonSchema, load_schema
from coordinator.plan.inputs import PlanInputs, expected_recovery, rank_order, trainer_of, usable_calibrations
from coordinator.plan.options import ResolvedOptions, resolve_options
from coordinator.plan.provenance import Section, SectionFields
from coordinator.plan.sections.checkpoint import checkpoint_section
from coordinator.plan.sections.distributed import JACCL_PORT
from coordinator.readiness.calibration import train_rate, workload_shares

KEEPALIVE_COUNT = 3  # node sessions give up after this many missed keepalives
DATA_PARALLEL_NAMES = ("data", "data_parallel", "data-parallel", "ddp", "dp")
GIB = 2**30


class DistributedConfig(SectionFields, total=False):
    strategy: str
    worldSize: int
    backend: str | None
    initMethod: str
    launchCommand: str


class NodeAssignment(TypedDict):
    """One rank: the node it runs on, what that node is, its share of the work."""

    rank: int
    node: str
    chip: str | None
    memoryBytes: int | None
    gpu: str | None
    trainSamplesPerS: float | None
    workloadShare: float


class ResourceAllocation(SectionFields, total=False):
    nodeAssignments: list[NodeAssignment]
    memoryPerNode: str
    shardingStrategy: str


class CheckpointStrategy(SectionFields, total=False):
    frequency: str
    storage: str
    retention: str
    replica: str
    expectedRecoverySeconds: float


class Elasticity(TypedDict):
    minNodes: int
    maxNodes: int
    nodeTimeoutSeconds: NotRequired[float]  # with elastic training: how long a lost node is waited for
    nodeWaitSeconds: float


class FaultTolerance(SectionFields, total=False):
    elasticTraining: bool
    elasticity: Elasticity
    recoveryStrategy: str
    maxRestarts: int
    healthChecks: list[HealthCheck]
    expectedRecoverySeconds: float


class MonitoringSetup(SectionFields, total=False):
    metrics: list[str]
    alerts: list[str]
    statusCommand: str
    dashboardUrl: str


class OrchestrationDocument(TypedDict):
    """The orchestration output (``schemas/orchestration-output.schema.json``)."""

    distributedConfig: DistributedConfig
    resourceAllocation: ResourceAllocation
    checkpointStrategy: CheckpointStrategy
    faultTolerance: FaultTolerance
    monitoringSetup: MonitoringSetup
    requestNotes: NotRequired[list[str]]  # with a request: what it asks that the cluster decides instead


class OrchestrationInputError(ValueError):
    """An orchestration input that cannot be used; one line per problem, each naming its field."""


@dataclass(frozen=True)
class OrchestrationRequest:
    """The orchestration input, field by field (None: not given)."""

    model_path: str | None = None
    model_size: str | None = None
    framework: str | None = None
    data_path: str | None = None
    data_size: str | None = None
    sharding: str | None = None
    num_nodes: int | None = None
    gpus_per_node: int | None = None
    network_bandwidth: str | None = None
    batch_size: int | None = None  # examples per optimizer step, over all ranks
    epochs: int | None = None
    parallelism_strategy: str | None = None
    ignored: tuple[str, ...] = ()  # unknown fields, named, so a typo does not pass silently


_REQUEST_FIELDS = {
    ("modelConfig", "path"): "model_path", ("modelConfig", "size"): "model_size",
    ("modelConfig", "framework"): "framework", ("dataConfig", "path"): "data_path",
    ("dataConfig", "size"): "data_size", ("dataConfig", "sharding"): "sharding",
    ("clusterConfig", "numNodes"): "num_nodes", ("clusterConfig", "gpusPerNode"): "gpus_per_node",
    ("clusterConfig", "networkBandwidth"): "network_bandwidth", ("trainingConfig", "batchSize"): "batch_size",
    ("trainingConfig", "epochs"): "epochs", ("trainingConfig", "parallelismStrategy"): "parallelism_strategy",
}


# --- the input --------------------------------------------------------------------------------


def read_orchestration_input(text: str, name: str = "input") -> OrchestrationRequest:
    """Parse an input file's text; a JSON error names the file, line and column."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OrchestrationInputError(f"{name}:{exc.lineno}:{exc.colno}: not JSON: {exc.msg}") from None
    return parse_orchestration_input(data)


def parse_orchestration_input(data: Any) -> OrchestrationRequest:
    """Check ``data`` against orchestration-input.schema.json and read it.

    Raises OrchestrationInputError listing every problem, e.g. ``clusterConfig.numNodes must
    be an integer, got a string ("4")`` or ``clusterConfig is required``.
    """
    errors, ignored = check_request(data)
    if errors:
        raise OrchestrationInputError("\n".join(errors))
    values = {attribute: data[section][key] for (section, key), attribute in _REQUEST_FIELDS.items()
              if key in data.get(section, {})}
    return OrchestrationRequest(**values, ignored=tuple(ignored))


def check_request(data: Any) -> tuple[list[str], list[str]]:
    """(errors, ignored fields) of an orchestration input, each naming its field by its path.

    jsonschema checks ``data`` against the format's own schema plus coord's two rules
    (:func:`coord_rules`): every count is at least 1, and a field the schema does not name is
    reported (``additionalProperties``) as ignored, not as an error, so a typo does not pass
    silently while the format stays open to fields coord does not read.
    """
    validator = _request_validator()
    errors: list[str] = []
    ignored: list[str] = []
    missing_named: set[str] = set()
    for error in validator.iter_errors(data):
        path = _path(error)
        # (An error from iter_errors has its schema, instance and validator value set: the checks
        # below only narrow the types jsonschema declares, Unset included.)
        schema, instance, value = error.schema, error.instance, error.validator_value
        if error.validator == "additionalProperties" and isinstance(schema, Mapping) and isinstance(instance, dict):
            known = list(schema.get("properties", {}))
            ignored += [f"{_join(path, key)} (known: {', '.join(known)})" for key in instance if key not in known]
        elif error.validator == "required" and isinstance(value, list) and isinstance(instance, dict):
            # One error per missing field, each with the whole list: name them all at the first.
            if path not in missing_named:
                missing_named.add(path)
                errors += [f"{_join(path, key)} is required" for key in value if key not in instance]
        else:
            errors.append(_message(error, path))
    return errors, ignored


def coord_rules(schema: Mapping[str, Any]) -> JsonSchema:
    """``schema`` with coord's rules added where it sets none: ``minimum: 1`` on every integer
    and ``additionalProperties: false`` on every object that lists its properties."""
    out = {key: value for key, value in schema.items()}
    if out.get("type") == "integer":
        out.setdefault("minimum", 1)
    if isinstance(out.get("properties"), Mapping):
        out["properties"] = {key: coord_rules(sub) for key, sub in out["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


@functools.cache
def _request_validator() -> jsonschema.protocols.Validator:
    schema = coord_rules(load_schema("orchestration-input"))
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)
    return cls(schema)


def _message(error: jsonschema.ValidationError, path: str) -> str:
    """The user's words for one jsonschema error: the field's path, what it must be, what it is."""
    where = path or "the input"
    if error.validator == "type":
        expected = error.validator_value
        expected = expected if isinstance(expected, str) else " or ".join(expected) if isinstance(expected, list) \
            else str(expected)
        return f"{where} must be {_article(expected)}, got {_describe(error.instance)}"
    if error.validator == "minimum":
        return f"{where} must be at least {error.validator_value}, got {error.instance}"
    return f"{where}: {error.message}"


def _path(error: jsonschema.ValidationError) -> str:
    return ".".join(str(part) for part in error.absolute_path)


def _article(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _describe(value: Any) -> str:
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
             type(None): "null"}
    kind = kinds.get(type(value), type(value).__name__)
    shown = json.dumps(value) if kind not in ("object", "array") else ""
    return f"{_article(kind)} ({shown[:40]})" if shown else _article(kind)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# --- the request against the cluster ----------------------------------------------------------


def apply_request(inputs: PlanInputs, request: OrchestrationRequest) -> tuple[PlanInputs, list[str]]:
    """The inputs with what the request sets (the batch), and notes on what it asks that the
    measured cluster decides instead."""
    notes = [f"ignored unknown field {field}" for field in request.ignored]
    order, _ = rank_order(inputs)
    ranks = len(order)
    if request.num_nodes is not None and request.num_nodes != ranks:
        notes.append(f"clusterConfig.numNodes asks for {request.num_nodes} nodes; the cluster file has {ranks} "
                     f"({', '.join(order)}), and the plan uses those")
    if request.gpus_per_node not in (None, 1):
        notes.append(f"clusterConfig.gpusPerNode {request.gpus_per_node}: coord runs one MLX rank per node, "
                     "which uses the node's whole GPU")
    per_node = [name for name in LAUNCHERS if capabilities(name).plan == "per_node"]  # what this plan sizes
    planners = planners_of(request.framework) if request.framework else per_node
    if not set(planners) & set(per_node):
        notes.append(f"modelConfig.framework {request.framework!r}: this plan sizes one rank per node for --launcher "
                     f"{' or '.join(per_node)}; " + (f"a {request.framework} job is planned by coord plan --launcher "
                                                f"{' or '.join(planners)}" if planners else
                                                f"coord plan does not plan a {request.framework} job"))
    if request.parallelism_strategy and request.parallelism_strategy.lower() not in DATA_PARALLEL_NAMES:
        notes.append(f"trainingConfig.parallelismStrategy {request.parallelism_strategy!r}: coord runs data "
                     "parallel only (every rank holds the whole model)")
    if request.sharding:
        notes.append(f"dataConfig.sharding {request.sharding!r} is not applied: see "
                     "resourceAllocation.shardingStrategy for what the trainer does")
    if request.model_size:
        notes.append(f"modelConfig.size {request.model_size!r} is not used: the model is sized from its config.json "
                     "and safetensors headers" if inputs.sizing else
                     f"modelConfig.size {request.model_size!r} is not used: give modelConfig.path (or --model DIR) "
                     "to size the model from its files")
    if request.data_size:
        notes.append(f"dataConfig.size {request.data_size!r} is not used: the data set is counted from its files"
                     if inputs.dataset else f"dataConfig.size {request.data_size!r} is not used: give dataConfig.path "
                     "(or --data DIR) to count the data set")
    if request.network_bandwidth:
        notes.append(f"clusterConfig.networkBandwidth {request.network_bandwidth!r} is not used: the backend "
                     "follows the measured links")
    options = inputs.options
    accumulation = options.gradient_accumulation_steps or 1
    if request.batch_size is not None and options.per_rank_batch_size is None:
        if request.batch_size % (ranks * accumulation):
            notes.append(f"trainingConfig.batchSize {request.batch_size} cannot be split over {ranks} ranks × "
                         f"{accumulation} accumulation steps: give a multiple of {ranks * accumulation}")
        else:
            per_rank = request.batch_size // (ranks * accumulation)
            options = replace(options, per_rank_batch_size=per_rank)
            notes.append(f"trainingConfig.batchSize {request.batch_size} = {per_rank} per rank × {ranks} ranks × "
                         f"{accumulation} accumulation steps")
    examples = inputs.dataset.get("examples") if inputs.dataset else None
    if request.epochs is not None and request.batch_size and isinstance(examples, int) and examples > 0:
        iterations = math.ceil(request.epochs * examples / request.batch_size)
        notes.append(f"trainingConfig.epochs {request.epochs} = --iters {iterations} (rule: epochs × {examples} "
                     f"examples / batch {request.batch_size}, rounded up)")
    elif request.epochs is not None:
        notes.append(f"trainingConfig.epochs {request.epochs}: iterations need the batch size and the example "
                     "count (coord plan --data DIR)")
    return replace(inputs, options=options), notes


# --- the output -------------------------------------------------------------------------------


def build_orchestration(inputs: PlanInputs, request: OrchestrationRequest | None = None) -> OrchestrationDocument:
    """The orchestration document for ``inputs`` (and a request, when one was given)."""
    notes: list[str] = []
    if request is not None:
        inputs, notes = apply_request(inputs, request)
    options = resolve_options(inputs.options, [node.name for node in inputs.nodes], inputs.sizing)
    document: OrchestrationDocument = {
        "distributedConfig": distributed_config(inputs, options),
        "resourceAllocation": resource_allocation(inputs, options),
        "checkpointStrategy": checkpoint_strategy(inputs, options),
        "faultTolerance": fault_tolerance(inputs, options),
        "monitoringSetup": monitoring_setup(),
    }
    if request is not None:
        document["requestNotes"] = notes
    return document


def distributed_config(inputs: PlanInputs, options: ResolvedOptions) -> DistributedConfig:
    order, order_source = rank_order(inputs)
    trainer_facts, trainer_source = trainer_of(inputs, options)
    section: Section[DistributedConfig] = Section()
    sync = trainer_facts["gradient_sync"] if trainer_facts else "gradients synced as the training script does it"
    section.put("strategy", f"data parallel: every rank holds the whole model; {sync}",
                f"coord runs one data-parallel rank per node; {trainer_source}")
    section.put("worldSize", len(order), f"one rank per node: {order_source}")
    choice = inputs.backend
    if choice and choice.get("ok"):
        section.put("backend", choice["backend"], "; ".join(choice.get("reasons") or []))
        section.put("initMethod", _init_method(choice["backend"], inputs), "mlx.launch with coord's hostfile")
    else:
        why = f"no backend chosen: {inputs.backend_error or 'no topology measured'} (coord hostfile)"
        section.lack("backend", why)
        section.lack("initMethod", why)
    if inputs.launch_argv:
        section.put("launchCommand", shlex.join(inputs.launch_argv), "coord's launcher (mlx.launch)")
    return section.done()


def _init_method(backend: str | None, inputs: PlanInputs) -> str:
    hosts = (inputs.hostfile or {}).get("hosts") or []
    where = f" {inputs.hostfile_path}" if inputs.hostfile_path else ""
    if backend == "ring":
        return (f"mlx.launch --hostfile{where}: every rank gets the ring's ip:port list (MLX_HOSTFILE) and "
                "connects to its two neighbours over TCP")
    coordinator = hosts[0]["ips"][0] if hosts and hosts[0].get("ips") else "rank 0's address"
    return (f"mlx.launch --hostfile{where}: ranks meet at rank 0, {coordinator}:{JACCL_PORT} "
            "(MLX_JACCL_COORDINATOR), then use the RDMA devices the hostfile lists")


def resource_allocation(inputs: PlanInputs, options: ResolvedOptions) -> ResourceAllocation:
    order, order_source = rank_order(inputs)
    section: Section[ResourceAllocation] = Section()
    if not order:
        return section.disabled("no nodes in the cluster file")
    usable, lacking = usable_calibrations(inputs, order)
    shares = workload_shares({name: train_rate(usable[name]) if name in usable else None for name in order})
    assignments: list[NodeAssignment] = []
    for rank, name in enumerate(order):
        facts = inputs.facts.get(name) or {}
        assignments.append({"rank": rank, "node": name, "chip": facts.get("chip"),
                            "memoryBytes": facts.get("memory_bytes"), "gpu": facts.get("gpu"),
                            "trainSamplesPerS": train_rate(usable[name]) if name in usable else None,
                            "workloadShare": round(shares["shares"][name], 4)})
    section.put("nodeAssignments", assignments,
                f"{order_source}; chip, memory and GPU from node facts; rate from coord calibrate"
                + (f" (none for {', '.join(lacking)})" if lacking else "") + f"; share: {shares['reason']}")
    memory = {name: (inputs.facts.get(name) or {}).get("memory_bytes") for name in order}
    known = {name: size for name, size in memory.items() if isinstance(size, int)}
    needed = inputs.sizing.get("memory_per_rank_bytes") if inputs.sizing else None
    if known:
        smallest = min(known, key=known.__getitem__)
        text = f"{known[smallest] / GIB:.0f} GiB available on the smallest node ({smallest})"
        source = "node facts: physical memory"
        if isinstance(needed, int):
            text = f"{needed / GIB:.1f} GiB needed per rank; " + text
            source += f"; sizing: {(inputs.sizing.get('source') if inputs.sizing else None) or 'estimate per rank'}"
        section.put("memoryPerNode", text, source)
    else:
        section.lack("memoryPerNode", "no node reported its memory (are the nodes up?)")
    trainer_facts, trainer_source = trainer_of(inputs, options)
    if trainer_facts is None:
        section.lack("shardingStrategy", f"the training script shards its data itself ({trainer_source})")
    else:
        section.put("shardingStrategy", trainer_facts["sharding"].format(ranks=len(order)) + " (nothing is partitioned "
                    "on disk: every node holds the whole data set)", trainer_source)
    return section.done()


def checkpoint_strategy(inputs: PlanInputs, options: ResolvedOptions) -> CheckpointStrategy:
    plan = checkpoint_section(inputs, dict(options))
    section: Section[CheckpointStrategy] = Section()
    if plan.get("enabled") is False:
        return section.disabled(plan["reason"])
    fields: Mapping[str, object] = plan  # read by name
    for ours, theirs in (("frequency", "frequency"), ("storage", "storage"), ("retention", "retention"),
                         ("replica", "replica"), ("expectedRecoverySeconds", "expected_recovery_seconds")):
        if theirs in fields:
            section.put(ours, fields[theirs], plan["sources"][theirs])
    for theirs, why in (plan.get("missing") or {}).items():
        if theirs == "expected_recovery_time":
            section.lack("expectedRecoverySeconds", why)
    return section.done()


def fault_tolerance(inputs: PlanInputs, options: ResolvedOptions) -> FaultTolerance:
    order, _ = rank_order(inputs)
    restarts, restarts_source = options["max_restarts"]
    section: Section[FaultTolerance] = Section()
    min_nodes, min_source = options["min_nodes"]
    timeout, timeout_source = options["node_timeout"]
    if min_nodes is not None and min_nodes < len(order):
        section.put("elasticTraining", True, f"{min_source}: a node down longer than {timeout:g} s is left out "
                    f"while {min_nodes} or more remain, with the global batch kept (coordinator/jobs/elastic.py)")
        section.put("elasticity", {"minNodes": min_nodes, "maxNodes": len(order), "nodeTimeoutSeconds": timeout,
                                   "nodeWaitSeconds": NODE_WAIT_S},
                    f"{min_source}; {timeout_source}; a node back from an outage rejoins at the next attempt")
    else:
        section.put("elasticTraining", False, f"{min_source}: coord relaunches on the same nodes, waiting for a "
                    "lost node to come back")
        section.put("elasticity", {"minNodes": len(order), "maxNodes": len(order), "nodeWaitSeconds": NODE_WAIT_S},
                    f"coord's supervisor: every node must be up to launch; it waits up to {NODE_WAIT_S:g} s for one")
    section.put("recoveryStrategy", "stop every rank on every node, copy the newest checkpoint that validates "
                "(SHA256, safetensors header) to every node, relaunch from its step with backoff; a job that fails "
                "twice in a row before its first step with the same error is failed, not looped",
                "coord's supervisor and restart policy")
    section.put("maxRestarts", restarts, restarts_source)
    section.put("healthChecks", health_checks(inputs), "what coord watches while a job runs")
    seconds, how = expected_recovery(inputs)
    if seconds is None:
        section.lack("expectedRecoverySeconds", how)
    else:
        section.put("expectedRecoverySeconds", seconds, how)
    return section.done()


class HealthCheck(TypedDict):
    name: str
    detects: str
    within: str


def health_checks(inputs: PlanInputs) -> list[HealthCheck]:
    """Each failure coord detects, and how soon."""
    keepalive = inputs.keepalive_s
    step = inputs.timings.step_s
    lost_within = (f"{KEEPALIVE_COUNT * keepalive:g} s ({KEEPALIVE_COUNT} keepalives of {keepalive:g} s)"
                   if keepalive else f"{KEEPALIVE_COUNT} SSH keepalive intervals (ssh.keepalive_s)")
    rule = f"{HANG_GAP_MULTIPLE:g} times the time between steps, at least {HANG_FLOOR_S:g} s"
    hang = (f"{training_allowance(step):g} s without a new step ({rule}); a stopped rank process within "
            f"{STOPPED_GRACE_S:g} s" if step else f"{training_allowance(None):g} s without a new step until the time "
            f"between steps is measured (then {rule}); a stopped rank process within {STOPPED_GRACE_S:g} s")
    return [
        {"name": "rank_exit", "detects": "a rank that exits non-zero or vanishes",
         "within": "a few tenths of a second (each node's agent holds the supervisor's question about its rank "
                   f"for up to {HOLD_S:g} s and answers as soon as the rank ends, looking ten times a second)"},
        {"name": "node_lost", "detects": "a node whose SSH session or agent stops answering", "within": lost_within},
        {"name": "hang", "detects": "ranks that stop making progress (their Python stacks are dumped first)",
         "within": hang},
        {"name": "first_step", "detects": "an attempt that never reaches its first step",
         "within": f"the first-step limit: --first-step-timeout, else three times the previous attempt's time "
                   "to its first step, else from the model's size and the disk's read rate, else "
                   f"{FIRST_STEP_UNKNOWN_S:g} s; past loading, {COMPILE_S:g} s or --hang-timeout"},
        {"name": "checkpoint_valid", "detects": "a checkpoint that is incomplete or unreadable",
         "within": f"about {CHECKPOINT_POLL_S:g} s after it is written (size, safetensors header, SHA256)"},
        {"name": "preflight", "detects": "nodes that differ in code, data, versions, RDMA or disk",
         "within": "before the first launch (coord preflight; blocks unless --force)"},
    ]


def monitoring_setup() -> MonitoringSetup:
    section: Section[MonitoringSetup] = Section()
    section.put("metrics", ["step", "loss", "tokens_per_second", "peak_memory_gb", "restarts",
                            "last_checkpoint_step", "eta_s"],
                "the progress each rank reports every step, and the job record (coord status --json)")
    section.put("alerts", ["job.failed", "job.restart", "job.diverged", "job.loss_spike", "job.checkpoint_invalid",
                           "job.checkpoint_rejected", "job.waiting_for_nodes", "job.stacks"],
                "coord's event log: recorded with their reason and shown by coord status; the cluster file's "
                "[[alerts]] send job_failed, diverged, loss_spike, job_succeeded, job_restarted, job_stalled and "
                "node_down to a webhook (JSON, Slack, ntfy) or a command")
    section.put("statusCommand", "coord status --watch", "coord's CLI")
    section.lack("dashboardUrl", "coord has no web dashboard; coord status --watch is the live view")
    return section.done()
