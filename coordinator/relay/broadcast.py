"""Send one file to several nodes at once: each byte over each link once, relayed by the nodes.

The daemon is the control plane. It reads the SHA256 of every chunk from the source (the head
reads its own file; a node source reads its copy and checks it still has its recorded hash),
opens a receiver on every node with those hashes, plans a route (``route.plan_route``) and
tells each sender whom to feed. Then it follows every receiver with a long poll. A receiver
whose sender is lost (its node went away, or the link to it stopped moving), or whose sender
gave it bad bytes, is fed by the nearest sender above it instead, and carries on from the
first chunk it lacks. A receiver that is itself lost, or cannot write, fails alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypedDict

import anyio
import structlog

from coordinator.relay.route import Linked, plan_route, reroute
from shared import protocol as p
from shared import relay as wire
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.nodes.session import NodeSession
    from shared.agent_api.relay import ForwardState

HEAD = "head"
POLL_S = 2.0
#: A receiver that gains no chunk for this long has a sender that is gone or stuck.
STALL_S = 15.0
#: A link found broken is judged with the receiver's word a moment later: a receiver whose disk is full
#: closes its link and says why, and under load its sender may see the link go before that word comes.
LINK_RECHECK_S = 1.0
MAX_REROUTES = 8  # per receiver: a bound, so a broadcast always ends
CALL_TIMEOUT_S = 60.0

log = structlog.get_logger("relay")
Address = Callable[[str, str], str]


class RelayProgress(TypedDict):
    """A receiver gained chunks: how far it is, and from whom."""

    phase: Literal["relay"]
    node: str
    bytes_done: int
    bytes_total: int
    sender: str | None


Progress = Callable[[RelayProgress], Awaitable[None] | None]


class OutcomeDict(TypedDict):
    """``Outcome.as_dict``."""

    node: str
    ok: bool
    path: str | None
    detail: str
    sender: str | None
    seconds: float
    reroutes: int


class ReceiverState(TypedDict):
    """A receiving agent's answer to ``relay_wait`` (agent/relay.py, the fields read here)."""

    have: int  # chunks written and checked
    bytes: int
    done: bool
    error: str | None
    upstream_error: str | None
    upstream_error_at: int  # the count of upstream connections when that error happened
    connections: int
    path: str
    seconds: float
    forwards: list[ForwardState]  # what this node sends on, each with its error


class SourceChanged(Exception):
    """The file to send no longer has the size and SHA256 it was recorded with."""


@dataclass(frozen=True)
class Source:
    node: str  # HEAD or a node's name
    path: str  # absolute: on the head, or under that node's workdir
    size: int
    sha256: str


@dataclass(frozen=True)
class Target:
    node: str
    rel: str  # under the node's workdir
    mode: int = 0o644


@dataclass
class Outcome:
    node: str
    ok: bool = False
    path: str | None = None
    detail: str = ""
    sender: str | None = None
    seconds: float = 0.0
    reroutes: int = 0
    source_damaged: bool = False  # the source no longer has its recorded SHA256: no copy of it is any good
    node_failed: bool = False  # the node itself cannot hold the file (its disk): another way there fails too

    def as_dict(self) -> OutcomeDict:
        return {"node": self.node, "ok": self.ok, "path": self.path, "detail": self.detail, "sender": self.sender,
                "seconds": self.seconds, "reroutes": self.reroutes}


@dataclass
class _Receiver:
    target: Target
    port: int | None = None
    have: int = 0
    since: float = field(default_factory=time.monotonic)  # when ``have`` last grew
    sender: str | None = None
    avoid: set[str] = field(default_factory=set)
    connections: int = 0  # upstream connections the node had accepted when it was last looked at
    fed_after: int = 0  # connections up to this one came from senders before the current one
    head_error: str | None = None
    outcome: Outcome | None = None


#: (path, size, mtime, inode, chunk size) -> (each chunk's SHA256, the whole file's)
_chunk_cache: dict[tuple[str, int, int, int, int], tuple[list[bytes], str]] = {}


def head_chunk_hashes(path: str, size: int, sha256: str, chunk_bytes: int) -> list[bytes]:
    """The chunks' hashes of a file on the head, read once and kept while the file is unchanged."""
    info = os.stat(path)
    key = (path, info.st_size, info.st_mtime_ns, info.st_ino, chunk_bytes)
    cached = _chunk_cache.get(key)
    if cached is None:
        cached = wire.chunk_hashes(path, size, chunk_bytes)
        if len(_chunk_cache) > 256:
            _chunk_cache.clear()
        _chunk_cache[key] = cached
    hashes, whole = cached
    if whole != sha256 or info.st_size != size:
        raise SourceChanged(f"{path} no longer has the size and SHA256 recorded for it")
    return hashes


