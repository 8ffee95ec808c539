"""The control socket: a Unix socket only its owner may use, speaking the coord protocol.

The socket lives in a 0700 directory and is itself 0600; a connection from any
other uid is refused even so (checked with the peer's credentials), because the
daemon can run commands on every node of the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import struct
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from shared.rpc import Dispatcher, Peer

# macOS: getsockopt(SOL_LOCAL=0, LOCAL_PEERCRED=1) returns a struct xucred.
_SOL_LOCAL, _LOCAL_PEERCRED = 0, 1


class ControlSocketError(Exception):
    pass


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process on the other end of a Unix socket, or None if unknown."""
    try:
        if hasattr(socket, "SO_PEERCRED"):
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _pid, uid, _gid = struct.unpack("3i", creds)
            return uid
        if sys.platform == "darwin":
            creds = sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERCRED, struct.calcsize("IIh16I"))
            return struct.unpack_from("II", creds)[1]
    except OSError:
        return None
    return None


def prepare_socket_dir(path: Path) -> None:
    """Make the socket's directory private (0700, ours), or refuse to use it."""
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = directory.stat()
    if info.st_uid != os.getuid():
        raise ControlSocketError(f"socket directory {directory} belongs to uid {info.st_uid}, not to us; "
                                 "choose another cluster.socket")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(directory, 0o700)


class ControlServer:
    def __init__(self, path: Path, dispatcher: Dispatcher):
        self.path = path
        self._dispatcher = dispatcher
        self._server: asyncio.AbstractServer | None = None
        self._peers: set[Peer] = set()
        import structlog  # the daemon's logger; kept out of the CLI's start-up time

        self.log = structlog.get_logger("control")

    async def start(self) -> None:
        prepare_socket_dir(self.path)
        if self.path.exists() or self.path.is_symlink():
            # Only reached while we hold the state-dir lock, so this is a crashed daemon's socket.
            self.path.unlink()
        old_umask = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._accept, path=str(self.path))
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for peer in list(self._peers):
            await peer.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        uid = peer_uid(writer.get_extra_info("socket"))
        if uid != os.getuid():
            self.log.warning("control connection refused", peer_uid=uid)
            writer.close()
            return
        peer = Peer(reader, writer, dispatcher=self._dispatcher, name="control", log=self.log)
        self._peers.add(peer)
        try:
            await peer.run()
        finally:
            self._peers.discard(peer)
            writer.close()


class DaemonNotRunning(Exception):
    pass


async def call_daemon(path: Path, method: str, args: Mapping[str, object] | None = None, *,
                      timeout: float | None = 30.0, on_event: Callable[[Any], Any] | None = None) -> Any:
    """One call to the daemon over its control socket (the client half).

    ``args`` and the answer are the method's own (each control method declares its arguments in
    the daemon's dispatch table), so they stay plain data here; ``on_event`` gets what a
    streaming method sends before its answer."""
    try:
        reader, writer = await asyncio.open_unix_connection(str(path))
    except (FileNotFoundError, NotADirectoryError, ConnectionRefusedError) as exc:
        raise DaemonNotRunning(str(exc)) from None
    peer = Peer(reader, writer, name="coord")
    runner = asyncio.ensure_future(peer.run())
    try:
        return await peer.call(method, args, timeout=timeout, on_event=on_event)
    finally:
        await peer.close()
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await runner
