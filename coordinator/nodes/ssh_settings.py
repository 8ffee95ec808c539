"""How the head speaks SSH to a node: asyncssh options (key auth only, host keys verified, the
user's ssh config) and the errors that say why a node cannot be reached."""

from __future__ import annotations

import os
from typing import Required, TypedDict

import asyncssh

from coordinator.config.cluster_file import NodeConfig, SshSettings


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
        "keepalive_interval": ssh.keepalive_s,
        "keepalive_count_max": 3,
        "connect_timeout": ssh.connect_timeout_s,
        "password_auth": False,
        "kbdint_auth": False,
        "agent_forwarding": False,
    }
    # Leaving known_hosts unset means ~/.ssh/known_hosts; passing None would turn
    # verification off, which coord never does.
    if ssh.known_hosts:
        # A file not made yet holds no keys, as for ssh: every host is unknown (and `coord trust` makes it).
        exists = os.path.exists(os.path.expanduser(ssh.known_hosts))
        options["known_hosts"] = ssh.known_hosts if exists else asyncssh.import_known_hosts("")
    if ssh.identity_file:
        options["client_keys"] = [ssh.identity_file]
    if ssh.config:
        options["config"] = [ssh.config]
    elif os.path.exists(os.path.expanduser("~/.ssh/config")):
        options["config"] = [os.path.expanduser("~/.ssh/config")]
    if node.user:
        options["username"] = node.user
    if node.port:
        options["port"] = node.port
    return options
