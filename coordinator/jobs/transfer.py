"""Copying a checkpoint between places, streamed and verified: a node's workdir (through its
agent) or the head's state directory.

A copy is read once, in chunks, and written to every destination at the same time; the
SHA256 is computed on the way and compared with the one recorded when the checkpoint was
validated. A node's agent checks the hash of what it received again before its atomic
rename; the head writes to a temporary name, fsyncs, and renames only when the hash matches.
Nothing half-copied is ever left under a checkpoint's name.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import anyio

from shared.agent_api.ranks import ReadFileReply
from shared.agent_api.sync import UploadBeginReply
from shared.errors import first_error
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.nodes.session import NodeSession

CHUNK = 4 << 20  # the agent's read_file answers at most this much per call


class CheckpointDamaged(Exception):
    """The bytes read no longer match the SHA256 recorded when the checkpoint was validated."""


class Source(Protocol):
    @property
    def where(self) -> str: ...

    def chunks(self) -> AsyncIterator[bytes]: ...


class Sink(Protocol):
    @property
    def where(self) -> str: ...

    async def begin(self, size: int, sha256: str) -> None: ...
    async def write(self, offset: int, data: bytes) -> None: ...
    async def commit(self) -> str: ...
    async def abort(self) -> None: ...


@dataclass
class NodeSource:
    session: NodeSession  # up
    path: str  # absolute, under the node's workdir

    @property
    def where(self) -> str:
        return f"{self.session.node.name}:{self.path}"

    async def chunks(self) -> AsyncIterator[bytes]:
        offset = 0
        while True:
            piece: ReadFileReply = await self.session.call(
                "read_file", {"workdir": self.session.node.workdir, "path": self.path, "offset": offset}, timeout=120)
            if piece["data"]:
                yield piece["data"]
            offset = piece["offset"]
            if not piece["data"] or offset >= piece["size"]:
                return


@dataclass
class HeadSource:
    path: Path

    @property
    def where(self) -> str:
        return f"head:{self.path}"

    async def chunks(self) -> AsyncIterator[bytes]:
        handle = await anyio.open_file(self.path, "rb")
        async with handle:
            while data := await handle.read(CHUNK):
                yield data


class NodeSink:
    """A file under a node's workdir, written through its agent's verified upload."""

    def __init__(self, session: NodeSession, rel: str):
        self.session, self.rel = session, rel
        self.where = f"{session.node.name}:{rel}"
        self._upload: int | None = None

    async def begin(self, size: int, sha256: str) -> None:
        begun: UploadBeginReply = await self.session.call(
            "upload_begin", {"root": self.session.node.workdir, "path": self.rel, "size": size, "mode": 0o644,
                             "sha256": sha256}, timeout=60)
        self._upload = begun["upload"]

    async def write(self, offset: int, data: bytes) -> None:
        await self.session.call("upload_chunk", {"upload": self._upload, "offset": offset, "data": data}, timeout=120)

    async def commit(self) -> str:
        await self.session.call("upload_finish", {"upload": self._upload}, timeout=120)
        self._upload = None
        return posixpath.join(self.session.node.workdir, self.rel)

    async def abort(self) -> None:
        if self._upload is not None:
            with contextlib.suppress(RemoteError):  # a node that went away drops its open uploads itself
                await self.session.call("upload_abort", {"upload": self._upload}, timeout=30)
            self._upload = None


class HeadSink:
    """A file in the head's state directory: temporary name, fsync, rename."""

    def __init__(self, path: Path):
        self.path = path
        self.where = f"head:{path}"
        self._tmp = path.with_name(f".{path.name}.partial")
        self._fd: int | None = None

    async def begin(self, size: int, sha256: str) -> None:
        def open_tmp() -> int:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            return os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
        self._fd = await anyio.to_thread.run_sync(open_tmp)

    def _open_fd(self) -> int:
        assert self._fd is not None, "written only between begin and commit"
        return self._fd

    async def write(self, offset: int, data: bytes) -> None:
        await anyio.to_thread.run_sync(os.pwrite, self._open_fd(), data, offset)

    async def commit(self) -> str:
        fd = self._open_fd()

        def finish() -> None:
            os.fsync(fd)
            os.close(fd)
            os.replace(self._tmp, self.path)
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        await anyio.to_thread.run_sync(finish)
        self._fd = None
        return str(self.path)

    async def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._tmp.unlink(missing_ok=True)


async def copy_verified(source: Source, sinks: Sequence[Sink], *, size: int, sha256: str) -> list[str]:
    """Stream ``source`` into every sink; the paths written, or CheckpointDamaged and nothing written."""
    digest = hashlib.sha256()
    offset = 0
    begun: list[Sink] = []
    try:
        for sink in sinks:
            await sink.begin(size, sha256)
            begun.append(sink)
        async for data in source.chunks():
            digest.update(data)
            try:
                async with anyio.create_task_group() as tasks:
                    for sink in sinks:
                        tasks.start_soon(sink.write, offset, data)
            except BaseExceptionGroup as group:  # a sink that failed: its own error, not a group of one
                raise first_error(group) from None
            offset += len(data)
        if offset != size or digest.hexdigest() != sha256:
            raise CheckpointDamaged(f"{source.where} no longer matches the size and SHA256 recorded when it was "
                                    "validated")
        return [await sink.commit() for sink in sinks]
    except BaseException:
        with anyio.CancelScope(shield=True):
            for sink in begun:
                await sink.abort()
        raise
