"""``hello``, ``ping`` and ``heartbeat``: the session's handshake and liveness checks."""

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


class HeartbeatRequest(TypedDict):
    interval: float  # seconds between two beats (kept within 0.2 and 60)


class HeartbeatEvent(TypedDict):
    """``heartbeat`` streams one every interval, and answers only when its session ends."""

    time: float  # the agent's clock at the beat
