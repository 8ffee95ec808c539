"""`coord plan`: how this cluster should train a model, from what coord measured on it.

The daemon half gathers what the plan is made from (facts, calibration, links and the
backend they allow, consistency and pre-flight, past launch and recovery times, the model's
size and the data set's shape) and hands it to the pure builders in ``coordinator.plan``.
Nothing is written to the nodes; the hostfile path is the one ``coord run`` would use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio

from agent.launch import rank_command
from coordinator.jobs import diagnosis
from coordinator.launch.mlx_launch import launcher_argv
from coordinator.launch.registry import chosen, planned
from coordinator.plan import datasets, model_shape, sizing
from coordinator.plan.document import PlanDocument, build_plan
from coordinator.plan.inputs import PlanInputs, timings_from_events
from coordinator.plan.options import JobOptions, PlanInputError
from coordinator.plan.orchestration import (
    OrchestrationDocument,
    OrchestrationInputError,
    build_orchestration,
    parse_orchestration_input,
)
from coordinator.plan.provenance import DisabledSection
from coordinator.plan.torch_configs import TorchPlanSection, torch_plan_section
from coordinator.plan.torch_plan import TorchPlanError, TorchRequest, build_torch_plan
from coordinator.readiness.calibration import gpu_memory
from shared import protocol as p
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from rich.console import Console

    from coordinator.jobs.supervisor import JobRunner
    from coordinator.nodes.cluster import Cluster
    from coordinator.plan.datasets import DatasetReport
    from coordinator.readiness.preflight import PreflightReport
    from shared.rpc import Emit

SCHEMAS = ("v2", "orchestration")
#: Options only a PyTorch plan reads (coord plan --launcher), beside OPTION_FIELDS.
TORCH_OPTION_FIELDS = {"global_batch_size": int}
OPTION_FIELDS = {"fine_tune_type": str, "per_rank_batch_size": int, "gradient_accumulation_steps": int,
                 "learning_rate": float, "base_batch_size": int, "optimizer": str, "lr_scaling": str,
                 "warmup_steps": int, "save_every": int, "keep": int, "max_restarts": int, "trainer": str,
                 "replica": str, "min_nodes": int, "node_timeout": float}


async def serve_plan(cluster: Cluster, runs: Iterable[JobRunner], emit: Emit, *, schema: str = "v2",
                     model: str | None = None, data: str | None = None, options: Mapping[str, Any] | None = None,
                     request: Mapping[str, object] | None = None, name: str = "job",
                     seq_len: int = 2048, launcher: str | None = None,
                     master_port: int | None = None) -> PlanDocument | OrchestrationDocument:
    """``options``: the job options as the CLI sent them, those of OPTION_FIELDS used (and checked by
    resolve_options); ``request``: an orchestration input, checked against its schema here;
    ``launcher``: accelerate or deepspeed for a PyTorch plan (its ``pytorch`` section, with the
    launcher's files), whose pre-flight is a PyTorch job's."""
    from coordinator.readiness.preflight import run_preflight

    if schema not in SCHEMAS:
        raise RemoteError(p.BAD_ARGS, f"schema must be one of {', '.join(SCHEMAS)}")
    launcher = chosen(launcher)
    try:
        sized = planned(launcher)  # per_node: the plan's own sizing; per_gpu: its pytorch section
    except KeyError as exc:
        raise RemoteError(p.BAD_ARGS, str(exc.args[0])) from None
    try:
        job_options = JobOptions(**{k: v for k, v in (options or {}).items() if k in OPTION_FIELDS and v is not None})
        parsed = parse_orchestration_input(request) if request is not None else None
    except OrchestrationInputError as exc:
        raise RemoteError(p.BAD_ARGS, f"orchestration input: {exc}") from None
    if parsed is not None:
        model = model or parsed.model_path
        data = data or parsed.data_path
    await emit({"node": "head", "progress": "pre-flight on every node", "fraction": 0.1})
    preflight = await run_preflight(cluster, _quiet, launcher=launcher, master_port=master_port)
    facts = {session.node.name: session.view.facts for session in cluster.sessions.values()}
    calibrations = {n.name: cluster.state.calibration(n.name) for n in cluster.config.nodes}
    fit = None
    if model and sized == "per_node":
        fit = await _sizing(emit, model, facts, gpu_memory(calibrations, facts), job_options, seq_len)
    dataset = await _dataset(emit, data) if data else None
    state_dir = cluster.config.state_dir
    hostfile_path = str(state_dir / "jobs" / name / "attempt-0" / "hostfile.json")
    inputs = PlanInputs(
        nodes=tuple(cluster.config.nodes), facts=facts, calibrations=calibrations,
        backend=preflight["backend"], backend_error=preflight.get("backend_error"), hostfile=preflight["hostfile"],
        hostfile_path=hostfile_path,
        launch_argv=[*launcher_argv(), "--hostfile", hostfile_path, "--", *rank_command(name)],
        launch_env={"PATH": str(state_dir / "jobs" / name / "attempt-0" / "bin") + ":$PATH"},
        job_name=name, consistency=preflight.get("consistency"), preflight=preflight,
        sync_hook=cluster.config.sync.hook, keepalive_s=cluster.config.ssh.keepalive_s,
        timings=timings_from_events(cluster.state.recent_events(2000)),
        sizing=sizing.sizing_summary(fit) if fit else None, dataset=dataset,
        options=job_options, replica_check=latest_replica_check(runs, name))
    try:
        if schema == "orchestration":
            return build_orchestration(inputs, parsed)
        document = build_plan(inputs)
    except PlanInputError as exc:
        raise RemoteError(p.BAD_ARGS, str(exc)) from None
    # coord's own sections: the memory estimate behind the batch, and the known failures this
    # cluster is exposed to (each with its fix).
    document["memory_sizing"] = fit if fit else {"enabled": False, "reason": "no model given: coord plan --model DIR"
                                                 if sized == "per_node" else "a PyTorch plan: see its pytorch section"}
    if sized == "per_gpu":
        document["pytorch"] = await _torch_section(emit, cluster, preflight, model, launcher,
                                                   options or {}, seq_len)
    document["data_validation"] = dataset if dataset else {"enabled": False,
                                                           "reason": "no data set given: coord plan --data DIR"}
    document["known_failures"] = diagnosis.diagnose_cluster(
        {name: fact for name, fact in facts.items() if fact}, preflight.get("topologies"))
    return document


def latest_replica_check(runs: Iterable[JobRunner], name: str) -> Mapping[str, object] | None:
    """The named job's replica checks (the jobs layer's summary of them, JobRecord.replica_check) with the
    job's name and run id, or else those of the newest job that made any."""
    checked = [(runner, check) for runner in runs
               if (check := runner.record.replica_check) and check.get("steps_compared")]
    named = [(runner, check) for runner, check in checked if runner.spec.name == name]
    if not (named or checked):
        return None
    runner, check = (named or sorted(checked, key=lambda found: found[0].record.started or 0))[-1]
    return {**check, "job": runner.spec.name, "run_id": runner.run_id}


