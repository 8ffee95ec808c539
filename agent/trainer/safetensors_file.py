"""A small safetensors writer and header reader (standard library only).

The writer runs on a background thread while training goes on, so it must not
call MLX: it takes tensors already copied to host memory, as a dtype code, a
shape and any C-contiguous buffer (a numpy array, bytes), and writes the
format by hand: an 8-byte little-endian header length, the JSON header, then
the raw bytes of each tensor in header order. MLX runs only on little-endian
machines, so host buffers are already in the byte order the format wants.

Files are written atomically: to a hidden temporary name in the same
directory, flushed and fsynced, renamed over the final name, and the directory
fsynced, so a reader (or a crash) never sees a partial checkpoint under its
final name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

if TYPE_CHECKING:
    from shared.agent_api.common import JsonObject

from agent import proc_state
from shared import safetensors_header

#: The dtype codes of the safetensors format.
DTYPES = frozenset({"BOOL", "U8", "I8", "U16", "I16", "F16", "BF16", "U32", "I32", "F32", "U64", "I64", "F64"})
#: Readers refuse larger headers; so do we (a corrupt length must not make us read gigabytes).
MAX_HEADER = 100 << 20
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.tmp$")


class HostTensor(NamedTuple):
    dtype: str          # a safetensors dtype code, e.g. "F32", "BF16"
    shape: tuple        # the tensor's shape; () for a scalar
    data: Any           # a C-contiguous buffer holding exactly the tensor's bytes


def _header(tensors: dict[str, HostTensor], metadata: dict[str, str]) -> bytes:
    header: JsonObject = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        if tensor.dtype not in DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype!r}, not a safetensors dtype")
        size = memoryview(tensor.data).nbytes
        header[name] = {"dtype": tensor.dtype, "shape": [int(d) for d in tensor.shape],
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # The format pads the header with spaces so the data starts 8-byte aligned.
    return encoded + b" " * (-len(encoded) % 8)


def write_safetensors(handle: BinaryIO, tensors: dict[str, HostTensor], metadata: dict[str, str] | None = None) -> int:
    """Write a complete safetensors file to an open binary handle; returns the bytes written."""
    header = _header(tensors, metadata or {})
    handle.write(struct.pack("<Q", len(header)))
    handle.write(header)
    written = 8 + len(header)
    for name in sorted(tensors):
        view = memoryview(tensors[name].data)
        handle.write(view)
        written += view.nbytes
    return written


def temp_path(path: str) -> str:
    """The hidden name a file is written under before its rename (coord's catalog ignores it)."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.{os.getpid()}.tmp")


def write_atomic(path: str, tensors: dict[str, HostTensor], metadata: dict[str, str] | None = None) -> int:
    """Write ``path`` so that it either holds the whole new file or is left as it was."""
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as handle:
            written = write_safetensors(handle, tensors, metadata)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_directory(os.path.dirname(path) or ".")
    return written


def fsync_directory(directory: str) -> None:
    """Make a rename durable: the directory entry, not only the file, must reach the disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temps(directory: str) -> list[str]:
    """Remove temporary files left by writers that died mid-write (a killed run leaves one)."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        match = _TEMP_NAME.match(name)
        if match and not proc_state.alive(int(match.group("pid"))):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def read_header(path: str) -> JsonObject:
    """The JSON header of a safetensors file (tensor entries and ``__metadata__``)."""
    return safetensors_header.read_header(path)


def read_metadata(path: str) -> dict[str, str]:
    metadata = read_header(path).get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: __metadata__ is not a JSON object")
    return metadata
