"""The daemon's small, read-only HTTP server: Prometheus ``/metrics`` now, the dashboard next.

HTTP/1.1 on anyio, one request per connection (``Connection: close``), GET and HEAD only, a
16 KiB limit on a request's head and 10 s to send it. Routes are ``path -> handler``; a handler
returns a ``Response`` whose body is bytes or, for server-sent events, an async iterator of
bytes. With a token configured (required off loopback, see ``[dashboard]``), every request
must carry it as ``Authorization: Bearer TOKEN`` or ``?token=TOKEN``.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

import anyio
import structlog
from anyio.abc import SocketAttribute, SocketStream

from coordinator.config import DashboardSettings

log = structlog.get_logger("web")

MAX_HEAD_BYTES = 16 << 10
READ_TIMEOUT_S = 10.0


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


class WebServer:
    def __init__(self, settings: DashboardSettings, routes: dict[str, Handler]):
        self.settings = settings
        self.routes = routes
        self.url: str | None = None  # once listening (the port may have been 0)

    async def serve(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Listen, report the URL through ``task_status``, serve until cancelled. OSError when the
        address cannot be bound."""
        listener = await anyio.create_tcp_listener(local_host=self.settings.host, local_port=self.settings.port,
                                                   reuse_port=False)
        port = listener.extra(SocketAttribute.local_port)
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        self.url = f"http://{host}:{port}/"
        log.info("http server listening", url=self.url)
        task_status.started(self.url)
        async with listener:
            await listener.serve(self._connection)

    async def _connection(self, stream: SocketStream) -> None:
        async with stream:
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
        if not self._authorized(request):
            return _text(HTTPStatus.UNAUTHORIZED, "this dashboard needs its token: send Authorization: Bearer TOKEN "
                         "or add ?token=TOKEN (the token is [dashboard] token in the cluster file)\n",
                         {"WWW-Authenticate": 'Bearer realm="coord"'})
        handler = self.routes.get(request.path)
        if handler is None:
            return _text(HTTPStatus.NOT_FOUND, f"no page at {request.path}; try " + ", ".join(sorted(self.routes))
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
               "X-Content-Type-Options": "nosniff", **response.headers}
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
