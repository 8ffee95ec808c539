"""One read of a checkpoint file that both hashes it and looks at its tensors' values.

A checkpoint whose weights hold a NaN or an infinity (a diverged run writes one; so does a bit flip
before coord hashed it) is not one to resume from. The agent reads every byte of a new checkpoint to
hash it anyway, so the same read walks the file's format and tests each floating-point tensor's bytes
as they pass (:mod:`agent.nonfinite`): no second read of the file, and no library to import.

The formats read:

- safetensors (mlx-lm's adapters, coord's trainer, Hugging Face's ``model.safetensors``): the JSON
  header names each tensor's dtype and bytes; F64, F32, F16, BF16, C64 and the 8-bit floats are read.
- ``.npy``, and the ``.npy`` members of an ``.npz`` stored without compression (``mx.savez``,
  ``np.savez``): the header's ``descr``; ``<f8``, ``<f4``, ``<f2``, ``<c8``, ``<c16`` and MLX's bfloat16
  (``<V2``: numpy itself writes a void type as ``|V2``).
- torch.save's zip (``.pt``, ``.bin``, ``.pth``; Accelerate's ``optimizer.bin``, DeepSpeed's
  ``*_states.pt``): ``data.pkl`` comes first, and its opcodes name each storage's dtype
  (:mod:`agent.torch_storages`, never unpickled); each ``data/<key>`` record of a floating type is read.
  torch writes each member's size after its data, so where the members lie is taken from the zip's
  central directory first (``zipfile`` reads it from the end of the file: about 100 bytes a member).

A file is told by its first bytes (a zip, the ``.npy`` magic) or, for safetensors (which has no magic),
by its name. Everything else is hashed only, and so is what these walks cannot follow: a compressed
member (``np.savez_compressed``), a torch storage of a class that names no dtype (float8), a big-endian
file, a structure cut short or not what its first bytes promised (validation judges those). Stdlib only:
this runs with the node's Python.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import io
import json
import os
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

from agent import nonfinite
from agent.nonfinite import FloatLayout
from agent.torch_storages import Storage, float_storages

READ_CHUNK = 1 << 20
MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit
MAX_PICKLE = 64 << 20  # a data.pkl of a model with tens of thousands of tensors is a few MB
MAX_NPY_HEADER = 1 << 20

#: Layouts by the safetensors dtype code (complex64 is pairs of float32).
LAYOUTS = {"F64": nonfinite.F64, "F32": nonfinite.F32, "F16": nonfinite.F16, "BF16": nonfinite.BF16,
           "C64": nonfinite.F32, "F8_E5M2": nonfinite.F8_E5M2, "F8_E4M3": nonfinite.F8_E4M3}
#: Layouts by a .npy header's ``descr``: little-endian floats, and MLX's bfloat16.
NPY_LAYOUTS = {"<f8": nonfinite.F64, "<f4": nonfinite.F32, "<f2": nonfinite.F16, "<c8": nonfinite.F32,
               "<c16": nonfinite.F64, "<V2": nonfinite.BF16}

_ZIP_LOCAL = b"PK\x03\x04"
_NPY_MAGIC = b"\x93NUMPY"


@dataclass(frozen=True)
class Bad:
    """The first non-finite value found in a file."""

    tensor: str
    value: str  # "NaN", "inf" or "-inf"
    element: int  # its index in the tensor's bytes, counted in elements
    dtype: str


@dataclass(frozen=True)
class Scan:
    sha256: str
    values_read: int  # floating-point tensors whose every value was read
    bad: Bad | None  # the first non-finite value, or None


class _Cut(Exception):
    """The file ended inside a structure: the rest is hashed, nothing more is read as tensors."""


class _Reader:
    """The file read once, front to back: every byte that passes is hashed, and some are tested. Bulk
    bytes go through one buffer, reused (``readinto``, as ``hashlib.file_digest`` reads)."""

    def __init__(self, handle: io.BufferedReader):
        self.handle = handle
        self.digest = hashlib.sha256()
        self.values_read = 0
        self.bad: Bad | None = None
        self.position = 0
        self.buffer = bytearray(READ_CHUNK)
        self.view = memoryview(self.buffer)

    def read(self, size: int) -> bytes:
        """A few bytes of a structure (a header, a pickle)."""
        data = self.handle.read(size)
        self.digest.update(data)
        self.position += len(data)
        return data

    def exactly(self, size: int) -> bytes:
        data = self.read(size)
        if len(data) != size:
            raise _Cut
        return data

    def _fill(self, size: int) -> int:
        """Up to ``size`` bytes (at most a chunk) into the buffer, hashed; raises at the end of the file.
        (A buffered file's ``readinto`` fills what it is given until the end of the file.)"""
        count = self.handle.readinto(self.view[:size])
        if not count:
            raise _Cut
        self.digest.update(self.view[:count])
        self.position += count
        return count

    def skip(self, size: int) -> None:
        while size > 0:
            size -= self._fill(min(size, READ_CHUNK))

    def tensor(self, size: int, layout: FloatLayout | None, name: str) -> None:
        """``size`` bytes of one tensor: tested when its type is a float one and nothing was found yet."""
        if layout is None or self.bad is not None:
            self.skip(size)
            return
        chunk = READ_CHUNK - READ_CHUNK % layout.size
        whole = size - size % layout.size
        seen = 0
        while seen < whole:
            count = self._fill(min(chunk, whole - seen))
            # NaN only: an infinity alone is kept (a mask buffer of -inf is one by design, and a run that
            # diverged holds NaN within a step of its first infinity, besides its loss saying so).
            found = nonfinite.first_nan(self.buffer, layout, count - count % layout.size)
            if found is not None:
                self.bad = Bad(name, found.value, seen // layout.size + found.index, layout.name)
                self.skip(size - seen - count)
                return
            seen += count
        self.skip(size - whole)
        self.values_read += 1

    def rest(self) -> str:
        with contextlib.suppress(_Cut):
            while True:
                self._fill(READ_CHUNK)
        return self.digest.hexdigest()


def scan_file(path: str) -> Scan:
    """The file's SHA256, and whether its tensors' values are finite, from one read of it."""
    with open(path, "rb") as handle:
        reader = _Reader(handle)
        head = os.pread(handle.fileno(), 8, 0)  # which format: the walk reads these 8 bytes again, hashing them
        walker = _walker_for(head, path)
        if walker is not None:
            # Not the format it looked like, or cut short: the rest is hashed, and validation judges it.
            with contextlib.suppress(_Cut, ValueError, TypeError, SyntaxError, RecursionError, struct.error,
                                     zipfile.BadZipFile):
                walker(reader)
            handle.seek(reader.position)  # where the hashing stopped, whatever a failed walk moved
        return Scan(reader.rest(), reader.values_read, reader.bad)


def _walker_for(head: bytes, path: str) -> Callable[[_Reader], None] | None:
    if head.startswith(_ZIP_LOCAL):
        return _walk_zip
    if head.startswith(_NPY_MAGIC):
        return _walk_npy
    if path.endswith(".safetensors") and len(head) == 8:
        return _walk_safetensors
    return None


def _walk_safetensors(reader: _Reader) -> None:
    (length,) = struct.unpack("<Q", reader.exactly(8))
    if length > MAX_SAFETENSORS_HEADER:
        return
    header = json.loads(reader.exactly(length))
    if not isinstance(header, dict):
        return
    tensors = []
    for name, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) and name != "__metadata__" else None
        if (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            tensors.append((offsets[0], offsets[1], name, LAYOUTS.get(entry.get("dtype"))))
    position = 0
    for begin, end, name, layout in sorted(tensors, key=lambda t: (t[0], t[1], t[2])):
        if begin < position:
            continue  # overlaps the one before: validation names that, not this walk
        reader.skip(begin - position)
        reader.tensor(end - begin, layout, name)
        position = end


def _npy_header(reader: _Reader) -> tuple[FloatLayout | None, int, int]:
    """A .npy header: (its dtype's layout, its element count, its length)."""
    head = reader.exactly(8)
    if not head.startswith(_NPY_MAGIC):
        raise ValueError("not an npy array")
    if head[6] == 1:
        (length,), fixed = struct.unpack("<H", reader.exactly(2)), 10
    elif head[6] in (2, 3):
        (length,), fixed = struct.unpack("<I", reader.exactly(4)), 12
    else:
        raise ValueError(f"npy version {head[6]}")
    if length > MAX_NPY_HEADER:
        raise ValueError("npy header too long")
    described = ast.literal_eval(reader.exactly(length).decode("latin-1"))  # a literal: never run
    if not isinstance(described, dict) or not isinstance(described.get("shape"), tuple):
        raise ValueError("npy header is not a dict with a shape")
    count = 1
    for extent in described["shape"]:
        count *= int(extent)
    descr = described.get("descr")
    return (NPY_LAYOUTS.get(descr) if isinstance(descr, str) else None), count, fixed + length


def _walk_npy(reader: _Reader, name: str = "array", size: int | None = None) -> None:
    """One .npy: a file (``size`` None: its tensor runs to the end) or an .npz member of ``size`` bytes."""
    layout, count, used = _npy_header(reader)
    length = count * layout.size if layout is not None else 0
    if size is not None:
        length = min(length, size - used)
    reader.tensor(length, layout, name)
    if size is not None:
        reader.skip(size - used - length)


@dataclass
class _TorchRecords:
    """What a torch.save zip's ``data.pkl`` said: the records' prefix (``archive/``), each float storage."""

    prefix: str = ""
    storages: dict[str, Storage] | None = None


def _walk_zip(reader: _Reader) -> None:
    """Each member in the order the writer laid them down. Where each one starts and how long it is
    comes from the zip's central directory, at the end of the file (a few bytes a member, read first by
    ``zipfile``): torch.save writes its sizes after each member's data, not in its local header."""
    with zipfile.ZipFile(reader.handle) as archive:  # a file object passed in: left open
        members = sorted(archive.infolist(), key=lambda info: info.header_offset)
    reader.handle.seek(0)
    torch = _TorchRecords()
    for info in members:
        if info.header_offset < reader.position:
            return  # members that overlap: not a zip this walk can follow
        reader.skip(info.header_offset - reader.position)
        fixed = reader.exactly(30)
        if not fixed.startswith(_ZIP_LOCAL):
            return
        name_length, extra_length = struct.unpack_from("<HH", fixed, 26)
        reader.skip(name_length + extra_length)
        _zip_member(reader, info.filename, info.compress_type, info.compress_size, torch)


def _zip_member(reader: _Reader, name: str, method: int, size: int, torch: _TorchRecords) -> None:
    base = name.rsplit("/", 1)[-1]
    if method != 0:  # compressed (np.savez_compressed): its bytes are not the values
        reader.skip(size)
    elif base == "data.pkl" and size <= MAX_PICKLE:
        torch.prefix = name[:-len(base)]
        torch.storages = dict(float_storages(reader.exactly(size)) or {})
    elif torch.storages is not None and name == torch.prefix + "byteorder" and size <= 16:
        if reader.exactly(size).strip() != b"little":
            torch.storages = {}  # a big-endian machine's file: its floats are not read
    elif torch.storages and name.startswith(torch.prefix + "data/"):
        storage = torch.storages.get(name[len(torch.prefix) + 5:])
        if storage is None:
            reader.skip(size)
        else:
            reader.tensor(size, LAYOUTS[storage.dtype], storage.tensor or f"storage {storage.key}")
    elif base.endswith(".npy"):
        _walk_npy(reader, name[:-4], size)
    else:
        reader.skip(size)
