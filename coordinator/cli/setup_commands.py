"""The commands that set a cluster up, run in the CLI's own process: `coord init`, `trust`, `daemon`,
`demo` and `agent-bundle`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from coordinator.cli.client import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CliError
from coordinator.cli.json_output import print_json

#: coord init's options that shape what --hosts finds, with their defaults (None in the parser, so that
#: one given without --hosts is refused instead of ignored).
HOSTS_OPTIONS = {"name": "cluster", "workdir": "coord-work", "known_hosts": None, "identity_file": None,
                 "ssh_config": None, "timeout": 10.0, "json": False}


def cmd_init(args: argparse.Namespace) -> int:
    if args.output and args.path:
        raise CliError("give the file once: as PATH or with -o", EXIT_USAGE)
    if not args.hosts:
        unused = [key for key, default in HOSTS_OPTIONS.items() if getattr(args, key) not in (None, False)]
        if unused:
            flag = "--" + unused[0].replace("_", "-")
            raise CliError(f"{flag} applies only with --hosts (the example file is written as is): add --hosts "
                           f"USER@HOST,..., or leave {flag} out", EXIT_USAGE)
    for key, default in HOSTS_OPTIONS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    path = Path(args.output or args.path or "coord.toml")
    if path.exists() and not args.force:
        raise CliError(f"{path} already exists; use --force to overwrite it", EXIT_USAGE)
    if args.hosts:
        return _init_from_hosts(args, path)
    from coordinator.config.example_cluster import EXAMPLE_CLUSTER

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
    try:
        init.check_distinct_accounts(specs, ssh)
    except OnboardingError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
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
        print_json(init.as_json(path, written, reports))
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
