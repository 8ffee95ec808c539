"""`coord bench scaling -- COMMAND`: the same short job on 1, 2, ... all of the chosen nodes, one after the
other through the daemon, and how it scales (the numbers: coordinator/observe/scaling.py)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.cli.client import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CliError, ask_daemon, resolve_socket
from coordinator.cli.job_commands import follow_job
from coordinator.cli.json_output import print_json

if TYPE_CHECKING:
    from collections.abc import Mapping

    from coordinator.jobs.spec import JobSpecFields
    from coordinator.observe.metrics.history import HistoryDocument
    from coordinator.observe.scaling import ScalingRow

#: A scaling run writes no checkpoint unless asked: saving is not what is measured.
NO_CHECKPOINTS = 10**9
#: `coord bench scaling`'s options that are fields of each job it runs, as `coord run` takes them.
JOB_OPTIONS = ("source", "total_steps", "launcher", "procs_per_node", "global_batch", "micro_batch", "env_style",
               "trainer",
               "backend", "follow_outside_links", "hang_timeout", "first_step_timeout", "node_wait")


def job_specs(args: argparse.Namespace, nodes: list[str], sizes: list[int], stamp: str) -> dict[int, JobSpecFields]:
    """Size -> the job run on the first ``size`` of ``nodes``, checked as `coord run` checks its own."""
    from coordinator.jobs.spec import JobSpec, JobSpecError, validate

    if not args.command:
        raise CliError("give the job after --, e.g. coord bench scaling --total-steps 50 -- python train.py",
                       EXIT_USAGE)
    given = {key: value for key in JOB_OPTIONS if (value := getattr(args, key, None)) is not None}
    specs = {}
    for size in sizes:
        try:
            spec = validate(JobSpec(name=f"scaling-{size}of{len(nodes)}-{stamp}", command=list(args.command),
                                    nodes=nodes[:size], max_restarts=0,
                                    save_every=args.save_every or NO_CHECKPOINTS, **given))
        except JobSpecError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
        specs[size] = spec.as_dict()
    return specs


def cmd_bench_scaling(args: argparse.Namespace) -> int:
    from coordinator.observe.scaling import measure, render_svg, table

    if args.sizes and args.nodes and max(args.sizes) > len(args.nodes):
        raise CliError(f"--sizes {max(args.sizes)} is more than the {len(args.nodes)} nodes --nodes gives", EXIT_USAGE)
    # Mistakes first, before the daemon is looked for (nodes named n1, n2, ... until it says which it has).
    job_specs(args, args.nodes or [f"n{i}" for i in range(1, max(args.sizes or [1]) + 1)], args.sizes or [1], "check")
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    every = [node["name"] for node in ask_daemon(socket, "status", {"events": 0}, config_hint=hint)["nodes"]]
    nodes = args.nodes or every
    unknown = [n for n in nodes if n not in every]
    if unknown:
        raise CliError(f"--nodes: {', '.join(unknown)} is not a node of this cluster ({', '.join(every)})", EXIT_USAGE)
    sizes = args.sizes or list(range(1, len(nodes) + 1))
    if max(sizes) > len(nodes):
        raise CliError(f"--sizes {max(sizes)} is more than the cluster's {len(nodes)} nodes", EXIT_USAGE)
    specs = job_specs(args, nodes, sizes, time.strftime("%Y%m%d-%H%M%S"))
    samples_per_step = args.samples_per_step or args.global_batch
    results, runs = [], {}
    say = (lambda text: None) if args.json else (lambda text: print(text, flush=True))
    for size, spec in specs.items():
        say(f"{size} node{'s' if size != 1 else ''} ({', '.join(nodes[:size])}): running {spec['name']}")
        job = ask_daemon(socket, "run", {"spec": spec, "resume": False}, config_hint=hint)
        try:
            final = follow_job(socket, job["run_id"], hint, quiet=True)
        except KeyboardInterrupt:
            # Interrupted: the job running now is stopped too, not left holding its nodes.
            ask_daemon(socket, "stop", {"name": job["run_id"]}, config_hint=hint)
            print(f"\ninterrupted: {spec['name']} stopped", file=sys.stderr)
            return 130
        runs[size] = final["run_id"]
        if final["state"] != "succeeded":
            raise CliError(f"{spec['name']} {final['state']}: {final.get('error') or 'see coord status'}; the "
                           f"scaling stops here (coord logs {spec['name']})", EXIT_FAILED)
        history: HistoryDocument = ask_daemon(socket, "status", {"events": 0, "history": True, "run": final["run_id"]},
                             config_hint=hint)["history"]
        result = measure(train_points(history, final["run_id"]), size, samples_per_step=samples_per_step)
        results.append(result)
        say(f"  {result.steps_per_second or 0:.2f} steps/s" + (f" ({result.detail})" if result.detail else ""))
    rows = table(results)
    if args.svg:
        title = f"{' '.join(args.command)[:60]}: scaling over {len(nodes)} nodes"
        Path(args.svg).write_text(render_svg(rows, title), encoding="utf-8")
    if args.json:
        print_json({"runs": runs, "rows": [vars(row) for row in rows]})
        return EXIT_OK
    print(render_rows(rows))
    if args.svg:
        print(f"wrote {args.svg}")
    return EXIT_OK


def train_points(history: HistoryDocument, run_id: str) -> list[dict[str, object]]:
    """The run's train series (columnar in the history document), as one dict per point."""
    run = next((r for r in history["runs"] if r["run_id"] == run_id), None)
    if run is None:
        return []
    columns: Mapping[str, object] = run["train"]
    lists = {key: values for key, values in columns.items() if isinstance(values, list)}
    return [{key: values[i] for key, values in lists.items()} for i in range(len(run["train"]["step"]))]


def render_rows(rows: list[ScalingRow]) -> str:
    lines = ["NODES  STEPS/S  THROUGHPUT          SPEEDUP  EFFICIENCY  COMM SHARE"]
    for row in rows:
        rate = f"{row.steps_per_second:.2f}" if row.steps_per_second else "-"
        through = f"{row.throughput:.4g} {row.unit}" if row.throughput else "-"
        speedup = f"{row.speedup:.2f}x" if row.speedup is not None else "-"
        efficiency = f"{row.efficiency:.0%}" if row.efficiency is not None else "-"
        comm = f"{row.comm_share:.0%}" if row.comm_share is not None else "not reported"
        lines.append(f"{row.nodes:<6} {rate:<8} {through:<19} {speedup:<8} {efficiency:<11} {comm}"
                     + (f"  ({row.detail})" if row.detail else ""))
    return "\n".join(lines)
