"""The node side of sync: describe the workdir, write what the head sends, delete what it says.

Every path is checked by ``shared.paths`` against the workdir before use, and
every write goes to a temporary name in the target's directory, is checked
against the SHA256 the head sent and renamed into place: a node never holds half
a file, or other bytes than the hash it was sent under, under its real name, and
nothing outside the workdir is touched.

Small files are not flushed one by one or batch by batch: ``sync_state`` (the
end of a sync, and the start of the next) makes everything written since the
last one durable at once (one ``syncfs`` on Linux; elsewhere an fsync per file
written and per directory touched, then one ``F_FULLFSYNC`` on macOS), in the
background: it reports the tree's hash without waiting for the flush. Until the
flush has succeeded the files written are not entered in the saved hash cache,
so a crash before it costs a re-hash, never a wrong cache entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import shutil
import stat
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent import sync_durable as durable
from agent.write_errors import write_failed
from shared import protocol as p
from shared.file_batch import BadBatch, FileBatch, unpack_batch
from shared.ignore import IgnoreRules
from shared.manifest import ScanStats, keep_links, scan_tree, sha256_file, tree_hash
from shared.paths import PathGuard, UnsafePath, check_relative, resolve_under
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from shared.agent_api.sync import (
        CheckWritableReply,
        DeleteFilesReply,
        FileInfo,
        InspectFilesReply,
        ManifestReply,
        ModeRow,
        PutFilesReply,
        SetModesReply,
        SyncStateReply,
        UploadAbortReply,
        UploadBeginReply,
        UploadChunkReply,
        UploadFinishReply,
    )

_upload_ids = itertools.count(1)


def _root(root: str, create: bool = False) -> str:
    if not isinstance(root, str) or not os.path.isabs(root):
        raise RemoteError(p.BAD_ARGS, f"workdir must be an absolute path, got {root!r}")
    if create:
        os.makedirs(root, exist_ok=True)
    elif not os.path.isdir(root):
        raise RemoteError(p.NOT_FOUND, f"workdir {root} does not exist")
    return root


def _safe(root: str, rel: str, *, must_exist: bool = False) -> str:
    try:
        return resolve_under(root, rel, must_exist=must_exist)
    except UnsafePath as exc:
        raise RemoteError(p.REFUSED, str(exc)) from None


def _mode(mode: int) -> int:
    return mode & 0o777  # permission bits only: never setuid, setgid or sticky from the wire


def _scan(root: str, patterns: list[str]) -> tuple[dict[str, list[Any]], ScanStats]:
    """scan_tree with this workdir's cache (saved unless a flush is under way: see ``durable.Flush``)."""
    with durable.scan_lock(root):
        return scan_tree(root, IgnoreRules(patterns), cache=durable.cache_for(root), on_link=keep_links,
                         save=not durable.flushing(root))


def describe(root: str, patterns: list[str]) -> ManifestReply:
    root = _root(root, create=True)
    manifest, stats = _scan(root, patterns)
    return {"files": [[rel, *entry] for rel, entry in manifest.items()], "tree_hash": tree_hash(manifest),
            "stats": stats.as_dict()}


def sync_state(root: str, patterns: list[str], known: list[str] | None = None) -> SyncStateReply:
    """Start making everything written since the last call durable, and describe the tree by its hash from a
    stat-only scan (its directories included: an empty one, or one with another mode, is a difference).

    The scan runs while the disk flushes: it reads no file data (the files just written are known by their
    stat and hash), and nothing it learns is saved to the hash cache until the flush has succeeded, so a
    crash never leaves a cache entry for bytes that were not durable. The answer does not wait for the
    flush beyond ``FLUSH_WAIT_S`` (see ``durable.Flush``). The full manifest comes back only when ``known``
    (hashes of trees the head already holds the manifest of) is given and the tree's hash is not in it:
    an unchanged node sends a hash, not its listing.
    """
    root = _root(root, create=True)
    rules = IgnoreRules(patterns)
    cache = durable.cache_for(root)
    with durable.scan_lock(root):  # no other scan saves the cache meanwhile
        flush = durable.start_flush(root, cache)
        manifest, stats = scan_tree(root, rules, cache=cache, save=not durable.flushing(root), on_link=keep_links,
                                    directories=True, ordered=False)
    flushed, how, flush_seconds = flush.outcome() if flush is not None else (0, "nothing", 0.0)
    digest = tree_hash(manifest)
    answer: SyncStateReply = {"tree_hash": digest, "count": len(manifest), "flushed": flushed,
                              "flush": how, "flush_seconds": round(flush_seconds, 4), "stats": stats.as_dict()}
    if known is not None and digest not in known:
        answer["files"] = [[rel, *entry] for rel, entry in sorted(manifest.items())]
    return answer


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: The agent's umask, read once at start (before any thread writes): a file made with a mode the umask
#: leaves whole needs no fchmod afterwards, which is one system call less per file of a sync.
_UMASK = _current_umask()


