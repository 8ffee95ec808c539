"""The code sync's methods: manifests, whole small files, chunked uploads, deletes and modes,
file inspection and the writable check."""

from __future__ import annotations

from typing import Any, TypedDict

from shared.file_batch import FileBatch

#: A manifest row: [path, size, mode, sha256].
ManifestRow = list[Any]
#: A mode to set: [path, mode].
ModeRow = list[Any]
#: A directory to make (or whose mode to set): [path, mode].
DirRow = list[Any]


class ScanStatsReport(TypedDict):
    files: int
    bytes: int
    hashed_files: int
    hashed_bytes: int
    skipped: list[str]  # the first 50: special files, and links a walk was not told to keep
    skipped_count: int
    links: int  # symlinks kept as links (entries of their own, mode LINK_MODE)
    directories: int  # directories entered (a sync's scans enter them: shared.manifest.dir_entry)
    unlisted: list[str]  # the first 50 names that are not UTF-8, escaped (shared.paths.printable_name)
    unlisted_count: int
    seconds: float


class ManifestRequest(TypedDict):
    root: str
    patterns: list[str]


class ManifestReply(TypedDict):
    files: list[ManifestRow]
    tree_hash: str
    stats: ScanStatsReport


class PutFilesRequest(TypedDict):
    root: str
    batch: FileBatch  # small files sent whole, as columns (shared.file_batch), each checked by the agent


class PutFilesReply(TypedDict):
    files: int
    bytes: int


#: A symlink to create: [path, target], the target relative and unable to leave the tree.
LinkRow = list[Any]


class PutLinksRequest(TypedDict):
    root: str
    links: list[LinkRow]


class PutLinksReply(TypedDict):
    links: int


class SyncStateRequest(ManifestRequest, total=False):
    known: list[str] | None  # tree hashes whose manifest the head holds


class _SyncStateReply(TypedDict):
    tree_hash: str
    count: int
    flushed: int  # files this call flushes (made durable, or being made durable: see ``flush``)
    # how: "nothing", "syncfs", "fsync" or "fsync+F_FULLFSYNC"; "under way" when it goes on behind the answer
    flush: str
    flush_seconds: float  # how long the flush took, or has taken so far (the stat-only scan ran meanwhile)
    stats: ScanStatsReport


class SyncStateReply(_SyncStateReply, total=False):
    files: list[ManifestRow]  # only when ``known`` was given and the tree's hash is not in it


class MakeDirsRequest(TypedDict):
    root: str
    dirs: list[DirRow]


class MakeDirsReply(TypedDict):
    made: int  # directories that did not exist
    modes: int  # directories whose mode was set


class RemoveDirsReply(TypedDict):
    removed: int
    kept: list[str]  # the first 50 that still hold something (files the sync ignores): left in place
    kept_count: int


class UploadBeginRequest(TypedDict):
    root: str
    path: str
    size: int
    mode: int
    sha256: str


class UploadBeginReply(TypedDict):
    upload: int


class UploadChunkRequest(TypedDict):
    upload: int
    offset: int
    data: bytes


class UploadChunkReply(TypedDict):
    offset: int


class UploadRequest(TypedDict):
    upload: int


class UploadFinishReply(TypedDict):
    bytes: int


class UploadAbortReply(TypedDict):
    aborted: int


class PathsRequest(TypedDict):
    root: str
    paths: list[str]


class DeleteFilesReply(TypedDict):
    deleted: int


class SetModesRequest(TypedDict):
    root: str
    modes: list[ModeRow]


class SetModesReply(TypedDict):
    changed: int


class InspectFilesRequest(PathsRequest, total=False):
    count_lines: bool


class _FileInfo(TypedDict):
    size: int
    mode: int
    sha256: str


class FileInfo(_FileInfo, total=False):
    lines: int  # with count_lines


class InspectFilesReply(TypedDict):
    files: dict[str, FileInfo | None]  # None: missing, or not a regular file


class CheckWritableRequest(TypedDict):
    root: str
    subdir: str


class CheckWritableReply(TypedDict):
    writable: bool
    detail: str
    free_bytes: int
    path: str
