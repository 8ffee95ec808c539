"""Reading a safetensors file's header: the one reader the head and the agent share.

Standard library only (the agent imports ``shared``). The format: an 8-byte little-endian
header length, then that many bytes of JSON (an object: ``{tensor name: {"dtype", "shape",
"data_offsets"}}`` and an optional ``"__metadata__"`` of strings), then the tensors' bytes.
Only the header is read, however large the file.

Every problem raises :class:`HeaderError` (a ValueError) whose message starts with the path;
an unreadable file raises the OSError ``open`` raised.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

#: safetensors readers refuse larger headers; so do we (a corrupt length must not make us read gigabytes).
MAX_HEADER_BYTES = 100 << 20
METADATA = "__metadata__"


class HeaderError(ValueError):
    """A file whose first bytes are not a safetensors header."""


def read_header_block(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    """(the header as parsed, ``__metadata__`` included; where the tensors' bytes start)."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise HeaderError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise HeaderError(f"{path}: header length {length} is over the format's 100 MB limit")
        raw = handle.read(length)
    if len(raw) != length:
        raise HeaderError(f"{path}: header cut short ({len(raw)} of {length} bytes)")
    try:
        header = json.loads(raw)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError both
        raise HeaderError(f"{path}: header is not JSON: {error}") from error
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: header is not a JSON object")
    return header, 8 + length


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The header as parsed: tensor entries and ``__metadata__`` if the file has one."""
    return read_header_block(path)[0]


def tensor_entries(header: dict[str, Any], path: str | os.PathLike[str] = "") -> dict[str, dict[str, Any]]:
    """``{tensor name: {"dtype", "shape", "data_offsets"}}``: the header without its metadata,
    each entry checked to have the three fields."""
    out = {}
    for name, entry in header.items():
        if name == METADATA:
            continue
        if not (isinstance(entry, dict) and isinstance(entry.get("shape"), list)
                and isinstance(entry.get("dtype"), str) and isinstance(entry.get("data_offsets"), list)):
            raise HeaderError(f"{path}: tensor {name!r} has no dtype, shape and data_offsets")
        out[name] = entry
    return out
