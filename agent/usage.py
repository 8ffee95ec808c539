"""What a node is using now, sampled by the daemon every few seconds for its metrics history.

Only what the OS gives without root. On macOS: memory from ``vm_stat`` and ``sysctl
hw.memsize``; GPU utilisation and GPU memory from ``ioreg -r -d 1 -c IOAccelerator``
(PerformanceStatistics); power only on Macs with a battery, from ``ioreg -r -c
AppleSmartBattery`` (PowerTelemetryData SystemLoad). ``powermetrics`` would give GPU power
and the SoC's temperature but needs root, so temperature is not reported: ``None``, with
the reason in ``sources``. On Linux: memory from ``/proc/meminfo``; no GPU reading.
"""

from __future__ import annotations

import platform
import time
from typing import TYPE_CHECKING

from agent import usage_parsers
from agent.facts import read_physical_memory, read_text, run_command

if TYPE_CHECKING:
    from shared.agent_api.facts import UsageReply, UsageSample

USAGE_TIMEOUT_S = 5.0
NO_TEMPERATURE = "not read: macOS gives the SoC temperature only to root (powermetrics, SMC)"


def collect_usage() -> UsageReply:
    """One sample; a value this OS cannot give without root is None, its source says why."""
    if platform.system() == "Darwin":
        sample = read_macos_usage()
    elif platform.system() == "Linux":
        sample = read_linux_usage()
    else:
        sample = _empty(f"no reading on {platform.system()}")
    return {**sample, "time": time.time()}


def read_macos_usage() -> UsageSample:
    sample = _empty("not read")
    vm_stat = run_command(["vm_stat"], USAGE_TIMEOUT_S) or ""
    sample["memory_used_bytes"] = usage_parsers.parse_vm_stat(vm_stat)
    sample["wired_bytes"] = usage_parsers.parse_vm_stat_wired(vm_stat)
    sample["memory_total_bytes"] = read_physical_memory()
    sample["sources"]["memory"] = "vm_stat (app + wired + compressed), sysctl hw.memsize"
    gpu = usage_parsers.parse_gpu_statistics(
        run_command(["ioreg", "-r", "-d", "1", "-c", "IOAccelerator"], USAGE_TIMEOUT_S) or "")
    sample["gpu_utilization"], sample["gpu_memory_bytes"] = gpu["gpu_utilization"], gpu["gpu_memory_bytes"]
    sample["sources"]["gpu"] = ("ioreg IOAccelerator PerformanceStatistics" if gpu["gpu_utilization"] is not None
                                else "no IOAccelerator PerformanceStatistics in ioreg")
    power = usage_parsers.parse_battery_power(
        run_command(["ioreg", "-r", "-c", "AppleSmartBattery"], USAGE_TIMEOUT_S) or "")
    sample["power_watts"] = power
    sample["sources"]["power"] = ("ioreg AppleSmartBattery PowerTelemetryData SystemLoad" if power is not None
                                  else "not read: no battery telemetry (powermetrics needs root)")
    sample["sources"]["temperature"] = NO_TEMPERATURE
    return sample


def read_linux_usage() -> UsageSample:
    sample = _empty("not read on Linux")
    used, total = usage_parsers.parse_meminfo_used(read_text("/proc/meminfo") or "")
    sample["memory_used_bytes"], sample["memory_total_bytes"] = used, total
    sample["sources"]["memory"] = "/proc/meminfo (MemTotal - MemAvailable)"
    return sample


def _empty(reason: str) -> UsageSample:
    return {"memory_used_bytes": None, "memory_total_bytes": None, "gpu_utilization": None,
            "gpu_memory_bytes": None, "power_watts": None, "temperature_c": None, "wired_bytes": None,
            "sources": {"memory": reason, "gpu": reason, "power": reason, "temperature": reason}}
