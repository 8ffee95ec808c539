"""coordd's small web server: the dashboard page, its data as JSON and server-sent events,
and /metrics for Prometheus. Read-only: GET and HEAD only, nothing it serves changes anything.

Who may look: on loopback (the default, 127.0.0.1:8470) the owner's machine alone, and a
Host header that names loopback (a page on another site cannot reach it by DNS rebinding);
anywhere else only with the cluster file's token, as ``Authorization: Bearer TOKEN`` or
``?token=TOKEN``. The page's own files are code, not data, and need no token; every answer
that carries the cluster's data does.
"""

from __future__ import annotations

import hmac
import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

import anyio
import anyio.abc
import structlog

from coordinator.config import DashboardSettings, is_loopback

log = structlog.get_logger("coordd.web")

STATIC = Path(__file__).parent / "static"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8"}
MAX_REQUEST = 16 * 1024  # request line and headers; nothing here takes a body
MAX_CLIENTS = 32
STREAM_EVERY_S = 1.0
# Scripts only from this server; uPlot sizes its parts with inline styles.
SECURITY_HEADERS = ("Content-Security-Policy: default-src 'self'; style-src 'self' 'unsafe-inline'; "
                    "img-src 'self' data:; frame-ancestors 'none'\r\n"
                    "X-Content-Type-Options: nosniff\r\nReferrer-Policy: no-referrer\r\n")


def static_files(root: Path = STATIC) -> dict[str, tuple[bytes, str]]:
    """Every file the page may load, read once, by its URL path: nothing else is ever served
    from disk, so no path from a request reaches the file system."""
    files = {}
    for path in sorted(root.rglob("*")):
        ctype = CONTENT_TYPES.get(path.suffix)
        if path.is_file() and ctype:
            files["/static/" + path.relative_to(root).as_posix()] = (path.read_bytes(), ctype)
    return files


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]


class BadRequest(Exception):
    pass


