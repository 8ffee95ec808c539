"""The rendezvous probe: can every node reach the master address and port a PyTorch job will use?

Rank 0's node opens a TCP listener on the master port, on every interface as torch's TCPStore
does (``listen``); every node, rank 0's included, resolves the master address as the ranks will
be given it and connects to it (``connect``); the listener is closed (``close``). The listener
sends the caller's token to each connection, so a connector knows it reached this probe and not
whatever else may answer on that port. A listener closes by itself after its time, so none
outlives a daemon that forgot it.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
import time
from typing import TYPE_CHECKING

from shared import protocol as p
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from shared.agent_api.torch import RendezvousCloseReply, RendezvousConnectReply, RendezvousListenReply

MAX_LISTEN_S = 300.0
MAX_CONNECT_S = 60.0
MAX_TOKEN = 128


class Rendezvous:
    """The listeners this agent holds open, by port."""

    def __init__(self) -> None:
        self._servers: dict[int, asyncio.AbstractServer] = {}
        self._accepted: dict[int, int] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}

    async def listen(self, port: int, token: str, seconds: float = 60.0) -> RendezvousListenReply:
        _check_port(port)
        _check_token(token)
        if not 0 < seconds <= MAX_LISTEN_S:
            raise RemoteError(p.BAD_ARGS, f"seconds must be in (0, {MAX_LISTEN_S:g}], got {seconds!r}")
        if port in self._servers:
            return {"listening": True, "port": port, "detail": f"coord's probe already listens on port {port}"}
        greeting = token.encode("utf-8") + b"\n"
        self._accepted[port] = 0

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._accepted[port] = self._accepted.get(port, 0) + 1
            try:
                writer.write(greeting)
                await writer.drain()
            except OSError:
                pass  # the connector went away first: its own answer says so
            finally:
                writer.close()

        try:
            server = await _start_server(answer, port)
        except OSError as error:
            self._accepted.pop(port, None)
            if error.errno == errno.EADDRINUSE:
                return {"listening": False, "port": port,
                        "detail": f"port {port} is in use on this node (another job's rendezvous, or another "
                                  "service): the job's master port must be free"}
            return {"listening": False, "port": port,
                    "detail": f"cannot listen on port {port}: {error.strerror or error}"}
        self._servers[port] = server
        loop = asyncio.get_running_loop()
        self._timers[port] = loop.call_later(seconds, lambda: asyncio.ensure_future(self.close(port)))
        return {"listening": True, "port": port, "detail": f"listening on port {port} for {seconds:g} s"}

    async def connect(self, host: str, port: int, token: str, timeout: float = 10.0) -> RendezvousConnectReply:
        """Resolve ``host`` here and connect to ``port`` at each address until the probe answers."""
        _check_port(port)
        _check_token(token)
        if not host or len(host) > 253 or any(c.isspace() for c in host):
            raise RemoteError(p.BAD_ARGS, f"host must be an address or a name, got {host!r}")
        if not 0 < timeout <= MAX_CONNECT_S:
            raise RemoteError(p.BAD_ARGS, f"timeout must be in (0, {MAX_CONNECT_S:g}], got {timeout!r}")
        reply: RendezvousConnectReply = {"host": host, "port": port, "resolved": [], "loopback": False,
                                         "connected": False, "detail": ""}
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout)
        except (OSError, TimeoutError) as error:
            reply["detail"] = f"{host} does not resolve on this node: {_reason(error)}"
            return reply
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        reply["resolved"] = addresses
        reply["loopback"] = bool(addresses) and all(_is_loopback(address) for address in addresses)
        failures = []
        for address in addresses:
            started = time.monotonic()
            try:
                answer = await asyncio.wait_for(_greeting(address, port), timeout)
            except (OSError, TimeoutError) as error:
                failures.append(f"{address}:{port} {_reason(error)}")
                continue
            if answer != token:
                failures.append(f"{address}:{port} answers, but not as coord's probe (another service holds the port)")
                continue
            reply["connected"] = True
            reply["detail"] = (f"connected to {address}:{port} in {(time.monotonic() - started) * 1000:.0f} ms"
                               + (f" ({host} resolves to {', '.join(addresses)})" if host != address else ""))
            return reply
        reply["detail"] = "; ".join(failures) or f"{host} resolves to no address"
        return reply

    async def close(self, port: int) -> RendezvousCloseReply:
        _check_port(port)
        timer = self._timers.pop(port, None)
        if timer is not None:
            timer.cancel()
        server = self._servers.pop(port, None)
        accepted = self._accepted.pop(port, 0)
        if server is None:
            return {"closed": False, "accepted": accepted}
        server.close()
        await server.wait_closed()
        return {"closed": True, "accepted": accepted}

    async def close_all(self) -> None:
        for port in list(self._servers):
            await self.close(port)


async def _start_server(answer: object, port: int) -> asyncio.AbstractServer:
    """Every interface, IPv4 and IPv6 (as torch's TCPStore binds); IPv4 alone where IPv6 is off."""
    try:
        return await asyncio.start_server(answer, host=None, port=port)  # type: ignore[arg-type]
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise
        return await asyncio.start_server(answer, host="0.0.0.0", port=port)  # type: ignore[arg-type]


async def _greeting(address: str, port: int) -> str:
    reader, writer = await asyncio.open_connection(address, port)
    try:
        line = await reader.readline()
    finally:
        writer.close()
    return line.decode("utf-8", "replace").strip()


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _reason(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timed out (a firewall dropping the packets, or no route)"
    if isinstance(error, ConnectionRefusedError):
        return "refused (nothing listens there: a firewall rejecting it, or the wrong address)"
    if isinstance(error, socket.gaierror):
        return error.strerror or str(error)
    return (error.strerror if isinstance(error, OSError) and error.strerror else str(error)) or type(error).__name__


def _check_port(port: int) -> None:
    if not 1 <= port <= 65535:
        raise RemoteError(p.BAD_ARGS, f"port must be in 1..65535, got {port!r}")


def _check_token(token: str) -> None:
    if not token or len(token) > MAX_TOKEN or not token.isprintable() or "\n" in token:
        raise RemoteError(p.BAD_ARGS, "token must be 1 to 128 printable characters")
