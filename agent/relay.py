"""The node side of a broadcast: receive a file chunk by chunk, verify each chunk, and pass it on.

The daemon opens a transfer on every node that needs the file (``open_receiver``), on the
node that already holds it if it is the source (``open_source``), and tells each node whom
to forward to (``forward``). One TCP listener per agent serves every transfer; each
connection names its transfer and proves it with the transfer's token.

A receiver writes verified chunks into a temporary file beside the target and renames it
only when every chunk is there (the chunks' hashes were computed from a read whose whole-
file SHA256 matched, so the whole file matches too), after an fsync: a node never holds a
file under its final name that does not match its hash. Chunks arrive in order; a new
upstream (the daemon routed around a failed relay) resumes at the first chunk missing.
A forwarder reads what has arrived from the temporary file and sends it on while the rest
is still coming: a chain is pipelined by chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import itertools
import os
import socket
import stat
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent import ranks as node_ranks
from agent import sync as node_sync
from agent import sync_durable as durable
from agent import upkeep
from agent.write_errors import write_failed
from shared import protocol as p
from shared import relay as wire
from shared.paths import UnsafePath, resolve_under
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from shared.agent_api.relay import ForwardState, RelayCloseReply, RelayReceiveReply, RelaySourceReply, TransferState

_ids = itertools.count(1)
MAX_TRANSFERS = 64
IDLE_CLOSE_S = 600.0  # a transfer nobody asked about for this long is dropped


@dataclass
class Forward:
    host: str
    port: int
    task: asyncio.Task | None = None
    sent: int = 0
    error: str | None = None
    done: bool = False

    def as_dict(self) -> ForwardState:
        return {"host": self.host, "port": self.port, "sent": self.sent, "error": self.error, "done": self.done}


@dataclass
class Transfer:
    id: str
    token: str
    plan: wire.ChunkPlan
    hashes: list[bytes]
    read_fd: int
    source: bool  # holds the whole file already
    root: str = ""
    rel: str = ""
    target: str = ""
    tmp: str = ""
    mode: int = 0o644
    sha256: str = ""
    write_fd: int | None = None
    have: int = 0  # leading chunks verified and written
    done: bool = False
    committing: bool = False
    error: str | None = None  # this node cannot hold the file (its disk, say): final
    upstream_error: str | None = None  # what the last upstream did wrong: the daemon may route around it
    upstream_error_at: int = 0  # the upstream connection (counted from 1) the error came from
    connections: int = 0  # upstream connections accepted so far
    upstream: asyncio.Task | None = None
    upstream_peer: str | None = None
    forwards: dict[str, Forward] = field(default_factory=dict)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    touched: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None

    def open_write_fd(self) -> int:
        """The temporary file's descriptor for writing; closed (an OSError) once committed or dropped."""
        if self.write_fd is None:
            raise OSError(errno.EBADF, f"{self.tmp} is no longer open for writing")
        return self.write_fd

    def state(self) -> TransferState:
        return {"transfer": self.id, "have": self.have, "chunks": self.plan.count, "size": self.plan.size,
                "bytes": min(self.plan.size, self.have * self.plan.chunk_bytes), "done": self.done,
                "error": self.error, "upstream_error": self.upstream_error,
                "upstream_error_at": self.upstream_error_at, "connections": self.connections, "path": self.target,
                "upstream": self.upstream_peer,
                "seconds": round((self.finished or time.monotonic()) - self.started, 3),
                "forwards": [f.as_dict() for f in self.forwards.values()]}



def _remove_stale_temporaries(target: str) -> None:
    """Temporaries of this target left by an agent that was killed mid-transfer (its process is
    gone): the next transfer of the file removes them, so they do not pile up on a node."""
    prefix = f".{os.path.basename(target)}.coord-relay-"
    directory = os.path.dirname(target)
    for name in os.listdir(directory):
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # another agent of this user is alive with that pid: maybe its transfer
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))


def _mode(mode: int) -> int:
    return mode & 0o777


