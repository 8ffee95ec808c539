"""The hostfile mlx.launch reads, and the SSH settings coord's own launches use to reach the nodes.

mlx.launch starts ranks with the plain ``ssh`` command, which reads only the
user's own ``~/.ssh/config``. So that coord's own launches reach each node with
exactly the cluster file's settings (user, port, key, known_hosts) without editing
that file, coord writes its own ssh config with one private ``Host`` alias per node
and a small ``ssh`` wrapper that adds ``-F`` to it, put first on mlx.launch's PATH.
The hostfile ``coord hostfile`` hands to users names nodes as their own ssh does
instead (coordinator.launch.user_hostfile).
"""

from __future__ import annotations

import ipaddress
import math
import os
import shlex
import shutil
import socket
from pathlib import Path
from typing import TypedDict

from coordinator.config.cluster_file import ClusterConfig, NodeConfig

BACKENDS = ("ring", "jaccl", "jaccl-ring")
LOCAL_ADDRESS = "127.0.0.1"  # mlx.launch runs a host named 127.0.0.1 without ssh


class HostfileError(ValueError):
    pass


class HostfileHost(TypedDict):
    """One rank's host in mlx.launch's hostfile."""

    ssh: str  # how ssh reaches it: coord's private alias, or the user's own entry
    ips: list[str]  # the addresses the other ranks connect to
    rdma: list[str | None]  # jaccl: the RDMA device toward each rank (None toward itself); ring: []


class Hostfile(TypedDict):
    """The JSON mlx.launch reads (``--hostfile``), one host per rank in rank order."""

    backend: str  # one of BACKENDS
    envs: list[str]  # NAME=value, for every rank
    hosts: list[HostfileHost]


def ssh_alias(node: NodeConfig) -> str:
    return LOCAL_ADDRESS if node.is_local else f"coord-{node.name}"


def render_ssh_config(config: ClusterConfig, *, outlive_silence_s: float | None = None) -> str:
    """An OpenSSH client config with one alias per node; host keys are always checked.

    ``outlive_silence_s``: how long a connection outlives a silent node before ssh gives up on it
    (keepalives every ``keepalive_s``). mlx.launch's connections carry its ranks: one that gives up
    hangs up on its rank once the path is back, so a head whose network blinked would lose ranks
    that trained through the blink. The supervisor, not ssh, decides when a node is lost."""
    interval = max(1, int(config.ssh.keepalive_s))
    count = max(3, math.ceil(outlive_silence_s / interval)) if outlive_silence_s else 3
    lines = ["# Written by coord for mlx.launch; regenerated on every launch.", ""]
    for node in config.nodes:
        if node.is_local:
            continue
        lines.append(f"Host {ssh_alias(node)}")
        lines.append(f"  HostName {node.host}")
        if node.user:
            lines.append(f"  User {node.user}")
        if node.port:
            lines.append(f"  Port {node.port}")
        if config.ssh.identity_file:
            lines.append(f"  IdentityFile {_quote_config(config.ssh.identity_file)}")
            lines.append("  IdentitiesOnly yes")
        # The one known_hosts coord checks (the cluster's, else ~/.ssh/known_hosts), whatever the
        # user's ssh config says: the daemon's own sessions and coord trust use no other.
        lines.append(f"  UserKnownHostsFile {_quote_config(config.ssh.known_hosts or '~/.ssh/known_hosts')}")
        lines.append("  StrictHostKeyChecking yes")
        lines.append("  BatchMode yes")
        lines.append("  PasswordAuthentication no")
        lines.append(f"  ServerAliveInterval {interval}")
        lines.append(f"  ServerAliveCountMax {count}")
        lines.append("")
    user_config = config.ssh.config or os.path.expanduser("~/.ssh/config")
    if os.path.exists(user_config):
        # Aliases and options from the user's own config still apply to the rest.
        lines += ["Match all", f"  Include {_quote_config(user_config)}", ""]
    return "\n".join(lines)


def _quote_config(value: str) -> str:
    return f'"{value}"' if any(c.isspace() for c in value) else value


