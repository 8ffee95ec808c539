"""Hostfile entries as the user would write them, so plain ``mlx.launch --hostfile`` works.

mlx.launch reaches each rank with ``ssh <entry>`` from whoever runs it. So each node's
entry is ``user@host`` (or the user's own ssh alias, as is) whenever the user's plain ssh
already reaches the node with the cluster file's settings; ``ssh -G`` says what it would
use. A node that needs more (another port, a key or a known_hosts file the user's ssh
would not use, an alias only the cluster's own ssh config knows) gets a ``Host`` block in
a file coord writes, and the entry names that block. The one ``Include`` line that brings
the file into ``~/.ssh/config`` is printed: coord never edits that file.

coord's own launches do not go through here: they keep their private ssh config and
wrapper (coordinator.launch.hostfile), so they work before the user adds the line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio

from coordinator.config.cluster_file import ClusterConfig, NodeConfig, SshSettings
from coordinator.launch.hostfile import LOCAL_ADDRESS, HostfileError
from coordinator.nodes.ssh_view import SshView, SshViewError, resolve_ssh

INCLUDE_FILE = Path("ssh") / "coord_hosts.conf"  # under the cluster's state_dir

Resolver = Callable[..., Awaitable[SshView]]


@dataclass(frozen=True)
class UserEntry:
    """One node's ``ssh`` entry; ``needs`` (and ``block``) when the user's ssh alone cannot reach it."""

    node: str
    ssh: str
    needs: tuple[str, ...] = ()
    block: tuple[str, ...] = ()


@dataclass(frozen=True)
class UserSsh:
    entries: dict[str, UserEntry]
    include_file: str | None = None  # written only when some node needs a block
    include_line: str | None = None

    def names(self) -> dict[str, str]:
        return {name: entry.ssh for name, entry in self.entries.items()}

    def describe(self) -> dict[str, object]:
        """What ``coord hostfile --json`` carries besides the hostfile."""
        return {"entries": [{"node": e.node, "ssh": e.ssh, "needs": list(e.needs)} for e in self.entries.values()],
                "include_file": self.include_file, "include_line": self.include_line}


def host_alias(cluster: str, node: str) -> str:
    """The Host name of a node's block: lowercase, since ssh lowercases what it matches."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", cluster.lower()).strip("-.") or "cluster"
    return f"coord-{slug}-{node.lower()}"


def plain_destination(node: NodeConfig) -> str | None:
    """``user@host`` as typed on a command line, or None where ssh would misread it there.

    (The cluster file already refuses these; a Host block is the safe answer if one slips by.)"""
    words = [node.host] + ([node.user] if node.user else [])
    if any(not w or w.startswith("-") or "@" in w or any(c.isspace() or ord(c) < 32 for c in w) for w in words):
        return None
    return f"{node.user}@{node.host}" if node.user else node.host


def candidate_entry(node: NodeConfig, bare: SshView) -> str | None:
    """The user's own alias as is when it already names the cluster file's user, else ``user@host``."""
    destination = plain_destination(node)
    if destination is None:
        return None
    is_alias = bare.hostname != node.host.lower()
    if is_alias and (node.user is None or bare.user == node.user):
        return node.host
    return destination


def coord_identities(settings: SshSettings, wanted: SshView) -> tuple[str, ...]:
    """The keys coord itself offers: the cluster file's key, else what the ssh config gives."""
    if settings.identity_file:
        return (os.path.normpath(settings.identity_file),)
    return wanted.identity_files


def missing_settings(settings: SshSettings, wanted: SshView, plain: SshView) -> list[str]:
    """What the user's plain ssh would do differently from coord's own connection, in words."""
    needs = []
    if plain.hostname != wanted.hostname:
        needs.append(f"address {wanted.hostname}")
    if plain.user != wanted.user:
        needs.append(f"user {wanted.user}")
    if plain.port != wanted.port:
        needs.append(f"port {wanted.port}")
    # An explicit key must be offered; of the config's or default keys, only those that exist are.
    offered = [key for key in coord_identities(settings, wanted) if settings.identity_file or os.path.exists(key)]
    lacking = [key for key in offered if key not in plain.identity_files]
    if lacking:
        needs.append("identity file " + ", ".join(lacking))
    if settings.known_hosts and not plain.checks_known_hosts(settings.known_hosts):
        needs.append(f"known_hosts {os.path.normpath(settings.known_hosts)}")
    if (plain.proxy_jump, plain.proxy_command) != (wanted.proxy_jump, wanted.proxy_command):
        needs.append("proxy " + (wanted.proxy_jump or wanted.proxy_command or "none"))
    return needs