def _write_error(state: Transfer, exc: OSError) -> str:
    """Why this node cannot hold the file; a full disk with the room it lacks."""
    still = state.plan.size - min(state.plan.size, state.have * state.plan.chunk_bytes)
    said = write_failed(exc, state.target, still)
    return said.message if said is not None else f"cannot write {state.target}: {exc.strerror or exc}"


def _discard_temporary(state: Transfer) -> None:
    """A receiver that failed for good: its write descriptor closed and its temporary removed (its read
    descriptor stays open until the transfer is closed: a forwarder may still be reading from it)."""
    if state.write_fd is not None:
        fd, state.write_fd = state.write_fd, None
        with contextlib.suppress(OSError):
            os.close(fd)
    if not state.done and state.tmp:
        with contextlib.suppress(OSError):
            os.unlink(state.tmp)


def _held_file(workdir: str, path: str) -> str:
    """The file ``path`` names under ``workdir`` (relative, or absolute inside it); it must exist."""
    if not isinstance(workdir, str) or not os.path.isabs(workdir):
        raise RemoteError(p.BAD_ARGS, f"workdir must be an absolute path, got {workdir!r}")
    try:
        return resolve_under(workdir, os.path.relpath(path, workdir) if os.path.isabs(path) else path,
                             must_exist=True)
    except UnsafePath as exc:
        raise RemoteError(p.REFUSED, str(exc)) from None


