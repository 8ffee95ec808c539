"""What the ssh config makes of a node's host, port and user: the one place coord applies it.

asyncssh reads the config as it connects (HostName, Port, User, HostKeyAlias, ProxyJump and
ProxyCommand); this asks it the same question without connecting, for what must agree with
the connection: the name a host key is filed under, and which account a node logs in to.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.config.accounts import Account, account

DEFAULT_SSH_CONFIG = "~/.ssh/config"


class SshConfigUnreadable(Exception):
    """The ssh config cannot be read or parsed; the message names the file."""


@dataclass(frozen=True)
class Destination:
    """Where ssh goes for a node, after its config."""

    host: str  # after HostName
    port: int  # the node's port, else the config's Port, else 22
    user: str  # the node's user, else the config's User, else the local user
    key_alias: str | None = None  # HostKeyAlias: the name its host key is filed under instead of the host
    via: str | None = None  # ProxyJump or ProxyCommand: the same address behind another jump is another machine


def ssh_config_files(configured: str | None) -> list[str]:
    """The ssh config coord honours: the cluster's [ssh] config, else ~/.ssh/config when there is one."""
    if configured:
        return [configured]
    default = os.path.expanduser(DEFAULT_SSH_CONFIG)
    return [default] if os.path.exists(default) else []


def resolve_destination(host: str, port: int | None, user: str | None, config_files: Sequence[str]) -> Destination:
    """Apply the ssh config as asyncssh will when it connects (nothing is connected to)."""
    import asyncssh  # a second of import on a small machine: only where a node is reached over SSH

    try:
        options = asyncssh.SSHClientConnectionOptions(host=host, port=port or (), username=user or (),
                                                      config=list(config_files))
    except (OSError, ValueError, asyncssh.Error) as exc:
        files = ", ".join(config_files) or "no ssh config"
        raise SshConfigUnreadable(f"cannot read the ssh config ({files}) for {host}: {exc}") from None
    proxy = options.proxy_command
    via = options.tunnel if isinstance(options.tunnel, str) else None
    if via is None and proxy:
        via = " ".join(proxy) if isinstance(proxy, (list, tuple)) else str(proxy)
    return Destination(host=str(options.host), port=int(options.port), user=str(options.username),
                       key_alias=options.host_key_alias, via=via)


def resolve_account(host: str, port: int | None, user: str | None, config_files: Sequence[str]) -> Account:
    """The account a node logs in to, as ssh reaches it."""
    found = resolve_destination(host, port, user, config_files)
    return account(found.host, found.port, found.user, found.via)
