"""How the daemon reaches a node: a local subprocess, or an SSH session.

Both give the same two things: run a shell command to completion (installs,
checks), and start the agent as a long-running process whose stdin/stdout carry
the protocol. Everything above this module is the same for local and SSH nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import asyncssh

from coordinator.config.cluster_file import NodeConfig, SshSettings


class NodeUnreachable(Exception):
    """The node could not be reached; ``reason`` is shown to the user as is."""

    def __init__(self, reason: str, *, retry: bool = True):
        super().__init__(reason)
        self.reason = reason
        self.retry = retry


@dataclass
class CommandResult:
    exit_status: int | None
    stdout: bytes
    stderr: bytes


@dataclass
class AgentProcess:
    reader: Any
    writer: Any
    wait: Callable[[], Awaitable[int | None]]
    stderr: Any
    terminate: Callable[[], None]


class Transport(Protocol):
    async def run(self, command: str, input: bytes | None = None) -> CommandResult: ...
    async def start(self, command: str) -> AgentProcess: ...
    async def close(self) -> None: ...


class LocalTransport:
    """This machine, no SSH: the same shell commands through /bin/sh."""

    peer_address = "127.0.0.1"

    async def run(self, command: str, input: bytes | None = None) -> CommandResult:
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", command, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate(input)
        return CommandResult(proc.returncode, out, err)

    async def start(self, command: str) -> AgentProcess:
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", command, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            limit=2**20, start_new_session=True)

        def terminate() -> None:
            if proc.returncode is None:
                proc.kill()

        return AgentProcess(proc.stdout, proc.stdin, proc.wait, proc.stderr, terminate)

    async def close(self) -> None:
        return None


class SshTransport:
    """One asyncssh connection to a node: key auth only, host keys always verified."""

    def __init__(self, conn: asyncssh.SSHClientConnection):
        self._conn = conn
        peer = conn.get_extra_info("peername")
        # The address this head reached the node at: where the head sends a relay's bytes.
        self.peer_address: str | None = peer[0] if isinstance(peer, tuple) and peer else None

    @classmethod
    async def connect(cls, node: NodeConfig, ssh: SshSettings) -> SshTransport:
        options = ssh_options(node, ssh)
        try:
            conn = await asyncssh.connect(node.host, **options)
        except asyncssh.HostKeyNotVerifiable as exc:
            raise await unknown_host_key(node, ssh, exc) from None
        except asyncssh.PermissionDenied:
            who = node.user or "the default user"
            key = ssh.identity_file or "the default keys"
            raise NodeUnreachable(f"key authentication refused for {who} at {node.host} with {key}; "
                                  f"add the public key to that user's ~/.ssh/authorized_keys") from None
        except (TimeoutError, OSError, asyncssh.Error) as exc:
            text = str(exc) or exc.__class__.__name__
            raise NodeUnreachable(f"cannot connect to {node.address}: {text}") from None
        return cls(conn)

    async def run(self, command: str, input: bytes | None = None) -> CommandResult:
        result = await self._conn.run(command, input=input, encoding=None, check=False)
        return CommandResult(result.exit_status, result.stdout or b"", result.stderr or b"")

    async def start(self, command: str) -> AgentProcess:
        proc = await self._conn.create_process(command, encoding=None)

        async def wait() -> int | None:
            completed = await proc.wait(check=False)
            return completed.exit_status

        return AgentProcess(proc.stdout, proc.stdin, wait, proc.stderr, proc.close)

    async def close(self) -> None:
        self._conn.close()
        with contextlib.suppress(TimeoutError, OSError, asyncssh.Error):
            await asyncio.wait_for(self._conn.wait_closed(), 5)


class UnknownHostKey(NodeUnreachable):
    """The node's host key is not in known_hosts; ``key`` is what it presented (None if unseen)."""

    def __init__(self, reason: str, *, key: asyncssh.SSHKey | None):
        super().__init__(reason)
        self.key = key


def ssh_options(node: NodeConfig, ssh: SshSettings) -> dict[str, Any]:
    """asyncssh.connect options for a node: key auth only, host keys verified, the user's ssh config."""
    options: dict[str, Any] = {
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


async def unknown_host_key(node: NodeConfig, ssh: SshSettings, exc: Exception) -> UnknownHostKey:
    """Say which key the node presented and the command that trusts it, never trust it ourselves."""
    from coordinator.nodes.known_hosts import fetch_host_key, resolve_target

    target = resolve_target(node, ssh)
    port = target.port
    known = ssh.known_hosts or "~/.ssh/known_hosts"
    trust = f"coord trust {node.name}" + (f" --config {ssh.cluster_file}" if ssh.cluster_file else "")
    try:
        key = await fetch_host_key(target, ssh)
    except NodeUnreachable:  # best effort: the reason is still shown without the fingerprint
        key = None
    if key is not None:
        fingerprint = key.get_fingerprint("sha256")
        return UnknownHostKey(
            f"host key of {target.host}:{port} is not trusted ({key.get_algorithm()} {fingerprint}, "
            f"not in {known}: {exc}); if that fingerprint is the node's, trust it with: "
            f"{trust} --fingerprint {fingerprint}", key=key)
    return UnknownHostKey(f"host key of {target.host}:{port} is not trusted ({exc}); check it, then trust it "
                          f"with: {trust}", key=None)
