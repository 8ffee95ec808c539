"""`coord trust`: add a node's host key to the known_hosts the cluster uses, on the user's word.

The key is fetched from the node and its SHA256 fingerprint shown, as ssh shows it; it is
added only when the user types yes (or pastes the fingerprint) at a terminal, or when
``--fingerprint`` names it. Without a terminal and without ``--fingerprint`` nothing is
added: a script has to say which key it expects.
"""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import asyncssh

from coordinator.config.cluster_file import ClusterConfig, NodeConfig, SshSettings
from coordinator.nodes.host_key_verdict import host_key_file_type
from coordinator.nodes.known_hosts import (
    SshTarget,
    TrustRefused,
    append_known_host,
    check_can_add,
    fetch_host_key,
    fingerprint,
    fingerprint_matches,
    known_entries,
    known_hosts_path,
    resolve_target,
    trust_command,
)
from coordinator.nodes.onboarding import OnboardingError, parse_host_spec


@dataclass(frozen=True)
class TrustRequest:
    """Where the key comes from and where it goes."""

    node: NodeConfig  # only its host, user and port are used
    ssh: SshSettings
    known_hosts: Path
    cluster_file: Path | None = None  # set when the node was named from a cluster file


def request_for(name_or_host: str, config: ClusterConfig | None, *, port: int | None = None,
                known_hosts: str | None = None, ssh_config: str | None = None,
                timeout: float = 10.0) -> TrustRequest:
    """A node of the cluster file by name (or host), else HOST[:PORT] with the given ssh settings."""
    node = None
    if config is not None:
        node = next((n for n in config.nodes if n.name == name_or_host), None) or next(
            (n for n in config.nodes if n.host == name_or_host and (port is None or n.port == port)), None)
        if node is not None and node.is_local:
            raise TrustRefused(f"node {node.name} is this machine (host = \"local\"): it has no host key to trust")
    ssh = config.ssh if config is not None else SshSettings(connect_timeout_s=timeout)
    if ssh_config or known_hosts:
        ssh = SshSettings(known_hosts=_absolute(known_hosts) or ssh.known_hosts,
                          identity_file=ssh.identity_file, config=_absolute(ssh_config) or ssh.config,
                          keepalive_s=ssh.keepalive_s, connect_timeout_s=ssh.connect_timeout_s)
    if node is None:
        try:
            spec = parse_host_spec(name_or_host)
        except OnboardingError as exc:
            raise TrustRefused(str(exc).replace("--hosts: ", "")) from None
        if spec.port and port and spec.port != port:
            raise TrustRefused(f"{name_or_host} names port {spec.port} but --port says {port}")
        node = NodeConfig(name=spec.name or spec.host, host=spec.host, python="", workdir="",
                          port=port or spec.port)
        return TrustRequest(node=node, ssh=ssh, known_hosts=known_hosts_path(ssh))
    return TrustRequest(node=node, ssh=ssh, known_hosts=known_hosts_path(ssh),
                        cluster_file=config.path if config is not None else None)


def trust_host(request: TrustRequest, *, expected: str | None, interactive: bool,
               out: TextIO = sys.stdout) -> str:
    """Fetch the key, then add it if the user says so; returns a one-line result.

    Raises TrustRefused when nothing may be added, with the reason and what to do.
    """
    target = resolve_target(request.node, request.ssh)
    # A key of the types already recorded for the host, as a connection would negotiate: a changed key
    # is then compared with its own type's old one and refused as changed, as the daemon reports it.
    recorded = [entry.key for entry in known_entries(request.known_hosts, target) if entry.marker is None]
    key = asyncio.run(fetch_host_key(target, request.ssh, like=recorded))
    return decide_and_add(target, key, request.known_hosts, expected=expected, interactive=interactive,
                          command=trust_command_for(request), out=out)


def decide_and_add(target: SshTarget, key: asyncssh.SSHKey, path: Path, *, expected: str | None,
                   interactive: bool, command: str, out: TextIO = sys.stderr) -> str:
    """The one place a host key is trusted: a matching --fingerprint, or a yes at a terminal."""
    shown = f"{target.known_hosts_name} {key.get_algorithm()} {fingerprint(key)}"
    if not check_can_add(path, target, key, trust_command=command):
        return f"{shown} is already trusted in {path}"
    if expected is not None:
        if not fingerprint_matches(expected, key):
            raise TrustRefused(f"{target.host}:{target.port} presents {key.get_algorithm()} {fingerprint(key)}, "
                               f"not {expected}: nothing added to {path}")
    elif not interactive:
        raise TrustRefused(
            f"host key of {target.host}:{target.port} is not known: {key.get_algorithm()} {fingerprint(key)}.\n"
            f"Not trusted: no terminal to ask on. Compare that fingerprint with the node's own (on the node: "
            f"ssh-keygen -lf /etc/ssh/ssh_host_{host_key_file_type(key)}_key.pub), then trust it with:\n"
            f"  {command} --fingerprint {fingerprint(key)}", fix=f"{command} --fingerprint {fingerprint(key)}")
    elif not ask_user(target, key, path, out=out):
        raise TrustRefused(f"not trusted: nothing added to {path}")
    append_known_host(path, target, key)
    return f"added {shown} to {path}"


def ask_user(target: SshTarget, key: asyncssh.SSHKey, path: Path, *, out: TextIO = sys.stderr,
             answers: TextIO = sys.stdin) -> bool:
    """ssh's question: only "yes" or the fingerprint itself trusts the key."""
    out.write(f"The authenticity of host '{target.known_hosts_name}' can't be established.\n"
              f"{host_key_file_type(key).upper()} key fingerprint is {fingerprint(key)}.\n"
              f"Trust it and add it to {path}? (yes/no/[fingerprint]) ")
    out.flush()
    while True:
        answer = answers.readline()
        if not answer:
            out.write("\n")
            return False
        answer = answer.strip()
        if answer.lower() == "yes" or (answer.startswith("SHA256:") and fingerprint_matches(answer, key)):
            return True
        if answer.lower() in ("no", "n"):
            return False
        if answer.startswith("SHA256:"):
            out.write("That is not this key's fingerprint. Please type 'yes', 'no' or the fingerprint: ")
        else:
            out.write("Please type 'yes', 'no' or the fingerprint: ")
        out.flush()


def trust_command_for(request: TrustRequest) -> str:
    """The `coord trust` command for this host, with the options needed to reach it the same way."""
    return trust_command(request.node, request.ssh, str(request.cluster_file) if request.cluster_file else None)


def _absolute(path: str | None) -> str | None:
    return os.path.abspath(os.path.expanduser(path)) if path else None
