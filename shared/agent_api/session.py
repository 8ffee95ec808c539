"""``hello`` and ``ping``: the session's handshake and liveness check."""

from __future__ import annotations

from typing import TypedDict


class _HelloRequest(TypedDict):
    protocol: int


class HelloRequest(_HelloRequest, total=False):
    client: str


class HelloReply(TypedDict):
    protocol: int
    agent_version: str
    bundle: str  # the installed bundle's digest, or "source" in a checkout
    pid: int
    python: str


class PingReply(TypedDict):
    time: float
