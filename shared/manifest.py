"""A tree described as (relative path, size, mode, SHA256), with a hash cache.

The same code describes the head's source tree and each node's copy of it, so
two manifests compare entry by entry. A sync's manifests hold its directories
too (``dir_entry``: an empty directory is part of a tree, and so is a
directory's mode), and a name that is not UTF-8 is in none: it could cross
neither the wire nor a Mac's disk, so a walk lists it apart
(``ScanStats.unlisted``). Hashes are cached per file by (size, mtime_ns,
inode): re-checking an unchanged tree costs one stat per file. A cold
hash reads files in a few threads (hashlib releases the GIL), like running one
sha256sum per core. Stdlib only: this runs with the node's Python.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shared.ignore import IgnoreRules
from shared.paths import is_utf8, printable_name

if TYPE_CHECKING:  # the reply shapes are for type checking only: no import cost at run time
    from shared.agent_api.sync import ScanStatsReport

READ_CHUNK = 1 << 20
LISTED_NAMES = 50  # names a scan's report lists, each kind (with the count of all)
PARALLEL_ABOVE = 256 << 10
CACHE_VERSION = 1
#: A symlink's mode in a manifest: its type bits tell it from a file, whose mode holds permissions only.
LINK_MODE = stat.S_IFLNK | 0o777


def link_entry(target: str) -> list[Any]:
    """A symlink's manifest entry: [length of its target, LINK_MODE, SHA256 of its target's text], so two
    links compare equal exactly when their targets are the same text."""
    data = target.encode("utf-8", "surrogateescape")
    return [len(data), LINK_MODE, hashlib.sha256(b"symlink\0" + data).hexdigest()]


def is_link(entry: list[Any]) -> bool:
    return stat.S_ISLNK(entry[1])


#: A directory's digest in a manifest: it has no content of its own; what it holds has entries of its own.
DIR_DIGEST = "directory"


def dir_entry(mode: int) -> list[Any]:
    """A directory's manifest entry: [0, S_IFDIR | its permissions, DIR_DIGEST]. Permissions only: a node
    never takes setuid, setgid or sticky bits from the wire, so a tree that has them would never match."""
    return [0, stat.S_IFDIR | (mode & 0o777), DIR_DIGEST]


def is_dir(entry: list[Any]) -> bool:
    return stat.S_ISDIR(entry[1])


@dataclass(frozen=True)
class LinkChoice:
    """What a walk does with a symlink it meets (``OnLink``): follow it (take what it points to as if it
    stood there), keep it as a link to ``target``, or, with neither, leave it out (the one who chose
    has recorded why)."""

    follow: bool = False
    target: str | None = None


#: Called with a symlink's path relative to the root and its full path; None: skipped (listed in the
#: scan's ``skipped``), as a walk without it does with every link.
OnLink = Callable[[str, str], "LinkChoice | None"]


def keep_links(rel: str, path: str) -> LinkChoice:
    """A node's walk: every link is an entry of its own, with its target as it is."""
    return LinkChoice(target=os.readlink(path))


@dataclass
class ScanStats:
    files: int = 0
    bytes: int = 0
    hashed_files: int = 0
    hashed_bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # special files (and links a walk was not told about)
    links: int = 0  # symlinks kept as links
    directories: int = 0  # directories entered in the manifest (a scan asked for them)
    #: names that are not UTF-8 (a directory's with a "/" after it: nothing in it was walked), as found
    unlisted: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> ScanStatsReport:
        return {"files": self.files, "bytes": self.bytes, "hashed_files": self.hashed_files,
                "hashed_bytes": self.hashed_bytes, "skipped": [printable_name(rel) for rel in self.skipped[:50]],
                "skipped_count": len(self.skipped), "links": self.links, "directories": self.directories,
                "unlisted": [printable_name(rel) for rel in self.unlisted[:LISTED_NAMES]],
                "unlisted_count": len(self.unlisted), "seconds": round(self.seconds, 4)}


