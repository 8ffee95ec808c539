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
import ctypes
import fcntl
import hashlib
import itertools
import os
import shutil
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent.write_errors import write_failed
from shared import protocol as p
from shared.file_batch import BadBatch, FileBatch, unpack_batch
from shared.ignore import IgnoreRules
from shared.manifest import HashCache, ScanStats, keep_links, scan_tree, sha256_file, tree_hash
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

CACHE_NAME = os.path.join(".coord", "hashcache.json")
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


_caches: dict[str, HashCache] = {}
_scan_locks: dict[str, threading.Lock] = {}


def cache_for(root: str) -> HashCache:
    """One hash cache per workdir for the agent's life: files it writes are entered once flushed,
    so the check after a sync costs a stat per file, not a read."""
    cache = _caches.get(root)
    if cache is None:
        cache = _caches[root] = HashCache(os.path.join(root, CACHE_NAME))
    return cache


def _scan_lock(root: str) -> threading.Lock:
    """Held by whatever scans a workdir or saves its cache: two scans of one workdir take turns."""
    return _scan_locks.setdefault(root, threading.Lock())


def _scan(root: str, patterns: list[str]) -> tuple[dict[str, list[Any]], ScanStats]:
    """scan_tree with this workdir's cache (saved unless a flush is under way: see ``_Flush``)."""
    with _scan_lock(root):
        return scan_tree(root, IgnoreRules(patterns), cache=cache_for(root), on_link=keep_links,
                         save=not _flushing(root))


def _syncfs(path: str) -> bool:
    """Flush the filesystem holding path in one call (Linux); False where not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            return libc.syncfs(fd) == 0
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return False


def describe(root: str, patterns: list[str]) -> ManifestReply:
    root = _root(root, create=True)
    manifest, stats = _scan(root, patterns)
    return {"files": [[rel, *entry] for rel, entry in manifest.items()], "tree_hash": tree_hash(manifest),
            "stats": stats.as_dict()}


_Written = tuple[str, os.stat_result, str]


class _Unflushed:
    """What ``put_files`` wrote under one workdir since its last flush."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.writing = threading.Lock()
        self.files: dict[str, _Written] = {}  # rel -> (path, stat when written, sha256)
        self.dirs: set[str] = set()
        self.devices: dict[int, str] = {}  # st_dev -> a directory on it (for syncfs)


_unflushed: dict[str, _Unflushed] = {}
_unflushed_lock = threading.Lock()


def _pending(root: str) -> _Unflushed:
    with _unflushed_lock:
        state = _unflushed.get(root)
        if state is None:
            state = _unflushed[root] = _Unflushed()
        return state


#: Up to this many files, a flush fsyncs each of them and their directories rather than the whole
#: filesystem (syncfs also waits for every other writer's dirty data on it, a training run's included).
FSYNC_AT_MOST = 64


def _take_pending(root: str) -> tuple[dict[str, _Written], set[str], dict[int, str]] | None:
    """What was written under root since the last flush, taken (files, directories, devices); None if nothing."""
    state = _pending(root)
    with state.lock:
        files, dirs, devices = state.files, state.dirs, state.devices
        state.files, state.dirs, state.devices = {}, set(), {}
    return (files, dirs, devices) if files or dirs else None


def _make_durable(root: str, files: dict[str, _Written], dirs: set[str], devices: dict[int, str]) -> str:
    """Flush what ``_take_pending`` took; on failure it goes back to be flushed next time. Returns how.

    Linux: one ``syncfs`` per filesystem written to (it flushes file data, inodes and the
    directory entries of the renames), or for a handful of files an fsync each and one per
    directory. Elsewhere, or where syncfs fails: an fsync per file and per directory, and on
    macOS then one ``F_FULLFSYNC`` (plain fsync there leaves the data in the drive's cache).
    """
    try:
        how = "syncfs"
        if len(files) <= FSYNC_AT_MOST or not all(_syncfs(directory) for directory in devices.values()):
            how = "fsync"
            for path, _, _ in files.values():
                _fsync_path(path)
            _fsync_dirs(dirs)
            if sys.platform == "darwin" and hasattr(fcntl, "F_FULLFSYNC"):
                how = "fsync+F_FULLFSYNC"
                fd = os.open(root, os.O_RDONLY)
                try:
                    fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
                except OSError:
                    pass
                finally:
                    os.close(fd)
    except BaseException:
        state = _pending(root)
        with state.lock:  # not flushed: the next flush tries again
            for rel, item in files.items():
                state.files.setdefault(rel, item)
            state.dirs |= dirs
            state.devices.update(devices)
        raise
    return how


#: How long ``sync_state`` waits for its flush after its scan before it answers with the flush still under
#: way: a sync is proven by the tree's hash, not by the disk's flush, which goes on in the background as
#: rsync's writes do (rsync never flushes). 0.9 to 2 s a node of a cold sync of 20,000 files was the flush.
FLUSH_WAIT_S = 0.05


