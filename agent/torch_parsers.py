"""Parsers for what a PyTorch node's facts are read from: ``nvidia-smi``'s CSV, the torch probe's
answer, NCCL's version number and ``statvfs`` of ``/dev/shm``.

Pure functions: text or numbers in, plain values out, no I/O, stdlib only (this runs in the
node's own Python). Output that cannot be read is ``None`` ("unknown"), never ``[]``.
``ibv_devinfo`` is read by :func:`agent.rdma_parsers.parse_ibv_devinfo`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.agent_api.torch import GpuDevice, ShmFacts

MIB = 2**20

#: The fields asked of ``nvidia-smi --query-gpu``, in order; ``compute_cap`` needs a driver of 2022
#: or later (510+): an older nvidia-smi refuses the whole query, and is asked again without it.
NVIDIA_SMI_FIELDS: tuple[str, ...] = ("index", "name", "memory.total", "memory.used", "compute_cap")
NVIDIA_SMI_FIELDS_OLD: tuple[str, ...] = NVIDIA_SMI_FIELDS[:-1]
_NOT_A_VALUE = {"[n/a]", "[not supported]", "n/a", "[unknown error]", ""}
_CAPABILITY = re.compile(r"^\d+\.\d+$")


def nvidia_smi_argv(fields: tuple[str, ...] = NVIDIA_SMI_FIELDS) -> list[str]:
    """The command line: CSV without header or units (memory in MiB)."""
    return ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]


def parse_nvidia_smi_gpus(text: str | None, fields: tuple[str, ...] = NVIDIA_SMI_FIELDS) -> list[GpuDevice] | None:
    """One GPU per line of ``nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits``.

    ``fields`` are those asked for, in order (``index`` and ``name`` and ``memory.total`` at
    least). Memory is in MiB; ``[N/A]`` or ``[Not Supported]`` is None (a total that is not a
    number makes the whole answer None: it cannot be sized). No line at all is ``[]``: a
    driver without GPUs. A line with the wrong number of fields makes the answer None.
    """
    if not isinstance(text, str):
        return None
    gpus: list[GpuDevice] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        # A GPU's name holds no comma (NVIDIA's product names), so the CSV splits plainly.
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(fields):
            return None
        values = dict(zip(fields, cells, strict=True))
        index, total = _int(values.get("index")), _int(values.get("memory.total"))
        name = values.get("name") or ""
        if index is None or total is None or name.lower() in _NOT_A_VALUE:
            return None
        used = _int(values.get("memory.used"))
        capability = values.get("compute_cap")
        gpus.append({
            "index": index,
            "name": name,
            "memory_total_bytes": total * MIB,
            "memory_used_bytes": used * MIB if used is not None else None,
            "compute_capability": capability if capability and _CAPABILITY.match(capability) else None,
        })
    return gpus


def is_unknown_field_error(text: str | None) -> bool:
    """nvidia-smi's answer to a field its driver does not know (``Field "compute_cap" is not a valid
    field to query.``)."""
    return isinstance(text, str) and "is not a valid field" in text


def nccl_version_text(value: Any) -> str | None:
    """``torch.cuda.nccl.version()``: a tuple ``(2, 21, 5)`` in torch 1.13 and later, an int before
    (``2708`` = 2.7.8; from NCCL 2.9 the code is ``major·10000 + minor·100 + patch``)."""
    if isinstance(value, (list, tuple)) and value and all(_is_int(part) for part in value):
        return ".".join(str(part) for part in value)
    if not _is_int(value) or value <= 0:
        return None
    if value >= 10000:
        return f"{value // 10000}.{value % 10000 // 100}.{value % 100}"
    return f"{value // 1000}.{value % 1000 // 100}.{value % 100}"


def gpus_from_probe(answer: Any) -> list[GpuDevice] | None:
    """The torch probe's ``gpus`` (``torch.cuda.get_device_properties`` and ``mem_get_info``),
    each field checked; None when the list is not one."""
    if not isinstance(answer, list):
        return None
    gpus: list[GpuDevice] = []
    for entry in answer:
        if not isinstance(entry, dict):
            return None
        index, total = entry.get("index"), entry.get("memory_total_bytes")
        name, used, capability = entry.get("name"), entry.get("memory_used_bytes"), entry.get("compute_capability")
        if not isinstance(index, int) or not isinstance(total, int) or not _is_int(index) or not _is_int(total) \
                or not isinstance(name, str):
            return None
        gpus.append({
            "index": index, "name": name, "memory_total_bytes": total,
            "memory_used_bytes": used if _is_int(used) else None,
            "compute_capability": capability if isinstance(capability, str) and _CAPABILITY.match(capability)
            else None,
        })
    return gpus


def shm_from_statvfs(path: str, block_size: int, blocks: int, available: int) -> ShmFacts | None:
    """``os.statvfs(path)``'s ``f_frsize``, ``f_blocks`` and ``f_bavail`` in bytes; None when the
    numbers cannot be sizes."""
    if not all(_is_int(value) and value >= 0 for value in (block_size, blocks, available)) or block_size == 0:
        return None
    return {"path": path, "total_bytes": block_size * blocks, "free_bytes": block_size * available}


def _int(text: str | None) -> int | None:
    if text is None or text.lower() in _NOT_A_VALUE:
        return None
    try:
        return int(float(text))
    except ValueError:
        return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