class HashCache:
    """path -> (size, mtime_ns, inode, sha256), kept in one JSON file."""

    def __init__(self, path: str | None):
        self.path = path
        self.entries: dict[str, list[Any]] = {}  # rel -> [size, mtime_ns, inode, sha256]
        self.dirty = False
        if path:
            try:
                with open(path, encoding="utf-8") as handle:
                    data = json.load(handle)
                if isinstance(data, dict) and data.get("version") == CACHE_VERSION:
                    self.entries = data.get("entries", {})
            except (OSError, ValueError):
                self.entries = {}  # a missing or damaged cache only costs a re-hash

    def lookup(self, rel: str, info: os.stat_result) -> str | None:
        entry = self.entries.get(rel)
        if entry and entry[0] == info.st_size and entry[1] == info.st_mtime_ns and entry[2] == info.st_ino:
            return entry[3]
        return None

    def store(self, rel: str, info: os.stat_result, digest: str) -> None:
        self.entries[rel] = [info.st_size, info.st_mtime_ns, info.st_ino, digest]
        self.dirty = True

    def prune(self, keep: set[str]) -> None:
        stale = set(self.entries) - keep
        for rel in stale:
            self.entries.pop(rel, None)
        self.dirty = self.dirty or bool(stale)

    def save(self) -> bool:
        """Write the cache (not flushed: a lost or torn cache file only costs a re-hash). A cache that cannot
        be written (a full disk) is kept in memory and tried again next time: it is no reason to fail the
        scan it belongs to, and its temporary is removed, not left to hold what little room there is."""
        if not self.path or not self.dirty:
            return True
        self.dirty = False
        entries = dict(self.entries)  # a snapshot: another thread may store while this one writes
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            # json.dumps, not json.dump: only the one-shot form runs in C (20,000 entries: 20 ms, not 200).
            _write_file(tmp, json.dumps({"version": CACHE_VERSION, "entries": entries}, separators=(",", ":")))
            os.replace(tmp, self.path)
        except OSError:
            self.dirty = True
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False
        except BaseException:
            self.dirty = True
            raise
        return True


