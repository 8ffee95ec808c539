"""`coord`: the command line. Talks to coordd over its control socket.

Start-up time counts (`coord sync` on an unchanged tree is a fraction of a second):
asyncio and the rpc layer are imported only by the commands that need them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from coordinator.cli.console import make_console
from coordinator.config.daemon_options import add_daemon_arguments

# Not coordinator.config.cluster_file: its dataclasses and checks are a third of a start that every command pays
# (each imports it where it needs the whole file).
from coordinator.control.address import SOCKET_NAME, default_state_dir, socket_from_file

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    def __init__(self, message: str, status: int = EXIT_FAILED):
        super().__init__(message)
        self.status = status


def resolve_socket(args: argparse.Namespace) -> Path:
    """--socket, then COORD_SOCKET, then --config (or COORD_CONFIG), then the default state dir.

    A cluster file's ``[cluster]`` table alone names the socket; the rest of the file is the daemon's
    to check (it did, when it started), so a command still reaches a running daemon while its file is
    being edited."""
    if getattr(args, "socket", None):
        return Path(args.socket)
    if os.environ.get("COORD_SOCKET"):
        return Path(os.environ["COORD_SOCKET"])
    config_path = getattr(args, "config", None) or os.environ.get("COORD_CONFIG")
    if config_path:
        socket = socket_from_file(config_path)
        if socket is not None:
            return socket
        from coordinator.config.cluster_file import ConfigError, load_config

        try:  # the file or its [cluster] table is unusable: the full check says where and why
            return load_config(config_path).socket
        except ConfigError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    return default_state_dir() / SOCKET_NAME


def ask_daemon(socket: Path, method: str, args: dict[str, Any] | None = None, *, config_hint: str | None = None,
               timeout: float | None = 30.0, on_event=None) -> Any:
    import asyncio

    from coordinator.control.server import DaemonNotRunning, call_daemon
    from shared.rpc import RemoteError

    try:
        return asyncio.run(call_daemon(socket, method, args, timeout=timeout, on_event=on_event))
    except DaemonNotRunning:
        raise _not_running(socket, config_hint) from None
    except RemoteError as exc:
        raise CliError(f"coordd refused {method}: {exc.message}") from None
    except TimeoutError:
        raise CliError(f"coordd did not answer {method} in time on {socket}") from None


def _not_running(socket: Path, config_hint: str | None) -> CliError:
    start = f"coord daemon --config {config_hint}" if config_hint else "coord daemon --config CLUSTER.toml"
    return CliError(f"coordd is not running (no daemon answers on {socket}).\n"
                    f"Start it with: {start}\n"
                    f"(or as a service: see deploy/ for launchd and systemd)", EXIT_USAGE)


def ask_daemon_blocking(socket: Path, method: str, args: dict[str, Any] | None = None, *,
                        config_hint: str | None = None, on_event=None) -> Any:
    """One call over the control socket with plain blocking I/O, no event loop (no asyncio to import):
    the same frames as ``call_daemon``, the events of the call passed to ``on_event``, then its result."""
    import socket as sockets

    from shared import protocol as p

    connection = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    try:
        try:
            connection.connect(str(socket))
        except (FileNotFoundError, ConnectionRefusedError):
            raise _not_running(socket, config_hint) from None
        connection.sendall(p.pack(p.Request(1, method, args or {})))
        stream = connection.makefile("rb")

        def read_exactly(n: int) -> bytes:
            data = stream.read(n)
            if data is None or len(data) < n:
                raise CliError(f"coordd closed the connection during {method} on {socket}")
            return data

        while True:
            length = p.frame_length(read_exactly(p.HEADER.size), p.DEFAULT_MAX_FRAME)
            message = p.unpack(read_exactly(length))
            if isinstance(message, p.Event):
                if on_event is not None and message.id == 1:
                    on_event(message.data)
            elif isinstance(message, p.Result) and message.id == 1:
                return message.value
            elif isinstance(message, p.Error) and message.id in (1, None):
                raise CliError(f"coordd refused {method}: {message.message}")
    except p.ProtocolError as exc:
        raise CliError(f"coordd sent a frame that could not be read during {method}: {exc.message}") from None
    finally:
        connection.close()


def cmd_status(args: argparse.Namespace) -> int:
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    if args.watch:
        return _watch_status(args, socket, hint)
    request = {"events": args.events, "all": args.all}
    if args.history:
        request.update(history=True, run=args.run, since=time.time() - args.since if args.since else None)
    doc = ask_daemon(socket, "status", request, config_hint=hint)
    if args.json:
        json.dump(doc, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        from coordinator.commands.status import render_history, render_status
        render_status(doc, make_console())
        if args.history:
            render_history(doc["history"], make_console())
    return EXIT_OK if doc["summary"]["up"] == doc["summary"]["nodes"] or not args.check else EXIT_FAILED


def _watch_status(args: argparse.Namespace, socket: Path, hint: str | None) -> int:
    from rich.console import Console
    from rich.live import Live

    from coordinator.commands.status import render_status

    console = Console()
    try:
        # Each refresh renders into a recording console that writes nowhere (one devnull, not one a refresh).
        with open(os.devnull, "w") as devnull, Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                doc = ask_daemon(socket, "status", {"events": args.events}, config_hint=hint)
                capture = Console(record=True, width=console.width, file=devnull)
                render_status(doc, capture)
                from rich.text import Text
                live.update(Text.from_ansi(capture.export_text(styles=True)), refresh=True)
                time.sleep(args.interval)
    except KeyboardInterrupt:
        return EXIT_OK


def cmd_sync(args: argparse.Namespace) -> int:
    from coordinator.cli.progress import SyncProgress
    from coordinator.commands.sync import render_sync

    source = str(Path(args.source).resolve()) if args.source else None
    report = _streamed(args, "sync", {"source": source, "delete": args.delete, "dry_run": args.dry_run},
                       render_sync, SyncProgress, blocking=True)
    return EXIT_OK if report["status"] == "ok" else EXIT_FAILED


def _streamed(args: argparse.Namespace, method: str, request: dict[str, Any], render, progress_class, *,
              blocking: bool = False) -> dict:
    """Call a long daemon method: progress bars from its events, then its report (or --json).

    ``blocking``: over a plain socket (``ask_daemon_blocking``), for the commands whose start-up
    time is part of what they cost (``coord sync`` on an unchanged tree)."""
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")

    def ask(on_event=None) -> Any:
        if blocking:
            return ask_daemon_blocking(socket, method, request, config_hint=hint, on_event=on_event)
        return ask_daemon(socket, method, request, config_hint=hint, timeout=None, on_event=on_event)

    if args.json:
        report = ask()
        json.dump(report, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
        return report
    console = make_console()
    with progress_class(console) as progress:
        report = ask(progress.update)
    render(report, console)
    return report


def cmd_calibrate(args: argparse.Namespace) -> int:
    from coordinator.cli.progress import NodeProgress
    from coordinator.commands.calibrate import render_calibrate

    report = _streamed(args, "calibrate", {"refresh": args.refresh, "quick": args.quick}, render_calibrate,
                       NodeProgress)
    return EXIT_OK if report["status"] == "ok" else EXIT_FAILED


def cmd_preflight(args: argparse.Namespace) -> int:
    from coordinator.cli.progress import NodeProgress
    from coordinator.commands.preflight import render_preflight

    result = _streamed(args, "preflight", {"backend": args.backend}, render_preflight, NodeProgress)
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
        except FileNotFoundError:
            raise CliError(f"{args.input}: no such file", EXIT_USAGE) from None
        except OrchestrationInputError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
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
               "min_nodes": args.min_nodes}
    for flag, value in (("--model", args.model), ("--data", args.data)):
        if value and not Path(value).exists():
            where = f" (from {args.input})" if args.input else ""
            raise CliError(f"{flag} {value}{where}: no such directory", EXIT_USAGE)
    call = {"schema": args.schema, "options": {k: v for k, v in options.items() if v is not None},
            "model": str(Path(args.model).resolve()) if args.model else None,
            "data": str(Path(args.data).resolve()) if args.data else None, "request": request,
            "name": args.name, "seq_len": args.max_seq_length}
    _streamed(args, "plan", call, render_plan, NodeProgress)
    return EXIT_OK


def cmd_hostfile(args: argparse.Namespace) -> int:
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    output = str(Path(args.output).resolve()) if args.output else None
    result = ask_daemon(socket, "hostfile", {"output": output, "backend": args.backend}, config_hint=hint,
                        timeout=300)
    if args.json:
        json.dump(result, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
        return EXIT_OK
    if output:
        document = result["hostfile"]
        print(f"wrote {output} ({document['backend']}, {len(document['hosts'])} hosts: "
              f"{', '.join(h['ssh'] for h in document['hosts'])})")
    else:
        json.dump(result["hostfile"], sys.stdout, indent=2)
        sys.stdout.write("\n")
    # Without -o stdout is the hostfile itself: the advice goes to stderr.
    advice = sys.stdout if output else sys.stderr
    print(render_hostfile_ssh(result), file=advice)
    return EXIT_OK


def render_hostfile_ssh(result: dict) -> str:
    """How the user's own ssh reaches the nodes, and the one line to add when it cannot yet."""
    ssh = result.get("ssh") or {}
    needing = [e for e in ssh.get("entries", []) if e.get("needs")]
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


