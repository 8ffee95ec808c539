"""Parts of a checkpoint file put straight into the checkpoint store by a node that holds it.

The head signs a URL for each part (an object of its own, with a short expiry) and hands a node a
few at a time; the node reads each part where it lies, hashes it, and PUTs it over HTTP(S). So every
node with a copy uploads at once, each a disjoint share, and no credential ever reaches a node: a
signed URL allows one PUT of one object, for minutes.

Before a byte goes, the file is checked against the SHA256 recorded when it was validated (from this
agent's hash cache where it is unchanged since: agent/ranks.py). Each part is read, hashed and sent
in an upkeep thread (agent/upkeep.py: nice 10 on Linux, so a rank's thread goes first) and paced to
``bandwidth`` (``--store-bandwidth``) across all of this node's parts in flight. A request has a time
limit per socket operation, and a part that meets a 5xx or a dropped connection is tried twice more
before the store's error goes back to the head.

A part goes compressed (zstd, level 1) where that pays for this node: where it shrinks to at most
``MAX_RATIO`` of its size, and the node's uplink (measured on its last parts) is at most half the speed
it compresses at, so that the compression neither slows the upload nor takes a core from the ranks.
bench/checkpoint_compression.py measured it: bf16 weights go to 0.78 of their size at about 700 MB/s a
core, and pay on uplinks up to about 3 Gbit/s; fp32 weights and optimizer state stay at 0.91-0.92 and
never do. The first part of a file on a node decides for its others. Stdlib only: this runs in the
node's Python, and compresses where it has zstd (Python 3.14's ``compression.zstd``, or the
``zstandard`` package where the node's Python has it)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.client
import os
import re
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from agent import upkeep
from shared import protocol as p
from shared.agent_api.store import StorePart, StorePutDone, StorePutReply
from shared.rpc import RemoteError

REQUEST_TIMEOUT_S = 60.0
SEND_BYTES = 256 << 10  # what goes to the socket between two looks at the pace
TRIES = 3
_CODE = re.compile(rb"<Code>([A-Za-z]+)</Code>")
_HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")


MAX_RATIO = 0.9  # a part compressed to more than this of its size goes as it is


def compressor() -> Callable[[bytes], bytes] | None:
    """zstd at level 1, or None where this Python has none."""
    with contextlib.suppress(ImportError):
        from compression import zstd  # type: ignore[import-not-found]  # Python 3.14

        return lambda data: bytes(zstd.compress(data, level=1))
    with contextlib.suppress(ImportError):
        import zstandard

        return lambda data: bytes(zstandard.ZstdCompressor(level=1).compress(data))
    return None


def worth_compressing(ratio: float, compress_bytes_per_s: float, uplink_bytes_per_s: float | None) -> bool:
    """The rule: a tenth smaller at least, and an uplink (when measured) at most half the compression's speed."""
    return ratio <= MAX_RATIO and (uplink_bytes_per_s is None or uplink_bytes_per_s <= compress_bytes_per_s / 2)


class Uplink:
    """The node's uplink as its last parts went, bytes per second on the wire."""

    def __init__(self) -> None:
        self.rate: float | None = None
        self._lock = threading.Lock()

    def saw(self, size: int, seconds: float) -> None:
        if size < (1 << 20) or seconds <= 0:
            return  # a small part says more of a request's overhead than of the link
        with self._lock:
            now = size / seconds
            self.rate = now if self.rate is None else 0.7 * self.rate + 0.3 * now


_uplink = Uplink()
#: (path, sha256) -> whether its first part here went compressed: the rest follow. Bounded, as the hash
#: cache is: a run writes a new file per checkpoint for as long as it trains.
_compressing: dict[tuple[str, str], bool] = {}
_COMPRESSING_AT_MOST = 4096


class Pace:
    """At most ``rate`` bytes per second through every thread that asks (None: no cap)."""

    def __init__(self) -> None:
        self.rate: float | None = None
        self._next = 0.0
        self._lock = threading.Lock()

    def wait(self, size: int) -> None:
        rate = self.rate
        if not rate:
            return
        # A piece goes when its whole slot has passed, so no stretch of time carries more than the rate.
        with self._lock:
            now = time.monotonic()
            self._next = max(now, self._next) + size / rate
            until = self._next
        if until > now:
            time.sleep(until - now)


#: One pace for the node: the cap is on its uplink, whichever upload asks.
_pace = Pace()


class _Retry(Exception):
    """A failure worth another try: the store's 5xx, a connection dropped or refused."""


def _check_part(part: Any) -> StorePart:
    if not isinstance(part, dict):
        raise RemoteError(p.BAD_ARGS, "each part must be an object")
    offset, size, url, headers = part.get("offset"), part.get("size"), part.get("url"), part.get("headers", {})
    if not isinstance(offset, int) or not isinstance(size, int) or offset < 0 or size < 0:
        raise RemoteError(p.BAD_ARGS, f"a part's offset and size must be whole numbers, got {offset!r}, {size!r}")
    parsed = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parsed is None or not isinstance(url, str) or parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise RemoteError(p.BAD_ARGS, "a part's url must be an http or https URL")
    if not isinstance(headers, dict) or not all(
            isinstance(k, str) and _HEADER_NAME.match(k) and isinstance(v, str) and "\r" not in v and "\n" not in v
            for k, v in headers.items()):
        raise RemoteError(p.BAD_ARGS, "a part's headers must be names and values on one line")
    return {"offset": offset, "size": size, "url": url, "headers": headers}


