"""The link probe of ``coord doctor``: throughput each way and round-trip latency between two nodes,
over the address coord would put in the hostfile, and the route the kernel takes toward the peer.

One node listens on its link address (``listen``: a port the kernel picks, closed by itself after
its time), the other connects from its own link address and measures (``measure``): a few pings,
then bytes up (it sends, the listener counts them and answers with the total), then bytes down (the
listener sends). Each direction stops at its byte count or its share of the time limit, whichever
comes first, so a slow link costs time, never more than that. Blocking sockets in threads: the
agent's event loop keeps answering pings while megabytes go by.

Wire, after the connector's ``token\\n`` and the listener's ``coord-link\\n``: lines ``ping`` (answered
``pong``), ``up SECONDS`` (then chunks, each a 4-byte length and its bytes, ended by a zero length;
answered ``got BYTES SECONDS``, as the listener counted them), ``down BYTES SECONDS`` (chunks the same
way, from the listener).
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import struct
import sys
import threading
import time
from typing import TYPE_CHECKING, BinaryIO

from agent import route_parsers
from agent.topology import run_command
from shared import protocol as p
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from shared.agent_api.link import LinkCloseReply, LinkListenReply, LinkMeasureReply, LinkRouteReply

MAX_LISTEN_S = 300.0
MAX_MEASURE_S = 120.0
MAX_BYTES = 8 * 2**30
MAX_PINGS = 50
MAX_TOKEN = 128
CHUNK = 256 * 1024
GREETING = b"coord-link\n"
_LENGTH = struct.Struct("!I")
_ZEROS = bytes(CHUNK)


class LinkProbes:
    """The probe listeners this agent holds open, by port."""

    def __init__(self) -> None:
        self._listeners: dict[int, _Listener] = {}

    async def listen(self, address: str, token: str, seconds: float = 60.0) -> LinkListenReply:
        _check_token(token)
        _check_host(address, "address")
        if not 0 < seconds <= MAX_LISTEN_S:
            raise RemoteError(p.BAD_ARGS, f"seconds must be in (0, {MAX_LISTEN_S:g}], got {seconds!r}")
        try:
            listener = _Listener(address, token, seconds)
        except OSError as error:
            return {"listening": False, "port": 0, "address": address,
                    "detail": f"cannot listen on {address}: {error.strerror or error} (is the address still this "
                              "node's? its interface may be down or renumbered)"}
        self._listeners[listener.port] = listener
        listener.start(on_end=lambda: self._listeners.pop(listener.port, None))
        return {"listening": True, "port": listener.port, "address": address,
                "detail": f"listening on {address}:{listener.port} for {seconds:g} s"}

    async def close(self, port: int) -> LinkCloseReply:
        listener = self._listeners.pop(port, None)
        if listener is None:
            return {"closed": False, "served": 0}
        await asyncio.to_thread(listener.stop)
        return {"closed": True, "served": listener.served}

    async def close_all(self) -> None:
        for port in list(self._listeners):
            await self.close(port)


class _Listener:
    def __init__(self, address: str, token: str, seconds: float) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._socket.bind((address, 0))
            self._socket.listen(4)
        except OSError:
            self._socket.close()
            raise
        self._socket.settimeout(0.2)
        self.port: int = self._socket.getsockname()[1]
        self._token = token.encode("utf-8")
        self._deadline = time.monotonic() + seconds
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.served = 0

    def start(self, on_end: object) -> None:
        def run() -> None:
            try:
                self._accept_until_done()
            finally:
                self._socket.close()
                if callable(on_end):
                    on_end()

        self._thread = threading.Thread(target=run, name=f"link-probe-{self.port}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _accept_until_done(self) -> None:
        while not self._stopping.is_set() and time.monotonic() < self._deadline:
            try:
                connection, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.served += 1
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            connection.settimeout(max(self._deadline - time.monotonic(), 0.1))
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stream = connection.makefile("rb")
            try:
                if stream.readline(MAX_TOKEN + 2).rstrip(b"\n") != self._token:
                    return  # not coord's probe: say nothing
                connection.sendall(GREETING)
                while not self._stopping.is_set():
                    words = stream.readline(200).split()
                    if not words:
                        return
                    self._answer(words, stream, connection)
            except (OSError, ValueError):
                return  # the connector gone or its time up: its own answer says so
            finally:
                stream.close()

    @staticmethod
    def _answer(words: list[bytes], stream: BinaryIO, connection: socket.socket) -> None:
        if words[0] == b"ping":
            connection.sendall(b"pong\n")
        elif words[0] == b"up":
            started = time.monotonic()
            got = _receive_chunks(stream)
            connection.sendall(f"got {got} {time.monotonic() - started:.6f}\n".encode())
        elif words[0] == b"down" and len(words) == 3:
            _send_chunks(connection, min(int(words[1]), MAX_BYTES), min(float(words[2]), MAX_MEASURE_S))
        else:
            raise ValueError("unknown probe request")


def _send_chunks(connection: socket.socket, size: int, seconds: float) -> int:
    """Chunks until ``size`` bytes or ``seconds`` have gone, then the zero length that ends them."""
    sent = 0
    stop = time.monotonic() + seconds
    zeros = memoryview(_ZEROS)
    while sent < size and time.monotonic() < stop:
        n = min(CHUNK, size - sent)
        connection.sendall(_LENGTH.pack(n))
        connection.sendall(zeros[:n])
        sent += n
    connection.sendall(_LENGTH.pack(0))
    return sent


def _receive_chunks(stream: BinaryIO) -> int:
    buffer = memoryview(bytearray(CHUNK))
    header = memoryview(bytearray(_LENGTH.size))
    got = 0
    while True:
        _read_exact(stream, header)
        (n,) = _LENGTH.unpack(header)
        if n == 0:
            return got
        if n > CHUNK:
            raise ValueError("chunk too large")
        _read_exact(stream, buffer[:n])
        got += n


def _read_exact(stream: BinaryIO, view: memoryview) -> None:
    filled = 0
    while filled < len(view):
        count = stream.readinto(view[filled:])  # type: ignore[attr-defined]
        if not count:
            raise ConnectionError("the other end closed the probe")
        filled += count


# --- the connector -------------------------------------------------------------------------------


def measure(host: str, port: int, token: str, size: int, source: str | None = None,
            seconds: float = 10.0, pings: int = 5) -> LinkMeasureReply:
    """Connect to a probe listener from ``source`` (the local link address) and measure the link."""
    _check_token(token)
    _check_host(host, "host")
    if source is not None:
        _check_host(source, "source")
    if not 1 <= port <= 65535:
        raise RemoteError(p.BAD_ARGS, f"port must be in 1..65535, got {port!r}")
    if not 0 <= size <= MAX_BYTES:
        raise RemoteError(p.BAD_ARGS, f"bytes must be in 0..{MAX_BYTES}, got {size!r}")
    if not 0 < seconds <= MAX_MEASURE_S:
        raise RemoteError(p.BAD_ARGS, f"seconds must be in (0, {MAX_MEASURE_S:g}], got {seconds!r}")
    if not 1 <= pings <= MAX_PINGS:
        raise RemoteError(p.BAD_ARGS, f"pings must be in 1..{MAX_PINGS}, got {pings!r}")
    reply: LinkMeasureReply = {"connected": False, "latency_ms": None, "bits_per_second": None,
                               "reverse_bits_per_second": None, "bytes_up": 0, "bytes_down": 0,
                               "seconds": 0.0, "complete": False, "detail": ""}
    started = time.monotonic()
    deadline = started + seconds
    try:
        connection = _connect(host, port, source, min(seconds, 5.0))
    except (OSError, TimeoutError) as error:
        reply["detail"] = f"cannot reach {host}:{port}" + (f" from {source}" if source else "") + f": {_reason(error)}"
        reply["seconds"] = round(time.monotonic() - started, 3)
        return reply
    with connection:
        try:
            _run_measurement(connection, token, size, pings, deadline, reply)
        except (OSError, TimeoutError, ValueError) as error:
            reply["detail"] = f"the probe to {host}:{port} broke off: {_reason(error)}"
    reply["seconds"] = round(time.monotonic() - started, 3)
    return reply


def _connect(host: str, port: int, source: str | None, timeout: float) -> socket.socket:
    connection = socket.create_connection((host, port), timeout=timeout,
                                          source_address=(source, 0) if source else None)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connection


def _run_measurement(connection: socket.socket, token: str, size: int, pings: int, deadline: float,
                     reply: LinkMeasureReply) -> None:
    stream = connection.makefile("rb")
    connection.settimeout(max(deadline - time.monotonic(), 0.1))
    connection.sendall(token.encode("utf-8") + b"\n")
    if stream.readline(64) != GREETING:
        raise ValueError("something else answers on that port, not coord's probe")
    reply["connected"] = True
    rounds = []
    for _ in range(pings):
        sent = time.monotonic()
        connection.sendall(b"ping\n")
        if stream.readline(16) != b"pong\n":
            raise ValueError("the probe did not answer a ping")
        rounds.append(time.monotonic() - sent)
    reply["latency_ms"] = round(statistics.median(rounds) * 1000, 3)
    if size == 0:
        reply["complete"] = True
        reply["detail"] = "latency only"
        return
    # Each direction gets half the time left, so a slow link still comes back within the limit.
    share = max((deadline - time.monotonic()) / 2 - 0.05, 0.05)
    connection.settimeout(share + 2.0)
    reply["bytes_up"], up_seconds = _measure_up(connection, stream, size, share)
    reply["bits_per_second"] = _rate(reply["bytes_up"], up_seconds)
    share = max(deadline - time.monotonic() - 0.05, 0.05)
    connection.settimeout(share + 2.0)
    reply["bytes_down"], down_seconds = _measure_down(connection, stream, size, share)
    reply["reverse_bits_per_second"] = _rate(reply["bytes_down"], down_seconds)
    reply["complete"] = reply["bytes_up"] >= size and reply["bytes_down"] >= size
    reply["detail"] = ("measured" if reply["complete"]
                       else f"stopped at the time limit after {reply['bytes_up']} bytes up and "
                            f"{reply['bytes_down']} down (of {size} each)")


def _measure_up(connection: socket.socket, stream: BinaryIO, size: int, seconds: float) -> tuple[int, float]:
    started = time.monotonic()
    connection.sendall(f"up {seconds:.3f}\n".encode())
    _send_chunks(connection, size, seconds)
    words = stream.readline(100).split()
    if len(words) != 3 or words[0] != b"got":
        raise ValueError("the probe did not count the bytes sent")
    return int(words[1]), time.monotonic() - started


def _measure_down(connection: socket.socket, stream: BinaryIO, size: int, seconds: float) -> tuple[int, float]:
    started = time.monotonic()
    connection.sendall(f"down {size} {seconds:.3f}\n".encode())
    got = _receive_chunks(stream)
    return got, time.monotonic() - started


def _rate(count: int, seconds: float) -> float | None:
    return round(count * 8 / seconds, 1) if count and seconds > 0 else None


# --- the route and the MTU -----------------------------------------------------------------------


def link_route(address: str, interface: str | None = None) -> LinkRouteReply:
    """The route the kernel takes toward ``address``, and the MTU of the interface it leaves by and of
    ``interface`` (the one coord chose)."""
    _check_host(address, "address")
    if interface is not None and (not interface or "/" in interface or len(interface) > 64):
        raise RemoteError(p.BAD_ARGS, f"interface must name a network interface, got {interface!r}")
    detail = ""
    if sys.platform.startswith("linux"):
        done = run_command(["ip", "-j", "route", "get", address])
        route = route_parsers.parse_ip_route_get(done.stdout)
    elif sys.platform == "darwin":
        done = run_command(["route", "-n", "get", address])
        route = route_parsers.parse_route_get(done.stdout)
    else:
        done, route = None, None
        detail = f"routes are read on Linux and macOS, not {sys.platform}"
    if done is not None and route is None:
        detail = done.why or "the route's answer was not understood"
    route_interface = route["interface"] if route else None
    return {"address": address, "route": route,
            "route_mtu": interface_mtu(route_interface) if route_interface else None,
            "interface": interface, "interface_mtu": interface_mtu(interface) if interface else None,
            "interface_speed_bps": interface_speed_bps(interface or route_interface),
            "detail": detail}


def interface_speed_bps(name: str | None) -> float | None:
    """The speed the interface negotiated (Linux: /sys/class/net/IF/speed in Mbit/s; unknown, -1 or
    another OS: None)."""
    if not name or not sys.platform.startswith("linux"):
        return None
    try:
        with open(os.path.join("/sys/class/net", name, "speed"), encoding="ascii") as handle:
            mbps = int(handle.read().strip())
    except (OSError, ValueError):
        return None
    return mbps * 1e6 if mbps > 0 else None


def interface_mtu(name: str) -> int | None:
    if sys.platform.startswith("linux"):
        try:
            with open(os.path.join("/sys/class/net", name, "mtu"), encoding="ascii") as handle:
                return int(handle.read().strip())
        except (OSError, ValueError):
            return None
    return route_parsers.parse_ifconfig_mtu(run_command(["ifconfig", name]).stdout)


def _reason(error: BaseException) -> str:
    if isinstance(error, TimeoutError | socket.timeout):
        return "timed out (no route over that interface, a firewall, or the link is down)"
    if isinstance(error, ConnectionRefusedError):
        return "refused (nothing listens there)"
    return (error.strerror if isinstance(error, OSError) and error.strerror else str(error)) or type(error).__name__


def _check_token(token: str) -> None:
    if not token or len(token) > MAX_TOKEN or not token.isprintable() or any(c.isspace() for c in token):
        raise RemoteError(p.BAD_ARGS, "token must be 1 to 128 printable characters without spaces")


def _check_host(value: str, what: str) -> None:
    if not value or len(value) > 253 or any(c.isspace() for c in value) or "\0" in value:
        raise RemoteError(p.BAD_ARGS, f"{what} must be an address, got {value!r}")
