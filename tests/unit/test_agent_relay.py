"""The agent's relay listener: what a connection that is not a known transfer gets."""

from __future__ import annotations

import asyncio
import socket

import pytest

from agent.relay import Relay
from shared import relay as wire


async def _hello(relay: Relay, frame: dict) -> dict:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", relay.port))
        await loop.sock_sendall(sock, wire.MAGIC + wire.pack_frame(frame))
        return await wire.read_frame(sock)
    finally:
        sock.close()


@pytest.mark.parametrize("transfer", ["unknown", ["a", "list"], {"a": "map"}, None])
def test_a_hello_naming_no_open_transfer_is_refused_with_an_answer(transfer):
    async def scenario() -> dict:
        relay = Relay()
        await relay._listen()
        try:
            return await asyncio.wait_for(_hello(relay, {"transfer": transfer, "token": "t"}), 10)
        finally:
            await relay.close_all()
            await relay._stop_listening()

    assert asyncio.run(scenario()) == {"error": "no such transfer here"}