class Broadcast:
    """One file from ``source`` to every target; ``run()`` returns each node's outcome."""

    def __init__(self, sessions: Mapping[str, NodeSession], source: Source, targets: list[Target], *,
                 address: Address, thunderbolt: Linked = lambda a, b: False, progress: Progress | None = None,
                 chunk_bytes: int = wire.CHUNK_BYTES, events: Callable[[str, str], None] | None = None,
                 stall_s: float = STALL_S) -> None:
        self.stall_s = stall_s
        self.sessions, self.source, self.address = sessions, source, address
        self.thunderbolt, self.progress, self.chunk_bytes = thunderbolt, progress, chunk_bytes
        self.events = events or (lambda kind, text: None)
        self.plan = wire.ChunkPlan(source.size, chunk_bytes)
        self.transfer = secrets.token_hex(8)
        self.token = secrets.token_hex(32)
        self.receivers = {t.node: _Receiver(t) for t in targets if t.node != source.node}
        self.parents: dict[str, str] = {}
        self.lost: set[str] = set()
        self.failed: set[str] = set()  # receivers that said they cannot hold the file: they feed no one
        self._head_sends: dict[str, asyncio.Task[None]] = {}
        self._head_fd: int | None = None
        self.log = log.bind(transfer=self.transfer, source=source.node)

    async def run(self) -> dict[str, Outcome]:
        started = time.monotonic()
        try:
            hashes = await self._open_source()
        except SourceChanged as exc:
            return self._fail_all(str(exc), source_damaged=True)
        except OSError as exc:
            return self._fail_all(f"cannot read {self.source.path} on the head: {exc.strerror or exc}")
        except RemoteError as exc:
            return self._fail_all(f"the source {self.source.node} cannot send it: {exc.message}",
                                  source_damaged=exc.code == p.DAMAGED)
        try:
            await self._open_receivers(hashes)
            ready = [name for name, r in self.receivers.items() if r.outcome is None]
            self.parents = plan_route(self.source.node, ready, self.thunderbolt)
            self.log.info("route", parents=self.parents, size=self.source.size)
            for name in ready:
                await self._feed(name, self.parents[name])
            await self._follow()
        finally:
            with anyio.CancelScope(shield=True):
                await self._close()
        elapsed = round(time.monotonic() - started, 3)
        outcomes: dict[str, Outcome] = {}
        for name, receiver in self.receivers.items():
            assert receiver.outcome is not None  # _follow returns once every receiver has one
            receiver.outcome.seconds = receiver.outcome.seconds or elapsed
            outcomes[name] = receiver.outcome
        return outcomes

    # --- setting up -----------------------------------------------------------------------

    async def _open_source(self) -> list[bytes]:
        if self.source.node == HEAD:
            hashes = await anyio.to_thread.run_sync(head_chunk_hashes, self.source.path, self.source.size,
                                                    self.source.sha256, self.chunk_bytes)
            self._head_fd = os.open(self.source.path, os.O_RDONLY)
            return hashes
        session = self.sessions[self.source.node]
        answer = await session.call("relay_source", {
            "transfer": self.transfer, "token": self.token, "workdir": session.node.workdir,
            "path": self.source.path, "size": self.source.size, "sha256": self.source.sha256,
            "chunk_bytes": self.chunk_bytes}, timeout=max(CALL_TIMEOUT_S, self.source.size / 50e6))
        return list(answer["chunks"])

    async def _open_receivers(self, hashes: list[bytes]) -> None:
        async def one(name: str, receiver: _Receiver) -> None:
            session = self.sessions.get(name)
            if session is None:
                receiver.outcome = Outcome(name, detail="not a node of this cluster")
                return
            try:
                answer = await session.call("relay_receive", {
                    "transfer": self.transfer, "token": self.token, "root": session.node.workdir,
                    "path": receiver.target.rel, "size": self.source.size, "mode": receiver.target.mode,
                    "sha256": self.source.sha256, "chunk_bytes": self.chunk_bytes, "chunks": hashes},
                    timeout=CALL_TIMEOUT_S)
                receiver.port = answer["port"]
            except (RemoteError, TimeoutError) as exc:
                receiver.outcome = Outcome(name, detail=_reason(exc))
                self.lost.add(name)

        async with anyio.create_task_group() as tasks:
            for name, receiver in self.receivers.items():
                tasks.start_soon(one, name, receiver)

    async def _feed(self, name: str, sender: str) -> None:
        """Have ``sender`` send to ``name``; a sender that cannot be asked counts as lost."""
        receiver = self.receivers[name]
        receiver.sender, receiver.since = sender, time.monotonic()
        receiver.fed_after, receiver.head_error = receiver.connections, None
        self.parents[name] = sender
        host = self.address(sender, name)
        if sender == HEAD:
            old = self._head_sends.pop(name, None)
            if old is not None:
                old.cancel()
            self._head_sends[name] = asyncio.get_running_loop().create_task(self._send_from_head(host, receiver))
            return
        try:
            await self.sessions[sender].call("relay_forward", {"transfer": self.transfer,
                                                              "targets": [[host, receiver.port]]},
                                             timeout=CALL_TIMEOUT_S)
        except (RemoteError, TimeoutError) as exc:
            await self._lose(sender, _reason(exc))

    async def _send_from_head(self, host: str, receiver: _Receiver) -> None:
        assert self._head_fd is not None
        try:
            await wire.send_file(host, receiver.port or 0, transfer=self.transfer, token=self.token, plan=self.plan,
                                 fd=self._head_fd, available=lambda: self.plan.count)
        except (wire.RelayError, OSError) as exc:
            receiver.head_error = f"from the head: {exc}"

    # --- following ------------------------------------------------------------------------

    async def _follow(self) -> None:
        async with anyio.create_task_group() as tasks:
            for name, receiver in self.receivers.items():
                if receiver.outcome is None:
                    tasks.start_soon(self._follow_one, name, receiver)

    async def _follow_one(self, name: str, receiver: _Receiver) -> None:
        session = self.sessions[name]
        wait_s, rechecked = POLL_S, None  # the link problem asked about once more, before routing around it
        while receiver.outcome is None:
            if name in self.lost:
                receiver.outcome = Outcome(name, detail=f"{name} was lost during the transfer",
                                           sender=receiver.sender, reroutes=len(receiver.avoid))
                return
            try:
                state: ReceiverState = await session.call(
                    "relay_wait", {"transfer": self.transfer, "timeout": wait_s, "have": receiver.have},
                    timeout=wait_s + 10)
            except (RemoteError, TimeoutError) as exc:
                await self._lose(name, _reason(exc))
                continue
            if state["have"] > receiver.have:
                receiver.have, receiver.since = state["have"], time.monotonic()
                await self._report(name, state)
            if state["done"]:
                receiver.outcome = Outcome(name, ok=True, path=state["path"], sender=receiver.sender,
                                           seconds=state["seconds"], reroutes=len(receiver.avoid),
                                           detail=f"{self.source.size} bytes from {receiver.sender}, every "
                                                  f"chunk's SHA256 checked on arrival")
                return
            if state["error"]:
                receiver.outcome = Outcome(name, detail=state["error"], sender=receiver.sender, node_failed=True)
                await self._sender_failed(name, f"{name} cannot hold the file: {state['error']}")
                return
            await self._forwards_failed(name, state.get("forwards") or [])
            receiver.connections = max(receiver.connections, state["connections"])
            problem, wait_s = None, POLL_S
            if state["upstream_error"] and state["upstream_error_at"] > receiver.fed_after:
                problem = state["upstream_error"]  # from the current sender, not one already replaced
            elif receiver.head_error and receiver.sender == HEAD:
                problem = receiver.head_error
                if rechecked != problem:  # the receiver may have closed the link itself: ask it again first
                    wait_s, rechecked = LINK_RECHECK_S, problem
                    continue
            elif time.monotonic() - receiver.since > self.stall_s and state["have"] < self.plan.count:
                problem = f"nothing arrived from {receiver.sender} for {self.stall_s:.0f} s"
            elif receiver.sender != HEAD and receiver.sender in self.lost:
                problem = f"its sender {receiver.sender} was lost"
            elif receiver.sender in self.failed:
                problem = f"its sender {receiver.sender} cannot hold the file"
            if problem is not None:
                await self._route_around(name, receiver, problem)

    async def _lose(self, name: str, reason: str) -> None:
        """A node stopped answering: it receives nothing more, and what it fed is fed from above it."""
        if name in self.lost or name == HEAD:
            return
        self.lost.add(name)
        self.log.info("node lost", node=name, reason=reason)
        for child, sender in list(self.parents.items()):
            receiver = self.receivers.get(child)
            if sender == name and receiver is not None and receiver.outcome is None and child not in self.lost:
                await self._route_around(child, receiver, f"its sender {name} was lost: {reason}")

    async def _sender_failed(self, name: str, reason: str) -> None:
        """A receiver said it failed (its disk): whatever it fed is fed from above it now, not after a
        stall. Its session is fine: its transfer is closed with the others at the end."""
        self.failed.add(name)
        self.log.info("receiver failed", node=name, reason=reason)
        for child, sender in list(self.parents.items()):
            receiver = self.receivers.get(child)
            if sender == name and receiver is not None and receiver.outcome is None and child not in self.lost:
                await self._route_around(child, receiver, reason)

    async def _forwards_failed(self, name: str, forwards: list[ForwardState]) -> None:
        """``name`` said that sending on to a receiver failed: that receiver is fed by another now."""
        failed = {(f["host"], f["port"]): f["error"] for f in forwards if f["error"]}
        if not failed:
            return
        for child, sender in list(self.parents.items()):
            receiver = self.receivers.get(child)
            if sender != name or receiver is None or receiver.outcome is not None or child in self.lost:
                continue
            error = failed.get((self.address(name, child), receiver.port or 0))
            if error is not None:
                await self._route_around(child, receiver, f"{name} could not send to it: {error}")

    async def _route_around(self, name: str, receiver: _Receiver, why: str) -> None:
        if receiver.sender is not None:
            receiver.avoid.add(receiver.sender)
        if len(receiver.avoid) > MAX_REROUTES:
            receiver.outcome = Outcome(name, detail=f"gave up after {MAX_REROUTES} senders: {why}",
                                       sender=receiver.sender, reroutes=len(receiver.avoid))
            return
        sender = reroute(self.parents, name, receiver.avoid | self.lost | self.failed)
        if sender is None:
            receiver.outcome = Outcome(name, detail=f"no sender left: {why}", sender=receiver.sender,
                                       reroutes=len(receiver.avoid))
            return
        self.events("relay.rerouted", f"{name} now receives from {sender} (chunk {receiver.have} of "
                                      f"{self.plan.count} on): {why}")
        self.log.info("rerouted", node=name, sender=sender, have=receiver.have, why=why)
        await self._feed(name, sender)

    async def _report(self, name: str, state: ReceiverState) -> None:
        if self.progress is None:
            return
        outcome = self.progress({"phase": "relay", "node": name, "bytes_done": state["bytes"],
                                 "bytes_total": self.source.size, "sender": self.receivers[name].sender})
        if outcome is not None:
            await outcome

    # --- ending -----------------------------------------------------------------------------

    def _fail_all(self, detail: str, *, source_damaged: bool = False) -> dict[str, Outcome]:
        return {name: Outcome(name, detail=detail, source_damaged=source_damaged) for name in self.receivers}

    async def _close(self) -> None:
        await wire.cancel_and_wait(self._head_sends.values())
        if self._head_fd is not None:
            os.close(self._head_fd)
            self._head_fd = None

        async def close(name: str) -> None:
            session = self.sessions.get(name)
            if session is None or name in self.lost:
                return
            # An agent that went away drops its transfers with its session.
            with contextlib.suppress(RemoteError, TimeoutError):
                await session.call("relay_close", {"transfer": self.transfer}, timeout=15)

        async with anyio.create_task_group() as tasks:
            for name in [*self.receivers, self.source.node]:
                if name != HEAD:
                    tasks.start_soon(close, name)


def _reason(exc: BaseException) -> str:
    return exc.message if isinstance(exc, RemoteError) else (str(exc) or exc.__class__.__name__)


async def broadcast(sessions: Mapping[str, NodeSession], source: Source, targets: list[Target], *, address: Address,
                    thunderbolt: Linked = lambda a, b: False, progress: Progress | None = None,
                    chunk_bytes: int = wire.CHUNK_BYTES,
                    events: Callable[[str, str], None] | None = None) -> dict[str, Outcome]:
    """Send ``source`` to every target through a relay; each node's outcome (never raises for one
    node's failure)."""
    return await Broadcast(sessions, source, targets, address=address, thunderbolt=thunderbolt,
                           progress=progress, chunk_bytes=chunk_bytes, events=events).run()
