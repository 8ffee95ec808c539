"""The commands about jobs: `coord run`, `wait`, `stop`, `cancel`, `resize` and `logs`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.cli.client import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CliError, ask_daemon, resolve_socket
from coordinator.cli.json_output import print_json

if TYPE_CHECKING:
    from coordinator.jobs.view import RunView

TERMINAL = ("succeeded", "failed", "stopped")


#: While a run waits for its nodes, how often the wait is shown again with its time so far.
WAIT_SHOWN_EVERY_S = 15.0
#: How often a followed job is asked again: the daemon answers from memory (well under a millisecond), and
#: `coord wait` in a script returns this much sooner after the end.
FOLLOW_EVERY_S = 0.5


def follow_job(socket: Path, name: str, hint: str | None, *, quiet: bool = False) -> RunView:
    """Poll the job until it ends, printing each change of state, step or what it waits for (and
    a wait again every WAIT_SHOWN_EVERY_S, with how long so far)."""
    from coordinator.commands.jobs import render_job

    shown = None
    shown_at = 0.0
    while True:
        job: RunView = ask_daemon(socket, "job", {"name": name}, config_hint=hint)
        waiting = job.get("waiting")
        reasons = sorted(waiting["reasons"].items()) if waiting else []
        key = (job["state"], job["step"], job["restarts"], reasons)
        if not quiet and (key != shown or (waiting and time.monotonic() - shown_at >= WAIT_SHOWN_EVERY_S)):
            print(render_job(job), flush=True)
            shown, shown_at = key, time.monotonic()
        if job["state"] in TERMINAL:
            return job
        time.sleep(FOLLOW_EVERY_S)


#: `coord run`'s options that are fields of the job (JobSpec), each None unless given.
SPEC_OPTIONS = ("name", "source", "save_every", "max_restarts", "hang_timeout", "keep", "force", "backend", "trainer",
                "replica", "min_nodes", "node_timeout", "node_wait", "total_steps", "nodes", "priority",
                "follow_outside_links", "first_step_timeout", "launcher", "procs_per_node", "global_batch",
                "micro_batch", "env_style", "on_divergence", "max_rollbacks", "skip_on_rollback", "on_spike",
                "straggler_policy", "straggler_grace", "checkpoint_store", "store_keep", "store_keep_every",
                "durability_lag_alert", "store_bandwidth", "store_from")


def run_request(args: argparse.Namespace) -> dict[str, object]:
    """What `coord run` asks the daemon, checked as far as this machine can: every field in its range,
    the source a directory, the command after ``--`` (or a job file, whose fields the options given
    override). The daemon checks it again, against the cluster: nodes, replica, a resumed run."""
    from coordinator.jobs.spec import JobSpec, JobSpecError, check_fields, load_job_file, validate

    given = {key: value for key in SPEC_OPTIONS if (value := getattr(args, key)) is not None}
    if args.plan:
        from coordinator.cli.plan_file import plan_fields

        planned = plan_fields(args.plan)
        if given.get("launcher", planned["launcher"]) != planned["launcher"]:
            raise CliError(f"--launcher {given['launcher']} and the plan's launcher, {planned['launcher']}: give one",
                           EXIT_USAGE)
        given = {**planned, **given}  # an option given on the line wins over the plan's value
    command = args.command  # the words after --; None without --
    if args.resume and args.resume_from:
        raise CliError("--resume continues a run this head knows, --resume-from one from a checkpoint store: "
                       "give one", EXIT_USAGE)
    if args.resume and given.get("name", args.resume) != args.resume:
        raise CliError("--resume NAME names the job; --name is not needed with it", EXIT_USAGE)
    try:
        if args.job_file:
            if command is not None:
                raise CliError("give the command once: in the job file, or after -- without one", EXIT_USAGE)
            spec = load_job_file(Path(args.job_file))
            fields = {**spec.as_dict(), **given, **({"name": args.resume} if args.resume else {})}
            fields = dict(validate(JobSpec(**fields)).as_dict())
        elif args.resume:
            fields = {**given, "name": args.resume, **({"command": command} if command else {})}
            check_fields(fields)  # the daemon checks the whole, over the run it continues
            return {"spec": fields, "resume": True}
        else:
            if not command:
                raise CliError("give the command after --, e.g. coord run --name tiny -- python train.py (or a job "
                               "file: coord run tiny.toml)", EXIT_USAGE)
            name = given.pop("name", None) or f"job-{time.strftime('%Y%m%d-%H%M%S')}"
            fields = dict(validate(JobSpec(name=name, command=command, **given)).as_dict())
    except JobSpecError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if args.resume_from:
        return {"spec": fields, "url": args.resume_from}
    return {"spec": fields, "resume": bool(args.resume)}


def cmd_run(args: argparse.Namespace) -> int:
    request = run_request(args)  # before the daemon is looked for: a mistake is named even without one
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    if "url" in request:
        print(f"looking for the newest committed checkpoint in {request['url']} ...", flush=True)
        job = ask_daemon(socket, "run_from_store", request, config_hint=hint, timeout=None,
                         on_event=lambda event: print(f"  {event.get('progress')}", flush=True))
    else:
        job = ask_daemon(socket, "run", request, config_hint=hint)
    verb = "resumed" if args.resume or "url" in request else "submitted"
    print(f"{verb} {job['name']} as run {job['run_id']}: {' '.join(job['command'])}")
    if job.get("hang_watch"):
        print(f"note: {job['hang_watch']}")
    if args.detach:
        print(f"follow it with: coord status   coord logs -f {job['name']}   coord wait {job['name']}")
        return EXIT_OK
    final = follow_job(socket, job["run_id"], hint)
    return EXIT_OK if final["state"] == "succeeded" else EXIT_FAILED


def cmd_cancel(args: argparse.Namespace) -> int:
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    job = ask_daemon(socket, "cancel", {"name": args.job}, config_hint=hint)
    print(f"{job['name']}: cancelled (run {job['run_id']} never started)")
    return EXIT_OK


def cmd_wait(args: argparse.Namespace) -> int:
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    final = follow_job(socket, args.job, hint, quiet=args.quiet)
    if args.json:
        print_json(final)
    return EXIT_OK if final["state"] == "succeeded" else EXIT_FAILED


def cmd_stop(args: argparse.Namespace) -> int:
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    ask_daemon(socket, "stop", {"name": args.job}, config_hint=hint)
    final = follow_job(socket, args.job, hint, quiet=True)
    print(f"{args.job}: {final['state']}")
    return EXIT_OK


def cmd_resize(args: argparse.Namespace) -> int:
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    answer = ask_daemon(socket, "resize", {"name": args.job}, config_hint=hint)
    if args.json:
        print_json(answer)
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
