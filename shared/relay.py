"""The relay's data plane: a file sent as numbered chunks over plain TCP, node to node.

A broadcast sends each byte over every link of a chain (or tree) once, instead of over
the head's uplink once per node. The daemon sets it up over the agents' SSH sessions
(the control plane): it gives every receiver the file's size, its SHA256 and the SHA256
of every chunk, read from the source before anything is sent, plus a random token for
this transfer. The data plane only carries bytes:

    sender -> receiver   b"COORDRL1" + frame {"transfer": id, "token": token}
    receiver -> sender   frame {"want": k}            (or {"error": "..."} and close)
    sender -> receiver   chunk k, k+1, ...: >II (index, length) + the bytes

A frame is a 4-byte big-endian length and msgpack, at most ``MAX_HELLO`` bytes. The
receiver checks each chunk against the hash the daemon gave it before it writes or
forwards it, so a relay can corrupt nothing downstream; it asks for the first chunk it
lacks, so a sender that replaces a failed one resumes where the last one stopped. The
bytes are not encrypted (like MLX's own ring traffic between the same machines); the
token keeps other programs from feeding a receiver, the hashes keep anything from
landing that the source did not hold. Stdlib and msgpack only: this runs on every node.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import hmac
import os
import socket
import struct
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    from shared.agent_api.common import JsonObject
    from shared.agent_api.relay import RelayFrame

MAGIC = b"COORDRL1"
MAX_HELLO = 4096
CHUNK_BYTES = 4 << 20
CHUNK_HEADER = struct.Struct(">II")
LENGTH = struct.Struct(">I")
CONNECT_TIMEOUT_S = 10.0
HELLO_TIMEOUT_S = 10.0
#: A link that moves nothing for this long is given up (a cut cable sends no RST).
STALL_TIMEOUT_S = 30.0


class RelayError(Exception):
    """A transfer on the data plane failed; the message says where and why."""


@dataclass(frozen=True)
class ChunkPlan:
    """How a file of ``size`` bytes is cut: ``count`` chunks of ``chunk_bytes``, the last shorter."""

    size: int
    chunk_bytes: int

    @property
    def count(self) -> int:
        return max(1, -(-self.size // self.chunk_bytes)) if self.size else 0

    def length(self, index: int) -> int:
        return min(self.chunk_bytes, self.size - index * self.chunk_bytes)


def chunk_hashes(path: str, size: int, chunk_bytes: int = CHUNK_BYTES) -> tuple[list[bytes], str]:
    """The SHA256 of each chunk and of the whole file, in one read; the whole-file hash runs in a
    second thread beside the chunks' (hashlib releases the GIL on large buffers)."""
    whole = hashlib.sha256()
    digests: list[bytes] = []
    read = 0
    with open(path, "rb", buffering=0) as handle, ThreadPoolExecutor(1) as beside:
        pending = None
        while True:
            block = handle.read(chunk_bytes)
            if not block:
                break
            if pending is not None:
                pending.result()
            pending = beside.submit(whole.update, block)
            digests.append(hashlib.sha256(block).digest())
            read += len(block)
        if pending is not None:
            pending.result()
    if read != size:
        raise RelayError(f"{path} holds {read} bytes, {size} were expected")
    return digests, whole.hexdigest()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask Linux to start writing a range to disk now (sync_file_range), so that the fsync at the
    end of a large file waits for little; a no-op elsewhere."""
    if _sync_file_range is not None:
        _sync_file_range(fd, ctypes.c_int64(offset), ctypes.c_int64(length), 2)  # SYNC_FILE_RANGE_WRITE


def _load_sync_file_range() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


_sync_file_range = _load_sync_file_range()


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any] | None]) -> None:
    """Cancel tasks and wait until each has ended, whatever it ended with (cleanup paths)."""
    started = [task for task in tasks if task is not None]
    for task in started:
        task.cancel()
    for task in started:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def pack_frame(message: RelayFrame) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return LENGTH.pack(len(body)) + body


class LinkLost(ConnectionError):
    """The other end closed the connection (or it broke) before all was said."""


async def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket: straight into the caller's buffer, no copy in between."""
    loop = asyncio.get_running_loop()
    got = 0
    while got < len(view):
        count = await loop.sock_recv_into(sock, view[got:])
        if count == 0:
            raise LinkLost(f"connection closed after {got} of {len(view)} bytes")
        got += count


