"""The head side of sync: compare manifests, send only what a node lacks.

``plan_sync`` is pure policy (tested with plain dicts); ``sync_node`` carries a
plan out through one node's agent: the directories it lacks first, then small
files in batches, large ones in chunks (``send_large``, the one place a large
file is sent), a few calls in flight at once so the link stays busy. Nodes sent
the same files at the same time share one read of each batch (``SourceReader``).
Nothing here flushes: the node's ``sync_state`` at the end does, once.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Required, TypedDict

import anyio

from coordinator.nodes.session import NodeSession
from coordinator.readiness.consistency import Manifest
from shared.errors import first_error
from shared.file_batch import FileBatch, batch_bytes, pack_batch
from shared.manifest import LINK_MODE, is_dir, is_link, read_file
from shared.rpc import RemoteError

SMALL_FILE = 1 << 20
BATCH_BYTES = 8 << 20
BATCH_FILES = 2048
CHUNK_BYTES = 4 << 20
IN_FLIGHT = 4
ABORT_TIMEOUT_S = 30

class SyncProgress(TypedDict, total=False):
    """A sync's progress event, streamed to the CLI as it happens (coordinator/cli/progress.py)."""

    phase: Required[Literal["hash", "compare", "plan", "send", "relay"]]
    node: str
    files_done: int
    files_total: int
    bytes_done: int
    bytes_total: int
    sender: str | None  # relay: the node (or the head) feeding this one
    file: str  # relay: the file


Progress = Callable[[SyncProgress], Awaitable[None] | None]


class SyncPlanDict(TypedDict):
    """``SyncPlan.as_dict``: counts, with the first paths of each list."""

    send: int  # files and links
    missing: int  # of those sent, the files the node lacked (the rest differed)
    bytes_to_send: int
    chmod: int
    dirs: int  # directories to make, or to give the source's mode
    delete: int  # files, links and directories
    extra_kept: int
    send_paths: list[str]
    missing_paths: list[str]
    dir_paths: list[str]
    delete_paths: list[str]
    extra_paths: list[str]


class SendResult(TypedDict):
    """What ``sync_node`` did on one node."""

    files_sent: int
    bytes_sent: int
    chmod: int
    dirs_made: int  # directories that were missing (those whose mode was set are in the plan's dirs)
    deleted: int  # files, links and directories
    dirs_kept: list[str]  # directories --delete left in place: they hold files the sync ignores
    seconds: float


@dataclass
class SyncPlan:
    send: list[str] = field(default_factory=list)  # files and links
    missing: list[str] = field(default_factory=list)  # of those, the ones the node lacks
    chmod: list[tuple[str, int]] = field(default_factory=list)
    dirs: list[tuple[str, int]] = field(default_factory=list)  # directories to make or to give their mode
    delete: list[str] = field(default_factory=list)  # files and links
    delete_dirs: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # on the node only, kept without --delete
    #: links or files on the node where the source has a directory: removed before anything is written there
    unlink_first: list[str] = field(default_factory=list)
    bytes_to_send: int = 0

    @property
    def empty(self) -> bool:
        return not (self.send or self.chmod or self.dirs or self.delete or self.delete_dirs or self.unlink_first)

    def as_dict(self) -> SyncPlanDict:
        return {"send": len(self.send), "missing": len(self.missing), "bytes_to_send": self.bytes_to_send,
                "chmod": len(self.chmod), "dirs": len(self.dirs), "delete": len(self.delete) + len(self.delete_dirs),
                "extra_kept": len(self.extra), "send_paths": self.send[:20], "missing_paths": self.missing[:20],
                "dir_paths": [rel for rel, _ in self.dirs[:20]],
                "delete_paths": (self.delete + self.delete_dirs)[:20], "extra_paths": self.extra[:20]}


