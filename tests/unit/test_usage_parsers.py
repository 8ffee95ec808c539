"""What a node uses now: the parsers on SYNTHETIC macOS outputs (tests/fixtures/macos-synthetic,
see its README), Linux's /proc/meminfo, and the collector on this machine."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from agent import usage
from agent.usage_parsers import (
    parse_battery_power,
    parse_gpu_statistics,
    parse_ioreg_property,
    parse_meminfo_used,
    parse_vm_stat,
    parse_vm_stat_wired,
)
from coordinator.jobs import reboot

SYNTHETIC = Path(__file__).resolve().parents[1] / "fixtures" / "macos-synthetic"


def fixture(name: str) -> str:
    return (SYNTHETIC / name).read_text()


def test_vm_stat_counts_app_wired_and_compressed_memory_as_used():
    # (1,835,008 anonymous - 65,536 purgeable + 393,216 wired + 131,072 compressed) pages of 16 KiB
    assert parse_vm_stat(fixture("macstudio.vm_stat.training.txt")) == (1835008 - 65536 + 393216 + 131072) * 16384


def test_wired_memory_is_read_from_vm_stat_and_stranded_wired_memory_means_a_reboot():
    idle = parse_vm_stat_wired(fixture("macstudio.vm_stat.idle.txt"))
    stranded = parse_vm_stat_wired(fixture("macstudio.vm_stat.stranded.txt"))
    assert idle == 131072 * 16384 and stranded == 1966080 * 16384
    assert parse_vm_stat_wired(fixture("macstudio.vm_stat.training.txt")) == 393216 * 16384
    assert parse_vm_stat_wired("Pages wired down: 5.\n") is None  # no page size
    memory = 64 << 30
    why = reboot.wired_stranded(idle, stranded, memory)
    assert why is not None and "30.0 GiB" in why and "28.0 GiB above the 2.0 GiB" in why
    # What a training run holds while it runs is no reason; nor is an unknown reading.
    assert reboot.wired_stranded(idle, parse_vm_stat_wired(fixture("macstudio.vm_stat.training.txt")), memory) is None
    assert reboot.wired_stranded(idle, None, memory) is None


def test_vm_stat_without_its_counters_is_unknown():
    assert parse_vm_stat("Mach Virtual Memory Statistics: (page size of 16384 bytes)\nPages free: 5.\n") is None
    assert parse_vm_stat("") is None


def test_gpu_utilization_and_memory_come_from_the_accelerators_performance_statistics():
    assert parse_gpu_statistics(fixture("macstudio.ioreg-IOAccelerator.busy.txt")) == {
        "gpu_utilization": 87.0, "gpu_memory_bytes": 24696061952}
    assert parse_gpu_statistics(fixture("macstudio.ioreg-IOAccelerator.idle.txt"))["gpu_utilization"] == 0.0


def test_no_accelerator_means_no_gpu_reading():
    assert parse_gpu_statistics("") == {"gpu_utilization": None, "gpu_memory_bytes": None}


def test_ioreg_dictionary_property_keeps_numbers_strings_and_booleans():
    text = '      "Stats" = {"a b %"=3,"name"="x","on"=Yes,"f"=1.5}\n'
    assert parse_ioreg_property(text, "Stats") == {"a b %": 3, "name": "x", "on": True, "f": 1.5}
    assert parse_ioreg_property(text, "Other") is None


def test_laptop_power_is_the_battery_telemetrys_system_load_in_watts():
    assert parse_battery_power(fixture("macbookpro.ioreg-AppleSmartBattery.ac.txt")) == 38.25
    # a desktop has no battery: no unprivileged power reading
    assert parse_battery_power(fixture("macstudio.ioreg-IOAccelerator.busy.txt")) is None


def test_linux_memory_used_is_total_less_available():
    text = "MemTotal:       16384000 kB\nMemFree:         1000000 kB\nMemAvailable:    4096000 kB\n"
    assert parse_meminfo_used(text) == ((16384000 - 4096000) * 1024, 16384000 * 1024)
    assert parse_meminfo_used("") == (None, None)


@pytest.mark.skipif(platform.system() != "Linux", reason="reads this Linux machine's /proc/meminfo")
def test_the_collector_reads_this_machines_memory_and_says_temperature_is_not_read():
    sample = usage.collect_usage()
    assert 0 < sample["memory_used_bytes"] < sample["memory_total_bytes"]
    assert sample["temperature_c"] is None and sample["sources"]["temperature"]
    assert sample["time"] > 0