async def _quiet(_event: object) -> None:
    return None


async def _sizing(emit: Emit, model: str, facts: Mapping[str, Mapping[str, Any] | None],
                  measured: Mapping[str, tuple[int, str]], options: JobOptions, seq_len: int) -> sizing.FitPlan:
    """fit_nodes over every node whose memory is known: the estimate, per node, with its rules."""
    await emit({"node": "head", "progress": f"sizing {model}", "fraction": 0.6})
    nodes, unknown = sizing.nodes_from_facts({name: fact for name, fact in facts.items() if fact}, measured)
    try:
        shape = await anyio.to_thread.run_sync(model_shape.read_model_shape, model)
        # mlx-lm adapts its top 16 blocks by default, or all of a smaller model's
        fit = sizing.fit_nodes(shape, nodes, fine_tune_type=options.fine_tune_type or "lora",
                               batch_size=options.per_rank_batch_size or 1, seq_len=seq_len,
                               lora_layers=min(16, shape.num_layers), optimizer=options.optimizer or "adam")
    except model_shape.SizingError as exc:
        raise RemoteError(p.BAD_ARGS, f"--model {model}: {exc}") from None
    if unknown:
        fit["notes"] = [*fit.get("notes", []), f"not sized (memory unknown): {', '.join(unknown)}"]
    return fit


async def _torch_section(emit: Emit, cluster: Cluster, preflight: PreflightReport, model: str | None, launcher: str,
                         options: Mapping[str, Any], seq_len: int) -> TorchPlanSection | DisabledSection:
    """The PyTorch plan from the nodes' torch facts (gathered by the pre-flight) and the model's shape."""
    if not model:
        return {"enabled": False, "reason": f"no model given: coord plan --launcher {launcher} --model DIR"}
    found = preflight.get("torch")
    probe = found["rendezvous"] if found else None
    if not found or not found["facts"] or probe is None:
        missing = found["missing"] if found else {}
        why = "; ".join(f"{n}: {w}" for n, w in sorted(missing.items())) or "no node is up"
        return {"enabled": False, "reason": f"no PyTorch facts from the nodes ({why}): coord status"}
    await emit({"node": "head", "progress": f"sizing {model} for {launcher}", "fraction": 0.6})
    try:
        shape = await anyio.to_thread.run_sync(model_shape.read_model_shape, model)
        request = TorchRequest(launcher=launcher, seq_len=seq_len, micro_batch=options.get("per_rank_batch_size"),
                               global_batch=options.get("global_batch_size"),
                               gradient_accumulation_steps=options.get("gradient_accumulation_steps"),
                               learning_rate=options.get("learning_rate"), base_batch=options.get("base_batch_size"))
        order = [n.name for n in cluster.config.nodes]
        plan = build_torch_plan(shape, found["facts"], order, request)
    except model_shape.SizingError as exc:
        raise RemoteError(p.BAD_ARGS, f"--model {model}: {exc}") from None
    except TorchPlanError as exc:
        raise RemoteError(p.BAD_ARGS, str(exc)) from None
    return torch_plan_section(plan, probe["choice"]["master_address"], probe["port"])


