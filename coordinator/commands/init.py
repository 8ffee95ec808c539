"""`coord init --hosts`: reach every host as the daemon will, ask what it has, write the cluster file.

The logic is in ``coordinator.nodes.onboarding`` (pure); this is the SSH layer around it: the same
asyncssh options as the daemon (the user's ssh config, known_hosts and keys; key
authentication only), two commands per host, all hosts at once. A host key nobody trusted
yet is shown and trusted only on the user's yes (``coordinator.commands.trust``).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO, TypedDict

import asyncssh

from coordinator.commands.trust import TrustRequest, decide_and_add, trust_command_for
from coordinator.config.accounts import shared_account
from coordinator.config.cluster_file import NodeConfig, SshSettings
from coordinator.config.ssh_destination import SshConfigUnreadable, resolve_account, ssh_config_files
from coordinator.nodes.known_hosts import SshTarget, TrustRefused, known_hosts_path, resolve_target
from coordinator.nodes.onboarding import (
    HostSpec,
    NodeReport,
    NodeReportDict,
    OnboardingError,
    assess,
    format_bytes,
    python_path,
)
from coordinator.nodes.onboarding_cluster_file import SshFileSettings, render_cluster
from coordinator.nodes.onboarding_probes import facts_command, parse_facts, parse_probe, probe_command, propose_workdir
from coordinator.nodes.ssh_settings import ChangedHostKey, NodeUnreachable, UnknownHostKey
from coordinator.nodes.transport import SshTransport

SURVEY_TIMEOUT_S = 120.0  # a node's answers, all candidate Pythons included


@dataclass
class Survey:
    """Every host's report, and the host keys waiting for the user's word."""

    reports: list[NodeReport]
    # node name -> the key it presented (None when even fetching it failed)
    unknown_keys: dict[str, asyncssh.SSHKey | None] = field(default_factory=dict)


def ssh_settings(*, known_hosts: str | None, identity_file: str | None, ssh_config: str | None,
                 timeout: float) -> SshSettings:
    return SshSettings(known_hosts=_absolute(known_hosts), identity_file=_absolute(identity_file),
                       config=_absolute(ssh_config), connect_timeout_s=timeout)


def check_distinct_accounts(specs: list[HostSpec], ssh: SshSettings) -> None:
    """No two hosts are one account on one machine as ssh reaches them (an alias and its address, say), which
    the cluster file would be refused for; the same spelling twice is parse_hosts' to refuse."""
    if len(specs) < 2:
        return
    files = ssh_config_files(ssh.config)
    try:
        accounts = [resolve_account(spec.host, spec.port, spec.user, files) for spec in specs]
    except SshConfigUnreadable as exc:
        raise OnboardingError(str(exc)) from None
    pair = shared_account(accounts)
    if pair is not None:
        first, second = specs[pair[0]], specs[pair[1]]
        raise OnboardingError(f"--hosts names {first.label} and {second.label}, which both log in as "
                              f"{accounts[pair[0]]}: give each node its own machine or user (several ranks on one "
                              "machine are one node with a PyTorch job's --procs-per-node)")


def as_node(name: str, spec: HostSpec) -> NodeConfig:
    # Python and workdir are what we are here to find; connecting reads only host, user and port.
    return NodeConfig(name=name, host=spec.host, user=spec.user, port=spec.port, python="", workdir="")


async def survey_host(name: str, spec: HostSpec, ssh: SshSettings, workdir: str) -> NodeReport:
    """Connect, ask for the facts and candidate Pythons, probe them, and assess the answers."""
    transport = await SshTransport.connect(as_node(name, spec), ssh)
    try:
        first = await transport.run(facts_command())
        if first.exit_status != 0:
            raise NodeUnreachable(f"{spec.label}: the facts command failed (exit {first.exit_status}): "
                                  f"{_last_line(first.stderr)}")
        facts = parse_facts(first.stdout.decode("utf-8", "replace"))
        where = propose_workdir(facts.home, workdir)
        second = await transport.run(probe_command(facts.candidates, where))
        if second.exit_status != 0:
            raise NodeUnreachable(f"{spec.label}: the probe failed (exit {second.exit_status}): "
                                  f"{_last_line(second.stderr)}")
        return assess(name, spec, facts, parse_probe(second.stdout.decode("utf-8", "replace")), where)
    finally:
        await transport.close()


