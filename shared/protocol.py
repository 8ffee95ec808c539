"""The wire format spoken agent<->daemon and CLI<->daemon.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack.
Each frame holds one message, a map with a type tag ``t``:

    {"t": "req", "id": 7, "m": "facts", "a": {...}}      a call
    {"t": "res", "id": 7, "r": ...}                       its result
    {"t": "err", "id": 7, "code": "...", "msg": "..."}    or its error
    {"t": "evt", "id": 7, "e": ...}                       an event of call 7's stream

Every call gets exactly one ``res`` or ``err``. Nothing here ever unpickles or
evaluates what it reads: msgpack decodes to plain data only, and a frame larger
than the connection's limit is refused before its body is read.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeGuard

import msgpack

PROTOCOL_VERSION = 1

HEADER = struct.Struct(">I")
#: Frames above this are refused. Sync chunks are sent well below it.
DEFAULT_MAX_FRAME = 16 * 1024 * 1024

# Error codes carried in "err" messages; the CLI maps some of them to exit statuses.
BAD_FRAME = "bad_frame"
FRAME_TOO_LARGE = "frame_too_large"
BAD_MESSAGE = "bad_message"
UNKNOWN_METHOD = "unknown_method"
BAD_ARGS = "bad_args"
PROTOCOL_MISMATCH = "protocol_mismatch"
INTERNAL = "internal"
CONNECTION_LOST = "connection_lost"
NOT_FOUND = "not_found"
REFUSED = "refused"
DAMAGED = "damaged"  # a file no longer has the SHA256 recorded for it
STORE = "store"  # the checkpoint store refused a request or did not answer: the message says which
NO_SPACE = "no_space"  # a node's disk (or quota) is full: the message names the directory and the space


class ProtocolError(Exception):
    """A peer sent something that is not a valid frame or message."""

    def __init__(self, code: str, message: str, msg_id: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        # The id of the message refused, when it could be read: the error reply then reaches
        # the caller at once instead of leaving it to wait for its timeout.
        self.msg_id = msg_id


# Immutable records as named tuples, not dataclasses: every `coord` command imports this module
# at start, and dataclasses (with the inspect module it pulls in) cost a CLI start about 8 ms.
# Messages are told apart by isinstance, never by comparing one kind with another.
class Request(NamedTuple):
    id: int
    method: str
    args: Mapping[str, Any]  # any method's arguments: checked by the method served (shared.rpc.Method)


class Result(NamedTuple):
    id: int
    value: Any


class Error(NamedTuple):
    id: int | None
    code: str
    message: str


class Event(NamedTuple):
    id: int
    data: Any


Message = Request | Result | Error | Event


def pack(message: Message) -> bytes:
    """Encode one message as a complete frame (header included)."""
    if isinstance(message, Request):
        body = {"t": "req", "id": message.id, "m": message.method, "a": message.args}
    elif isinstance(message, Result):
        body = {"t": "res", "id": message.id, "r": message.value}
    elif isinstance(message, Error):
        body = {"t": "err", "id": message.id, "code": message.code, "msg": message.message}
    elif isinstance(message, Event):
        body = {"t": "evt", "id": message.id, "e": message.data}
    else:  # pragma: no cover - a programming error, not wire input
        raise TypeError(f"not a message: {message!r}")
    payload = msgpack.packb(body, use_bin_type=True)
    return HEADER.pack(len(payload)) + payload


def frame_length(header: bytes, max_frame: int) -> int:
    """Read a frame header; refuse lengths over the limit before reading the body."""
    (length,) = HEADER.unpack(header)
    if length > max_frame:
        raise ProtocolError(FRAME_TOO_LARGE, f"frame of {length} bytes exceeds the limit of {max_frame}")
    return length


def unpack(payload: bytes) -> Message:
    """Decode a frame body into a message, or raise ProtocolError saying what is wrong."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(BAD_FRAME, f"frame is not valid msgpack: {exc.__class__.__name__}") from None
    if not isinstance(body, dict):
        raise ProtocolError(BAD_MESSAGE, f"message must be a map, got {type(body).__name__}")
    kind = body.get("t")
    if kind == "err":
        # An error may carry no id: it answers a frame whose id could not be read.
        error_id = None if body.get("id") is None else _message_id(body)
        code, text = body.get("code"), body.get("msg")
        if not isinstance(code, str) or not isinstance(text, str):
            raise ProtocolError(BAD_MESSAGE, "error must carry a string code and message")
        return Error(error_id, code, text)
    msg_id = _message_id(body)
    if kind == "req":
        method, args = body.get("m"), body.get("a", {})
        if not isinstance(method, str) or not method:
            raise ProtocolError(BAD_MESSAGE, "request method must be a non-empty string", msg_id)
        if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
            raise ProtocolError(BAD_MESSAGE, "request arguments must be a map with string keys", msg_id)
        return Request(msg_id, method, args)
    if kind == "res":
        return Result(msg_id, body.get("r"))
    if kind == "evt":
        return Event(msg_id, body.get("e"))
    raise ProtocolError(BAD_MESSAGE, f"unknown message type {kind!r}")


def _message_id(body: dict[Any, Any]) -> int:
    msg_id = body.get("id")
    if not _is_int(msg_id) or msg_id < 0:
        raise ProtocolError(BAD_MESSAGE, "message id must be a non-negative integer")
    return msg_id


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