class _Flush:
    """A flush of what ``put_files`` wrote, under way in a thread of its own.

    While any flush of a workdir is under way, no scan of it saves the hash cache (the cache holds entries
    for bytes not yet durable, so that the scans meanwhile do not read those files again); the last flush
    to end saves it. One that fails drops its files' entries (they are known again only by a read) and
    puts them back to be flushed by the next ``sync_state``, which then waits for its flush: a disk that
    cannot flush fails that call, as it would have failed this one.
    """

    def __init__(self, root: str, taken: tuple[dict[str, _Written], set[str], dict[int, str]]) -> None:
        self.root, self.taken = root, taken
        self.done = threading.Event()
        self.how, self.seconds = "under way", 0.0
        self.error: BaseException | None = None
        self.started = time.monotonic()
        with _flushes_lock:
            _flushes.setdefault(root, set()).add(self)
        threading.Thread(target=self._run, name=f"flush {root}", daemon=True).start()

    def _run(self) -> None:
        try:
            how = _make_durable(self.root, *self.taken)
        except BaseException as exc:  # said by a sync_state waiting for it, or the next one (it flushes again)
            self.error = exc
        else:
            self.how = how
        self.seconds = time.monotonic() - self.started
        cache = cache_for(self.root)
        with _scan_lock(self.root):
            if self.error is not None:
                _failed_flushes.add(self.root)
                for rel, (_, info, digest) in self.taken[0].items():
                    entry = cache.entries.get(rel)
                    if entry is not None and entry[1:] == [info.st_mtime_ns, info.st_ino, digest]:
                        cache.entries.pop(rel)
            with _flushes_lock:
                _flushes[self.root].discard(self)
                last = not _flushes[self.root]
            if last:
                cache.save()
        self.done.set()


_flushes: dict[str, set[_Flush]] = {}
_flushes_lock = threading.Lock()
_failed_flushes: set[str] = set()  # workdirs whose last flush failed: the next one is waited for


def _flushing(root: str) -> bool:
    with _flushes_lock:
        return bool(_flushes.get(root))


def wait_flushed(root: str, timeout: float | None = None) -> bool:
    """Wait for every flush of root under way now; False if one is still going after ``timeout``."""
    with _flushes_lock:
        under_way = list(_flushes.get(root, ()))
    return all(flush.done.wait(timeout) for flush in under_way)


def sync_state(root: str, patterns: list[str], known: list[str] | None = None) -> SyncStateReply:
    """Start making everything written since the last call durable, and describe the tree by its hash from a
    stat-only scan (its directories included: an empty one, or one with another mode, is a difference).

    The scan runs while the disk flushes: it reads no file data (the files just written are known by their
    stat and hash), and nothing it learns is saved to the hash cache until the flush has succeeded, so a
    crash never leaves a cache entry for bytes that were not durable. The answer does not wait for the
    flush beyond ``FLUSH_WAIT_S`` (see ``_Flush``). The full manifest comes back only when ``known``
    (hashes of trees the head already holds the manifest of) is given and the tree's hash is not in it:
    an unchanged node sends a hash, not its listing.
    """
    root = _root(root, create=True)
    rules = IgnoreRules(patterns)
    cache = cache_for(root)
    flush: _Flush | None = None
    with _scan_lock(root):  # no other scan saves the cache meanwhile
        taken = _take_pending(root)
        if taken is not None:
            files = taken[0]
            for rel, (_, info, digest) in files.items():
                cache.store(rel, info, digest)  # in memory only: a file changed since is not matched by its stat
            flush = _Flush(root, taken)
        manifest, stats = scan_tree(root, rules, cache=cache, save=not _flushing(root), on_link=keep_links,
                                    directories=True, ordered=False)
        retry = root in _failed_flushes
        _failed_flushes.discard(root)
    flushed, how, flush_seconds = 0, "nothing", 0.0
    if flush is not None:
        flush.done.wait(None if retry else FLUSH_WAIT_S)
        if flush.error is not None:
            raise flush.error
        flushed, how = len(flush.taken[0]), flush.how
        flush_seconds = flush.seconds if flush.done.is_set() else time.monotonic() - flush.started
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
    state = _pending(root)
    written = 0
    total = len(batch["data"])
    landed: dict[str, _Written] = {}
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
            _note_written(state, landed)
    return {"files": len(files), "bytes": written}


def _note_written(state: _Unflushed, landed: dict[str, _Written]) -> None:
    with state.lock:
        state.files.update(landed)
        for target, info, _ in landed.values():
            directory = target.rpartition("/")[0]
            if directory not in state.dirs:
                state.dirs.add(directory)
                state.devices.setdefault(info.st_dev, directory)


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
                _fsync_dirs({os.path.dirname(state.target)})
                cache_for(state.root).store(state.rel, os.stat(state.target), state.sha256)
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


def _fsync_path(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # replaced or deleted since: nothing of ours to flush
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dirs(directories: set[str]) -> None:
    # The renames themselves are durable only once their directories are.
    for directory in directories:
        try:
            fd = os.open(directory, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)


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