async def survey(names: list[str], specs: list[HostSpec], ssh: SshSettings, workdir: str) -> Survey:
    """Every host at once; a host that cannot be asked gets a report saying why."""
    result = Survey(reports=[])

    async def one(name: str, spec: HostSpec) -> NodeReport:
        try:
            return await asyncio.wait_for(survey_host(name, spec, ssh, workdir), SURVEY_TIMEOUT_S)
        except UnknownHostKey as exc:
            result.unknown_keys[name] = exc.key
            return NodeReport(name=name, spec=spec, problem=f"the host key of {spec.label} is not trusted yet")
        except ChangedHostKey as exc:
            return NodeReport(name=name, spec=spec, problem=exc.reason, fix=f"{exc.remove} (only if the node was "
                                                                            "reinstalled)")
        except NodeUnreachable as exc:
            return NodeReport(name=name, spec=spec, problem=exc.reason)
        except OnboardingError as exc:
            return NodeReport(name=name, spec=spec, problem=f"{spec.label}: {exc}")
        except TimeoutError:
            return NodeReport(name=name, spec=spec, problem=f"{spec.label} did not answer within "
                                                             f"{SURVEY_TIMEOUT_S:g} s")
        except (OSError, asyncssh.Error) as exc:
            return NodeReport(name=name, spec=spec, problem=f"{spec.label}: lost the connection: {exc}")

    result.reports = list(await asyncio.gather(*(one(n, s) for n, s in zip(names, specs, strict=True))))
    return result


def settle_host_keys(found: Survey, specs: dict[str, HostSpec], ssh: SshSettings, *, interactive: bool,
                     out: TextIO = sys.stderr) -> list[str]:
    """Ask about each unknown host key in turn; returns the names whose key the user trusted.

    Without a terminal nothing is trusted: the report says which `coord trust` command to run.
    """
    trusted = []
    path = known_hosts_path(ssh)
    for report in found.reports:
        if report.name not in found.unknown_keys:
            continue
        key = found.unknown_keys[report.name]
        node = as_node(report.name, specs[report.name])
        target: SshTarget = resolve_target(node, ssh)
        command = trust_command_for(TrustRequest(node=node, ssh=ssh, known_hosts=path))
        if key is None:
            report.problem = f"the host key of {report.spec.label} is not trusted, and fetching it failed"
            report.fix = command
            continue
        report.host_key = {"algorithm": key.get_algorithm(), "fingerprint": key.get_fingerprint("sha256")}
        try:
            decide_and_add(target, key, path, expected=None, interactive=interactive, command=command, out=out)
        except TrustRefused as exc:
            report.problem = str(exc).split("\n")[0]
            if not interactive and exc.fix and "--fingerprint" in exc.fix:
                report.problem += " (no terminal to ask on: compare it with the node's own, then trust it)"
            report.fix = exc.fix
            continue
        trusted.append(report.name)
    return trusted


def write_cluster_file(path: Path, text: str, *, force: bool) -> None:
    """Written whole or not at all; an existing file is replaced only with force."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        if force:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if the file appeared since we checked
    finally:
        tmp.unlink(missing_ok=True)


def summary(report: NodeReport) -> list[str]:
    """A few lines per host for the terminal."""
    head = f"{report.name:<12} {report.spec.label}"
    if not report.ok:
        lines = [f"{head}  NOT READY: {report.problem}"]
        if report.fix:
            lines.append(f"{'':<12} fix: {report.fix}")
        return lines
    facts, py, disk = report.facts, report.python, report.disk
    assert facts is not None and py is not None
    system = ", ".join(x for x in (facts.os_version or facts.os, facts.arch, facts.chip) if x)
    free = f", {format_bytes(disk.free_bytes)} free" if disk else ""
    lines = [f"{head}  {system}",
             f"{'':<12} python  {python_path(py)} (Python {py.python}, mlx {py.mlx}, mlx-lm {py.mlx_lm})",
             f"{'':<12} workdir {report.workdir}{free}"]
    lines += [f"{'':<12} warning: {w}" for w in report.warnings]
    return lines


def render_file(cluster_name: str, ssh: SshSettings, reports: list[NodeReport], argv: list[str]) -> str:
    import shlex

    return render_cluster(cluster_name, SshFileSettings(known_hosts=ssh.known_hosts, identity_file=ssh.identity_file,
                                                        config=ssh.config), reports,
                          command=shlex.join(["coord", *argv]), when=time.strftime("%Y-%m-%d %H:%M %Z"))


class InitAnswer(TypedDict):
    """``coord init --json``."""

    path: str
    written: bool
    ok: bool
    nodes: list[NodeReportDict]


def as_json(path: Path, written: bool, reports: list[NodeReport]) -> InitAnswer:
    return {"path": str(path), "written": written, "ok": all(r.ok for r in reports),
            "nodes": [r.as_dict() for r in reports]}


def _absolute(path: str | None) -> str | None:
    return os.path.abspath(os.path.expanduser(path)) if path else None


def _last_line(data: bytes) -> str:
    lines = data.decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else "no error output"