TERMINAL = ("succeeded", "failed", "stopped")


def _follow_job(socket: Path, name: str, hint: str | None, *, quiet: bool = False) -> dict[str, Any]:
    """Poll the job until it ends, printing each change of state and step."""
    from coordinator.commands.jobs import render_job

    shown = None
    while True:
        job = ask_daemon(socket, "job", {"name": name}, config_hint=hint)
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
            fields = spec.as_dict()
        elif args.resume and not command:
            fields = {"name": args.resume, "command": [], "force": args.force}  # the run's own command
        else:
            name = args.resume or args.name or f"job-{time.strftime('%Y%m%d-%H%M%S')}"
            source = str(Path(args.source).resolve()) if args.source else None
            fields = validate(JobSpec(name=name, command=command, save_every=args.save_every,
                                      max_restarts=args.max_restarts, hang_timeout=args.hang_timeout, keep=args.keep,
                                      force=args.force, source=source, backend=args.backend, trainer=args.trainer,
                                      replica=args.replica, min_nodes=args.min_nodes,
                                      node_timeout=args.node_timeout, total_steps=args.total_steps,
                                      nodes=_node_list(args.nodes), priority=args.priority)).as_dict()
    except JobSpecError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    job = ask_daemon(socket, "run", {"spec": fields, "resume": bool(args.resume)}, config_hint=hint)
    verb = "resumed" if args.resume else "submitted"
    print(f"{verb} {job['name']} as run {job['run_id']}: {' '.join(job['command'])}")
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