async def _dataset(emit: Emit, data: str) -> DatasetReport:
    """validate_data_dir in a worker thread, its chunk progress streamed to the CLI."""
    def progress(message: str) -> None:
        anyio.from_thread.run(emit, {"node": "head", "progress": message, "fraction": 0.8})

    await emit({"node": "head", "progress": f"checking {data}", "fraction": 0.7})
    try:
        return await anyio.to_thread.run_sync(datasets.validate_data_dir, data, progress)
    except (OSError, ValueError) as exc:
        raise RemoteError(p.BAD_ARGS, f"--data {data}: {exc}") from None


def render_plan(document: PlanDocument | OrchestrationDocument, console: Console) -> None:
    """A short reading of the plan; --json prints all of it."""
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("SECTION")
    table.add_column("")
    sections: Mapping[str, object] = document  # each section alike, by name
    for key, value in sections.items():
        if not isinstance(value, dict):
            continue
        if value.get("enabled") is False:
            table.add_row(key, f"[yellow]not filled[/]: {value.get('reason', '')}")
        else:
            shown = {k: v for k, v in value.items()
                     if k not in ("sources", "missing") and not isinstance(v, (dict, list))}
            table.add_row(key, ", ".join(f"{k}={v}" for k, v in list(shown.items())[:4]))
    console.print(table)
    data = sections.get("data_validation")
    if isinstance(data, dict) and data.get("enabled") is not False:  # a DatasetReport
        for problem in data.get("problems") or []:
            console.print(f"[red]data set[/]: {problem}", markup=True, highlight=False)
        for split, report in sorted((data.get("splits") or {}).items()):
            for bad in (report or {}).get("bad_lines", []):
                console.print(f"  {split}.jsonl line {bad['line']}: {bad['reason']}", markup=False, highlight=False)
    torch = sections.get("pytorch")
    if isinstance(torch, dict) and torch.get("enabled") is not False:  # a TorchPlanSection
        render_torch_plan(torch, console)
    console.print("\nthe whole plan, with where each value comes from: coord plan --json")


def render_torch_plan(section: Mapping[str, Any], console: Console) -> None:
    """The PyTorch plan: bytes per GPU under each strategy, the choice with why, precision, batch and rate."""
    from rich.table import Table

    gib = 2**30
    usable = section["usable_bytes_per_rank"] / gib
    table = Table(title=f"GiB per rank (one per GPU), {section['world']} ranks, {usable:.1f} GiB usable each",
                  box=None, header_style="bold", pad_edge=False, title_justify="left")
    for column in ("STRATEGY", "PARAMS", "GRADS", "OPTIMIZER", "ACTIVATIONS", "TOTAL", "HOST/RANK", "FITS"):
        table.add_column(column, justify="left" if column == "STRATEGY" else "right")
    for row in section["memory"]:
        mark = "[green]yes[/]" if row["fits"] and row["host_fits"] else "[red]no[/]"
        chosen = " ◀" if row["strategy"] == section.get("strategy") else ""
        table.add_row(row["strategy"] + chosen, *(f"{row[key] / gib:.1f}" for key in
                                                  ("params", "grads", "optimizer", "activations", "total")),
                      f"{row['host_bytes_per_rank'] / gib:.1f}" if row["host_bytes_per_rank"] else "-", mark)
    console.print()
    console.print(table)
    batch = section["batch"]
    rate = section.get("learning_rate")
    lines = [f"strategy: {section.get('strategy') or 'none fits'} — {section['reason']}",
             f"precision: {section['precision']} ({section['sources']['precision']})",
             f"batch: {batch['micro_batch']} per GPU × {batch['gradient_accumulation_steps']} accumulation × "
             f"{batch['world']} ranks = {batch['global_batch']}",
             f"learning rate: {rate['scaled']:.3g} ({section['sources']['learning_rate']})" if rate
             else f"learning rate: {section['sources']['learning_rate']}"]
    for line in lines + list(section.get("notes") or []):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