class Relay:
    def __init__(self) -> None:
        self._transfers: dict[str, Transfer] = {}
        self._server: asyncio.Task | None = None  # the accept loop of the data port
        self.port: int | None = None

    # --- control (RPC) -----------------------------------------------------------------

    async def open_receiver(self, transfer: str, token: str, root: str, path: str, size: int, mode: int,
                            sha256: str, chunk_bytes: int, chunks: list[bytes]) -> RelayReceiveReply:
        """Get ready to receive ``path`` (under ``root``); returns the port to send to."""
        plan, hashes = self._check_plan(size, chunk_bytes, chunks)
        root = node_sync._root(root, create=True)
        try:
            target = resolve_under(root, path)
        except UnsafePath as exc:
            raise RemoteError(p.REFUSED, str(exc)) from None
        self._check_new(transfer)
        directory = os.path.dirname(target)
        tmp = os.path.join(directory, f".{os.path.basename(target)}.coord-relay-{os.getpid()}-{next(_ids)}")
        try:
            os.makedirs(directory, exist_ok=True)
            _remove_stale_temporaries(target)
            write_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError as exc:
            raise write_failed(exc, target, size) or exc from None
        try:
            read_fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            os.close(write_fd)
            os.unlink(tmp)
            raise
        self._transfers[transfer] = Transfer(transfer, token, plan, hashes, read_fd, False, root=root, rel=path,
                                             target=target, tmp=tmp, mode=_mode(mode), sha256=sha256,
                                             write_fd=write_fd)
        if plan.count == 0:
            self._transfers[transfer].committing = True
            await upkeep.run(self._commit, self._transfers[transfer])
        return {"port": await self._listen()}

    async def open_source(self, transfer: str, token: str, workdir: str, path: str, size: int, sha256: str,
                          chunk_bytes: int = wire.CHUNK_BYTES) -> RelaySourceReply:
        """Serve a file this node holds whole; returns its chunks' hashes, read now, after checking
        that the file still has the SHA256 recorded for it."""
        full = await asyncio.to_thread(_held_file, workdir, path)  # resolving it reads the disk
        if chunk_bytes <= 0 or chunk_bytes > 64 << 20:
            raise RemoteError(p.BAD_ARGS, f"chunk size {chunk_bytes} out of range")
        self._check_new(transfer)
        try:
            hashes, whole = await upkeep.run(wire.chunk_hashes, full, size, chunk_bytes)
        except (OSError, wire.RelayError) as exc:
            raise RemoteError(p.NOT_FOUND, f"cannot read {full}: {exc}") from None
        if whole != sha256:
            raise RemoteError(p.DAMAGED, f"{full} no longer matches the SHA256 recorded for it")
        read_fd = os.open(full, os.O_RDONLY)
        plan = wire.ChunkPlan(size, chunk_bytes)
        self._transfers[transfer] = Transfer(transfer, token, plan, hashes, read_fd, True, target=full,
                                             have=plan.count, done=True, sha256=sha256)
        return {"port": await self._listen(), "chunks": hashes}

    async def forward(self, transfer: str, targets: list[list[Any]]) -> TransferState:
        """Send this transfer on to each of ``targets`` ([host, port] pairs) as chunks arrive."""
        state = self._get(transfer)
        for target in targets:
            if not (isinstance(target, list) and len(target) == 2 and isinstance(target[0], str)
                    and isinstance(target[1], int)):
                raise RemoteError(p.BAD_ARGS, "each target must be [host, port]")
            key = f"{target[0]}:{target[1]}"
            old = state.forwards.get(key)
            if old is not None and old.task is not None and not old.task.done():
                continue
            entry = Forward(target[0], target[1])
            entry.task = asyncio.create_task(self._forward(state, entry))
            state.forwards[key] = entry
        return state.state()

    async def wait(self, transfer: str, timeout: float = 5.0, have: int = -1) -> TransferState:
        """This transfer's state once it is done, failed or holds more than ``have`` chunks, or
        after ``timeout`` seconds: the daemon's long poll."""
        state = self._get(transfer)
        deadline = time.monotonic() + max(0.0, min(float(timeout), 60.0))
        while not (state.done or state.error) and state.have <= have:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            async with state.changed:
                try:
                    await asyncio.wait_for(state.changed.wait(), remaining)
                except TimeoutError:
                    break
        state.touched = time.monotonic()
        return state.state()

    async def close(self, transfer: str) -> RelayCloseReply:
        """Forget a transfer: its forwarders stop, an unfinished temporary file is removed."""
        state = self._transfers.pop(transfer, None)
        if state is None:
            return {"closed": False}
        await self._drop(state)
        if not self._transfers:
            await self._stop_listening()
        return {"closed": True, "done": state.done}

    async def close_all(self) -> None:
        for transfer in list(self._transfers):
            await self.close(transfer)

    # --- internals ------------------------------------------------------------------------

    def _check_plan(self, size: int, chunk_bytes: int, chunks: list[bytes]) -> tuple[wire.ChunkPlan, list[bytes]]:
        if size < 0 or chunk_bytes <= 0 or chunk_bytes > 64 << 20:
            raise RemoteError(p.BAD_ARGS, f"size {size} or chunk size {chunk_bytes} out of range")
        plan = wire.ChunkPlan(size, chunk_bytes)
        if len(chunks) != plan.count or not all(isinstance(h, bytes) and len(h) == 32 for h in chunks):
            raise RemoteError(p.BAD_ARGS, f"expected {plan.count} chunk hashes of 32 bytes")
        return plan, list(chunks)

    def _check_new(self, transfer: str) -> None:
        self._expire()
        if not isinstance(transfer, str) or not transfer or len(transfer) > 64:
            raise RemoteError(p.BAD_ARGS, "a transfer id is a short string")
        if transfer in self._transfers:
            raise RemoteError(p.REFUSED, f"transfer {transfer} is already open here")
        if len(self._transfers) >= MAX_TRANSFERS:
            raise RemoteError(p.REFUSED, f"already {MAX_TRANSFERS} transfers open on this node")

    def _expire(self) -> None:
        now = time.monotonic()
        for transfer, state in list(self._transfers.items()):
            if now - state.touched > IDLE_CLOSE_S:
                self._transfers.pop(transfer, None)
                asyncio.get_running_loop().create_task(self._drop(state))

    def _get(self, transfer: str) -> Transfer:
        state = self._transfers.get(transfer)
        if state is None:
            raise RemoteError(p.NOT_FOUND, f"no transfer {transfer} open on this node")
        state.touched = time.monotonic()
        return state

    async def _drop(self, state: Transfer) -> None:
        await wire.cancel_and_wait([*(f.task for f in state.forwards.values()), state.upstream])
        if state.write_fd is not None:
            os.close(state.write_fd)
            state.write_fd = None
        os.close(state.read_fd)
        if not state.done and state.tmp:
            with contextlib.suppress(OSError):
                os.unlink(state.tmp)

    async def _listen(self) -> int:
        """The data port, listening from the first call on; IPv4 on every interface, one port. A
        connection proves itself with the transfer's token before it can write anything."""
        if self._server is not None and self.port is not None:
            return self.port
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", 0))
        listener.listen(64)
        listener.setblocking(False)
        self.port = port = listener.getsockname()[1]
        self._server = asyncio.get_running_loop().create_task(self._accept(listener))
        return port

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        connections: set[asyncio.Task] = set()
        try:
            while True:
                conn, peer = await loop.sock_accept(listener)
                conn.setblocking(False)
                task = loop.create_task(self._serve(conn, peer))
                connections.add(task)
                task.add_done_callback(connections.discard)
        finally:
            listener.close()
            for task in list(connections):
                task.cancel()

    async def _stop_listening(self) -> None:
        server, self._server, self.port = self._server, None, None
        if server is not None:
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await server

    async def _notify(self, state: Transfer) -> None:
        async with state.changed:
            state.changed.notify_all()

    async def _serve(self, conn: socket.socket, peer: Any) -> None:
        """One upstream connection: hello, then chunks in order until the file is whole."""
        loop = asyncio.get_running_loop()
        peer_text = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a peer"
        state: Transfer | None = None
        epoch = 0
        try:
            magic = bytearray(len(wire.MAGIC))
            await asyncio.wait_for(wire.recv_into(conn, memoryview(magic)), wire.HELLO_TIMEOUT_S)
            if magic != wire.MAGIC:
                return
            hello = await wire.read_frame(conn)
            transfer = hello.get("transfer")
            state = self._transfers.get(transfer) if isinstance(transfer, str) else None
            if state is None or not wire.token_matches(state.token, hello.get("token")) or state.source:
                state = None
                await loop.sock_sendall(conn, wire.pack_frame({"error": "no such transfer here"}))
                return
            if state.error:  # this node cannot hold the file: no sender gets it to try again
                await loop.sock_sendall(conn, wire.pack_frame({"error": state.error}))
                state = None
                return
            if state.upstream is not None and state.upstream is not asyncio.current_task():
                state.upstream.cancel()  # the newest upstream wins: the daemon routed around the old one
            state.upstream = asyncio.current_task()
            state.upstream_peer = peer_text
            state.connections += 1
            epoch = state.connections
            await loop.sock_sendall(conn, wire.pack_frame({"want": state.have}))
            await self._receive_chunks(state, conn, peer_text)
            await loop.sock_sendall(conn, wire.pack_frame({"done": True}))
        except asyncio.CancelledError:
            pass
        except (TimeoutError, ConnectionError, ValueError) as exc:
            if state is not None and epoch and epoch == state.connections:
                # The link, not this node: the daemon may route around it. An older upstream's
                # end (one the daemon already replaced) is not news.
                state.upstream_error = f"link from {peer_text} lost: {exc.__class__.__name__}"
                state.upstream_error_at = epoch
                await self._notify(state)
        except (wire.RelayError, OSError) as exc:
            if state is not None and epoch:
                if isinstance(exc, wire.RelayError):
                    if epoch != state.connections:
                        return
                    state.upstream_error = str(exc)  # bad bytes from upstream: take them from another
                    state.upstream_error_at = epoch
                else:
                    # Final for this node: said at once (the daemon routes its receivers around it now),
                    # and its temporary goes now, not when the transfer is closed: on a full disk, the
                    # space it took is given back at once.
                    _discard_temporary(state)  # first: the room it took counts as free in the message
                    state.error = state.error or _write_error(state, exc)
                await self._notify(state)
                with contextlib.suppress(TimeoutError, OSError):
                    await asyncio.wait_for(loop.sock_sendall(
                        conn, wire.pack_frame({"error": state.error or state.upstream_error})), 2)
        finally:
            if state is not None and state.upstream is asyncio.current_task():
                state.upstream = None
            conn.close()

    async def _receive_chunks(self, state: Transfer, conn: socket.socket, peer: str) -> None:
        """Chunks straight into one of two buffers: while one is checked and written (in a thread),
        the next arrives in the other (upkeep threads: agent/upkeep.py)."""
        buffers = [bytearray(state.plan.chunk_bytes), bytearray(state.plan.chunk_bytes)]
        header = bytearray(wire.CHUNK_HEADER.size)
        pending: tuple[int, asyncio.Future] | None = None
        which = 0
        expected = state.have
        while expected < state.plan.count:
            await asyncio.wait_for(wire.recv_into(conn, memoryview(header)), wire.STALL_TIMEOUT_S)
            index, length = wire.CHUNK_HEADER.unpack(header)
            if index != expected or length != state.plan.length(index):
                raise wire.RelayError(f"{peer} sent chunk {index} of {length} bytes, chunk {expected} of "
                                      f"{state.plan.length(expected)} bytes was expected")
            view = memoryview(buffers[which])[:length]
            await asyncio.wait_for(wire.recv_into(conn, view), wire.STALL_TIMEOUT_S)
            work = upkeep.run(self._verify_and_write, state, index, view, peer)
            if pending is not None:
                try:
                    await self._settle(state, *pending)
                except BaseException:
                    # This chunk's write is under way in a thread: it ends before anything closes its file.
                    with contextlib.suppress(BaseException):
                        await asyncio.shield(work)
                    raise
            pending = (index, work)
            which ^= 1
            expected += 1
        if pending is not None:
            await self._settle(state, *pending)

    async def _settle(self, state: Transfer, index: int, work: asyncio.Future) -> None:
        try:
            await work
        except asyncio.CancelledError:
            await asyncio.shield(work)  # the buffer is the thread's until it is done with it
            raise
        # An upstream being replaced may settle a chunk the new one also sends: never go back.
        state.have = max(state.have, index + 1)
        if state.have == state.plan.count and not state.committing:
            state.committing = True
            await upkeep.run(self._commit, state)
        await self._notify(state)

    @staticmethod
    def _verify_and_write(state: Transfer, index: int, data: memoryview, peer: str) -> None:
        if hashlib.sha256(data).digest() != state.hashes[index]:
            raise wire.RelayError(f"chunk {index} from {peer} does not match its SHA256")
        fd = state.open_write_fd()
        view, offset = memoryview(data), index * state.plan.chunk_bytes
        start = offset
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written
        wire.start_writeback(fd, start, len(data))

    @staticmethod
    def _commit(state: Transfer) -> None:
        """Every chunk verified: make it durable, give it its mode, rename it into place."""
        fd = state.open_write_fd()
        os.fchmod(fd, state.mode)
        os.fsync(fd)
        os.close(fd)
        state.write_fd = None
        os.replace(state.tmp, state.target)
        durable.fsync_dirs({os.path.dirname(state.target)})
        info = os.stat(state.target)
        if stat.S_ISREG(info.st_mode):
            durable.cache_for(state.root).store(state.rel, info, state.sha256)
            node_ranks.remember_hash(state.target, state.sha256)  # a checkpoint copy, re-checked at a resume
        state.done = True
        state.finished = time.monotonic()

    async def _forward(self, state: Transfer, entry: Forward) -> None:
        def on_sent(count: int) -> None:
            entry.sent = count

        try:
            await wire.send_file(entry.host, entry.port, transfer=state.id, token=state.token, plan=state.plan,
                                 fd=state.read_fd, available=lambda: state.have,
                                 changed=state.changed, on_sent=on_sent)
            entry.done = True
        except asyncio.CancelledError:
            raise
        except (TimeoutError, wire.RelayError, OSError) as exc:
            entry.error = str(exc) or exc.__class__.__name__
        finally:
            await self._notify(state)