def _connection(url: urllib.parse.SplitResult) -> http.client.HTTPConnection:
    if url.scheme == "https":
        return http.client.HTTPSConnection(url.hostname or "", url.port, timeout=REQUEST_TIMEOUT_S,
                                           context=ssl.create_default_context())
    return http.client.HTTPConnection(url.hostname or "", url.port, timeout=REQUEST_TIMEOUT_S)


def _put_once(part: StorePart, data: memoryview, pace: Pace) -> None:
    url = urllib.parse.urlsplit(part["url"])
    conn = _connection(url)
    try:
        conn.putrequest("PUT", url.path + (f"?{url.query}" if url.query else ""), skip_accept_encoding=True)
        conn.putheader("Content-Length", str(len(data)))
        conn.putheader("Content-Type", "application/octet-stream")
        for name, value in part["headers"].items():
            conn.putheader(name, value)
        conn.endheaders()
        for start in range(0, len(data), SEND_BYTES):
            piece = data[start:start + SEND_BYTES]
            pace.wait(len(piece))
            conn.send(piece)
        response = conn.getresponse()
        body = response.read(8192)
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out
        raise _Retry(f"{url.hostname}:{url.port or ''}: {exc or type(exc).__name__}") from None
    finally:
        conn.close()
    if response.status // 100 == 2:
        return
    found = _CODE.search(body)
    code = found.group(1).decode() if found else ""
    said = f"the store answered {response.status} {response.reason}" + (f" ({code})" if code else "")
    if "expired" in body.decode("utf-8", "replace").lower():
        said += ": the signed URL expired before the part was sent"
    if response.status >= 500:
        raise _Retry(said)
    raise RemoteError(p.STORE, said)


def _packed(data: bytes, file: tuple[str, str]) -> bytes | None:
    """The part compressed, where that pays (the module's docstring); else None."""
    pack = compressor()
    decided = _compressing.get(file)
    if pack is None or not data or decided is False:
        return None
    # The compressor's own CPU time, not the wall clock's: on a busy machine a thread waiting for a core
    # would make one moment's crowding the decision for the whole file.
    started = time.thread_time()
    packed = pack(data)
    ratio = len(packed) / len(data)
    if decided:  # the file's first part found it pays: its others follow, each still only if it shrinks
        return packed if ratio <= MAX_RATIO else None
    speed = len(data) / max(time.thread_time() - started, 1e-9)
    worth = worth_compressing(ratio, speed, _uplink.rate)
    if len(_compressing) >= _COMPRESSING_AT_MOST:
        _compressing.clear()
    _compressing.setdefault(file, worth)
    return packed if worth else None


def put_part(fd: int, part: StorePart, pace: Pace = _pace, file: tuple[str, str] = ("", "")) -> StorePutDone:
    """Read one part, hash it, compress it where that pays, PUT it (tried again on a 5xx or a dropped
    connection)."""
    data = os.pread(fd, part["size"], part["offset"])
    if len(data) != part["size"]:
        raise RemoteError(p.DAMAGED, f"the file ends before byte {part['offset'] + part['size']}")
    digest = hashlib.sha256(data).hexdigest()
    packed = _packed(data, file)
    body = packed if packed is not None else data
    view = memoryview(body)
    for attempt in range(TRIES):
        try:
            started = time.monotonic()
            _put_once(part, view, pace)
            _uplink.saw(len(body), time.monotonic() - started)
            done: StorePutDone = {"size": len(data), "sha256": digest}
            if packed is not None:
                done["encoding"], done["stored"] = "zstd", len(packed)
            return done
        except _Retry as exc:
            if attempt == TRIES - 1:
                raise RemoteError(p.STORE, f"{exc} ({TRIES} tries)") from None
            time.sleep(1.0 * 2 ** attempt)
    raise AssertionError("unreachable")


def _open_checked(workdir: str, path: str, sha256: str) -> int:
    from agent.ranks import sha256_remembered, under_workdir

    full = under_workdir(workdir, path)
    if not os.path.isfile(full):
        raise RemoteError(p.BAD_ARGS, f"{path} is not a file")
    if sha256_remembered(full) != sha256:
        raise RemoteError(p.DAMAGED, f"{path} no longer has the SHA256 recorded when it was validated")
    return os.open(full, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))


async def put_parts(workdir: str, path: str, sha256: str, parts: list[Any],
                    bandwidth: float | None = None) -> StorePutReply:
    """Put each part of the file at ``path`` (under ``workdir``) to its URL, all at once; each part's
    size and SHA256, in the order asked."""
    checked = [_check_part(part) for part in parts]
    if bandwidth is not None and not bandwidth > 0:
        raise RemoteError(p.BAD_ARGS, f"bandwidth must be a positive number of bytes per second, got {bandwidth!r}")
    _pace.rate = bandwidth
    started = time.monotonic()
    fd = await upkeep.run(_open_checked, workdir, path, sha256)
    try:
        # Every part's thread ends before the file is closed, a failed one's neighbours too.
        done = await asyncio.gather(*(upkeep.run(put_part, fd, part, _pace, (path, sha256)) for part in checked),
                                    return_exceptions=True)
    finally:
        os.close(fd)
    failed = next((d for d in done if isinstance(d, BaseException)), None)
    if failed is not None:
        raise failed
    return {"parts": [d for d in done if not isinstance(d, BaseException)],
            "seconds": round(time.monotonic() - started, 3)}
