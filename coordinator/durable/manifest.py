"""What a committed checkpoint in the store holds: its manifest, written after every part, so that a
checkpoint is in the store exactly when its manifest is. Pure.

The manifest names the run, the attempt, the step, the checkpoint's format and the job's world size,
and every file with its size and SHA256, each file as its parts (offset, size, SHA256). A manifest
read back is checked field by field before anything in it is used: it comes from a bucket other
people and tools may write to, so a path in it is a relative path without ``..``, and every number is
a number.

A part may be stored compressed (``encoding`` "zstd", ``stored`` bytes in the store): its size and
SHA256 are those of its bytes as the file holds them, checked after it is decompressed."""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Iterable
from typing import NotRequired, TypedDict

from coordinator.config.store_url import part_name

FORMAT_VERSION = 1
PART_BYTES = 32 << 20  # a part: big enough that a request's overhead is small, small enough to retry
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(ValueError):
    """A manifest that is not one coord wrote, or is damaged."""


ENCODINGS = ("zstd",)


class PartEntry(TypedDict):
    key: str  # relative to the checkpoint's prefix
    offset: int
    size: int
    sha256: str
    encoding: NotRequired[str]  # "zstd" when it is stored compressed
    stored: NotRequired[int]  # its bytes in the store, when compressed


class FileEntry(TypedDict):
    path: str  # relative to the checkpoint (a file checkpoint: its own name)
    size: int
    sha256: str
    parts: list[PartEntry]


class StoreManifest(TypedDict):
    format_version: int
    run: str
    job: str
    attempt: int
    step: int
    format: str  # safetensors, npz, a directory's format (dcp, deepspeed, accelerate, ...)
    world_size: int
    created: float  # the head's wall clock when committed
    bytes: int
    files: list[FileEntry]


def split_parts(size: int, part_bytes: int = PART_BYTES) -> list[tuple[int, int]]:
    """(offset, size) of each part of a file of ``size`` bytes (an empty file is one empty part)."""
    if size == 0:
        return [(0, 0)]
    return [(offset, min(part_bytes, size - offset)) for offset in range(0, size, part_bytes)]


def part_entries(file_index: int, parts: Iterable[tuple[int, int, str]],
                 stored: Iterable[tuple[str, int] | None] = ()) -> list[PartEntry]:
    """The parts of file ``file_index`` as (offset, size, sha256), in order; ``stored``: each one's
    (encoding, bytes in the store) where it went compressed."""
    entries: list[PartEntry] = [{"key": part_name(file_index, index), "offset": offset, "size": size, "sha256": sha}
                                for index, (offset, size, sha) in enumerate(parts)]
    for entry, how in zip(entries, stored, strict=False):
        if how is not None:
            entry["encoding"], entry["stored"] = how
    return entries


def build(*, run: str, job: str, attempt: int, step: int, format: str, world_size: int, created: float,
          files: list[FileEntry]) -> StoreManifest:
    return {"format_version": FORMAT_VERSION, "run": run, "job": job, "attempt": attempt, "step": step,
            "format": format, "world_size": world_size, "created": created,
            "bytes": sum(f["size"] for f in files), "files": files}


def dumps(manifest: StoreManifest) -> bytes:
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def _int(data: dict, key: str, where: str) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ManifestError(f"{where}: {key} is not a whole number >= 0: {value!r}")
    return value


def _str(data: dict, key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise ManifestError(f"{where}: {key} is missing or not text")
    return value


def _sha(data: dict, where: str) -> str:
    value = _str(data, "sha256", where)
    if not _SHA256.match(value):
        raise ManifestError(f"{where}: sha256 is not a SHA256 in hex: {value!r}")
    return value


def _relative(path: str, where: str) -> str:
    normal = posixpath.normpath(path)
    if path.startswith("/") or normal != path or normal.startswith("..") or "\\" in path or "\0" in path:
        raise ManifestError(f"{where}: {path!r} is not a plain relative path")
    return path


def _file(entry: object, index: int, at: str) -> FileEntry:
    if not isinstance(entry, dict):
        raise ManifestError(f"{at}: not an object")
    path = _relative(_str(entry, "path", at), at)
    size, sha = _int(entry, "size", at), _sha(entry, at)
    parts_raw = entry.get("parts")
    if not isinstance(parts_raw, list) or not parts_raw:
        raise ManifestError(f"{at}: it lists no parts")
    parts: list[PartEntry] = []
    offset = 0
    for p_index, part in enumerate(parts_raw):
        p_at = f"{at} part {p_index}"
        if not isinstance(part, dict):
            raise ManifestError(f"{p_at}: not an object")
        key = _str(part, "key", p_at)
        if key != part_name(index, p_index):
            raise ManifestError(f"{p_at}: its key is {key!r}, not {part_name(index, p_index)!r}")
        if _int(part, "offset", p_at) != offset:
            raise ManifestError(f"{p_at}: its offset leaves a gap or an overlap")
        p_size = _int(part, "size", p_at)
        parts.append({"key": key, "offset": offset, "size": p_size, "sha256": _sha(part, p_at)})
        if "encoding" in part:
            if part["encoding"] not in ENCODINGS:
                raise ManifestError(f"{p_at}: encoding {part['encoding']!r} is not one this coord reads "
                                    f"({', '.join(ENCODINGS)})")
            parts[-1]["encoding"], parts[-1]["stored"] = part["encoding"], _int(part, "stored", p_at)
        offset += p_size
    if offset != size:
        raise ManifestError(f"{at}: its parts add up to {offset} bytes, not its size {size}")
    return {"path": path, "size": size, "sha256": sha, "parts": parts}


def parse(raw: bytes, where: str = "manifest") -> StoreManifest:
    """A manifest read back, checked; ManifestError says what is wrong."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{where}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{where}: not a JSON object")
    version = _int(data, "format_version", where)
    if version != FORMAT_VERSION:
        raise ManifestError(f"{where}: format_version {version}, this coord reads {FORMAT_VERSION} (a newer coord "
                            "wrote it?)")
    created = data.get("created")
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        raise ManifestError(f"{where}: created is not a time")
    files_raw = data.get("files")
    if not isinstance(files_raw, list) or not files_raw:
        raise ManifestError(f"{where}: it lists no files")
    files: list[FileEntry] = []
    for index, entry in enumerate(files_raw):
        files.append(_file(entry, index, f"{where}: file {index}"))
        if files[-1]["path"] in {f["path"] for f in files[:-1]}:
            raise ManifestError(f"{where}: file {index}: {files[-1]['path']} is listed twice")
    manifest = build(run=_str(data, "run", where), job=_str(data, "job", where), attempt=_int(data, "attempt", where),
                     step=_int(data, "step", where), format=_str(data, "format", where),
                     world_size=_int(data, "world_size", where), created=float(created), files=files)
    if data.get("bytes") != manifest["bytes"]:
        raise ManifestError(f"{where}: bytes {data.get('bytes')!r} is not the sum of its files' sizes")
    return manifest
