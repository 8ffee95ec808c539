"""The daemon's HTTP server on a real socket (port 0): routes, read-only, the token, bad requests."""

from __future__ import annotations

import anyio
import pytest

from coordinator.config.cluster_file import DashboardSettings
from coordinator.observe.web.server import BadRequest, Response, WebServer, parse_head

TOKEN = "0123456789abcdef-token"


async def fetch(url: str, raw: bytes) -> tuple[int, bytes]:
    host, port = url.split("//")[1].rstrip("/").rsplit(":", 1)
    async with await anyio.connect_tcp(host, int(port)) as stream:
        await stream.send(raw)
        data = b""
        try:
            while True:
                data += await stream.receive()
        except anyio.EndOfStream:
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


async def hello(_request) -> Response:
    return Response(body=b"hello\n")


async def broken(_request) -> Response:
    raise RuntimeError("a bug")


async def with_server(settings: DashboardSettings, requests: list[bytes]) -> list[tuple[int, bytes]]:
    server = WebServer(settings, {"/hello": hello, "/broken": broken})
    async with anyio.create_task_group() as tasks:
        url = await tasks.start(server.serve)
        assert url == server.url and not url.endswith(":0/")
        answers = [await fetch(url, raw) for raw in requests]
        tasks.cancel_scope.cancel()
    return answers


def get(path: str, *headers: str) -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: localhost\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


def test_routes_answer_and_everything_else_is_refused_with_the_reason():
    answers = anyio.run(with_server, DashboardSettings(port=0), [
        get("/hello"), get("/nope"), b"POST /hello HTTP/1.1\r\nHost: localhost\r\n\r\n", get("/broken"), b"nonsense\r\n\r\n",
        b"HEAD /hello HTTP/1.1\r\nHost: localhost\r\n\r\n"])
    assert answers[0] == (200, b"hello\n")
    assert answers[1][0] == 404 and b"/hello" in answers[1][1]
    assert answers[2][0] == 405 and b"read-only" in answers[2][1]
    assert answers[3][0] == 500 and b"see its log" in answers[3][1]
    assert answers[4][0] == 400
    assert answers[5] == (200, b"")


def test_a_token_is_needed_as_a_bearer_header_or_a_query_parameter():
    answers = anyio.run(with_server, DashboardSettings(port=0, token=TOKEN), [
        get("/hello"), get("/hello", "Authorization: Bearer wrong-token-wrong-token"),
        get("/hello", f"Authorization: Bearer {TOKEN}"), get(f"/hello?token={TOKEN}")])
    assert answers[0][0] == 401 and b"?token=" in answers[0][1]
    assert answers[1][0] == 401
    assert answers[2] == answers[3] == (200, b"hello\n")


def test_a_busy_address_is_an_oserror_for_the_daemon_to_report():
    async def main():
        first = WebServer(DashboardSettings(port=0), {})
        async with anyio.create_task_group() as tasks:
            url = await tasks.start(first.serve)
            with pytest.raises(OSError):
                await WebServer(DashboardSettings(port=int(url.rstrip("/").rsplit(":", 1)[1])), {}).serve()
            tasks.cancel_scope.cancel()

    anyio.run(main)


def test_request_heads_are_parsed_strictly():
    request = parse_head(b"GET /api/history?run=r-1&since=5 HTTP/1.1\r\nAuthorization: Bearer x")
    assert (request.method, request.path, request.query["run"], request.headers["authorization"]) == \
        ("GET", "/api/history", ["r-1"], "Bearer x")
    with pytest.raises(BadRequest):
        parse_head(b"GET / SPDY/3")
    with pytest.raises(BadRequest):
        parse_head(b"GET / HTTP/1.1\r\nno colon here")