def write_ssh_wrapper(directory: Path, ssh_config: Path) -> Path:
    """``directory/ssh``: the real ssh with coord's config; put ``directory`` first on PATH."""
    real = None
    for entry in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
        candidate = Path(entry) / "ssh"
        if entry and Path(entry).resolve() != directory.resolve() and os.access(candidate, os.X_OK):
            real = str(candidate)
            break
    real = real or shutil.which("ssh") or "/usr/bin/ssh"
    directory.mkdir(parents=True, exist_ok=True)
    wrapper = directory / "ssh"
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(real)} -F {shlex.quote(str(ssh_config))} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def node_address(node: NodeConfig) -> str:
    """The address other ranks use to reach a node when nothing better was measured."""
    if node.is_local:
        return LOCAL_ADDRESS
    if node.ips:
        return node.ips[0]
    try:
        return str(ipaddress.ip_address(node.host))
    except ValueError:
        pass
    try:
        return str(socket.getaddrinfo(node.host, None, socket.AF_INET)[0][4][0])  # AF_INET: (address, port)
    except OSError:
        raise HostfileError(f"cannot resolve {node.host} (node {node.name}) to an address for the ring; "
                            f"set ips = [\"...\"] for it in the cluster file") from None


def build_hostfile(config: ClusterConfig, *, backend: str = "ring", ips: dict[str, list[str]] | None = None,
                   rdma: dict[str, list[str | None]] | None = None, envs: list[str] | None = None,
                   nodes: list[str] | None = None, ssh_names: dict[str, str] | None = None) -> Hostfile:
    """The JSON mlx.launch accepts as is, one host per node in rank order.

    Each host's ``ssh`` is coord's private alias (for coord's own launches, through its
    ssh wrapper) unless ``ssh_names`` gives the node's entry as the user's ssh reaches it
    (coordinator.launch.user_hostfile)."""
    if backend not in BACKENDS:
        raise HostfileError(f"unknown backend {backend!r} (one of {', '.join(BACKENDS)})")
    by_name = {n.name: n for n in config.nodes}
    order = nodes or [n.name for n in config.nodes]
    hosts: list[HostfileHost] = []
    for name in order:
        node = by_name[name]
        host_ips = list((ips or {}).get(name) or [node_address(node)])
        ssh = (ssh_names or {}).get(name) or ssh_alias(node)
        hosts.append({"ssh": ssh, "ips": host_ips, "rdma": list((rdma or {}).get(name, []))})
    if backend.startswith("jaccl") and any(not h["rdma"] for h in hosts):
        raise HostfileError(f"backend {backend} needs RDMA devices for every node")
    document: Hostfile = {"backend": backend, "envs": list(envs or []), "hosts": hosts}
    validate_hostfile(document)
    return document


def validate_hostfile(document: object) -> None:
    """Refuse a hostfile mlx.launch would choke on, saying where."""
    if not isinstance(document, dict):
        raise HostfileError("hostfile must be a JSON object with backend, envs and hosts")
    if document.get("backend") not in BACKENDS:
        raise HostfileError(f"hostfile backend {document.get('backend')!r} is not one of {', '.join(BACKENDS)}")
    envs = document.get("envs", [])
    if not isinstance(envs, list) or not all(isinstance(e, str) and "=" in e and
                                             e.split("=", 1)[0].replace("_", "a").isalnum() for e in envs):
        raise HostfileError("hostfile envs must be a list of NAME=value strings")
    hosts = document.get("hosts")
    if not isinstance(hosts, list) or not hosts:
        raise HostfileError("hostfile hosts must be a non-empty list")
    for i, host in enumerate(hosts):
        if not isinstance(host, dict) or not isinstance(host.get("ssh"), str) or not host["ssh"]:
            raise HostfileError(f"hosts[{i}].ssh must be a host name")
        ips = host.get("ips")
        if not isinstance(ips, list) or not ips:
            raise HostfileError(f"hosts[{i}].ips must list at least one address (the ring backend needs it)")
        for ip in ips:
            try:
                ipaddress.ip_address(ip)
            except (ValueError, TypeError):
                raise HostfileError(f"hosts[{i}].ips: {ip!r} is not an IP address") from None
        if not isinstance(host.get("rdma", []), list):
            raise HostfileError(f"hosts[{i}].rdma must be a list")
