"""The commands about the cluster as a whole: `coord status`, `sync`, `calibrate`, `preflight`, `plan` and
`hostfile`. Each asks the daemon and prints its answer (or --json)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from coordinator.cli.client import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    ask_daemon,
    resolve_socket,
    streamed,
)
from coordinator.cli.console import make_console
from coordinator.cli.json_output import print_json

if TYPE_CHECKING:
    from coordinator.commands.hostfile import HostfileAnswer
    from coordinator.commands.status import StatusDocument


def cmd_status(args: argparse.Namespace) -> int:
    _refuse_unused(args, "--interval", args.interval, "--watch", args.watch)
    for flag, value in (("--run", args.run), ("--since", args.since)):
        _refuse_unused(args, flag, value, "--history", args.history)
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    if args.watch:
        return _watch_status(args, socket, hint)
    request: dict[str, object] = {"events": args.events, "all": args.all}
    if args.history:
        request.update(history=True, run=args.run, since=time.time() - args.since if args.since else None)
    doc: StatusDocument = ask_daemon(socket, "status", request, config_hint=hint)
    if args.json:
        print_json(doc)
    else:
        from coordinator.commands.status import render_history, render_status
        render_status(doc, make_console())
        if args.history:
            render_history(doc["history"], make_console())
    return EXIT_OK if doc["summary"]["up"] == doc["summary"]["nodes"] or not args.check else EXIT_FAILED


def _refuse_unused(args: argparse.Namespace, flag: str, value: object, needs: str, given: bool) -> None:
    """An option that only means something with another is refused without it, not ignored."""
    if value is not None and not given:
        raise CliError(f"{flag} applies only with {needs}: add {needs}, or leave {flag} out", EXIT_USAGE)


def _watch_status(args: argparse.Namespace, socket: Path, hint: str | None) -> int:
    from rich.console import Console
    from rich.live import Live

    from coordinator.commands.status import render_status

    console = Console()
    try:
        with Live(console=console, auto_refresh=False, screen=False) as live, open(os.devnull, "w") as devnull:
            while True:
                doc: StatusDocument = ask_daemon(socket, "status", {"events": args.events}, config_hint=hint)
                capture = Console(record=True, width=console.width, file=devnull)
                render_status(doc, capture)
                from rich.text import Text
                live.update(Text.from_ansi(capture.export_text(styles=True)), refresh=True)
                time.sleep(args.interval or 1.0)
    except KeyboardInterrupt:
        return EXIT_OK


def cmd_sync(args: argparse.Namespace) -> int:
    from coordinator.cli.progress import SyncProgress
    from coordinator.commands.sync import render_sync

    source = str(Path(args.source).resolve()) if args.source else None
    asked: dict[str, object] = {"source": source, "delete": args.delete, "dry_run": args.dry_run}
    if args.follow_outside_links:  # only when given: a daemon from before the option still answers the rest
        asked["follow_outside_links"] = True
    report = streamed(args, "sync", asked, render_sync, SyncProgress, blocking=True)
    return EXIT_OK if report["status"] == "ok" else EXIT_FAILED


def cmd_calibrate(args: argparse.Namespace) -> int:
    from coordinator.cli.progress import NodeProgress
    from coordinator.commands.calibrate import render_calibrate

    report = streamed(args, "calibrate", {"refresh": args.refresh, "quick": args.quick}, render_calibrate,
                       NodeProgress)
    return EXIT_OK if report["status"] == "ok" else EXIT_FAILED


def cmd_checkpoints(args: argparse.Namespace) -> int:
    socket = resolve_socket(args)
    listing = ask_daemon(socket, "store_checkpoints", {"url": args.store},
                         config_hint=args.config or os.environ.get("COORD_CONFIG"), timeout=None)
    if args.json:
        print_json(listing)
        return EXIT_OK
    rows = listing["checkpoints"]
    if not rows:
        print(f"{listing['store']}: no checkpoints")
        return EXIT_OK
    print(f"{listing['store']}:")
    print(f"  {'run':<28} {'step':>8} {'attempt':>7} {'size':>10}  state")
    for row in rows:
        state = "committed" if row["committed"] else ("not a checkpoint: " + row["problem"] if row["problem"]
                                                      else "not committed (no manifest)")
        print(f"  {row['run']:<28} {row['step']:>8} {row['attempt']:>7} {row['bytes'] / 1e6:>8.1f}MB  {state}")
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from coordinator.cli.progress import NodeProgress
    from coordinator.commands.doctor import render_doctor

    request: dict[str, object] = {"all_pairs": args.all_pairs, "quick": args.quick,
                                  "set_baseline": args.set_baseline, "while_training": args.while_training}
    if args.bytes is not None:
        request["bytes"] = args.bytes
    if args.seconds is not None:
        request["seconds"] = args.seconds
    matrix_file = args.ibv_devices or os.environ.get("MLX_IBV_DEVICES")
    if matrix_file:
        request["ibv_devices"] = _ibv_matrix(matrix_file, "--ibv-devices" if args.ibv_devices else "MLX_IBV_DEVICES")
    report = streamed(args, "doctor", request, render_doctor, NodeProgress)
    return EXIT_OK if report["status"] == "ok" else EXIT_FAILED


def _ibv_matrix(path: str, given_by: str) -> list[object]:
    """An MLX_IBV_DEVICES file: one row per rank, each the device toward every rank (null toward itself)."""
    try:
        matrix = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CliError(f"{given_by} {path}: cannot read it as JSON: {exc}", EXIT_USAGE) from None
    if not isinstance(matrix, list) or not all(isinstance(row, list) for row in matrix):
        raise CliError(f"{given_by} {path}: expected a list of rows, one per rank (an MLX_IBV_DEVICES matrix)",
                       EXIT_USAGE)
    return matrix


def cmd_preflight(args: argparse.Namespace) -> int:
    from coordinator.cli.progress import NodeProgress
    from coordinator.commands.preflight import render_preflight

    call: dict[str, object] = {"backend": args.backend}
    if args.checkpoint_store:
        call["checkpoint_store"] = args.checkpoint_store
    if args.launcher:  # its checks are the ones it declares (coordinator/launch/registry.py)
        call.update(launcher=args.launcher, master_port=args.master_port)
    elif args.master_port is not None:
        raise CliError("--master-port is the rendezvous port of a PyTorch job: give --torch, or --launcher "
                       "torchrun|accelerate|deepspeed", EXIT_USAGE)
    result = streamed(args, "preflight", call, render_preflight, NodeProgress)
    return EXIT_FAILED if result["status"] == "fail" else EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from coordinator.cli.progress import NodeProgress
    from coordinator.commands.plan import render_plan
    from coordinator.plan.orchestration import OrchestrationInputError, read_orchestration_input

    request = None
    if args.input:
        try:
            text = Path(args.input).read_text(encoding="utf-8")
            read_orchestration_input(text, args.input)  # a bad file is named here, field by field
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"--input {args.input}: cannot read it: {exc}", EXIT_USAGE) from None
        except OrchestrationInputError as exc:
            raise CliError(f"--input {exc}", EXIT_USAGE) from None
        request = json.loads(text)
        # Paths in the input file are relative to the file, not to wherever the daemon runs.
        for section, flag in (("modelConfig", "model"), ("dataConfig", "data")):
            given = (request.get(section) or {}).get("path")
            if isinstance(given, str) and given and not getattr(args, flag):
                path = Path(given).expanduser()
                setattr(args, flag, str(path if path.is_absolute() else Path(args.input).resolve().parent / path))
    options = {"fine_tune_type": args.fine_tune_type, "per_rank_batch_size": args.batch_size,
               "gradient_accumulation_steps": args.grad_accumulation_steps, "learning_rate": args.learning_rate,
               "optimizer": args.optimizer, "lr_scaling": args.lr_scaling, "warmup_steps": args.warmup_steps,
               "save_every": args.save_every, "keep": args.keep, "trainer": args.trainer, "replica": args.replica,
               "min_nodes": args.min_nodes, "base_batch_size": args.base_batch_size,
               "global_batch_size": args.global_batch_size}
    for flag, value in (("--model", args.model), ("--data", args.data)):
        if value and not Path(value).exists():
            where = f" (from {args.input})" if args.input else ""
            raise CliError(f"{flag} {value}{where}: no such directory", EXIT_USAGE)
    call: dict[str, object] = {"schema": args.schema, "options": {k: v for k, v in options.items() if v is not None},
            "model": str(Path(args.model).resolve()) if args.model else None,
            "data": str(Path(args.data).resolve()) if args.data else None, "request": request,
            "name": args.name, "seq_len": args.max_seq_length}
    if args.launcher:
        call.update(launcher=args.launcher, master_port=args.master_port)
    elif args.master_port is not None:
        raise CliError("--master-port is for a PyTorch plan: give --launcher accelerate|deepspeed", EXIT_USAGE)
    document = streamed(args, "plan", call, render_plan, NodeProgress)
    torch_section = document.get("pytorch")  # there only for a launcher that plans per GPU
    if isinstance(torch_section, dict) and torch_section.get("files"):
        # The launcher's files, and the plan itself for `coord run --plan DIR`.
        plan = {key: value for key, value in torch_section.items() if key != "files"}
        files = {**torch_section["files"], "plan.json": json.dumps(plan, indent=2, sort_keys=True) + "\n"}
        write_launcher_files(files, Path(args.config_dir or f"coord-{args.launcher}"),
                             sys.stderr if args.json else sys.stdout)
    return EXIT_OK


def write_launcher_files(files: dict[str, str], directory: Path, out: TextIO) -> None:
    """The PyTorch plan's launcher files, each written whole (a temporary file renamed into place)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in sorted(files.items()):
            if "/" in name or name.startswith("."):
                raise CliError(f"the daemon sent a file name that is not a plain name: {name!r}", EXIT_FAILED)
            target = directory / name
            partial = target.with_name(f".{name}.partial")
            partial.write_text(text, encoding="utf-8")
            partial.replace(target)
            print(f"wrote {target}", file=out)
    except OSError as exc:
        raise CliError(f"cannot write the launcher's files in {directory}: {exc.strerror or exc}", EXIT_FAILED) \
            from None


