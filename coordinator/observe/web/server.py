"""The daemon's small, read-only HTTP server: the dashboard and Prometheus ``/metrics``.

HTTP/1.1 on anyio, one request per connection (``Connection: close``), GET and HEAD only, a
16 KiB limit on a request's head and 10 s to send it. Routes are ``path -> handler``; a handler
returns a ``Response`` whose body is bytes or, for server-sent events, an async iterator of
bytes.

Who may look: with a token configured (required off loopback, see ``[dashboard]``), every
request for data must carry it as ``Authorization: Bearer TOKEN`` or ``?token=TOKEN``; the
``public`` paths (the page's own code) need none. On loopback the Host header must name
loopback, so a page of another site whose name was pointed at 127.0.0.1 (DNS rebinding)
cannot read anything.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

import anyio
import structlog
from anyio.abc import SocketAttribute, SocketStream, TaskStatus

from coordinator.config.cluster_file import DashboardSettings, is_loopback

log = structlog.get_logger("web")

MAX_HEAD_BYTES = 16 << 10
READ_TIMEOUT_S = 10.0
MAX_CLIENTS = 64  # open connections (event streams stay open): beyond, 503
# Scripts only from this server; uPlot sizes its parts with inline styles.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # names in lower case


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    stream: AsyncIterator[bytes] | None = None  # sent after the head instead of ``body``
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Awaitable[Response]]


class BadRequest(Exception):
    pass


def host_allowed(host_header: str | None, settings: DashboardSettings, port: int) -> bool:
    """On loopback, the Host a browser sends must name loopback (and this port, if any)."""
    if not is_loopback(settings.host):
        return True  # reachable from elsewhere: the token guards it
    if not host_header:
        return False
    if host_header.startswith("["):
        name, _, rest = host_header[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        name, _, port_text = host_header.partition(":")
    return name in ("127.0.0.1", "localhost", "::1") and port_text in ("", str(port))


class WebServer:
    def __init__(self, settings: DashboardSettings, routes: dict[str, Handler],
                 public: frozenset[str] = frozenset()) -> None:
        self.settings = settings
        self.routes = routes
        self.public = public  # paths that carry no data of the cluster: no token needed
        self.url: str | None = None  # once listening (the port may have been 0)
        self.port: int | None = None
        self._clients = 0

    async def serve(self, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen, report the URL through ``task_status``, serve until cancelled. OSError when the
        address cannot be bound."""
        listener = await anyio.create_tcp_listener(local_host=self.settings.host, local_port=self.settings.port,
                                                   reuse_port=False)
        self.port = port = listener.extra(SocketAttribute.local_port)
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        self.url = f"http://{host}:{port}/"
        log.info("http server listening", url=self.url)
        task_status.started(self.url)
        async with listener:
            await listener.serve(self._connection)

    async def _connection(self, stream: SocketStream) -> None:
        async with stream:
            if self._clients >= MAX_CLIENTS:
                await _send(stream, _text(HTTPStatus.SERVICE_UNAVAILABLE, "too many clients\n"), head_only=False)
                return
            self._clients += 1
            try:
                await self._exchange(stream)
            finally:
                self._clients -= 1

    async def _exchange(self, stream: SocketStream) -> None:
        try:
            with anyio.fail_after(READ_TIMEOUT_S):
                request = parse_head(await _read_head(stream))
            response = await self._respond(request)
        except BadRequest as exc:
            request, response = None, _text(HTTPStatus.BAD_REQUEST, f"{exc}\n")
        except TimeoutError:
            return
        try:
            await _send(stream, response, head_only=request is not None and request.method == "HEAD")
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
            return  # the client went away: nothing to tell it

    async def _respond(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            return _text(HTTPStatus.METHOD_NOT_ALLOWED, "this server is read-only: GET and HEAD only\n",
                         {"Allow": "GET, HEAD"})
        if not host_allowed(request.headers.get("host"), self.settings, self.port or 0):
            return _text(HTTPStatus.FORBIDDEN, "this server answers to its loopback address only "
                         "(open it as http://127.0.0.1:PORT/)\n")
        if request.path not in self.public and not self._authorized(request):
            return _text(HTTPStatus.UNAUTHORIZED, "this dashboard needs its token: send Authorization: Bearer TOKEN "
                         "or add ?token=TOKEN (the token is [dashboard] token in the cluster file)\n",
                         {"WWW-Authenticate": 'Bearer realm="coord"'})
        handler = self.routes.get(request.path)
        if handler is None:
            pages = sorted(path for path in self.routes if not path.startswith("/static/"))
            return _text(HTTPStatus.NOT_FOUND, f"no page at {request.path}; try " + ", ".join(pages)
                         + "\n")
        try:
            return await handler(request)
        except Exception:  # the edge: one bad page never takes the daemon down
            log.exception("http handler failed", path=request.path)
            return _text(HTTPStatus.INTERNAL_SERVER_ERROR, "the daemon could not answer this page; see its log\n")

    def _authorized(self, request: Request) -> bool:
        token = self.settings.token
        if token is None:
            return True
        offered = request.query.get("token", [""])[0]
        authorization = request.headers.get("authorization", "")
        if authorization.lower().startswith("bearer "):
            offered = authorization[7:].strip()
        return hmac.compare_digest(offered.encode(), token.encode())


async def _read_head(stream: SocketStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEAD_BYTES:
            raise BadRequest(f"request head longer than {MAX_HEAD_BYTES} bytes")
        try:
            chunk = await stream.receive(4096)
        except anyio.EndOfStream:
            raise BadRequest("connection closed before the request was complete") from None
        data += chunk
    return data.split(b"\r\n\r\n", 1)[0]


def parse_head(head: bytes) -> Request:
    """The request line and headers of an HTTP/1.x request."""
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise BadRequest("malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise BadRequest(f"unsupported protocol {version!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise BadRequest(f"malformed header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    parts = urlsplit(target)
    return Request(method.upper(), parts.path or "/", parse_qs(parts.query), headers)


async def _send(stream: SocketStream, response: Response, *, head_only: bool) -> None:
    reason = HTTPStatus(response.status).phrase
    headers = {"Content-Type": response.content_type, "Connection": "close", "Cache-Control": "no-store",
               **SECURITY_HEADERS, **response.headers}
    if response.stream is None:
        headers["Content-Length"] = str(len(response.body))
    head = f"HTTP/1.1 {response.status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    await stream.send(head.encode("latin-1") + b"\r\n")
    if head_only:
        return
    if response.stream is None:
        await stream.send(response.body)
        return
    async for chunk in response.stream:
        await stream.send(chunk)


def _text(status: int, text: str, headers: dict[str, str] | None = None) -> Response:
    return Response(int(status), text.encode(), headers=headers or {})
