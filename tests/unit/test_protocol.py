"""The wire: frames, messages, and a peer that never crashes on what it reads."""

from __future__ import annotations

import asyncio
import socket
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import protocol as p
from shared.rpc import ConnectionLost, Dispatcher, Peer, RemoteError

plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@given(st.integers(0, 2**31), st.text(min_size=1, max_size=30), st.dictionaries(st.text(max_size=10), plain, max_size=5))
def test_request_round_trips(msg_id, method, args):
    frame = p.pack(p.Request(msg_id, method, args))
    length = p.frame_length(frame[:4], p.DEFAULT_MAX_FRAME)
    assert length == len(frame) - 4
    assert p.unpack(frame[4:]) == p.Request(msg_id, method, args)


@given(st.integers(0, 2**31), plain)
def test_results_events_and_errors_round_trip(msg_id, value):
    for message in (p.Result(msg_id, value), p.Event(msg_id, value), p.Error(msg_id, "bad_args", "why")):
        assert p.unpack(p.pack(message)[4:]) == message


def test_oversized_frame_is_refused_before_reading_its_body():
    with pytest.raises(p.ProtocolError) as caught:
        p.frame_length(struct.pack(">I", 2**31), 1024)
    assert caught.value.code == p.FRAME_TOO_LARGE


@given(st.binary(max_size=200))
def test_garbage_payload_is_a_protocol_error_or_a_message(data):
    try:
        message = p.unpack(data)
    except p.ProtocolError as exc:
        assert exc.code in (p.BAD_FRAME, p.BAD_MESSAGE)
    else:
        assert isinstance(message, (p.Request, p.Result, p.Error, p.Event))


@pytest.mark.parametrize("body", [
    [1, 2, 3],
    {"t": "req", "id": -1, "m": "x"},
    {"t": "req", "id": True, "m": "x"},
    {"t": "req", "id": 1, "m": ""},
    {"t": "req", "id": 1, "m": "x", "a": [1]},
    {"t": "res"},
    {"t": "err", "id": 1, "code": 5, "msg": "x"},
    {"t": "what", "id": 1},
])
def test_wrongly_typed_messages_are_refused_with_a_reason(body):
    with pytest.raises(p.ProtocolError) as caught:
        p.unpack(msgpack.packb(body))
    assert caught.value.code == p.BAD_MESSAGE and caught.value.message


def test_msgpack_extension_types_do_not_become_objects():
    # No pickle, no eval: an ext type decodes to inert data and fails type checks.
    body = msgpack.packb({"t": "req", "id": 1, "m": "x", "a": {"v": msgpack.ExtType(42, b"payload")}})
    message = p.unpack(body)
    assert isinstance(message.args["v"], msgpack.ExtType)


# --- the peer, over a real socket pair -------------------------------------------------------


async def _pair(dispatcher: Dispatcher | None = None, max_frame: int = p.DEFAULT_MAX_FRAME):
    a, b = socket.socketpair()
    ra, wa = await asyncio.open_connection(sock=a)
    rb, wb = await asyncio.open_connection(sock=b)
    server = Peer(rb, wb, dispatcher=dispatcher, max_frame=max_frame, name="server")
    client = Peer(ra, wa, name="client")
    return client, server, (ra, wa)


def _table() -> Dispatcher:
    table = Dispatcher()

    async def add(x: int, y: int = 0) -> int:
        return x + y

    async def count(emit, n: int) -> str:
        for i in range(n):
            await emit(i)
        return "done"

    async def hang() -> None:
        await asyncio.sleep(3600)

    async def boom() -> None:
        raise ValueError("broken handler")

    table.add("add", add, required={"x": int}, optional={"y": int})
    table.add("count", count, required={"n": int}, streams=True)
    table.add("hang", hang)
    table.add("boom", boom)
    return table


async def _with_peers(body, **kw):
    client, server, raw = await _pair(_table(), **kw)
    tasks = [asyncio.ensure_future(client.run()), asyncio.ensure_future(server.run())]
    try:
        return await asyncio.wait_for(body(client, server, raw), 10)
    finally:
        await client.close()
        await server.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_calls_get_exactly_one_answer_each():
    async def body(client, server, raw):
        results = await asyncio.gather(*(client.call("add", {"x": i, "y": 1}) for i in range(100)))
        assert results == [i + 1 for i in range(100)]
        events = []
        assert await client.call("count", {"n": 3}, on_event=events.append) == "done"
        assert events == [0, 1, 2]

    asyncio.run(_with_peers(body))