async def read_frame(sock: socket.socket, timeout: float = HELLO_TIMEOUT_S) -> JsonObject:
    """The next frame from the other end: a map, whose fields the caller checks."""
    header = bytearray(LENGTH.size)
    await asyncio.wait_for(recv_into(sock, memoryview(header)), timeout)
    (length,) = LENGTH.unpack(header)
    if length > MAX_HELLO:
        raise RelayError(f"frame of {length} bytes refused (at most {MAX_HELLO})")
    body = bytearray(length)
    await asyncio.wait_for(recv_into(sock, memoryview(body)), timeout)
    try:
        message = msgpack.unpackb(bytes(body), raw=False)
    except ValueError as exc:
        raise RelayError(f"a frame that is not msgpack: {exc}") from None
    if not isinstance(message, dict):
        raise RelayError("a frame that is not a map")
    return message


def token_matches(expected: str, given: Any) -> bool:
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())


async def send_file(host: str, port: int, *, transfer: str, token: str, plan: ChunkPlan, fd: int,
                    available: Callable[[], int], changed: asyncio.Condition | None = None,
                    on_sent: Callable[[int], None] | None = None) -> int:
    """Connect to a receiver and send it every chunk of the file open at ``fd`` from the one it asks for.

    ``available()`` says how many leading chunks this side holds (all of them at a source,
    what has arrived so far at a relay); ``changed`` is notified as that grows. The chunks go
    from the page cache to the socket with sendfile, read at their offsets (``fd``'s own
    position is never used, so several senders share one file). Returns the number of chunks
    sent. Raises RelayError when the link fails or the receiver refuses."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sent = 0
    try:
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), CONNECT_TIMEOUT_S)
        except (TimeoutError, OSError) as exc:
            raise RelayError(f"cannot connect to {host}:{port}: {exc or exc.__class__.__name__}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.wait_for(loop.sock_sendall(sock, MAGIC + pack_frame({"transfer": transfer, "token": token})),
                               STALL_TIMEOUT_S)
        answer = await read_frame(sock)
        if "error" in answer:
            raise RelayError(f"{host}:{port} refused the transfer: {answer['error']}")
        want = answer.get("want")
        if not isinstance(want, int) or not 0 <= want <= plan.count:
            raise RelayError(f"{host}:{port} asked for chunk {want!r} of {plan.count}")
        with os.fdopen(os.dup(fd), "rb", buffering=0) as handle:
            for index in range(want, plan.count):
                while available() <= index:
                    if changed is None:
                        raise RelayError(f"chunk {index} is not here to send")
                    async with changed:
                        if available() <= index:
                            await asyncio.wait_for(changed.wait(), STALL_TIMEOUT_S * 4)
                length = plan.length(index)
                try:
                    await asyncio.wait_for(loop.sock_sendall(sock, CHUNK_HEADER.pack(index, length)), STALL_TIMEOUT_S)
                    await asyncio.wait_for(loop.sock_sendfile(sock, handle, index * plan.chunk_bytes, length),
                                           STALL_TIMEOUT_S)
                except TimeoutError:
                    raise RelayError(f"{host}:{port} took nothing for {STALL_TIMEOUT_S:.0f} s") from None
                sent += 1
                if on_sent is not None:
                    on_sent(index + 1)
        # The receiver answers once it holds the whole file (or says what went wrong).
        try:
            final = await read_frame(sock, STALL_TIMEOUT_S * 4)
        except (TimeoutError, LinkLost):
            final = {}
        if final.get("error"):
            raise RelayError(f"{host}:{port}: {final['error']}")
        return sent
    except (ConnectionError, OSError) as exc:
        raise RelayError(f"link to {host}:{port} lost after {sent} chunks: {exc.__class__.__name__}") from None
    finally:
        sock.close()