def host_block(alias: str, settings: SshSettings, wanted: SshView, needs: list[str]) -> tuple[str, ...]:
    """A Host block that gives plain ssh exactly coord's settings for one node."""
    lines = [f"Host {alias}", f"  HostName {config_value(wanted.hostname, tokens=True)}",
             f"  User {config_value(wanted.user, tokens=False)}", f"  Port {wanted.port}"]
    if settings.identity_file or any(n.startswith("identity file") for n in needs):
        lines += [f"  IdentityFile {config_value(key, tokens=True)}" for key in coord_identities(settings, wanted)]
        lines.append("  IdentitiesOnly yes")
    if settings.known_hosts:
        lines.append(f"  UserKnownHostsFile {config_value(os.path.normpath(settings.known_hosts), tokens=True)}")
    # ssh -G prints these as written, tokens and all: copied, not re-escaped.
    if wanted.proxy_jump:
        lines.append(f"  ProxyJump {wanted.proxy_jump}")
    if wanted.proxy_command:
        lines.append(f"  ProxyCommand {wanted.proxy_command}")
    # Ranks start unattended: a prompt would hang mlx.launch, and an unknown host key is refused.
    lines += ["  BatchMode yes", "  StrictHostKeyChecking yes"]
    return tuple(lines)


def config_value(value: str, *, tokens: bool) -> str:
    """One ssh_config argument: ``%`` doubled where ssh expands tokens, quoted when it has to be."""
    if not value or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise HostfileError(f"{value!r} cannot be written in an ssh config (empty, or a control character)")
    if tokens:
        value = value.replace("%", "%%")
    if not any(c.isspace() or c in "\"'#\\" for c in value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def include_line(path: str) -> str:
    return f"Include {config_value(path, tokens=True)}"


def render_include_file(cluster: str, path: str, entries: list[UserEntry]) -> str:
    lines = [f"# Written by `coord hostfile` for cluster {cluster!r}; rewritten each time, do not edit.",
             "# Each Host is a node that needs settings your own ssh config lacks; the hostfile names it.",
             "# Bring it into ~/.ssh/config with this line, at the top (before any Host or Match):",
             f"#   {include_line(path)}", ""]
    for entry in entries:
        lines += [f"# node {entry.node}: {'; '.join(entry.needs)}", *entry.block, ""]
    return "\n".join(lines)


def coord_ssh_config(settings: SshSettings) -> str:
    """The ssh config coord's own connections read (as coordinator.nodes.transport picks it)."""
    if settings.config:
        return settings.config
    user_config = os.path.expanduser("~/.ssh/config")
    return user_config if os.path.exists(user_config) else os.devnull


async def choose_entry(node: NodeConfig, config: ClusterConfig, resolve: Resolver = resolve_ssh) -> UserEntry:
    """One node's entry, from what coord connects with and what the user's plain ssh would do."""
    if node.is_local:
        return UserEntry(node.name, LOCAL_ADDRESS)
    settings = config.ssh
    try:
        wanted = await resolve(node.host, user=node.user, port=node.port, config_file=coord_ssh_config(settings))
        candidate = candidate_entry(node, await resolve(node.host)) if plain_destination(node) else None
        if candidate is None:
            needs = [f"a user or host name ssh cannot take on its command line ({node.address!r})"]
        else:
            needs = missing_settings(settings, wanted, await resolve(candidate))
    except SshViewError as exc:
        raise HostfileError(f"node {node.name}: {exc}") from None
    if candidate is not None and not needs:
        return UserEntry(node.name, candidate)
    alias = host_alias(config.name, node.name)
    return UserEntry(node.name, alias, tuple(needs), host_block(alias, settings, wanted, needs))


async def choose_entries(config: ClusterConfig, resolve: Resolver = resolve_ssh) -> dict[str, UserEntry]:
    found: dict[str, UserEntry] = {}

    async def one(node: NodeConfig) -> None:
        found[node.name] = await choose_entry(node, config, resolve)

    async with anyio.create_task_group() as tasks:
        for node in config.nodes:
            tasks.start_soon(one, node)
    return {node.name: found[node.name] for node in config.nodes}


def write_include_file(config: ClusterConfig, entries: dict[str, UserEntry]) -> UserSsh:
    """The Host blocks some nodes need, in ``<state_dir>/ssh/coord_hosts.conf``.

    With no node needing one, an earlier file is emptied (so an Include already added
    stays harmless) and no line is asked for."""
    path = config.state_dir / INCLUDE_FILE
    blocks = [entry for entry in entries.values() if entry.block]
    if not blocks and not path.exists():
        return UserSsh(entries)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    text = render_include_file(config.name, str(path), blocks)
    temporary = path.with_name(path.name + ".tmp")
    # ssh refuses a config file others can write; 0600 like ~/.ssh/config.
    temporary.write_text(text)
    os.chmod(temporary, 0o600)
    os.replace(temporary, path)
    if not blocks:
        return UserSsh(entries)
    return UserSsh(entries, str(path), include_line(str(path)))