def cmd_init(args: argparse.Namespace) -> int:
    if args.output and args.path:
        raise CliError("give the file once: as PATH or with -o", EXIT_USAGE)
    path = Path(args.output or args.path or "coord.toml")
    if path.exists() and not args.force:
        raise CliError(f"{path} already exists; use --force to overwrite it", EXIT_USAGE)
    if args.hosts:
        return _init_from_hosts(args, path)
    from coordinator.config.cluster_file import EXAMPLE_CLUSTER

    path.write_text(EXAMPLE_CLUSTER)
    print(f"wrote {path}; edit the nodes, then start the daemon with: coord daemon --config {path}")
    return EXIT_OK


def _init_from_hosts(args: argparse.Namespace, path: Path) -> int:
    from coordinator.commands import init
    from coordinator.nodes.onboarding import OnboardingError, name_nodes, parse_hosts

    try:
        specs = parse_hosts(args.hosts)
        names = name_nodes(specs)
    except OnboardingError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    ssh = init.ssh_settings(known_hosts=args.known_hosts, identity_file=args.identity_file,
                            ssh_config=args.ssh_config, timeout=args.timeout)
    by_name = dict(zip(names, specs, strict=True))
    import asyncio

    found = asyncio.run(init.survey(names, specs, ssh, args.workdir))
    trusted = init.settle_host_keys(found, by_name, ssh, interactive=sys.stdin.isatty())
    if trusted:  # ask those hosts again, now that their keys are known
        again = asyncio.run(init.survey(trusted, [by_name[n] for n in trusted], ssh, args.workdir))
        fresh = {r.name: r for r in again.reports}
        found.reports = [fresh.get(r.name, r) for r in found.reports]
    reports = found.reports
    written = False
    if all(r.ok for r in reports):
        try:
            text = init.render_file(args.name, ssh, reports, _init_words(args, path))
        except OnboardingError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
        try:
            init.write_cluster_file(path, text, force=args.force)
        except FileExistsError:
            raise CliError(f"{path} already exists; use --force to overwrite it", EXIT_USAGE) from None
        written = True
    if args.json:
        json.dump(init.as_json(path, written, reports), sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        for report in reports:
            print("\n".join(init.summary(report)))
        if written:
            print(f"wrote {path} ({len(reports)} node{'s' if len(reports) != 1 else ''}). "
                  f"Start the daemon with: coord daemon --config {path}")
        else:
            bad = [r.name for r in reports if not r.ok]
            print(f"nothing written: {', '.join(bad)} not ready; fix them, then run this command again",
                  file=sys.stderr)
    return EXIT_OK if written else EXIT_FAILED


def _init_words(args: argparse.Namespace, path: Path) -> list[str]:
    """The command line that wrote a cluster file, for its first comment."""
    words = ["init", "--hosts", args.hosts, "-o", str(path)]
    for flag, value, default in (("--name", args.name, "cluster"), ("--workdir", args.workdir, "coord-work"),
                                 ("--known-hosts", args.known_hosts, None),
                                 ("--identity-file", args.identity_file, None),
                                 ("--ssh-config", args.ssh_config, None)):
        if value and value != default:
            words += [flag, value]
    return words


def cmd_trust(args: argparse.Namespace) -> int:
    from coordinator.commands.trust import request_for, trust_host
    from coordinator.config.cluster_file import ConfigError, load_config
    from coordinator.nodes.known_hosts import TrustRefused
    from coordinator.nodes.transport import NodeUnreachable

    config_path = args.config or os.environ.get("COORD_CONFIG")
    try:
        config = load_config(config_path) if config_path else None
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    try:
        request = request_for(args.host, config, port=args.port, known_hosts=args.known_hosts,
                              ssh_config=args.ssh_config)
        print(trust_host(request, expected=args.fingerprint, interactive=sys.stdin.isatty()))
    except TrustRefused as exc:
        raise CliError(str(exc)) from None
    except NodeUnreachable as exc:
        raise CliError(exc.reason) from None
    return EXIT_OK


def cmd_daemon(args: argparse.Namespace) -> int:
    from coordinator.daemon import run_daemon
    return run_daemon(args.config, log_file=args.log_file, log_level=args.log_level)


def cmd_agent_bundle(args: argparse.Namespace) -> int:
    from coordinator.nodes.agent_bundle import write_bundle
    bundle = write_bundle(args.output)
    print(json.dumps({"path": args.output, "bundle_id": bundle.bundle_id, "sha256": bundle.digest}))
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from coordinator.cli.demo import run_demo
    return run_demo(Path(args.dir), keep=args.keep)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coord",
        description="Turn a handful of Macs into one MLX training cluster and keep a training run alive on it.",
        epilog="The daemon (coord daemon / coordd) holds a session to every node; the other commands ask it "
               "over its control socket, found from --socket, $COORD_SOCKET, --config or $COORD_CONFIG.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def client_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", "-c", help="cluster file, to find the daemon's socket")
        p.add_argument("--socket", help="the daemon's control socket")

    p = sub.add_parser("status", help="nodes (up/down, chip, memory, versions) and recent events",
                       description="Ask the daemon what the cluster is doing.")
    client_options(p)
    p.add_argument("--json", action="store_true", help="print the status document as JSON")
    p.add_argument("--watch", "-w", action="store_true", help="refresh until interrupted")
    p.add_argument("--all", action="store_true", help="every run of every job, not only each job's newest run")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes with --watch")
    p.add_argument("--events", type=int, default=10,
                   help="how many recent events to show (default 10; the daemon keeps them all, "
                        "up to 10,000 are shown)")
    p.add_argument("--check", action="store_true", help="exit 1 unless every node is up")
    p.add_argument("--history", action="store_true",
                   help="add the metrics history: each run's curves (loss, learning rate, tokens/s, validation "
                        "loss, each rank's memory) across its attempts with each restart, and each node's memory "
                        "and GPU use (with --json: the whole series)")
    p.add_argument("--run", metavar="RUN", help="with --history: this run (or job name) only")
    p.add_argument("--since", type=float, metavar="SECONDS",
                   help="with --history: only what is newer than this many seconds ago")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("sync", help="send the project tree to every node (only what each lacks)",
                       description="Hash the source tree on the head and each node's copy under its workdir, "
                                   "send only the files a node lacks or holds with other content, then check "
                                   "that every node agrees. Ignores .git, __pycache__, virtualenvs, checkpoints "
                                   "and what .coordignore (gitignore syntax) lists.")
    client_options(p)
    p.add_argument("--source", help="the project directory on this machine (default: sync.source)")
    p.add_argument("--delete", action="store_true", help="remove files on nodes that the source does not have")
    p.add_argument("--dry-run", action="store_true", help="say what would be sent or deleted, change nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_sync)

    p = sub.add_parser("calibrate", help="measure every node: matmul rate, memory bandwidth, training steps",
                       description="Measure every node at once with its own training Python: MLX matmul rate "
                                   "(float32, bfloat16), memory bandwidth, memory available, and a short "
                                   "training-step rate. Results are kept until --refresh or a node's chip, OS or "
                                   "MLX changes; the workload share per node follows from them.")
    client_options(p)
    p.add_argument("--refresh", action="store_true", help="measure again even if nothing changed")
    p.add_argument("--quick", action="store_true", help="a shorter, rougher measurement")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("preflight", help="every check a launch must pass, on all nodes at once",
                       description="Run the pre-flight checks on all nodes: reachability, agent, Python/mlx/mlx-lm "
                                   "and OS versions, code, script, data and model consistency, disk and checkpoint "
                                   "directory, memory, calibration, sync hook, RDMA and backend, hostfile. "
                                   "Exits 1 when any check fails.")
    client_options(p)
    p.add_argument("--backend", choices=["ring", "jaccl", "jaccl-ring"], help="check this backend instead of the "
                   "one chosen from the measured links")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("hostfile", help="write the mlx.launch hostfile chosen from the measured links",
                       description="Write the JSON hostfile mlx.launch reads: backend (jaccl for a full RDMA mesh, "
                                   "jaccl-ring for an RDMA ring, ring over TCP otherwise), each node's address on "
                                   "its best link, RDMA devices. Without -o it is printed on stdout (the advice on "
                                   "stderr). Each node's ssh entry is written as your own ssh reaches it: "
                                   "user@host, or your ~/.ssh/config alias as is, so `mlx.launch --hostfile FILE "
                                   "...` works from your shell wherever `ssh <entry>` does. A node that needs "
                                   "settings your ssh config lacks (the cluster file's port, identity_file, "
                                   "known_hosts, or an alias only its [ssh] config knows) is named by a Host "
                                   "entry coord writes to <state_dir>/ssh/coord_hosts.conf; coord prints the one "
                                   "Include line to add at the top of ~/.ssh/config and never edits that file. "
                                   "coord run does not need the line (its launches carry their own ssh config).")
    client_options(p)
    p.add_argument("-o", "--output", help="write it here")
    p.add_argument("--backend", choices=["ring", "jaccl", "jaccl-ring"], help="force a backend (checked against "
                   "the links)")
    p.add_argument("--json", action="store_true", help="print the hostfile, the backend choice, each node's ssh "
                   "entry and what it needs, the include file and its Include line (null when none is needed)")
    p.set_defaults(func=cmd_hostfile)

    p = sub.add_parser("plan", help="how to train a model on this cluster, from what coord measured",
                       description="A training plan (format version 2.0.0, or an orchestration document with "
                                   "--schema orchestration) from this cluster's facts, calibration, links, "
                                   "consistency, pre-flight and past launch and recovery times, the model's size "
                                   "(--model) and the data set (--data). Every value says where it comes from; a "
                                   "section that cannot be filled says why and what fills it.")
    client_options(p)
    p.add_argument("--model", help="the model directory on this machine (config.json, *.safetensors)")
    p.add_argument("--data", help="the data directory on this machine (train.jsonl, valid.jsonl)")
    p.add_argument("--fine-tune-type", choices=["lora", "dora", "full"])
    p.add_argument("--batch-size", type=int, help="examples per rank per micro-step")
    p.add_argument("--grad-accumulation-steps", type=int)
    p.add_argument("--learning-rate", type=float, help="the base learning rate, before scaling to the total batch")
    p.add_argument("--optimizer", choices=["adam", "adamw", "muon", "sgd", "adafactor"])
    p.add_argument("--lr-scaling", choices=["linear", "sqrt"], help="rule to scale the learning rate to the "
                   "total batch (default linear; sqrt for the Adam family)")
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--max-seq-length", type=int, default=2048, help="sequence length for the memory estimate")
    p.add_argument("--save-every", type=int)
    p.add_argument("--keep", type=int)
    p.add_argument("--trainer", choices=["mlx_lm", "coord"])
    p.add_argument("--replica", metavar="head|none|NODE")
    p.add_argument("--min-nodes", type=int)
    p.add_argument("--name", default="job", help="the job name the launch command and hostfile path use")
    p.add_argument("--schema", choices=["v2", "orchestration"], default="v2")
    p.add_argument("--input", metavar="FILE", help="an orchestration input document (modelConfig, dataConfig, "
                   "clusterConfig, trainingConfig)")
    p.add_argument("--json", action="store_true", help="print the whole document as JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("run", help="launch a distributed job with mlx.launch and keep it running",
                       description="Run pre-flight (stopping on a failure unless --force), sync (with --source), "
                                   "write the hostfile and start `mlx.launch`, one rank per node, each in its "
                                   "node's workdir with its node's Python. A failed rank, a lost node or a hang "
                                   "stops the job everywhere and resumes it from the newest valid checkpoint. "
                                   "`python -m mlx_lm lora ...` is understood (adapter path, --save-every, "
                                   "resume); any other command gets the COORD_* environment contract. Each "
                                   "run gets its own run id: a name run again starts a new run from step 0 (the "
                                   "earlier one stays readable), and only --resume NAME continues one.",
                       usage="coord run [options] -- COMMAND...  |  coord run JOB.toml")
    client_options(p)
    p.add_argument("--name", help="job name (default: job-DATE-TIME)")
    p.add_argument("--source", help="sync this project directory to every node first")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps (default 10)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts before the job fails (default 3)")
    p.add_argument("--hang-timeout", type=float, help="seconds without progress that count as a hang "
                   "(default: ten times the step time, at least 60)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints to keep (default 3)")
    p.add_argument("--force", action="store_true", help="launch even if pre-flight fails")
    p.add_argument("--backend", choices=["ring", "jaccl", "jaccl-ring"], help="force a backend")
    p.add_argument("--trainer", choices=["mlx_lm", "coord"], default="mlx_lm",
                   help="for `python -m mlx_lm lora ...`: mlx-lm's own trainer (default; a resume restores the "
                        "weights only) or coord's (agent.train: same options, and a resume restores the optimizer, "
                        "the learning-rate schedule, the RNG and the data order exactly)")
    p.add_argument("--replica", default="head", metavar="head|none|NODE",
                   help="copy each validated checkpoint here, off rank 0's machine, SHA256-checked "
                        "(default: the head's state directory)")
    p.add_argument("--min-nodes", type=int, help="let the job go on with at least this many nodes when one is "
                   "down longer than --node-timeout (same global batch; default: wait for every node)")
    p.add_argument("--node-timeout", type=float, default=60.0,
                   help="seconds a lost node is waited for before it may be left out (default 60)")
    p.add_argument("--total-steps", type=int, help="for a script of your own: its length in steps (it gets "
                   "COORD_TOTAL_STEPS; coord shows step/total and an ETA, and an attempt whose ranks all exit 0 "
                   "before it is restarted); mlx_lm lora's is its --iters")
    p.add_argument("--nodes", metavar="N1,N2", help="run on these nodes only (default: every node); the job holds "
                   "them while it runs, and jobs on disjoint nodes run side by side")
    p.add_argument("--priority", type=int, default=0, help="a job waiting for busy nodes starts before those of a "
                   "lower priority (default 0; first in, first out within a priority)")
    p.add_argument("--detach", action="store_true", help="return once submitted instead of following the job")
    p.add_argument("--resume", metavar="NAME", help="continue the newest run of job NAME (finished, failed or "
                   "stopped) from its newest valid checkpoint instead of starting a new run from step 0; with "
                   "-- COMMAND (e.g. a larger --iters) the run goes on with that command, else with its own")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND... or a job file")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("wait", help="block until a job ends; exit 0 only if it succeeded",
                       description="Follow a job until it succeeds, fails or is stopped.")
    client_options(p)
    p.add_argument("job")
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing while waiting")
    p.add_argument("--json", action="store_true", help="print the final job document as JSON")
    p.set_defaults(func=cmd_wait)

    p = sub.add_parser("stop", help="stop every rank of a job on every node",
                       description="Stop a job: every rank on every node is stopped and confirmed gone.")
    client_options(p)
    p.add_argument("job")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("cancel", help="remove a queued job from the queue",
                       description="A job waiting for its nodes (queued) leaves the queue without ever starting. "
                                   "A running job is stopped with coord stop.")
    client_options(p)
    p.add_argument("job")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("resize", help="bring nodes that are back into a running job at its next checkpoint",
                       description="A job that left out a lost node (--min-nodes) runs on fewer ranks. Once the "
                                   "node is back, resize relaunches the job on every node that is up, right after "
                                   "its next checkpoint, with the job's own batch again: nothing is redone.")
    client_options(p)
    p.add_argument("job")
    p.add_argument("--json", action="store_true", help="print the job document as JSON")
    p.set_defaults(func=cmd_resize)

    p = sub.add_parser("logs", help="a rank's output, per attempt, kept on the head",
                       description="Print a rank's output (kept on the head per attempt and per rank).")
    client_options(p)
    p.add_argument("job")
    p.add_argument("--rank", type=int, default=0, help="which rank (default 0)")
    p.add_argument("--attempt", type=int, help="which attempt (default: the current one)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing as the rank writes")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("init", help="write the cluster file: found on the hosts, or a commented example",
                       description="With --hosts: connect to each host as the daemon will (your ssh config, "
                                   "known_hosts and keys; key authentication only), find a Python with mlx and "
                                   "mlx-lm there (the login shell's python3, venvs and conda envs under the home, "
                                   "Homebrew's and the system's), propose a workdir under that user's home, check "
                                   "its free disk, and write a cluster file with a comment per node saying what "
                                   "was found. Nothing is written unless every host is ready; each one that is "
                                   "not says how to fix it. A host key not yet trusted is shown with its "
                                   "fingerprint and added only if you type yes (see: coord trust). "
                                   "Without --hosts: write a commented example to edit.",
                       usage="coord init --hosts [NAME=][USER@]HOST[:PORT],... [-o FILE] [options]  |  "
                             "coord init [PATH]")
    p.add_argument("path", nargs="?", help="where to write the example (default: coord.toml)")
    p.add_argument("--hosts", metavar="HOSTS", help="comma-separated [NAME=][USER@]HOST[:PORT]: an address or "
                   "a Host alias of your ssh config, e.g. alice@10.0.0.2,bob@mac-studio.local")
    p.add_argument("-o", "--output", help="write the cluster file here (default: coord.toml)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.add_argument("--name", default="cluster", help="the cluster's name (default: cluster)")
    p.add_argument("--workdir", default="coord-work", help="each node's workdir: relative to that user's home, "
                   "or absolute (default: coord-work, e.g. /Users/alice/coord-work)")
    p.add_argument("--known-hosts", help="verify host keys against this file, and write it into the cluster file "
                   "(default: ~/.ssh/known_hosts)")
    p.add_argument("--identity-file", "-i", help="log in with this key, and write it into the cluster file "
                   "(default: your ssh config and default keys)")
    p.add_argument("--ssh-config", help="read this ssh config instead of ~/.ssh/config, and write it into the "
                   "cluster file")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each SSH connection "
                   "(default 10)")
    p.add_argument("--json", action="store_true", help="print what was found on each host as JSON")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("trust", help="show a node's host key fingerprint and add it to known_hosts if you agree",
                       description="Fetch the host key NODE (a node of the cluster file) or HOST presents, show "
                                   "its SHA256 fingerprint as ssh does, and add it to the known_hosts the "
                                   "cluster uses ([ssh] known_hosts of the cluster file, else ~/.ssh/known_hosts) "
                                   "only when you type yes, or paste the fingerprint. Without a terminal it "
                                   "trusts nothing unless --fingerprint names the key: scripts must say which key "
                                   "they expect (there is no blind --yes). A key that differs from one already "
                                   "recorded for the host is refused.",
                       usage="coord trust NODE|HOST[:PORT] [--config FILE] [--fingerprint SHA256:...]")
    p.add_argument("host", metavar="NODE|HOST", help="a node name of the cluster file, or a host (address or ssh "
                   "alias, optionally user@ and :PORT)")
    p.add_argument("--config", "-c", help="the cluster file (default: $COORD_CONFIG): its node names, ssh "
                   "settings and known_hosts")
    p.add_argument("--fingerprint", metavar="SHA256:...", help="trust the key only if it has this fingerprint "
                   "(compare with `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on the node); "
                   "for scripts, no question asked")
    p.add_argument("--port", "-p", type=int, help="the host's SSH port (default: the ssh config's, or 22)")
    p.add_argument("--known-hosts", help="add the key to this file instead")
    p.add_argument("--ssh-config", help="read this ssh config instead of ~/.ssh/config")
    p.set_defaults(func=cmd_trust)

    p = sub.add_parser("daemon", help="run coordd in the foreground",
                       description="Run the daemon in the foreground (launchd and systemd run `coordd`, the same).")
    add_daemon_arguments(p)
    p.set_defaults(func=cmd_daemon)

    p = sub.add_parser("demo", help="start a local cluster on this machine and show its status",
                       description="Start coordd with two local nodes (no SSH needed), wait until they are up, "
                                   "and print `coord status`.")
    p.add_argument("--dir", default="demo-state", help="where the demo's cluster file, state and logs go")
    p.add_argument("--keep", action="store_true", help="leave the daemon running afterwards")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("agent-bundle", help="write the agent bundle zip (for deploy/install-agent.sh)",
                       description="Write the zip the daemon installs on nodes, to install it by hand.")
    p.add_argument("--output", "-o", default="coord-agent.zip")
    p.set_defaults(func=cmd_agent_bundle)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        sys.exit(EXIT_USAGE)
    try:
        sys.exit(args.func(args))
    except CliError as exc:
        print(f"coord: {exc}", file=sys.stderr)
        sys.exit(exc.status)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # `coord status | head`: the reader left, nothing to report
        sys.stderr.close()
        sys.exit(EXIT_OK)


if __name__ == "__main__":
    main()