@pytest.mark.parametrize("method,args,code", [
    ("nope", {}, p.UNKNOWN_METHOD),
    ("add", {}, p.BAD_ARGS),
    ("add", {"x": "1"}, p.BAD_ARGS),
    ("add", {"x": True}, p.BAD_ARGS),
    ("add", {"x": 1, "z": 2}, p.BAD_ARGS),
    ("boom", {}, p.INTERNAL),
])
def test_bad_calls_get_an_error_reply_and_the_peer_keeps_serving(method, args, code):
    async def body(client, server, raw):
        with pytest.raises(RemoteError) as caught:
            await client.call(method, args)
        assert caught.value.code == code
        assert await client.call("add", {"x": 2}) == 2

    asyncio.run(_with_peers(body))


def test_a_lost_connection_fails_every_pending_call():
    async def body(client, server, raw):
        pending = [asyncio.ensure_future(client.call("hang")) for _ in range(5)]
        await asyncio.sleep(0.1)
        await server.close()
        for call in pending:
            with pytest.raises(ConnectionLost):
                await call
        with pytest.raises(ConnectionLost):
            await client.call("add", {"x": 1})

    asyncio.run(_with_peers(body))


def test_a_call_times_out_without_leaking_its_pending_entry():
    async def body(client, server, raw):
        with pytest.raises(TimeoutError):
            await client.call("hang", timeout=0.2)
        assert client._pending == {}

    asyncio.run(_with_peers(body))


async def _read_reply(reader) -> p.Message:
    header = await reader.readexactly(4)
    return p.unpack(await reader.readexactly(p.frame_length(header, p.DEFAULT_MAX_FRAME)))


def _with_raw_server(body) -> None:
    """A serving peer (frames up to 1 KiB) and the raw other end of its socket: body(server, reader, writer)."""

    async def run():
        a, b = socket.socketpair()
        ra, wa = await asyncio.open_connection(sock=a)
        rb, wb = await asyncio.open_connection(sock=b)
        server = Peer(rb, wb, dispatcher=_table(), max_frame=1024, name="server")
        task = asyncio.ensure_future(server.run())
        try:
            await asyncio.wait_for(body(server, ra, wa), 10)
        finally:
            wa.close()
            await asyncio.wait_for(task, 5)

    asyncio.run(run())


def test_an_oversized_frame_closes_the_connection_with_an_error():
    async def body(server, reader, writer):
        writer.write(struct.pack(">I", 10_000) + b"x" * 100)
        await writer.drain()
        reply = await _read_reply(reader)
        assert isinstance(reply, p.Error) and reply.code == p.FRAME_TOO_LARGE
        assert await reader.read() == b""  # closed by the server
        assert server.closed

    _with_raw_server(body)


def test_a_malformed_request_is_answered_under_its_own_id_and_the_connection_goes_on():
    """The caller of a refused request hears at once, not when its timeout runs out."""

    async def body(server, reader, writer):
        request = msgpack.packb({"t": "req", "id": 7, "m": "add", "a": [1, 2]})
        writer.write(struct.pack(">I", len(request)) + request)
        reply = await _read_reply(reader)
        assert isinstance(reply, p.Error) and reply.id == 7 and reply.code == p.BAD_MESSAGE
        writer.write(p.pack(p.Request(8, "add", {"x": 1, "y": 2})))
        assert await _read_reply(reader) == p.Result(8, 3)

    _with_raw_server(body)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), max_size=6), st.booleans())
def test_garbage_on_the_wire_never_crashes_the_serving_peer(chunks, framed):
    """Truncated, oversized, random or mistyped frames: errors or a close, never an exception."""

    async def run():
        a, b = socket.socketpair()
        ra, wa = await asyncio.open_connection(sock=a)
        rb, wb = await asyncio.open_connection(sock=b)
        server = Peer(rb, wb, dispatcher=_table(), max_frame=4096, name="server")
        task = asyncio.ensure_future(server.run())
        for chunk in chunks:
            wa.write(struct.pack(">I", len(chunk)) + chunk if framed else chunk)
        await wa.drain()
        wa.write_eof()
        # The server finishes by itself at end of input, without raising.
        await asyncio.wait_for(task, 5)
        wa.close()

    asyncio.run(run())
