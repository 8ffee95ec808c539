"""A peer on a framed msgpack connection: calls out, serves calls in.

Both ends of every coord connection use this class. It owns the four promises
the rest of coord relies on (after mitogen):

* a hard frame-size limit, checked before a body is read;
* a frame that cannot be understood is answered with an error and logged, and
  one that is too large closes the connection; neither crashes the peer;
* every call is answered exactly once, and when the connection is lost every
  pending call fails with ``ConnectionLost``, so no caller waits forever;
* each served method is declared with the arguments it accepts, checked before
  the handler runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from shared import protocol as p
from shared.log import Logger, get_logger

#: Calls served at once on one connection; further requests wait, so a flood of
#: requests costs bounded memory.
MAX_CONCURRENT_CALLS = 64


class RemoteError(Exception):
    """A call failed; ``code`` is one of the protocol error codes."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ConnectionLost(RemoteError):
    def __init__(self, message: str = "connection lost"):
        super().__init__(p.CONNECTION_LOST, message)


class Reader(Protocol):
    async def readexactly(self, n: int) -> bytes: ...


class Writer(Protocol):
    def write(self, data: bytes) -> None: ...
    async def drain(self) -> None: ...
    def close(self) -> None: ...


#: What a streaming method is handed to send an event of its call (a coroutine function, so it can be
#: scheduled from another thread with ``run_coroutine_threadsafe``).
Emit = Callable[[Any], Coroutine[Any, Any, None]]
Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


#: The type an argument must have, or a tuple of the types it may have (``type(None)`` for nil).
ArgType = type | tuple[type, ...]


@dataclass(frozen=True)
class Method:
    """A served method and the arguments it accepts: name -> type or tuple of types."""

    func: Callable[..., Awaitable[Any]]
    required: dict[str, ArgType] = field(default_factory=dict)
    optional: dict[str, ArgType] = field(default_factory=dict)
    streams: bool = False

    def check(self, args: Mapping[str, Any]) -> None:
        """Refuse arguments this method does not take, lacks or gets with another type."""
        unknown = sorted(set(args) - set(self.required) - set(self.optional))
        if unknown:
            raise RemoteError(p.BAD_ARGS, f"unexpected argument(s): {', '.join(unknown)}")
        for name in self.required:
            if name not in args:
                raise RemoteError(p.BAD_ARGS, f"missing argument: {name}")
        for name, value in args.items():
            kind = self.required[name] if name in self.required else self.optional[name]
            if not _has_type(value, kind):
                raise RemoteError(p.BAD_ARGS,
                                  f"argument {name!r} must be {_type_name(kind)}, got {type(value).__name__}")


def _has_type(value: object, kind: ArgType) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        return False  # True is an int to Python, not to the wire
    return isinstance(value, kinds)


def _type_name(kind: ArgType) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("nil" if k is type(None) else k.__name__ for k in kinds)


class Dispatcher:
    """The table of methods a peer serves."""

    def __init__(self) -> None:
        self._methods: dict[str, Method] = {}

    def add(self, name: str, func: Callable[..., Awaitable[Any]], *, required: dict[str, ArgType] | None = None,
            optional: dict[str, ArgType] | None = None, streams: bool = False) -> None:
        self._methods[name] = Method(func, required or {}, optional or {}, streams)

    def method(self, name: str, *, streams: bool = False, **required: ArgType) -> Callable[[Handler], Handler]:
        """Decorator form of ``add`` for methods with required arguments only."""

        def register(func: Handler) -> Handler:
            self.add(name, func, required=required, streams=streams)
            return func

        return register

    def names(self) -> list[str]:
        return sorted(self._methods)

    async def dispatch(self, request: p.Request, emit: Emit) -> Any:
        method = self._methods.get(request.method)
        if method is None:
            raise RemoteError(p.UNKNOWN_METHOD, f"unknown method {request.method!r}")
        method.check(request.args)
        if method.streams:
            return await method.func(emit=emit, **request.args)
        return await method.func(**request.args)


