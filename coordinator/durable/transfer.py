"""A checkpoint's bytes into the store and back, every part and file checked.

Up: a file's bytes, read once in order, are cut into parts (``PART_BYTES``), each hashed and put as
an object of its own while the next is read, a few at a time; the whole file's SHA256 is compared
with the one recorded when the checkpoint was validated. The manifest goes last, and only when every
part of every file is in: an upload that fails halfway leaves parts without a manifest, which are never
taken for a checkpoint (and are removed). Down: each part is read, checked against its SHA256, and
written at its offset; each file is checked whole and renamed into place only then."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import anyio

from coordinator.config.store_url import MANIFEST, part_name
from coordinator.durable import manifest as mf
from coordinator.durable.objects import ObjectStore, StoreError
from shared.errors import first_error

PARALLEL_PARTS = 4  # parts in flight at once, per file


def _sha256(data: bytes) -> str:
    # Called in a worker thread (hashlib lets go of the GIL): on the daemon's event loop, each part
    # (20 ms for 32 MiB, measured on a 2-core Linux head) and again the whole file would hold every
    # node's session and every job's poll, a gigabyte's checkpoint for over a second in all.
    return hashlib.sha256(data).hexdigest()


def decompress(data: bytes, size: int) -> bytes:
    """A part a node stored with zstd (agent/store_put.py), back to its ``size`` bytes; UploadDamaged
    when it is not zstd or holds more."""
    import zstandard

    try:
        return bytes(zstandard.ZstdDecompressor().decompress(data, max_output_size=size))
    except zstandard.ZstdError as exc:
        raise UploadDamaged(f"a compressed part does not decompress: {exc}") from None


class Pace:
    """At most ``rate`` bytes per second on average through ``wait`` (the head's own puts, under
    ``--store-bandwidth``)."""

    def __init__(self, rate: float | None):
        self.rate = rate
        self._next = 0.0

    async def wait(self, size: int) -> None:
        if not self.rate:
            return
        now = anyio.current_time()
        self._next = max(now, self._next) + size / self.rate
        await anyio.sleep(self._next - now)  # a part goes when its slot has passed: never above the rate


class UploadDamaged(Exception):
    """The bytes read do not match the size and SHA256 recorded for the checkpoint."""


@dataclass
class UploadFile:
    """One file of a checkpoint to upload: its path in the checkpoint, what was recorded of it, and its
    bytes (read once, in order)."""

    path: str
    size: int
    sha256: str
    chunks: Callable[[], AsyncIterator[bytes]]


async def upload_file(store: ObjectStore, prefix: str, index: int, file: UploadFile, *,
                      part_bytes: int = mf.PART_BYTES, sent: Callable[[int], None] | None = None,
                      pace: Pace | None = None) -> mf.FileEntry:
    """Put one file's parts under ``prefix``; its manifest entry, or UploadDamaged / StoreError."""
    whole = hashlib.sha256()
    parts: list[tuple[int, int, str]] = []
    limit = anyio.Semaphore(PARALLEL_PARTS)
    buffer = bytearray()
    offset = 0

    async def put(number: int, data: bytes) -> None:
        try:
            # Shielded: a request already sent completes in the store's client whether or not this side
            # waits, so a failure elsewhere waits for it (each is time-limited) and the removal of what
            # a failed upload left then sees every part.
            with anyio.CancelScope(shield=True):
                await store.put(f"{prefix}/{part_name(index, number)}", data)
            if sent is not None:
                sent(len(data))
        finally:
            limit.release()

    try:
        async with anyio.create_task_group() as tasks:
            async def flush(data: bytes) -> None:
                nonlocal offset
                await limit.acquire()
                if pace is not None:
                    await pace.wait(len(data))
                parts.append((offset, len(data), await anyio.to_thread.run_sync(_sha256, data)))
                tasks.start_soon(put, len(parts) - 1, data)
                offset += len(data)

            async for chunk in file.chunks():
                await anyio.to_thread.run_sync(whole.update, chunk)
                buffer += chunk
                while len(buffer) >= part_bytes:
                    await flush(bytes(buffer[:part_bytes]))
                    del buffer[:part_bytes]
            if buffer or not parts:
                await flush(bytes(buffer))
    except BaseExceptionGroup as group:  # a part that failed: its own error, not a group of one
        raise first_error(group) from None
    if offset != file.size or whole.hexdigest() != file.sha256:
        raise UploadDamaged(f"{file.path}: {offset} bytes read with SHA256 {whole.hexdigest()[:12]}, not the "
                            f"{file.size} bytes and {file.sha256[:12]} recorded when it was validated")
    return {"path": file.path, "size": file.size, "sha256": file.sha256, "parts": mf.part_entries(index, parts)}


