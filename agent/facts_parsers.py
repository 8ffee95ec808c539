"""Parsers for the command outputs and files the agent reads to describe its node.

Pure functions: text in, plain values out, no I/O. A value that is missing or cannot be
read is ``None`` ("unknown"), never ``0`` or ``""``, so the coordinator can tell a node
with no memory reading from a node with no memory.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.agent_api.common import JsonObject
    from shared.agent_api.facts import CpuInfo, HardwareFacts, PowerSettings

_SW_VERS_KEYS = {
    "ProductName": "product_name",
    "ProductVersion": "product_version",
    "BuildVersion": "build_version",
}

# system_profiler prints binary units with decimal names: "16 GB" is 16 GiB.
_MEMORY_UNITS = {"KB": 1024, "MB": 1024**2, "GB": 1024**3, "TB": 1024**4}

# /proc/cpuinfo on ARM gives no "model name"; the implementer code at least names the vendor.
_ARM_IMPLEMENTERS = {
    0x41: "ARM",
    0x42: "Broadcom",
    0x43: "Cavium",
    0x48: "HiSilicon",
    0x4E: "NVIDIA",
    0x51: "Qualcomm",
    0x61: "Apple",
    0xC0: "Ampere",
}

# `` sleep                 1 (sleep prevented by powerd, coreaudiod)``: a name (which may have
# spaces: "Sleep On Power Button"), a value, and perhaps a note in parentheses.
_PMSET_SETTING = re.compile(r"^\s+(?P<key>\S(?:.*?\S)?)\s+(?P<value>\S+)(?:\s+\((?P<note>[^)]*)\))?\s*$")

def parse_sw_vers(text: str) -> dict[str, str | None]:
    """Read macOS ``sw_vers`` output (``ProductVersion:\\t26.2`` lines)."""
    result: dict[str, str | None] = dict.fromkeys(_SW_VERS_KEYS.values())
    for key, value in _colon_pairs(text):
        name = _SW_VERS_KEYS.get(key)
        if name is not None and result[name] is None:
            result[name] = value or None
    return result


def parse_sp_hardware(json_text: str) -> HardwareFacts:
    """Read ``system_profiler SPHardwareDataType -json``; unreadable output is all None."""
    overview = _hardware_overview(json_text)
    if overview is None:
        return {"chip": None, "model": None, "memory_bytes": None, "cores": None, "performance_cores": None,
                "efficiency_cores": None}
    cores, performance, efficiency = parse_number_processors(overview.get("number_processors"))
    return {
        "chip": _text(overview.get("chip_type")) or _text(overview.get("cpu_type")),
        "model": _text(overview.get("machine_model")),
        "memory_bytes": parse_memory_size(overview.get("physical_memory")),
        "cores": cores,
        "performance_cores": performance,
        "efficiency_cores": efficiency,
    }


def parse_number_processors(value: object) -> tuple[int | None, int | None, int | None]:
    """Return (total, performance, efficiency) cores from ``number_processors``.

    A virtual Mac reports a plain number; real Apple Silicon a string such as
    ``"proc 12:0:8:4"``: total first, performance and efficiency cores third and fourth.
    """
    if isinstance(value, bool):
        return None, None, None
    if isinstance(value, int):
        return _positive(value), None, None
    if not isinstance(value, str):
        return None, None, None
    text = value.strip()
    if text.isdigit():
        return _positive(int(text)), None, None
    match = re.fullmatch(r"proc\s+(\d+(?::\d+)*)", text)
    if match is None:
        return None, None, None
    fields = [int(part) for part in match.group(1).split(":")]
    total = _positive(fields[0])
    performance = _positive(fields[2]) if len(fields) > 2 else None
    efficiency = _positive(fields[3]) if len(fields) > 3 else None
    return total, performance, efficiency


def parse_memory_size(value: object) -> int | None:
    """Turn system_profiler's ``"16 GB"`` into bytes (GB meaning GiB, as macOS does)."""
    if not isinstance(value, str):
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]B)\s*", value, re.IGNORECASE)
    if match is None:
        return None
    amount = float(match.group(1)) * _MEMORY_UNITS[match.group(2).upper()]
    return _positive(int(amount))


def parse_proc_cpuinfo(text: str) -> CpuInfo:
    """Read Linux ``/proc/cpuinfo``: the CPU's name and the number of logical CPUs."""
    pairs = list(_colon_pairs(text))
    processors = sum(1 for key, _ in pairs if key == "processor")
    return {"chip": _cpuinfo_chip(pairs), "cores": processors or None}