def _write_file(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def sha256_file(path: str, size: int | None = None) -> str:
    if size is not None and size < READ_CHUNK:
        # Small files: raw reads, no buffered file object (most of a tree's cost is per file). A read of a
        # byte more than its stat's size that gives that size is the whole file: no second read to find the end.
        fd = os.open(path, os.O_RDONLY)
        try:
            block = os.read(fd, size + 1)
            digest = hashlib.sha256(block)
            while len(block) != size:  # it changed since its stat, or a short read: to the end, as it is now
                block = os.read(fd, READ_CHUNK)
                if not block:
                    break
                digest.update(block)
                size = -1
            return digest.hexdigest()
        finally:
            os.close(fd)
    with open(path, "rb") as handle:
        if hasattr(hashlib, "file_digest"):
            return hashlib.file_digest(handle, "sha256").hexdigest()
        digest = hashlib.sha256()
        for block in iter(lambda: handle.read(READ_CHUNK), b""):
            digest.update(block)
        return digest.hexdigest()


def _walk_link(entry: os.DirEntry[str], rel: str, on_link: OnLink | None, stats: ScanStats,
               links: dict[str, str] | None, found: list[tuple[str, os.stat_result]]) -> os.stat_result | None:
    """A symlink met in a walk: kept, followed or left out, as ``on_link`` says. Returns the stat of the
    directory it leads to when the walk is to go through it, else None."""
    choice = on_link(rel, entry.path) if on_link is not None else None
    if choice is None:
        stats.skipped.append(rel)
    elif choice.follow:
        try:
            info = os.stat(entry.path)
        except OSError:
            stats.skipped.append(rel)
            return None
        if stat.S_ISDIR(info.st_mode):
            return info
        if stat.S_ISREG(info.st_mode):
            found.append((rel, info))
        else:
            stats.skipped.append(rel)
    elif choice.target is not None and links is not None:
        links[rel] = choice.target
    return None


def walk_tree(root: str, rules: IgnoreRules, stats: ScanStats, *, on_link: OnLink | None = None,
              links: dict[str, str] | None = None,
              dirs: dict[str, int] | None = None) -> list[tuple[str, os.stat_result]]:
    """Regular files under root, sorted by path, minus ignored ones; specials are skipped, and so are
    links unless ``on_link`` says what to do with each (links kept go into ``links``: rel -> target).
    ``dirs``: every directory walked goes in it (rel -> st_mode), the root not included. A name that
    is not UTF-8 is left out, file or directory, and listed in ``stats.unlisted``.

    One ``lstat`` per file (``scandir`` tells files from directories without one) and
    one sort at the end: on an unchanged tree this walk is most of a re-check's cost, so
    its loop is kept to the calls it needs.
    """
    found: list[tuple[str, os.stat_result]] = []
    skipped = stats.skipped
    matches = rules.matches
    file_name_rule, file_path_rule = rules.file_rules()
    exists = os.path.exists
    join = os.path.join

    def visit(directory: str, prefix: str) -> None:
        try:
            with os.scandir(directory) as listing:
                entries = list(listing)
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            name = entry.name
            rel = prefix + name
            if not name.isascii() and not is_utf8(name):  # rare: the check that costs is made only then
                _unlisted(entry, rel, matches, stats)
            elif entry.is_file(follow_symlinks=False):  # a regular file, not a link to one
                if file_name_rule is None:
                    if matches(rel, False, name):  # rules with negations: in order
                        continue
                elif file_name_rule(name) is not None or (file_path_rule is not None and file_path_rule(rel)):
                    continue
                found.append((rel, entry.stat(follow_symlinks=False)))
            elif entry.is_dir(follow_symlinks=False):
                if matches(rel, True, name) or exists(join(entry.path, "pyvenv.cfg")):
                    continue  # ignored directories and virtual environments are not descended
                _enter(dirs, rel, entry)
                visit(entry.path, rel + "/")
            elif entry.is_symlink():
                if not matches(rel, False, name):  # an ignored link is ignored like a file
                    followed = _walk_link(entry, rel, on_link, stats, links, found)
                    if followed is not None and not matches(rel, True, name):
                        _enter(dirs, rel, followed)  # it arrives as the directory it leads to
                        visit(entry.path, rel + "/")  # through the link: every path below is read through it
            else:
                skipped.append(rel)  # sockets, devices, FIFOs

    visit(root, "")
    found.sort()  # by path: paths are unique, so no two stat results are ever compared
    skipped.sort()
    stats.unlisted.sort()
    return found


def _enter(dirs: dict[str, int] | None, rel: str, found: os.DirEntry[str] | os.stat_result) -> None:
    """A directory walked, in ``dirs`` when the walk keeps them (its mode: one lstat, for a few hundred)."""
    if dirs is not None:
        dirs[rel] = found.st_mode if isinstance(found, os.stat_result) else found.stat(follow_symlinks=False).st_mode


def _unlisted(entry: os.DirEntry[str], rel: str, matches: Callable[[str, bool, str], bool], stats: ScanStats) -> None:
    """A name that is not UTF-8: listed apart unless the rules ignore it (a directory's whole tree with it)."""
    try:
        is_directory = entry.is_dir(follow_symlinks=False)
    except OSError:
        is_directory = False
    if not matches(rel, is_directory, entry.name):
        stats.unlisted.append(rel + "/" if is_directory else rel)


def scan_tree(root: str, rules: IgnoreRules, *, cache: HashCache | None = None, threads: int | None = None,
              on_progress: Callable[[int, int], None] | None = None, save: bool = True,
              on_link: OnLink | None = None, directories: bool = False,
              contents: Contents | None = None, ordered: bool = True) -> tuple[dict[str, list[Any]], ScanStats]:
    """Describe root: {rel: [size, mode, sha256]} and what it cost. ``save``: write the cache file
    at the end (a caller holding entries not yet durable saves it itself, once they are). ``on_link``:
    what to do with each symlink (``walk_tree``); a link kept is entered by ``link_entry``.
    ``directories``: every directory is entered too (``dir_entry``), as a sync compares them. ``contents``:
    the bytes of the small files hashed (the ones the cache did not know: new or changed) go in it.
    ``ordered=False``: the manifest's order is left as found (``tree_hash`` does not need one; a caller that
    sends the listing sorts it then), which saves a sort of the whole tree on a re-check."""
    started = time.monotonic()
    stats = ScanStats()
    cache = cache or HashCache(None)
    kept: dict[str, str] = {}
    dirs: dict[str, int] | None = {} if directories else None
    files = walk_tree(root, rules, stats, on_link=on_link, links=kept, dirs=dirs)
    manifest: dict[str, list[Any]] = {}
    todo: list[tuple[str, os.stat_result]] = []
    entries = cache.entries
    total = 0
    for rel, info in files:  # the warm path: a dict look-up per file, inlined
        size = info.st_size
        total += size
        entry = entries.get(rel)
        if entry is not None and entry[0] == size and entry[1] == info.st_mtime_ns and entry[2] == info.st_ino:
            manifest[rel] = [size, info.st_mode & 0o7777, entry[3]]
        else:
            todo.append((rel, info))
    stats.files = len(files)
    stats.bytes = total
    if todo:
        _hash_files(root, todo, cache, manifest, stats, threads, on_progress, contents)
    if len(entries) != len(manifest):  # every entry left is a file found: nothing stale to drop
        cache.prune(set(manifest))
    if save:
        cache.save()
    for rel, target in kept.items():  # links are not cached: their target is read by the walk's readlink
        manifest[rel] = link_entry(target)
    for rel, mode in (dirs or {}).items():
        manifest[rel] = dir_entry(mode)
    stats.links = len(kept)
    stats.directories = len(dirs or ())
    stats.seconds = time.monotonic() - started
    if ordered and (todo or kept or dirs):  # hashed files, links and directories went in after the rest
        manifest = {rel: manifest[rel] for rel in sorted(manifest)}  # keys sort faster than (key, entry) pairs
    return manifest, stats


def read_file(path: str) -> bytes:
    """A whole file's bytes, read raw (no buffered file object: most of a small file's cost is per call)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks: list[bytes] = []
        while True:
            block = os.read(fd, READ_CHUNK)
            if not block:
                return b"".join(chunks) if len(chunks) != 1 else chunks[0]
            chunks.append(block)
    finally:
        os.close(fd)


@dataclass
class Contents:
    """The bytes of the small files a scan hashes, kept (up to ``budget`` in all): a sync sends the bytes it
    hashed, read once, and never bytes that changed since (the node would refuse them by their hash)."""

    budget: int = 64 << 20
    files: dict[str, bytes] = field(default_factory=dict)
    size: int = 0

    def digest(self, rel: str, path: str, size: int) -> str:
        """``sha256_file``, keeping the bytes while the budget lasts."""
        if size > PARALLEL_ABOVE or self.size + size > self.budget:
            return sha256_file(path, size)
        data = read_file(path)
        self.files[rel] = data
        self.size += len(data)
        return hashlib.sha256(data).hexdigest()


def _hash_files(root: str, todo: list[tuple[str, os.stat_result]], cache: HashCache, manifest: dict[str, list[Any]],
                stats: ScanStats, threads: int | None, on_progress: Callable[[int, int], None] | None,
                contents: Contents | None = None) -> None:
    """Hash the files the cache did not know, into ``manifest`` and the cache (small ones' bytes into
    ``contents``, when given)."""
    workers = max(1, min(threads or os.cpu_count() or 1, 8, len(todo)))

    def digest_one(item: tuple[str, os.stat_result]) -> tuple[str, os.stat_result, str | None]:
        rel, info = item
        path = os.path.join(root, rel)
        try:
            if contents is not None:
                return rel, info, contents.digest(rel, path, info.st_size)
            return rel, info, sha256_file(path, info.st_size)
        except OSError:
            return rel, info, None  # vanished or unreadable since the walk

    # Threads pay off for large files only (hashlib releases the GIL on big buffers);
    # small ones are hashed inline, in order, which is faster than handing them around.
    large = [item for item in todo if item[1].st_size > PARALLEL_ABOVE]
    small = [item for item in todo if item[1].st_size <= PARALLEL_ABOVE]
    pool = ThreadPoolExecutor(max_workers=workers) if workers > 1 and len(large) > 1 else None
    try:
        results = itertools.chain(pool.map(digest_one, large) if pool else map(digest_one, large),
                                  map(digest_one, small))
        for rel, info, digest in results:
            if digest is None:
                stats.skipped.append(rel)
                continue
            cache.store(rel, info, digest)
            manifest[rel] = [info.st_size, stat.S_IMODE(info.st_mode), digest]
            stats.hashed_files += 1
            stats.hashed_bytes += info.st_size
            if on_progress is not None:
                on_progress(stats.hashed_files, stats.hashed_bytes)
    finally:
        if pool is not None:
            pool.shutdown()


def tree_hash(manifest: dict[str, list[Any]]) -> str:
    """One digest for a whole tree: paths, modes and contents."""
    lines = "".join([f"{rel}\0{(entry := manifest[rel])[1]:o}\0{entry[2]}\n" for rel in sorted(manifest)])
    return hashlib.sha256(lines.encode("utf-8", "surrogateescape")).hexdigest()
