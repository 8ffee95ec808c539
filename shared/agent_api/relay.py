"""The relay's control methods (``relay_*``, head to agent) and its data plane's frames (node to node)."""

from __future__ import annotations

from typing import Any, TypedDict


class RelayReceiveRequest(TypedDict):
    transfer: str
    token: str
    root: str
    path: str
    size: int
    mode: int
    sha256: str
    chunk_bytes: int
    chunks: list[bytes]  # the SHA256 of each chunk


class RelayReceiveReply(TypedDict):
    port: int


class _RelaySourceRequest(TypedDict):
    transfer: str
    token: str
    workdir: str
    path: str
    size: int
    sha256: str


class RelaySourceRequest(_RelaySourceRequest, total=False):
    chunk_bytes: int


class RelaySourceReply(TypedDict):
    port: int
    chunks: list[bytes]


class RelayForwardRequest(TypedDict):
    transfer: str
    targets: list[list[Any]]  # [host, port] pairs, checked by the agent


class TransferRequest(TypedDict):
    transfer: str


class RelayWaitRequest(TransferRequest, total=False):
    timeout: float
    have: int


class ForwardState(TypedDict):
    host: str
    port: int
    sent: int
    error: str | None
    done: bool


class TransferState(TypedDict):
    transfer: str
    have: int
    chunks: int
    size: int
    bytes: int
    done: bool
    error: str | None
    upstream_error: str | None
    upstream_error_at: int
    connections: int
    path: str
    upstream: str | None
    seconds: float
    forwards: list[ForwardState]


class _RelayCloseReply(TypedDict):
    closed: bool


class RelayCloseReply(_RelayCloseReply, total=False):
    done: bool  # when it was open


# The data plane's frames (``shared.relay``), node to node.


class RelayHello(TypedDict):
    transfer: str
    token: str


class RelayWant(TypedDict):
    want: int


class RelayRefusal(TypedDict):
    error: str | None


class RelayDone(TypedDict):
    done: bool


RelayFrame = RelayHello | RelayWant | RelayRefusal | RelayDone