async def upload_checkpoint(store: ObjectStore, prefix: str, files: list[UploadFile], *, describe: Callable[
        [list[mf.FileEntry]], mf.StoreManifest], part_bytes: int = mf.PART_BYTES,
        sent: Callable[[int], None] | None = None, pace: Pace | None = None) -> mf.StoreManifest:
    """Every file's parts, then the manifest (``describe`` of the files' entries): the commit. On any
    failure what was put is removed (as far as the store lets it) and the error raised."""
    async def put_files() -> list[mf.FileEntry]:
        return [await upload_file(store, prefix, index, file, part_bytes=part_bytes, sent=sent, pace=pace)
                for index, file in enumerate(files)]
    return await commit(store, prefix, put_files, describe)


async def commit(store: ObjectStore, prefix: str, put_files: Callable[[], Awaitable[list[mf.FileEntry]]],
                 describe: Callable[[list[mf.FileEntry]], mf.StoreManifest]) -> mf.StoreManifest:
    """``put_files`` (every file's parts, their entries), then the manifest: the commit. On any failure
    what was put is removed (as far as the store lets it) and the error raised."""
    try:
        manifest = describe(await put_files())
        await store.put(f"{prefix}/{MANIFEST}", mf.dumps(manifest))
        return manifest
    except BaseException:
        with anyio.CancelScope(shield=True), contextlib.suppress(StoreError):
            await remove_uncommitted(store, prefix)
        raise


@dataclass(frozen=True)
class SpreadFile:
    """One file of a checkpoint every sender holds a copy of, as it was catalogued."""

    path: str  # in the checkpoint
    size: int
    sha256: str


@dataclass(frozen=True)
class PartJob:
    file: int  # index in the checkpoint's files
    number: int
    offset: int
    size: int


class SenderLost(Exception):
    """A sender that can send no more (its node went away, its copy changed): its parts go to the others."""


#: A part as a sender put it: its size and SHA256 as the file holds it, and (encoding, bytes in the
#: store) where it went compressed.
SentPart = tuple[int, str, "tuple[str, int] | None"]


class PartSender(Protocol):
    """One holder of a copy that puts parts of it into the store itself (a node, with signed URLs)."""

    name: str

    async def send(self, file_index: int, file: SpreadFile, jobs: list[PartJob], keys: list[str]) -> list[SentPart]:
        """Put each job's bytes under its key; each one as it went. SenderLost, or StoreError (the store
        refused: no other sender would do better)."""
        ...


def plan_parts(files: list[SpreadFile], part_bytes: int = mf.PART_BYTES) -> list[PartJob]:
    return [PartJob(index, number, offset, size) for index, file in enumerate(files)
            for number, (offset, size) in enumerate(mf.split_parts(file.size, part_bytes))]


def _next_batch(queue: deque[PartJob], batch: int) -> list[PartJob]:
    """Up to ``batch`` parts off the queue's front, all of one file (a call reads one file)."""
    taken = [queue.popleft()]
    while queue and len(taken) < batch and queue[0].file == taken[0].file:
        taken.append(queue.popleft())
    return taken


