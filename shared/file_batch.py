"""A batch of small files as ``put_files`` carries them: a few fields for the whole batch, not a list per file.

A node's agent may run msgpack's pure-Python decoder (the bundle's own, where the node's Python has
none), which costs about 9 us an object: a batch of 2,048 files as [path, mode, sha256, data] lists is
five objects a file, about 0.18 s of a node's CPU for 20,000 files, more than its own bookkeeping of
the writes. As columns it is six objects a batch, whatever its size: the paths joined by NUL (a byte no
path can hold), the modes and sizes as big-endian integers, the SHA256 digests raw, the bytes one after
another. ``unpack_batch`` checks that every column agrees with the others before anything is written.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import TypedDict

DIGEST_BYTES = 32


class FileBatch(TypedDict):
    """The wire form: ``count`` files; ``paths`` joined by NUL; ``modes`` 2 bytes and ``sizes`` 4 bytes a
    file, big-endian; ``sha256`` 32 raw bytes a file; ``data`` every file's bytes in that order."""

    count: int
    paths: str
    modes: bytes
    sizes: bytes
    sha256: bytes
    data: bytes


#: One file of a batch: its path, mode, SHA256 (hex) and bytes.
BatchFile = tuple[str, int, str, bytes]


def pack_batch(files: Iterable[BatchFile]) -> FileBatch:
    rows = list(files)
    count = len(rows)
    return {"count": count, "paths": "\0".join(row[0] for row in rows),
            "modes": struct.pack(f">{count}H", *(row[1] & 0xFFFF for row in rows)),
            "sizes": struct.pack(f">{count}I", *(len(row[3]) for row in rows)),
            "sha256": b"".join(bytes.fromhex(row[2]) for row in rows),
            "data": b"".join(row[3] for row in rows)}


def batch_bytes(batch: FileBatch) -> int:
    return len(batch["data"])


class BadBatch(ValueError):
    """A batch whose fields do not agree: nothing of it is to be written."""


def unpack_batch(batch: Mapping[str, object]) -> list[tuple[str, int, bytes, memoryview]]:
    """The files of a batch from the wire: [(path, mode, raw sha256, data)], each field checked against the
    others (counts, lengths, types). The paths themselves are the caller's to check; each file's data is a
    view into the batch's (no copy)."""
    count, paths, modes, sizes, digests, data = (batch.get(key) for key in
                                                 ("count", "paths", "modes", "sizes", "sha256", "data"))
    if not (isinstance(count, int) and isinstance(paths, str) and isinstance(modes, bytes)
            and isinstance(sizes, bytes) and isinstance(digests, bytes) and isinstance(data, bytes)):
        raise BadBatch("a batch is {count: int, paths: str, modes, sizes, sha256, data: bytes}")
    if count <= 0:
        raise BadBatch("a batch holds at least one file")
    names = paths.split("\0")
    if len(names) != count or len(modes) != 2 * count or len(sizes) != 4 * count \
            or len(digests) != DIGEST_BYTES * count:
        raise BadBatch(f"a batch of {count} files has {len(names)} paths, {len(modes) // 2} modes, "
                       f"{len(sizes) // 4} sizes and {len(digests) // DIGEST_BYTES} digests")
    lengths = struct.unpack(f">{count}I", sizes)
    if sum(lengths) != len(data):
        raise BadBatch(f"a batch's sizes add up to {sum(lengths)} bytes, its data is {len(data)}")
    view = memoryview(data)
    files = []
    offset = 0
    for index, (name, mode, length) in enumerate(zip(names, struct.unpack(f">{count}H", modes), lengths,
                                                     strict=True)):
        files.append((name, mode, digests[DIGEST_BYTES * index:DIGEST_BYTES * (index + 1)],
                      view[offset:offset + length]))
        offset += length
    return files