def plan_sync(source: Manifest, remote: Manifest, *, delete: bool) -> SyncPlan:
    """What one node needs to hold the source: each file or link it lacks or holds with other content, each
    file with another mode, each directory it lacks or holds with another mode, and (``delete``) what it has
    that the source does not, else that is listed as kept."""
    plan = SyncPlan()
    if not remote:  # a node's first sync: everything, in one pass with no look-ups
        for rel, entry in source.items():
            if is_dir(entry):
                plan.dirs.append((rel, entry[1]))
            else:
                plan.send.append(rel)
                plan.bytes_to_send += entry[0]
        plan.missing = list(plan.send)
        return plan
    for rel, entry in source.items():
        have = remote.get(rel)
        if is_dir(entry):
            if have is None or have[1] != entry[1]:
                plan.dirs.append((rel, entry[1]))
            if have is not None and not is_dir(have):
                plan.unlink_first.append(rel)  # the node's file or link goes: the directory takes its place
        elif have is None or have[2] != entry[2]:
            plan.send.append(rel)
            plan.bytes_to_send += entry[0]
            if have is None:
                plan.missing.append(rel)
        elif have[1] != entry[1]:
            plan.chmod.append((rel, entry[1]))
    for rel, entry in remote.items():
        if rel not in source:
            (plan.extra if not delete else plan.delete_dirs if is_dir(entry) else plan.delete).append(rel)
    _unlink_links_in_the_way(plan, source, remote)
    return plan


def _unlink_links_in_the_way(plan: SyncPlan, source: Manifest, remote: Manifest) -> None:
    """A link on the node where the source has files under that name (a directory the source's manifest may
    not list itself) is removed first, whatever --delete says: it is never written through."""
    node_links = [rel for rel, entry in remote.items() if is_link(entry) and (rel not in source
                                                                              or not is_link(source[rel]))]
    if not node_links:  # rare: only then is the set of the source's directories worth making
        return
    directories = {rel[:i] for rel in source for i in range(len(rel)) if rel[i] == "/"}
    for rel in node_links:
        if rel in directories and rel not in plan.unlink_first:
            plan.unlink_first.append(rel)
    for rel in plan.unlink_first:
        for kept in (plan.delete, plan.extra):
            if rel in kept:
                kept.remove(rel)


class Landed(TypedDict):
    """What of a node's plan is on the node after the sync, by its own listing: only what landed counts."""

    files: int
    bytes: int
    planned_files: int
    planned_bytes: int


def landed_count(planned: list[str], source: Manifest, remote: Manifest) -> Landed:
    """Of the paths a node was to be sent, those it now holds as the source has them (``remote``: its
    listing after the sync): a node that failed halfway is credited with these, not with what it was sent."""
    landed = [rel for rel in planned if (have := remote.get(rel)) is not None and have[2] == source[rel][2]]
    return {"files": len(landed), "bytes": sum(source[rel][0] for rel in landed),
            "planned_files": len(planned), "planned_bytes": sum(source[rel][0] for rel in planned)}


def manifest_from_wire(files: list[list[Any]]) -> Manifest:
    """A node's listing as sent, [[rel, size, mode, sha256], ...], by path."""
    return {rel: [size, mode, sha] for rel, size, mode, sha in files}


class Meter:
    """Files and bytes done toward a total, reported at most ten times a second."""

    def __init__(self, node: str, files: int, total_bytes: int, progress: Progress | None) -> None:
        self.node, self.files_total, self.bytes_total = node, files, total_bytes
        self.files_done = self.bytes_done = 0
        self.started = time.monotonic()
        self._progress = progress
        self._last = 0.0

    async def add(self, files: int, nbytes: int, *, final: bool = False) -> None:
        self.files_done += files
        self.bytes_done += nbytes
        now = time.monotonic()
        if self._progress is not None and (final or now - self._last >= 0.1):
            self._last = now
            outcome = self._progress({"phase": "send", "node": self.node, "files_done": self.files_done,
                                      "files_total": self.files_total, "bytes_done": self.bytes_done,
                                      "bytes_total": self.bytes_total})
            if outcome is not None:
                await outcome


def _batches(source: Manifest, paths: list[str]) -> tuple[list[list[str]], list[str]]:
    small: list[list[str]] = []
    large: list[str] = []
    batch: list[str] = []
    size = 0
    for rel in paths:
        length = source[rel][0]
        if length >= SMALL_FILE:
            large.append(rel)
            continue
        if batch and (size + length > BATCH_BYTES or len(batch) >= BATCH_FILES):
            small.append(batch)
            batch, size = [], 0
        batch.append(rel)
        size += length
    if batch:
        small.append(batch)
    return small, large