def parse_request(head: bytes) -> Request:
    try:
        text = head.decode("latin-1")
        line, *header_lines = text.split("\r\n")
        method, target, version = line.split(" ")
    except ValueError:
        raise BadRequest("malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise BadRequest("HTTP/1.x only")
    headers = {}
    for header in header_lines:
        if not header:
            continue
        name, sep, value = header.partition(":")
        if not sep:
            raise BadRequest("malformed header")
        headers[name.strip().lower()] = value.strip()
    parts = urlsplit(target)
    return Request(method, parts.path or "/", parse_qs(parts.query), headers)


def host_allowed(host_header: str | None, settings: DashboardSettings, port: int) -> bool:
    """On loopback, the Host a browser sends must name loopback: a page from another site
    whose name was pointed at 127.0.0.1 (DNS rebinding) sends its own name and is refused."""
    if settings.host is None or not is_loopback(settings.host):
        return True  # reachable from elsewhere: the token guards it
    if not host_header:
        return False
    if host_header.startswith("["):
        name, _, rest = host_header[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        name, _, port_text = host_header.partition(":")
    return name in ("127.0.0.1", "localhost", "::1") and port_text in ("", str(port))


def token_ok(request: Request, token: str | None) -> bool:
    if token is None:
        return True
    offered = request.query.get("token", [""])[0]
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        offered = auth[7:].strip()
    return hmac.compare_digest(offered.encode(), token.encode())


def response(status: str, body: bytes, ctype: str, *, head: bool = False, cache: str = "no-store") -> bytes:
    headers = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
               f"Cache-Control: {cache}\r\nConnection: close\r\n{SECURITY_HEADERS}\r\n")
    return headers.encode() + (b"" if head else body)


def text_response(status: str, message: str) -> bytes:
    return response(status, (message + "\n").encode(), "text/plain; charset=utf-8")


class WebServer:
    """Serves until cancelled. ``document()`` is the dashboard's data; ``metrics()``, when
    given, is the Prometheus exposition (body, content type)."""

    def __init__(self, settings: DashboardSettings, document: Callable[[], dict[str, Any]],
                 metrics: Callable[[], tuple[bytes, str]] | None = None):
        self.settings = settings
        self.document = document
        self.metrics = metrics
        self.files = static_files()
        self.port: int | None = None
        self._clients = 0

    @property
    def url(self) -> str | None:
        if self.port is None or self.settings.host is None:
            return None
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        return f"http://{host}:{self.port}/"

    async def serve(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        family = socket.AF_INET6 if ":" in (self.settings.host or "") else socket.AF_INET
        listener = await anyio.create_tcp_listener(local_host=self.settings.host, local_port=self.settings.port,
                                                   family=family, reuse_port=False)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        log.info("dashboard listening", url=self.url)
        task_status.started(self.url)
        async with listener:
            await listener.serve(self._handle)

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            if self._clients >= MAX_CLIENTS:
                await _send(stream, text_response("503 Service Unavailable", "too many dashboard clients"))
                return
            self._clients += 1
            try:
                await self._answer(stream)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, ConnectionError):
                pass  # the browser went away
            finally:
                self._clients -= 1

    async def _answer(self, stream: anyio.abc.SocketStream) -> None:
        head = b""
        with anyio.move_on_after(10):
            while b"\r\n\r\n" not in head and len(head) <= MAX_REQUEST:
                head += await stream.receive(4096)
        if b"\r\n\r\n" not in head:
            await _send(stream, text_response("400 Bad Request", "incomplete or oversized request"))
            return
        try:
            request = parse_request(head.split(b"\r\n\r\n", 1)[0])
        except BadRequest as exc:
            await _send(stream, text_response("400 Bad Request", str(exc)))
            return
        await self._route(stream, request)

    async def _route(self, stream: anyio.abc.SocketStream, request: Request) -> None:
        if request.method not in ("GET", "HEAD"):
            await _send(stream, text_response("405 Method Not Allowed", "the dashboard is read-only"))
            return
        if not host_allowed(request.headers.get("host"), self.settings, self.port or 0):
            await _send(stream, text_response("403 Forbidden", "this dashboard answers on its loopback address only"))
            return
        head = request.method == "HEAD"
        path = "/static/index.html" if request.path in ("/", "/index.html") else request.path
        if path in self.files:
            body, ctype = self.files[path]
            await _send(stream, response("200 OK", body, ctype, head=head, cache="no-cache"))
            return
        if path not in ("/api/dashboard", "/api/stream", "/metrics") or (path == "/metrics" and not self.metrics):
            await _send(stream, text_response("404 Not Found", f"nothing at {request.path}"))
            return
        if not token_ok(request, self.settings.token):
            await _send(stream, text_response("401 Unauthorized", "a token is required: ?token=... or "
                                                                  "Authorization: Bearer ..."))
            return
        if path == "/metrics":
            body, ctype = self.metrics()
            await _send(stream, response("200 OK", body, ctype, head=head))
        elif path == "/api/dashboard":
            await _send(stream, response("200 OK", _json(self.document()), "application/json", head=head))
        else:
            await self._stream(stream)

    async def _stream(self, stream: anyio.abc.SocketStream) -> None:
        """Server-sent events: the whole document now and every STREAM_EVERY_S while it is open."""
        await _send(stream, ("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\n"
                             f"Connection: close\r\n{SECURITY_HEADERS}\r\n").encode())
        while True:
            await _send(stream, b"data: " + _json(self.document()) + b"\n\n")
            await anyio.sleep(STREAM_EVERY_S)


def _json(doc: Any) -> bytes:
    # One line: an SSE data field ends at a newline.
    return json.dumps(doc, separators=(",", ":"), default=str).encode()


async def _send(stream: anyio.abc.SocketStream, data: bytes) -> None:
    if data:
        await stream.send(data)
