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
from typing import TYPE_CHECKING, TypedDict, cast

if TYPE_CHECKING:
    from shared.agent_api.common import JsonObject

#: safetensors readers refuse larger headers; so do we (a corrupt length must not make us read gigabytes).
MAX_HEADER_BYTES = 100 << 20
METADATA = "__metadata__"


class HeaderError(ValueError):
    """A file whose first bytes are not a safetensors header."""


class TensorEntry(TypedDict):
    """One tensor of a header: its type, its shape, where its bytes are (after the header)."""

    dtype: str  # "F32", "BF16", ...
    shape: list[int]
    data_offsets: list[int]  # [start, end)


def read_header_block(path: str | os.PathLike[str]) -> tuple[JsonObject, int]:
    """(the header as parsed, ``__metadata__`` included, each entry as the file has it: see
    :func:`tensor_entries`; where the tensors' bytes start)."""
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


def read_header(path: str | os.PathLike[str]) -> JsonObject:
    """The header as parsed: tensor entries and ``__metadata__`` if the file has one."""
    return read_header_block(path)[0]


def tensor_entries(header: JsonObject, path: str | os.PathLike[str] = "") -> dict[str, TensorEntry]:
    """``{tensor name: {"dtype", "shape", "data_offsets"}}``: the header without its metadata,
    each entry checked to have the three fields."""
    out: dict[str, TensorEntry] = {}
    for name, entry in header.items():
        if name == METADATA:
            continue
        if not (isinstance(entry, dict) and isinstance(entry.get("shape"), list)
                and isinstance(entry.get("dtype"), str) and isinstance(entry.get("data_offsets"), list)):
            raise HeaderError(f"{path}: tensor {name!r} has no dtype, shape and data_offsets")
        out[name] = cast(TensorEntry, entry)  # its three fields checked just above
    return out