def cmd_hostfile(args: argparse.Namespace) -> int:
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    output = str(Path(args.output).resolve()) if args.output else None
    result: HostfileAnswer = ask_daemon(socket, "hostfile", {"output": output, "backend": args.backend},
                                        config_hint=hint, timeout=300)
    if args.json:
        print_json(result)
        return EXIT_OK
    if output:
        document = result["hostfile"]
        print(f"wrote {output} ({document['backend']}, {len(document['hosts'])} hosts: "
              f"{', '.join(h['ssh'] for h in document['hosts'])})")
    else:
        print_json(result["hostfile"], sort_keys=False)
    # Without -o stdout is the hostfile itself: the advice goes to stderr.
    advice = sys.stdout if output else sys.stderr
    print(render_hostfile_ssh(result), file=advice)
    return EXIT_OK


def render_hostfile_ssh(result: HostfileAnswer) -> str:
    """How the user's own ssh reaches the nodes, and the one line to add when it cannot yet."""
    ssh = result.get("ssh") or {}
    entries = ssh.get("entries")  # coordinator.launch.user_hostfile's UserSsh.describe
    needing = [e for e in entries if e.get("needs")] if isinstance(entries, list) else []
    lines = []
    if needing and ssh.get("include_line"):
        lines.append("your ssh config lacks what " + ", ".join(e["node"] for e in needing) + " need"
                     + "".join(f"\n  {e['node']} ({e['ssh']}): {'; '.join(e['needs'])}" for e in needing))
        lines.append(f"coord wrote Host entries for them to {ssh['include_file']}; add this line at the top "
                     f"of ~/.ssh/config (coord never edits it):\n  {ssh['include_line']}")
    else:
        lines.append("every node is reached as your own ssh reaches it (ssh <entry> works as is)")
    if result.get("launch"):
        lines.append(f"then: {result['launch']}")
    return "\n".join(lines)
