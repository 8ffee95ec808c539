"""The commands about jobs: `coord run`, `wait`, `stop`, `cancel`, `resize` and `logs`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.cli.client import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CliError, ask_daemon, resolve_socket

if TYPE_CHECKING:
    from coordinator.jobs.view import RunView

TERMINAL = ("succeeded", "failed", "stopped")


def _follow_job(socket: Path, name: str, hint: str | None, *, quiet: bool = False) -> RunView:
    """Poll the job until it ends, printing each change of state and step."""
    from coordinator.commands.jobs import render_job

    shown = None
    while True:
        job: RunView = ask_daemon(socket, "job", {"name": name}, config_hint=hint)
        line = render_job(job)
        key = (job["state"], job["step"], job["restarts"])
        if not quiet and key != shown:
            print(line, flush=True)
            shown = key
        if job["state"] in TERMINAL:
            return job
        time.sleep(1.0)


def cmd_run(args: argparse.Namespace) -> int:
    from coordinator.jobs.spec import JobSpec, JobSpecError, load_job_file, validate

    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    command = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    if args.resume and args.name and args.name != args.resume:
        raise CliError("--resume NAME names the job; --name is not needed with it", EXIT_USAGE)
    try:
        if len(command) == 1 and command[0].endswith(".toml"):
            spec = load_job_file(Path(command[0]))
            if args.resume:
                spec.name = args.resume
            fields: Mapping[str, object] = spec.as_dict()  # the spec's fields, as the daemon's run takes them
        elif args.resume and not command:
            fields = {"name": args.resume, "command": [], "force": args.force}  # the run's own command
        else:
            name = args.resume or args.name or f"job-{time.strftime('%Y%m%d-%H%M%S')}"
            source = str(Path(args.source).resolve()) if args.source else None
            fields = validate(JobSpec(name=name, command=command, save_every=args.save_every,
                                      max_restarts=args.max_restarts, hang_timeout=args.hang_timeout,
                                      first_step_timeout=args.first_step_timeout, keep=args.keep,
                                      force=args.force, source=source, backend=args.backend, trainer=args.trainer,
                                      replica=args.replica, min_nodes=args.min_nodes,
                                      node_timeout=args.node_timeout, total_steps=args.total_steps,
                                      nodes=_node_list(args.nodes), priority=args.priority)).as_dict()
    except JobSpecError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    job = ask_daemon(socket, "run", {"spec": fields, "resume": bool(args.resume)}, config_hint=hint)
    verb = "resumed" if args.resume else "submitted"
    print(f"{verb} {job['name']} as run {job['run_id']}: {' '.join(job['command'])}")
    if job.get("hang_watch"):
        print(f"note: {job['hang_watch']}")
    if args.detach:
        print(f"follow it with: coord status   coord logs -f {job['name']}   coord wait {job['name']}")
        return EXIT_OK
    final = _follow_job(socket, job["run_id"], hint)
    return EXIT_OK if final["state"] == "succeeded" else EXIT_FAILED


def _node_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    nodes = [name.strip() for name in text.split(",") if name.strip()]
    if not nodes:
        raise CliError("--nodes needs node names, e.g. --nodes n1,n2", EXIT_USAGE)
    return nodes


def cmd_cancel(args: argparse.Namespace) -> int:
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    job = ask_daemon(socket, "cancel", {"name": args.job}, config_hint=hint)
    print(f"{job['name']}: cancelled (run {job['run_id']} never started)")
    return EXIT_OK


def cmd_wait(args: argparse.Namespace) -> int:
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    final = _follow_job(socket, args.job, hint, quiet=args.quiet)
    if args.json:
        json.dump(final, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    return EXIT_OK if final["state"] == "succeeded" else EXIT_FAILED


def cmd_stop(args: argparse.Namespace) -> int:
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    ask_daemon(socket, "stop", {"name": args.job}, config_hint=hint)
    final = _follow_job(socket, args.job, hint, quiet=True)
    print(f"{args.job}: {final['state']}")
    return EXIT_OK


def cmd_resize(args: argparse.Namespace) -> int:
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    answer = ask_daemon(socket, "resize", {"name": args.job}, config_hint=hint)
    if args.json:
        json.dump(answer, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print(f"{args.job}: {answer['detail']}")
    return EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    offset = 0
    while True:
        piece = ask_daemon(socket, "logs", {"name": args.job, "rank": args.rank, "attempt": args.attempt,
                                            "offset": offset}, config_hint=hint)
        if piece["data"]:
            sys.stdout.buffer.write(piece["data"])
            sys.stdout.flush()
        offset = piece["offset"]
        if not args.follow or (piece["done"] and not piece["data"]):
            return EXIT_OK
        if not piece["data"]:
            time.sleep(0.5)