def parse_meminfo(text: str) -> int | None:
    """Return ``MemTotal`` from Linux ``/proc/meminfo`` in bytes."""
    for key, value in _colon_pairs(text):
        if key != "MemTotal":
            continue
        match = re.fullmatch(r"(\d+)\s*(kB)?", value, re.IGNORECASE)
        if match is None:
            return None
        scale = 1024 if match.group(2) else 1
        return _positive(int(match.group(1)) * scale)
    return None


def parse_os_release(text: str) -> dict[str, str | None]:
    """Read ``/etc/os-release``: ``name`` (PRETTY_NAME, else NAME) and ``version`` (VERSION_ID)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, raw = line.partition("=")
        fields.setdefault(key.strip(), _unquote(raw))
    return {
        "name": fields.get("PRETTY_NAME") or fields.get("NAME") or None,
        "version": fields.get("VERSION_ID") or None,
    }


def parse_pmset(text: str) -> PowerSettings | None:
    """Read macOS ``pmset -g``: the system sleep timer of the active power profile.

    ``sleep_minutes`` is ``sleep`` under "Currently in use" (0: never sleeps on idle);
    ``disksleep`` and ``displaysleep`` are left out, as a sleeping disk or display does not
    stop a run. ``sleep_disabled`` is ``SleepDisabled`` under "System-wide power settings"
    (``pmset disablesleep 1``, which overrides every timer). ``sleep_prevented_by`` lists the
    processes whose assertions hold sleep off right now (the note after ``sleep``); they
    let go when they end. Output with no "Currently in use" section is ``None``.
    """
    section = None
    in_use: dict[str, tuple[str, str | None]] = {}
    system_wide: dict[str, tuple[str, str | None]] = {}
    for line in text.splitlines() if isinstance(text, str) else ():
        header = line.strip()
        if header == "System-wide power settings:":
            section = system_wide
            continue
        if header == "Currently in use:":
            section = in_use
            continue
        match = _PMSET_SETTING.match(line)
        if section is None or match is None:
            continue
        section.setdefault(match.group("key"), (match.group("value"), match.group("note")))
    if not in_use:
        return None
    sleep, note = in_use.get("sleep", (None, None))
    disabled = system_wide.get("SleepDisabled", (None, None))[0]
    return {
        "sleep_minutes": _integer(sleep),
        "sleep_disabled": None if _integer(disabled) is None else _integer(disabled) != 0,
        "sleep_prevented_by": _prevented_by(note),
    }


def _hardware_overview(json_text: str) -> JsonObject | None:
    try:
        document = json.loads(json_text)
    except (TypeError, ValueError):
        return None
    if not isinstance(document, dict):
        return None
    items = document.get("SPHardwareDataType")
    if not isinstance(items, list) or not items or not isinstance(items[0], dict):
        return None
    return items[0]


def _cpuinfo_chip(pairs: list[tuple[str, str]]) -> str | None:
    found: dict[str, str] = {}
    for key, value in pairs:
        if value:
            found.setdefault(key, value)
    if "model name" in found:
        return found["model name"]
    if "Hardware" in found:
        return found["Hardware"]
    return _arm_implementer_name(found.get("CPU implementer"), found.get("CPU part"))


def _arm_implementer_name(implementer: str | None, part: str | None) -> str | None:
    if implementer is None:
        return None
    try:
        vendor = _ARM_IMPLEMENTERS.get(int(implementer, 0), f"implementer {implementer}")
    except ValueError:
        vendor = f"implementer {implementer}"
    return f"{vendor} (part {part})" if part else vendor


def _colon_pairs(text: str) -> Iterator[tuple[str, str]]:
    """Yield (key, value) from ``key: value`` lines, both stripped; other lines are skipped."""
    if not isinstance(text, str):
        return
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            yield key.strip(), value.strip()


def _unquote(raw: str) -> str:
    try:
        words = shlex.split(raw, comments=False, posix=True)
    except ValueError:
        return raw.strip().strip("\"'")
    return " ".join(words)


def _integer(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def _prevented_by(note: str | None) -> list[str]:
    prefix = "sleep prevented by"
    if not note or not note.strip().lower().startswith(prefix):
        return []
    names = note.strip()[len(prefix):].split(",")
    return [name.strip() for name in names if name.strip()]


def _text(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    return value.strip() or None


def _positive(value: int) -> int | None:
    return value if value > 0 else None
