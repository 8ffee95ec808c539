"""How the head speaks SSH to a node: asyncssh options (key auth only, host keys verified, the
user's ssh config) and the errors that say why a node cannot be reached."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Required, TypedDict

import asyncssh

from coordinator.config.cluster_file import NodeConfig, SshSettings
from coordinator.config.ssh_destination import ssh_config_files

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


class NodeUnreachable(Exception):
    """The node could not be reached; ``reason`` is shown to the user as is."""

    def __init__(self, reason: str, *, retry: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry = retry


class UnknownHostKey(NodeUnreachable):
    """The node's host key is not in known_hosts; ``key`` is what it presented (None if unseen)."""

    def __init__(self, reason: str, *, key: asyncssh.SSHKey | None) -> None:
        super().__init__(reason)
        self.key = key


class ChangedHostKey(NodeUnreachable):
    """known_hosts holds another key of this type for the node: reinstalled, or someone in the middle.
    ``remove`` is the command that removes the old key, for the user to run once they know which."""

    def __init__(self, reason: str, *, key: asyncssh.SSHKey, remove: str) -> None:
        super().__init__(reason)
        self.key = key
        self.remove = remove


def known_hosts_path(ssh: SshSettings) -> Path:
    """The one known_hosts file coord reads and adds to: the cluster's [ssh] known_hosts, else the
    user's ~/.ssh/known_hosts. The ssh config's UserKnownHostsFile is not read, so that what coord
    trusts, what it refuses and what its fixes name is always this file (and ``UserKnownHostsFile
    none``, which asyncssh takes as no checking at all, cannot turn verification off)."""
    return Path(os.path.expanduser(ssh.known_hosts or DEFAULT_KNOWN_HOSTS))


class SshOptions(TypedDict, total=False):
    """Keyword arguments of asyncssh.connect, as coord sets them."""

    keepalive_interval: Required[float]
    keepalive_count_max: Required[int]
    connect_timeout: Required[float]
    password_auth: Required[bool]
    kbdint_auth: Required[bool]
    agent_forwarding: Required[bool]
    known_hosts: str | asyncssh.SSHKnownHosts
    client_keys: list[str]
    config: list[str]
    username: str
    port: int


def ssh_options(node: NodeConfig, ssh: SshSettings) -> SshOptions:
    """asyncssh.connect options for a node: key auth only, host keys verified, the user's ssh config."""
    options: SshOptions = {
        # The agent's heartbeat every keepalive_s (coordinator/nodes/session.py) proves the connection as SSH's
        # own keepalive would: that one is only the backstop for the moments no agent beats yet (connecting,
        # installing), at a fifth of the rate, not a second message per node.
        "keepalive_interval": max(5 * ssh.keepalive_s, 10.0),
        "keepalive_count_max": 3,
        "connect_timeout": ssh.connect_timeout_s,
        "password_auth": False,
        "kbdint_auth": False,
        "agent_forwarding": False,
    }
    # Always given: left unset, asyncssh would take the ssh config's UserKnownHostsFile, and None
    # (what `UserKnownHostsFile none` becomes) would turn verification off, which coord never does.
    # A file not made yet holds no keys, as for ssh: every host is unknown (and `coord trust` makes it).
    known = known_hosts_path(ssh)
    options["known_hosts"] = str(known) if known.exists() else asyncssh.import_known_hosts("")
    if ssh.identity_file:
        options["client_keys"] = [ssh.identity_file]
    files = ssh_config_files(ssh.config)
    if files:
        options["config"] = files
    if node.user:
        options["username"] = node.user
    if node.port:
        options["port"] = node.port
    return options