def _first_remote_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The node's own refusal out of a task group's errors (the other calls were cancelled by it)."""
    remote = group.subgroup(lambda exc: isinstance(exc, RemoteError))
    return group if remote is None else first_error(remote)


class SourceReader:
    """Batches of source files, each read from disk once for every node sent it at about the same time.

    On a first sync (or a change made on the head) every node is sent the same batches: the
    nodes' senders ask for the same batch within moments, and the first one's read serves
    the others. Read batches are kept until ``keep_bytes`` is exceeded (oldest dropped
    first), so memory stays bounded however far apart the nodes run.
    """

    def __init__(self, source_dir: str, source: Manifest, keep_bytes: int = 4 * BATCH_BYTES * IN_FLIGHT,
                 hashed: Mapping[str, bytes] | None = None) -> None:
        self.source_dir, self.source, self.keep_bytes = source_dir, source, keep_bytes
        self.hashed = hashed or {}  # files the scan read to hash them (``shared.manifest.Contents``): not read again
        self._kept: OrderedDict[tuple[str, ...], FileBatch] = OrderedDict()
        self._kept_bytes = 0
        self._loading: dict[tuple[str, ...], anyio.Event] = {}
        self.reads = 0

    def _read_batch(self, batch: list[str]) -> FileBatch:
        source, directory, hashed = self.source, self.source_dir, self.hashed
        return pack_batch((rel, source[rel][1], source[rel][2],
                           hashed.get(rel) or read_file(os.path.join(directory, rel))) for rel in batch)

    async def batch(self, batch: list[str]) -> FileBatch:
        key = tuple(batch)
        while True:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                return kept
            loading = self._loading.get(key)
            if loading is None:
                break
            await loading.wait()  # another node's sender is reading it; a failed read is retried here
        loading = self._loading[key] = anyio.Event()
        try:
            files = await anyio.to_thread.run_sync(self._read_batch, batch)
            self.reads += 1
            self._kept[key] = files
            self._kept_bytes += batch_bytes(files)
            while self._kept_bytes > self.keep_bytes and len(self._kept) > 1:
                _, dropped = self._kept.popitem(last=False)
                self._kept_bytes -= batch_bytes(dropped)
            return files
        finally:
            del self._loading[key]
            loading.set()


async def abort_upload(session: NodeSession, upload: int) -> None:
    """End an upload that failed (or was cancelled, say by another file's failure) on the node: its
    descriptor and temporary go now, not when the session ends. The agent already ended one whose
    write failed (then this is a no-op); a node that is gone drops its uploads with its session."""
    with anyio.CancelScope(shield=True), contextlib.suppress(RemoteError, TimeoutError):
        await session.call("upload_abort", {"upload": upload}, timeout=ABORT_TIMEOUT_S)


#: The permission bits the sync itself needs on a directory it writes into (its owner's: read, write, search).
OWNER_BITS = 0o700


def dirs_to_open(plan: SyncPlan, source: Manifest) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The directories to make or set before anything is written, and those whose own mode waits for the end.

    Each directory of the plan is made first (files then land in it with its mode already set), with its
    owner's bits added where its mode lacks them, and so is every source directory of that kind that the plan
    writes into (a file, link or deletion below it): the sync could not write there otherwise. Those get
    their own mode back last (``close_dirs``), as ``rsync`` does with a directory of mode 0o500.
    """
    shut = {rel: entry[1] for rel, entry in source.items() if is_dir(entry) and entry[1] & OWNER_BITS != OWNER_BITS}
    first = dict(plan.dirs)
    if shut:  # rare: a read-only directory in the source
        for rel in [*plan.send, *plan.delete, *(rel for rel, _ in plan.chmod), *first]:
            parts = rel.split("/")
            for depth in range(1, len(parts)):
                parent = "/".join(parts[:depth])
                if parent in shut:
                    first.setdefault(parent, shut[parent])
    opened = sorted((rel, mode | OWNER_BITS if rel in shut else mode) for rel, mode in first.items())
    last = sorted((rel, mode) for rel, mode in first.items() if rel in shut)
    return opened, last


async def close_dirs(session: NodeSession, plan: SyncPlan, source: Manifest) -> None:
    """The source's mode, last, on each directory ``dirs_to_open`` opened to its owner for the sync."""
    _, last = dirs_to_open(plan, source)
    if last:
        await session.call("make_dirs", {"root": session.node.workdir, "dirs": [list(item) for item in last]})


async def sync_node(session: NodeSession, source_dir: str, source: Manifest, plan: SyncPlan,
                    progress: Progress | None = None, *, reader: SourceReader | None = None,
                    links: Mapping[str, str] | None = None, close: bool = True) -> SendResult:
    """Carry out one node's plan; returns what was done. Nothing is flushed here (see ``sync_state``).
    ``links``: the target of each link in the source (rel -> target), for the links the plan sends.
    ``close``: end with ``close_dirs`` (a caller that still has files to bring, by the relay, does it itself)."""
    root = session.node.workdir
    meter = Meter(session.node.name, len(plan.send), plan.bytes_to_send, progress)
    if plan.unlink_first:
        await session.call("delete_files", {"root": root, "paths": plan.unlink_first})
    opened, _ = dirs_to_open(plan, source)
    made = 0
    if opened:
        made = (await session.call("make_dirs", {"root": root, "dirs": [list(item) for item in opened]}))["made"]
    new_links = [rel for rel in plan.send if source[rel][1] == LINK_MODE]
    small, large = _batches(source, [rel for rel in plan.send if source[rel][1] != LINK_MODE] if new_links
                            else plan.send)
    limiter = anyio.Semaphore(IN_FLIGHT)
    reader = reader or SourceReader(source_dir, source, keep_bytes=0)

    async def send_batch(batch: list[str]) -> None:
        async with limiter:
            files = await reader.batch(batch)
            await session.call("put_files", {"root": root, "batch": files})
            await meter.add(len(batch), batch_bytes(files))

    async def send_large(rel: str) -> None:
        async with limiter:
            size, mode, sha = source[rel]
            begun = await session.call("upload_begin", {"root": root, "path": rel, "size": size, "mode": mode,
                                                        "sha256": sha})
            upload = begun["upload"]
            try:
                # anyio's file opens, reads and closes in a worker thread: a slow disk never blocks the loop.
                async with await anyio.open_file(os.path.join(source_dir, rel), "rb") as handle:
                    offset = 0
                    while offset < size:
                        data = await handle.read(CHUNK_BYTES)
                        if not data:
                            break
                        await session.call("upload_chunk", {"upload": upload, "offset": offset, "data": data})
                        offset += len(data)
                        await meter.add(0, len(data))
                await session.call("upload_finish", {"upload": upload})
            except BaseException:
                await abort_upload(session, upload)
                raise
            await meter.add(1, 0)

    try:
        async with anyio.create_task_group() as tasks:
            for batch in small:
                tasks.start_soon(send_batch, batch)
            for rel in large:
                tasks.start_soon(send_large, rel)
    except BaseExceptionGroup as group:
        raise _first_remote_error(group) from None
    for start in range(0, len(new_links), BATCH_FILES):  # after the files: a link to one of them dangles less
        batch = new_links[start:start + BATCH_FILES]
        await session.call("put_links", {"root": root, "links": [[rel, (links or {})[rel]] for rel in batch]})
        await meter.add(len(batch), 0)
    kept, kept_count = await _modes_and_deletions(session, plan)
    if close:
        await close_dirs(session, plan, source)
    await meter.add(0, 0, final=True)
    return {"files_sent": meter.files_done, "bytes_sent": meter.bytes_done, "chmod": len(plan.chmod),
            "dirs_made": made, "deleted": len(plan.delete) + len(plan.delete_dirs) - kept_count, "dirs_kept": kept,
            "seconds": round(time.monotonic() - meter.started, 3)}


async def _modes_and_deletions(session: NodeSession, plan: SyncPlan) -> tuple[list[str], int]:
    """The plan's last steps: file modes, then deletions (files and links, then directories, the deepest
    first). Returns the directories left in place because they still hold something, and how many."""
    root = session.node.workdir
    if plan.chmod:
        await session.call("set_modes", {"root": root, "modes": [[rel, mode] for rel, mode in plan.chmod]})
    if plan.delete:
        await session.call("delete_files", {"root": root, "paths": plan.delete})
    if not plan.delete_dirs:
        return [], 0
    removed = await session.call("remove_dirs", {"root": root, "paths": plan.delete_dirs})
    return removed["kept"], removed["kept_count"]