async def upload_spread(store: ObjectStore, prefix: str, files: list[SpreadFile], senders: list[PartSender], *,
                        describe: Callable[[list[mf.FileEntry]], mf.StoreManifest], part_bytes: int = mf.PART_BYTES,
                        batch: int = 1, parallel: int = PARALLEL_PARTS,
                        sent: Callable[[str, int], None] | None = None) -> mf.StoreManifest:
    """A checkpoint that several senders hold, each putting a disjoint share of its parts at once: each
    sender has ``parallel`` calls in flight, each taking the next ``batch`` parts (of one file) when its
    last is done, so a faster uplink takes more, and the last parts end on every uplink at about the same
    time (one part at a time: measured with 128 MiB a call, the uplinks' tails left a 1 GiB upload 1.2x
    its ideal); a sender lost hands its parts back to the others. Then the manifest, last, by the head;
    on any failure what was put is removed and the error raised (``sent``: a sender's name and bytes)."""
    if not senders:
        raise SenderLost("no node holding a copy can send it")
    queue = deque(plan_parts(files, part_bytes))
    done: dict[tuple[int, int], tuple[int, int, str]] = {}
    stored: dict[tuple[int, int], tuple[str, int] | None] = {}
    lost: dict[str, str] = {}
    in_flight = 0

    async def work(sender: PartSender) -> None:
        nonlocal in_flight
        while (queue or in_flight) and sender.name not in lost:
            if not queue:  # another sender's batch may yet come back to the queue
                await anyio.sleep(0.05)
                continue
            taken = _next_batch(queue, batch)
            keys = [f"{prefix}/{part_name(job.file, job.number)}" for job in taken]
            in_flight += 1
            try:
                # Shielded, as the head's own puts are: a failure elsewhere waits for the parts already
                # on their way (each call is time-limited), so that the removal sees all of them.
                with anyio.CancelScope(shield=True):
                    results = await sender.send(taken[0].file, files[taken[0].file], taken, keys)
            except SenderLost as exc:
                queue.extendleft(reversed(taken))
                lost.setdefault(sender.name, f"{sender.name}: {exc}")
                return
            finally:
                in_flight -= 1
            for job, (size, sha, how) in zip(taken, results, strict=True):
                if size != job.size:
                    raise UploadDamaged(f"{files[job.file].path}: {sender.name} sent {size} bytes of part "
                                        f"{job.number}, not {job.size}")
                done[(job.file, job.number)] = (job.offset, size, sha)
                stored[(job.file, job.number)] = how
                if sent is not None:
                    sent(sender.name, size)

    async def put_files() -> list[mf.FileEntry]:
        try:
            async with anyio.create_task_group() as tasks:
                for sender in senders:
                    for _ in range(parallel):
                        tasks.start_soon(work, sender)
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        if queue:
            raise SenderLost("no node holding a copy could send it: " + "; ".join(sorted(lost.values())))
        entries: list[mf.FileEntry] = []
        for index, file in enumerate(files):
            numbers = range(len(mf.split_parts(file.size, part_bytes)))
            entries.append({"path": file.path, "size": file.size, "sha256": file.sha256, "parts": mf.part_entries(
                index, [done[(index, n)] for n in numbers], [stored[(index, n)] for n in numbers])})
        return entries
    return await commit(store, prefix, put_files, describe)


async def remove_uncommitted(store: ObjectStore, prefix: str) -> int:
    """Remove a checkpoint's objects when it has no manifest (an upload that failed); how many went."""
    found = await store.list_objects(prefix + "/")
    if any(o.key == f"{prefix}/{MANIFEST}" for o in found):
        return 0
    await store.delete([o.key for o in found])
    return len(found)


async def remove_checkpoint(store: ObjectStore, prefix: str) -> None:
    """Remove a committed checkpoint: its manifest first (from then on it is not a checkpoint), then its parts."""
    await store.delete([f"{prefix}/{MANIFEST}"])
    found = await store.list_objects(prefix + "/")
    await store.delete([o.key for o in found])


async def read_manifest(store: ObjectStore, prefix: str) -> mf.StoreManifest:
    return mf.parse(await store.get(f"{prefix}/{MANIFEST}"), where=f"{store.location.url}/{prefix}/{MANIFEST}")


async def download_file(store: ObjectStore, prefix: str, entry: mf.FileEntry, dest: Path, *,
                        fetched: Callable[[int], Awaitable[None]] | None = None) -> None:
    """One file of a committed checkpoint to ``dest``: each part checked as it arrives (``fetched`` told
    its size), the whole checked, fsynced and renamed into place; nothing is left under ``dest``'s name
    otherwise."""
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = dest.with_name(f".{dest.name}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        whole = hashlib.sha256()
        for part in entry["parts"]:
            data = await store.get(f"{prefix}/{part['key']}")
            if "encoding" in part:
                if len(data) != part["stored"]:
                    raise UploadDamaged(f"{store.location.url}/{prefix}/{part['key']}: {len(data)} bytes in the "
                                        f"store, not the {part['stored']} its manifest says")
                data = await anyio.to_thread.run_sync(decompress, data, part["size"])
            if len(data) != part["size"] or await anyio.to_thread.run_sync(_sha256, data) != part["sha256"]:
                raise UploadDamaged(f"{store.location.url}/{prefix}/{part['key']}: does not match its manifest "
                                    "(size or SHA256)")
            await anyio.to_thread.run_sync(whole.update, data)
            await anyio.to_thread.run_sync(os.pwrite, fd, data, part["offset"])
            if fetched is not None:
                await fetched(len(data))
        if whole.hexdigest() != entry["sha256"]:
            raise UploadDamaged(f"{entry['path']}: its parts joined do not match its SHA256 in the manifest")
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(partial, dest)
    finally:
        if fd >= 0:
            os.close(fd)
        partial.unlink(missing_ok=True)
