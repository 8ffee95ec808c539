"""Checkpoint directories: what a node holds of one (its files with their sizes and SHA256), one digest
for a whole directory, and the file names a torch.distributed.checkpoint ``.metadata`` names.

A PyTorch job may save a checkpoint as a directory in ``$COORD_CHECKPOINT_DIR`` named by its step in
seven digits (``0000040/``): whatever ``accelerator.save_state``, ``torch.distributed.checkpoint`` or
DeepSpeed's ``save_checkpoint`` writes there. Its files may lie on several nodes (each rank writes
its own shard or random state on its own disk); the head puts them together. Both sides use this
module: the agent to describe what it holds, the head to compare and join the nodes' parts under
one digest. Stdlib only.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickletools
import re
from collections.abc import Iterable, Mapping
from typing import TypedDict

#: A checkpoint directory's name: its step within the attempt, seven digits.
DIR_NAME = re.compile(r"^\d{7}$")
#: Marker files read whole into a listing (DeepSpeed's ``latest`` names its tag).
NOTE_FILES = ("latest",)
NOTE_BYTES = 4096
MAX_METADATA_BYTES = 64 << 20


class NonFinite(TypedDict):
    """The first NaN or infinity the agent found in a checkpoint's file, read as it hashed it."""

    file: str  # the file's name (relative to a checkpoint directory)
    tensor: str  # the tensor's name (a torch file's: the keys leading to it, dotted)
    value: str  # "NaN", "inf" or "-inf"
    element: int  # its index within the tensor's bytes, counted in elements
    dtype: str  # "float32", "bfloat16", ...


def describe_nonfinite(bad: NonFinite) -> str:
    """What a checkpoint's event and catalog entry say of a non-finite value: which file, tensor and value."""
    return f"{bad['file']}: tensor {bad['tensor']!r} holds {bad['value']} ({bad['dtype']} element {bad['element']})"


def describe_values_read(count: int) -> str:
    """What a valid checkpoint's detail says of its tensors' values (``count``: float tensors read whole, at
    least one: a file with none says nothing of them)."""
    return f"{count} float tensor{'s' if count != 1 else ''} read, no NaN"


class _DirFile(TypedDict):
    path: str  # relative to the checkpoint directory, "/"-separated
    size: int
    sha256: str


class DirFile(_DirFile, total=False):
    # What the agent saw of the values of the file's tensors, in the read that hashed it (agent/tensor_scan.py):
    values_read: int  # tensors of a floating type whose every value was read (absent: none)
    nonfinite: NonFinite  # the first NaN or infinity among them (absent: none)


def digest(files: Iterable[DirFile]) -> str:
    """One SHA256 for a directory's files: over their relative paths, sizes and SHA256s, in path order.
    Two directories with the same digest hold the same bytes under the same names."""
    h = hashlib.sha256()
    for entry in sorted(files, key=lambda f: f["path"]):
        h.update(f"{entry['path']}\0{entry['size']}\0{entry['sha256']}\n".encode())
    return h.hexdigest()


def total_size(files: Iterable[DirFile]) -> int:
    return sum(entry["size"] for entry in files)


def walk(root: str) -> tuple[list[tuple[str, str]], str | None]:
    """(relative path, full path) of every regular file under ``root``, in path order; and what is
    wrong with the tree (a link, or something that is not a file), or None. Links are never followed."""
    found: list[tuple[str, str]] = []
    for directory, subdirs, names in os.walk(root, followlinks=False):
        for name in list(subdirs):
            if os.path.islink(os.path.join(directory, name)):
                return found, f"{os.path.relpath(os.path.join(directory, name), root)} is a link"
        for name in names:
            full = os.path.join(directory, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if os.path.islink(full) or not os.path.isfile(full):
                return found, f"{rel} is not a regular file"
            if name.startswith(".") and name.endswith((".tmp", ".partial")):
                continue  # a writer's temporary (the relay's own, or the script's), not part of it
            found.append((rel, full))
    found.sort()
    return found, None


def dcp_file_names(data: bytes) -> list[str] | None:
    """The storage files a torch.distributed.checkpoint ``.metadata`` names (``__0_0.distcp``, ...),
    read from the pickle's opcodes without running it: nothing in it is ever unpickled. None when
    the bytes are not a pickle."""
    names: set[str] = set()
    try:
        for opcode, arg, _ in pickletools.genops(io.BytesIO(data)):
            if isinstance(arg, str) and "UNICODE" in opcode.name and arg.endswith(".distcp") and "/" not in arg:
                names.add(arg)
    except (ValueError, EOFError, UnicodeDecodeError):
        return None
    return sorted(names)


def metadata_references(files: Mapping[str, str]) -> dict[str, list[str] | None]:
    """For each ``.metadata`` among ``files`` (relative path -> full path): the files it names, as paths
    relative to the checkpoint directory (None when it cannot be read as a pickle)."""
    out: dict[str, list[str] | None] = {}
    for rel, full in files.items():
        if rel.rsplit("/", 1)[-1] != ".metadata":
            continue
        try:
            if os.path.getsize(full) > MAX_METADATA_BYTES:
                out[rel] = None
                continue
            with open(full, "rb") as handle:
                names = dcp_file_names(handle.read())
        except OSError:
            names = None
        base = rel.rsplit("/", 1)[0] + "/" if "/" in rel else ""
        out[rel] = None if names is None else [base + name for name in names]
    return out


def notes_of(files: Mapping[str, str]) -> dict[str, str]:
    """The small marker files a format names its parts in (DeepSpeed's ``latest``), read whole."""
    notes: dict[str, str] = {}
    for rel in NOTE_FILES:
        full = files.get(rel)
        if full is None:
            continue
        try:
            with open(full, "rb") as handle:
                notes[rel] = handle.read(NOTE_BYTES).decode("utf-8", "replace").strip()
        except OSError:
            continue
    return notes