def _write_temporary(target: str, data: bytes | memoryview, mode: int) -> tuple[str, os.stat_result]:
    """The (already verified) content in a temporary beside target, and its stat; the caller renames it."""
    directory, _, name = target.rpartition("/")
    tmp = f"{directory}/.{name}.coord-{os.getpid()}-{next(_upload_ids)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    mode = _mode(mode)
    try:
        fd = os.open(tmp, flags, mode)
    except FileNotFoundError:  # first file in a new directory
        os.makedirs(directory, exist_ok=True)
        fd = os.open(tmp, flags, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if mode & _UMASK:
            os.fchmod(fd, mode)
        info = os.fstat(fd)  # size, mtime and inode survive the rename: the cache entry, without a stat
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    return tmp, info


def put_files(root: str, batch: FileBatch) -> PutFilesReply:
    """Write whole small files (``shared.file_batch``), each verified, then renamed.

    Every hash is checked before anything is written, so a batch with one bad file writes
    none. Each file goes to a temporary beside its target and is renamed into place; none is
    flushed here: ``sync_state`` makes the lot durable at the end.
    """
    root = _root(root, create=True)
    try:
        files = unpack_batch(batch)
    except BadBatch as exc:
        raise RemoteError(p.BAD_ARGS, str(exc)) from None
    guard = PathGuard(root)
    try:
        # Every path checked before any write: its directories (a file is renamed into place, never written
        # through whatever stands at its name).
        targets = [guard.resolve(rel, replaced=True) for rel, _, _, _ in files]
    except UnsafePath as exc:
        raise RemoteError(p.REFUSED, str(exc)) from None
    sha256 = hashlib.sha256
    for rel, _, digest, data in files:
        if sha256(data).digest() != digest:
            raise RemoteError(p.BAD_ARGS, f"content of {rel} does not match its SHA256; nothing of this batch "
                                          "was written")
    state = durable.pending(root)
    written = 0
    total = len(batch["data"])
    landed: dict[str, durable.Written] = {}
    # One batch at a time per workdir (the next ones wait decoded in memory): a dozen threads creating
    # files on one filesystem contend in its inode allocator for no gain.
    with state.writing:
        try:
            for (rel, mode, digest, data), target in zip(files, targets, strict=True):
                try:
                    tmp, info = _write_temporary(target, data, mode)
                except OSError as exc:  # the temporary is gone already; a full disk is said in words
                    raise write_failed(exc, target, total - written) or exc from None
                try:
                    os.replace(tmp, target)
                except BaseException:
                    os.unlink(tmp)
                    raise
                landed[rel] = (target, info, digest.hex())
                written += len(data)
        finally:  # what landed is flushed by the next sync_state, a batch that failed halfway included
            durable.note_written(state, landed)
    return {"files": len(files), "bytes": written}


@dataclass
class _Upload:
    """A large file being received: its temporary file, where it goes, and what has come so far."""

    fd: int | None  # None once closed
    tmp: str
    target: str
    size: int
    mode: int
    root: str
    rel: str
    sha256: str
    digest: hashlib._Hash = field(default_factory=hashlib.sha256)
    offset: int = 0
    #: Held while its file is written or closed: an abort from the head (its call failed or was cancelled)
    #: can arrive while a chunk is still being written in another thread, and must not close the
    #: descriptor under it (a number the next open would reuse).
    lock: threading.Lock = field(default_factory=threading.Lock)


def _write_all(fd: int, data: bytes) -> None:
    """All of ``data``: a write may take part of it (a disk filling up takes what fits, then refuses)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class Uploads:
    """Large files arrive in chunks into a temporary file; the rename waits for the last one.

    Any failure ends the upload here and now: its descriptor is closed and its temporary removed,
    so a failed upload retried again and again holds nothing open on the node (a disk that cannot
    be unmounted, space that cannot be freed) and leaves nothing behind.
    """

    def __init__(self) -> None:
        self._open: dict[int, _Upload] = {}

    def begin(self, root: str, path: str, size: int, mode: int, sha256: str) -> UploadBeginReply:
        root = _root(root, create=True)
        target = _safe(root, path)
        upload = next(_upload_ids)
        tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.coord-{os.getpid()}-{upload}")
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError as exc:
            raise write_failed(exc, target, size) or exc from None
        self._open[upload] = _Upload(fd=fd, tmp=tmp, target=target, size=size, mode=mode, root=root, rel=path,
                                     sha256=sha256)
        return {"upload": upload}

    def chunk(self, upload: int, offset: int, data: bytes) -> UploadChunkReply:
        state = self._get(upload)
        with state.lock:
            if state.fd is None:  # aborted meanwhile
                raise RemoteError(p.NOT_FOUND, f"no upload {upload} in progress")
            if offset != state.offset:
                self._end(upload)
                raise RemoteError(p.BAD_ARGS, f"chunk at {offset}, expected {state.offset}")
            if state.offset + len(data) > state.size:
                self._end(upload)
                raise RemoteError(p.BAD_ARGS, "more data than the announced size")
            try:
                _write_all(state.fd, data)
            except OSError as exc:
                self._end(upload)
                raise write_failed(exc, state.target, state.size - state.offset) or exc from None
            except BaseException:
                self._end(upload)
                raise
            state.digest.update(data)
            state.offset += len(data)
        return {"offset": state.offset}

    def finish(self, upload: int) -> UploadFinishReply:
        state = self._get(upload)
        with state.lock:
            try:
                if state.fd is None:
                    raise RemoteError(p.NOT_FOUND, f"no upload {upload} in progress")
                if state.offset != state.size or state.digest.hexdigest() != state.sha256:
                    raise RemoteError(p.BAD_ARGS,
                                      f"{state.target}: received content does not match its size and SHA256")
                fd = state.fd
                os.fchmod(fd, _mode(state.mode))
                os.fsync(fd)  # a disk that filled up under delayed allocation says so here
                os.close(fd)
                state.fd = None
                os.replace(state.tmp, state.target)
                durable.fsync_dirs({os.path.dirname(state.target)})
                durable.cache_for(state.root).store(state.rel, os.stat(state.target), state.sha256)
            except OSError as exc:
                self._end(upload)
                raise write_failed(exc, state.target, state.size) or exc from None
            except BaseException:
                self._end(upload)
                raise
        self._open.pop(upload, None)
        return {"bytes": state.size}

    def abort(self, upload: int) -> None:
        state = self._open.get(upload)
        if state is None:
            return
        with state.lock:  # after a chunk being written now
            self._end(upload)

    def _end(self, upload: int) -> None:
        """Forget an upload, close its file and remove its temporary (the caller holds its lock)."""
        state = self._open.pop(upload, None)
        if state is None:
            return
        if state.fd is not None:
            fd, state.fd = state.fd, None
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(state.tmp)

    def abort_reply(self, upload: int) -> UploadAbortReply:
        """``abort`` as a method answers it (an upload not in progress is not an error)."""
        self.abort(upload)
        return {"aborted": upload}

    def abort_all(self) -> None:
        for upload in list(self._open):
            self.abort(upload)

    def open_count(self) -> int:
        """Uploads in progress (each holds a descriptor and a temporary)."""
        return len(self._open)

    def _get(self, upload: int) -> _Upload:
        state = self._open.get(upload)
        if state is None:
            raise RemoteError(p.NOT_FOUND, f"no upload {upload} in progress")
        return state


def _safe_entry(root: str, rel: str) -> str:
    """``rel``'s own entry: its directories checked as ``_safe`` does, its last part not followed (a link
    is itself the entry, wherever it leads)."""
    try:
        normal = check_relative(rel)
    except UnsafePath as exc:
        raise RemoteError(p.REFUSED, str(exc)) from None
    parent, _, name = normal.rpartition("/")
    return f"{_safe(root, parent) if parent else os.path.realpath(root).rstrip('/')}/{name}"


def delete_files(root: str, paths: list[str]) -> DeleteFilesReply:
    """Remove files and links (a link itself, never what it leads to); a directory is refused."""
    root = _root(root)
    deleted = 0
    for rel in paths:
        target = _safe_entry(root, rel)
        try:
            info = os.lstat(target)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(info.st_mode):
            raise RemoteError(p.REFUSED, f"refused path {rel!r}: a directory, not a file")
        os.unlink(target)
        deleted += 1
    return {"deleted": deleted}


def set_modes(root: str, modes: list[ModeRow]) -> SetModesReply:
    root = _root(root)
    for item in modes:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], int)):
            raise RemoteError(p.BAD_ARGS, "each entry must be [path, mode]")
        os.chmod(_safe(root, item[0], must_exist=True), _mode(item[1]))
    return {"changed": len(modes)}


def inspect_files(root: str, paths: list[str], count_lines: bool = False) -> InspectFilesReply:
    """Size, mode, SHA256 (and line count) of named files; None for a missing one."""
    root = _root(root)
    found: dict[str, FileInfo | None] = {}
    for rel in paths:
        target = _safe(root, rel)
        try:
            info = os.stat(target)
        except FileNotFoundError:
            found[rel] = None
            continue
        if not stat.S_ISREG(info.st_mode):
            found[rel] = None
            continue
        entry: FileInfo = {"size": info.st_size, "mode": stat.S_IMODE(info.st_mode),
                               "sha256": sha256_file(target)}
        if count_lines:
            with open(target, "rb") as handle:
                entry["lines"] = sum(block.count(b"\n") for block in iter(lambda: handle.read(1 << 20), b""))
        found[rel] = entry
    return {"files": found}


def check_writable(root: str, subdir: str) -> CheckWritableReply:
    """Can this node write (and fsync) a file where its checkpoints go? And how much room is there?"""
    root = _root(root, create=True)
    directory = _safe(root, subdir)
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".coord-probe-{os.getpid()}")
        with open(probe, "wb") as handle:
            handle.write(b"coord")
            handle.flush()
            os.fsync(handle.fileno())
        os.unlink(probe)
        writable, detail = True, f"{directory} is writable"
    except OSError as exc:
        writable, detail = False, f"cannot write in {directory}: {exc.strerror or exc}"
    usage = shutil.disk_usage(root)
    return {"writable": writable, "detail": detail, "free_bytes": usage.free, "path": directory}
