"""How the daemon reaches a node: a local subprocess, or an SSH session.

Both give the same two things: run a shell command to completion (installs,
checks), and start the agent as a long-running process whose stdin/stdout carry
the protocol. Everything above this module is the same for local and SSH nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import asyncssh

from coordinator.config.cluster_file import NodeConfig, SshSettings
from coordinator.nodes.known_hosts import refused_host_key
from coordinator.nodes.ssh_settings import NodeUnreachable, UnknownHostKey, ssh_options
from shared.rpc import Reader, Writer

__all__ = ["NodeUnreachable", "UnknownHostKey", "ssh_options"]  # what callers of the transport catch and use


@dataclass
class CommandResult:
    exit_status: int | None
    stdout: bytes
    stderr: bytes


class LineReader(Protocol):
    """The agent's stderr: asyncio's StreamReader or asyncssh's SSHReader, read a line at a time."""

    async def readline(self) -> bytes: ...


@dataclass
class AgentProcess:
    reader: Reader  # the agent's stdout: frames from it
    writer: Writer  # its stdin: frames to it
    wait: Callable[[], Awaitable[int | None]]
    stderr: LineReader
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

        assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None  # all three are pipes
        return AgentProcess(proc.stdout, proc.stdin, proc.wait, proc.stderr, terminate)

    async def close(self) -> None:
        return None


class SshTransport:
    """One asyncssh connection to a node: key auth only, host keys always verified."""

    def __init__(self, conn: asyncssh.SSHClientConnection) -> None:
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
            raise await refused_host_key(node, ssh, exc) from None
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
        return CommandResult(result.exit_status, _as_bytes(result.stdout), _as_bytes(result.stderr))

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


def _as_bytes(output: bytes | str | None) -> bytes:
    """A command's output: bytes, since it runs without an encoding (asyncssh types it either way)."""
    if isinstance(output, str):
        return output.encode()
    return output or b""