class Peer:
    def __init__(self, reader: Reader, writer: Writer, *, dispatcher: Dispatcher | None = None,
                 max_frame: int = p.DEFAULT_MAX_FRAME, name: str = "peer", log: Logger | None = None):
        self._reader = reader
        self._writer = writer
        self._dispatcher = dispatcher
        self._max_frame = max_frame
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future[Any], Callable[[Any], Any] | None]] = {}
        self._write_lock = asyncio.Lock()
        self._call_slots = asyncio.Semaphore(MAX_CONCURRENT_CALLS)
        self._serving: set[asyncio.Task[None]] = set()
        self._closed_reason: str | None = None
        self.log = (log or get_logger("rpc")).bind(peer=name)
        # When the last whole frame went out and came in (monotonic): a heartbeat need not go while other
        # frames do, and any frame from the other side proves it alive.
        self.last_sent = self.last_received = time.monotonic()

    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    async def call(self, method: str, args: Mapping[str, Any] | None = None, *, timeout: float | None = None,
                   on_event: Callable[[Any], Any] | None = None) -> Any:
        """Call a method on the other side and return its result (or raise RemoteError).

        ``args`` are the method's arguments (any method's: their shape is the method's business, see
        ``shared.agent_api`` for the agent's); the result is whatever the method answers."""
        if self._closed_reason is not None:
            raise ConnectionLost(self._closed_reason)
        msg_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = (future, on_event)
        try:
            await self._send(p.Request(msg_id, method, args or {}))
            if timeout is None:
                return await future
            try:
                return await asyncio.wait_for(future, timeout)
            except TimeoutError:
                raise TimeoutError(f"{method} got no answer within {timeout:g} s") from None
        finally:
            self._pending.pop(msg_id, None)

    async def run(self) -> None:
        """Read and handle frames until the connection ends; then fail every pending call."""
        reason = "connection closed"
        try:
            reason = await self._read_loop()
        finally:
            for task in list(self._serving):
                task.cancel()
            self._shut(reason)
            with contextlib.suppress(Exception):  # already closed or broken
                self._writer.close()  # whatever ended reading ends the connection

    async def close(self) -> None:
        self._shut("closed locally")
        with contextlib.suppress(Exception):  # already closed or broken: nothing left to do
            self._writer.close()

    def _shut(self, reason: str) -> str:
        """Mark the connection closed (the first reason given stays) and fail every pending call;
        returns the reason it is closed for."""
        if self._closed_reason is None:
            self._closed_reason = reason
        for future, _ in list(self._pending.values()):
            if not future.done():
                future.set_exception(ConnectionLost(self._closed_reason))
                future.exception()  # a caller that already gave up must not leave a "never retrieved" log
        self._pending.clear()
        return self._closed_reason

    async def _read_loop(self) -> str:
        while True:
            try:
                header = await self._reader.readexactly(p.HEADER.size)
                length = p.frame_length(header, self._max_frame)
                payload = await self._reader.readexactly(length)
            except p.ProtocolError as exc:
                self.log.warning("frame refused, closing", code=exc.code, reason=exc.message)
                await self._send_quietly(p.Error(None, exc.code, exc.message))
                return exc.message
            except asyncio.IncompleteReadError as exc:
                return "connection closed by peer" if not exc.partial else "connection closed mid-frame"
            except (OSError, EOFError, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return f"connection error: {exc}"
            except Exception as exc:  # transport-specific errors (asyncssh) end the connection
                return f"connection error: {exc.__class__.__name__}: {exc}"
            self.last_received = time.monotonic()
            try:
                message = p.unpack(payload)
            except p.ProtocolError as exc:
                self.log.warning("bad frame refused", code=exc.code, reason=exc.message, id=exc.msg_id)
                await self._send_quietly(p.Error(exc.msg_id, exc.code, exc.message))
                continue
            await self._handle(message)

    async def _handle(self, message: p.Message) -> None:
        if isinstance(message, p.Request):
            await self._call_slots.acquire()
            task = asyncio.ensure_future(self._serve(message))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)
        elif isinstance(message, p.Event):
            entry = self._pending.get(message.id)
            if entry and entry[1] is not None:
                outcome = entry[1](message.data)
                if inspect.isawaitable(outcome):
                    await outcome
        elif isinstance(message, (p.Result, p.Error)):
            entry = self._pending.get(message.id) if message.id is not None else None
            if entry is None:
                if isinstance(message, p.Error):
                    self.log.warning("peer reported an error", code=message.code, reason=message.message)
                return
            future = entry[0]
            if not future.done():
                if isinstance(message, p.Result):
                    future.set_result(message.value)
                else:
                    future.set_exception(RemoteError(message.code, message.message))

    async def _serve(self, request: p.Request) -> None:
        try:
            async def emit(data: Any) -> None:
                await self._send(p.Event(request.id, data))

            if self._dispatcher is None:
                raise RemoteError(p.UNKNOWN_METHOD, "this side serves no methods")
            value = await self._dispatcher.dispatch(request, emit)
            reply: p.Message = p.Result(request.id, value)
        except RemoteError as exc:
            reply = p.Error(request.id, exc.code, exc.message)
        except Exception as exc:
            self.log.exception("method failed", method=request.method)
            reply = p.Error(request.id, p.INTERNAL, f"{exc.__class__.__name__}: {exc}")
        finally:
            self._call_slots.release()
        try:
            await self._send(reply)
        except ConnectionLost:
            self.log.info("reply not delivered: connection gone", method=request.method)
        except (TypeError, ValueError, RemoteError) as exc:  # msgpack cannot carry it, or it is too large
            self.log.error("result not serializable", method=request.method, error=str(exc))
            # What msgpack said names the value (a str that is not UTF-8 says which character, and where).
            await self._send_quietly(p.Error(request.id, p.INTERNAL,
                                             f"the result of {request.method} could not be encoded: {exc}"))
        except Exception as exc:
            self.log.info("reply not delivered", method=request.method, error=str(exc))

    async def _send(self, message: p.Message) -> None:
        frame = p.pack(message)
        if len(frame) - p.HEADER.size > self._max_frame:
            raise RemoteError(p.FRAME_TOO_LARGE, f"message of {len(frame)} bytes exceeds the frame limit")
        if self._closed_reason is not None and not isinstance(message, p.Error):
            raise ConnectionLost(self._closed_reason)
        async with self._write_lock:
            try:
                self._writer.write(frame)
                await self._writer.drain()
                self.last_sent = time.monotonic()
            except (OSError, EOFError) as exc:  # e.g. a pipe whose reader exited
                reason = self._shut(f"connection lost while writing: {exc}")
                raise ConnectionLost(reason) from None

    async def _send_quietly(self, message: p.Message) -> None:
        with contextlib.suppress(Exception):  # the peer is already gone; the log line has been written
            await self._send(message)
