"""What a sync wrote, made durable, and the workdir's hash cache that learns it only then.

``put_files`` notes what it wrote (``note_written``); ``sync_state`` takes it (``take_pending``) and
starts a ``Flush``: one ``syncfs`` on Linux for the filesystems written to (or an fsync each for a
handful of files), elsewhere an fsync per file and per directory, then one ``F_FULLFSYNC`` on macOS.
The flush goes on behind ``sync_state``'s answer. The hash cache of a workdir holds the written files'
entries in memory from the start (the scans meanwhile read none of them), but no scan writes it to disk
while a flush of that workdir is under way: the flush's end does, once it has succeeded. So a crash
before it costs a re-hash, never a cache entry for bytes that were not durable.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import sys
import threading
import time

from shared.manifest import HashCache

CACHE_NAME = os.path.join(".coord", "hashcache.json")
_caches: dict[str, HashCache] = {}
_scan_locks: dict[str, threading.Lock] = {}


def cache_for(root: str) -> HashCache:
    """One hash cache per workdir for the agent's life: files it writes are entered as they are flushed,
    so the check after a sync costs a stat per file, not a read."""
    cache = _caches.get(root)
    if cache is None:
        cache = _caches[root] = HashCache(os.path.join(root, CACHE_NAME))
    return cache


def scan_lock(root: str) -> threading.Lock:
    """Held by whatever scans a workdir or saves its cache: two scans of one workdir take turns."""
    return _scan_locks.setdefault(root, threading.Lock())


def syncfs(path: str) -> bool:
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


Written = tuple[str, os.stat_result, str]


class Unflushed:
    """What ``put_files`` wrote under one workdir since its last flush."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.writing = threading.Lock()
        self.files: dict[str, Written] = {}  # rel -> (path, stat when written, sha256)
        self.dirs: set[str] = set()
        self.devices: dict[int, str] = {}  # st_dev -> a directory on it (for syncfs)


_unflushed: dict[str, Unflushed] = {}
_unflushed_lock = threading.Lock()


def pending(root: str) -> Unflushed:
    with _unflushed_lock:
        state = _unflushed.get(root)
        if state is None:
            state = _unflushed[root] = Unflushed()
        return state


#: Up to this many files, a flush fsyncs each of them and their directories rather than the whole
#: filesystem (syncfs also waits for every other writer's dirty data on it, a training run's included).
FSYNC_AT_MOST = 64


def take_pending(root: str) -> tuple[dict[str, Written], set[str], dict[int, str]] | None:
    """What was written under root since the last flush, taken (files, directories, devices); None if nothing."""
    state = pending(root)
    with state.lock:
        files, dirs, devices = state.files, state.dirs, state.devices
        state.files, state.dirs, state.devices = {}, set(), {}
    return (files, dirs, devices) if files or dirs else None


def make_durable(root: str, files: dict[str, Written], dirs: set[str], devices: dict[int, str]) -> str:
    """Flush what ``take_pending`` took; on failure it goes back to be flushed next time. Returns how.

    Linux: one ``syncfs`` per filesystem written to (it flushes file data, inodes and the
    directory entries of the renames), or for a handful of files an fsync each and one per
    directory. Elsewhere, or where syncfs fails: an fsync per file and per directory, and on
    macOS then one ``F_FULLFSYNC`` (plain fsync there leaves the data in the drive's cache).
    """
    try:
        how = "syncfs"
        if len(files) <= FSYNC_AT_MOST or not all(syncfs(directory) for directory in devices.values()):
            how = "fsync"
            for path, _, _ in files.values():
                fsync_path(path)
            fsync_dirs(dirs)
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
        state = pending(root)
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


class Flush:
    """A flush of what ``put_files`` wrote, under way in a thread of its own.

    While any flush of a workdir is under way, no scan of it saves the hash cache (the cache holds entries
    for bytes not yet durable, so that the scans meanwhile do not read those files again); the last flush
    to end saves it. One that fails drops its files' entries (they are known again only by a read) and
    puts them back to be flushed by the next ``sync_state``, which then waits for its flush: a disk that
    cannot flush fails that call, as it would have failed this one.
    """

    def __init__(self, root: str, taken: tuple[dict[str, Written], set[str], dict[int, str]],
                 must_wait: bool = False) -> None:
        self.root, self.taken, self.must_wait = root, taken, must_wait
        self.done = threading.Event()
        self.how, self.seconds = "under way", 0.0
        self.error: BaseException | None = None
        self.started = time.monotonic()
        with _flushes_lock:
            _flushes.setdefault(root, set()).add(self)
        threading.Thread(target=self._run, name=f"flush {root}", daemon=True).start()

    def outcome(self) -> tuple[int, str, float]:
        """(files, how, seconds so far), once done or after ``FLUSH_WAIT_S``; its error if it failed by then."""
        self.done.wait(None if self.must_wait else FLUSH_WAIT_S)
        if self.error is not None:
            raise self.error
        seconds = self.seconds if self.done.is_set() else time.monotonic() - self.started
        return len(self.taken[0]), self.how, seconds

    def _run(self) -> None:
        try:
            how = make_durable(self.root, *self.taken)
        except BaseException as exc:  # said by a sync_state waiting for it, or the next one (it flushes again)
            self.error = exc
        else:
            self.how = how
        self.seconds = time.monotonic() - self.started
        cache = cache_for(self.root)
        with scan_lock(self.root):
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


_flushes: dict[str, set[Flush]] = {}
_flushes_lock = threading.Lock()
_failed_flushes: set[str] = set()  # workdirs whose last flush failed: the next one is waited for


def start_flush(root: str, cache: HashCache) -> Flush | None:
    """What was written under root since the last flush, entered in its cache (in memory) and flushing;
    None if nothing was. Called with ``scan_lock(root)`` held."""
    taken = take_pending(root)
    if taken is None:
        return None
    for rel, (_, info, digest) in taken[0].items():
        cache.store(rel, info, digest)  # in memory only: a file changed since is not matched by its stat
    must_wait = root in _failed_flushes  # the last one failed: this one is waited for, and says so if it fails
    _failed_flushes.discard(root)
    return Flush(root, taken, must_wait)


def flushing(root: str) -> bool:
    with _flushes_lock:
        return bool(_flushes.get(root))


def wait_flushed(root: str, timeout: float | None = None) -> bool:
    """Wait for every flush of root under way now; False if one is still going after ``timeout``."""
    with _flushes_lock:
        under_way = list(_flushes.get(root, ()))
    return all(flush.done.wait(timeout) for flush in under_way)


def note_written(state: Unflushed, landed: dict[str, Written]) -> None:
    with state.lock:
        state.files.update(landed)
        for target, info, _ in landed.values():
            directory = target.rpartition("/")[0]
            if directory not in state.dirs:
                state.dirs.add(directory)
                state.devices.setdefault(info.st_dev, directory)


def fsync_path(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # replaced or deleted since: nothing of ours to flush
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dirs(directories: set[str]) -> None:
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
