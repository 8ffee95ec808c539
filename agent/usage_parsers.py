"""Parsers for what a node is using right now: memory, and on a Mac the GPU and power.

Pure functions over command output, so they are tested on captured or synthetic text
(``tests/fixtures/macos-synthetic/*.vm_stat.txt``, ``*.ioreg-*.txt``). Each returns
``None`` for what the text does not hold; nothing here raises on odd input.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.agent_api.facts import GpuStatistics

_VM_PAGE_SIZE = re.compile(r"page size of (\d+) bytes")
_VM_LINE = re.compile(r'^"?([A-Za-z][A-Za-z \-]*?)"?:\s+(\d+)\.?\s*$')
# ioreg prints a dictionary property on one line: "Name" = {"key"=value,"key"=value,...}
_IOREG_ITEM = re.compile(r'"([^"]+)"=(-?\d+(?:\.\d+)?|"[^"]*"|Yes|No)')


def parse_vm_stat(text: str) -> int | None:
    """Memory in use from macOS ``vm_stat``, in bytes, as Activity Monitor's "Memory Used" counts it:
    app memory (anonymous pages less purgeable ones) + wired + compressed (pages the compressor
    occupies). File-backed cache is not "used": macOS gives it back on demand."""
    size = _VM_PAGE_SIZE.search(text)
    if size is None:
        return None
    pages: dict[str, int] = {}
    for line in text.splitlines():
        match = _VM_LINE.match(line.strip())
        if match:
            pages[match.group(1).strip()] = int(match.group(2))
    needed = ("Anonymous pages", "Pages wired down", "Pages occupied by compressor")
    if not all(key in pages for key in needed):
        return None
    app = max(0, pages["Anonymous pages"] - pages.get("Pages purgeable", 0))
    return (app + pages["Pages wired down"] + pages["Pages occupied by compressor"]) * int(size.group(1))


def parse_vm_stat_wired(text: str) -> int | None:
    """Wired memory from macOS ``vm_stat`` in bytes ("Pages wired down"): what the kernel holds
    and cannot page out. MLX wires the memory of a Metal working set; a rank stranded in the
    kernel after SIGKILL can leave it wired with no process left to hold it."""
    size = _VM_PAGE_SIZE.search(text)
    if size is None:
        return None
    for line in text.splitlines():
        match = _VM_LINE.match(line.strip())
        if match and match.group(1).strip() == "Pages wired down":
            return int(match.group(2)) * int(size.group(1))
    return None


def parse_ioreg_property(text: str, name: str) -> dict[str, int | float | str | bool] | None:
    """The first one-line dictionary property ``name`` in ``ioreg`` output, e.g.
    ``"PerformanceStatistics" = {"Device Utilization %"=12,...}``; None when absent."""
    match = re.search(r'"' + re.escape(name) + r'"\s*=\s*\{([^\n]*)\}', text)
    if match is None:
        return None
    values: dict[str, int | float | str | bool] = {}
    for key, raw in _IOREG_ITEM.findall(match.group(1)):
        if raw in ("Yes", "No"):
            values[key] = raw == "Yes"
        elif raw.startswith('"'):
            values[key] = raw.strip('"')
        else:
            values[key] = float(raw) if "." in raw else int(raw)
    return values


def parse_gpu_statistics(text: str) -> GpuStatistics:
    """GPU use from ``ioreg -r -d 1 -c IOAccelerator`` (no root needed): the accelerator's
    ``PerformanceStatistics`` "Device Utilization %" and "In use system memory" (bytes)."""
    stats = parse_ioreg_property(text, "PerformanceStatistics") or {}
    utilization = stats.get("Device Utilization %")
    in_use = stats.get("In use system memory")
    return {"gpu_utilization": float(utilization) if isinstance(utilization, (int, float)) else None,
            "gpu_memory_bytes": int(in_use) if isinstance(in_use, (int, float)) else None}


def parse_battery_power(text: str) -> float | None:
    """The whole machine's power draw in watts from ``ioreg -r -c AppleSmartBattery`` (no root
    needed): ``PowerTelemetryData`` "SystemLoad", in milliwatts. Only Macs with a battery have
    it; a desktop has no unprivileged reading (``powermetrics`` needs root)."""
    telemetry = parse_ioreg_property(text, "PowerTelemetryData") or {}
    load = telemetry.get("SystemLoad")
    if not isinstance(load, (int, float)) or isinstance(load, bool) or load <= 0:
        return None
    return round(load / 1000.0, 3)


def parse_meminfo_used(text: str) -> tuple[int | None, int | None]:
    """(used, total) bytes from Linux ``/proc/meminfo``: used is MemTotal - MemAvailable."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        match = re.match(r"^(\w+):\s+(\d+)\s*kB", line)
        if match:
            values[match.group(1)] = int(match.group(2)) * 1024
    total = values.get("MemTotal")
    available = values.get("MemAvailable")
    if total is None:
        return None, None
    return (total - available if available is not None else None), total
