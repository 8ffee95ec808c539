"""Node facts: the parsers on real macOS outputs and inline samples, and the collector
on this machine."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agent import facts
from agent.facts_parsers import (
    parse_meminfo,
    parse_os_release,
    parse_pmset,
    parse_proc_cpuinfo,
    parse_sp_hardware,
    parse_sw_vers,
)

# The repository is /work/main; the shared fixtures sit beside it in /work/shared.
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "macos"
# Written by generate.py beside them, in this repository (see its README: synthetic).
SYNTHETIC = Path(__file__).resolve().parents[1] / "fixtures" / "macos-synthetic"
GIB = 1024**3

FACT_KEYS = {
    "hostname", "user", "home", "os", "os_version", "os_build", "os_pretty", "arch",
    "chip", "cores", "performance_cores", "efficiency_cores", "memory_bytes",
    "disk_free_bytes", "workdir", "python_version", "python_executable",
    "mlx_version", "mlx_lm_version", "gpu", "gpu_detail", "mlx_env", "power", "boot_id",
}
HARDWARE_KEYS = {"chip", "model", "memory_bytes", "cores", "performance_cores", "efficiency_cores"}


def read_fixture(name: str) -> str:
    path = FIXTURES / name
    if not path.is_file():
        reason = f"macOS fixture {path} is missing (expected in tests/fixtures/macos)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return path.read_text(encoding="utf-8")


# --- sw_vers -------------------------------------------------------------------------

SW_VERS = "ProductName:\t\tmacOS\nProductVersion:\t\t26.2\nBuildVersion:\t\t25C56\n"


def test_sw_vers_gives_product_version_and_build():
    assert parse_sw_vers(SW_VERS) == {
        "product_name": "macOS",
        "product_version": "26.2",
        "build_version": "25C56",
    }


def test_empty_sw_vers_output_is_unknown_not_blank():
    assert parse_sw_vers("") == {"product_name": None, "product_version": None, "build_version": None}


def test_sw_vers_with_a_blank_value_reports_it_unknown():
    parsed = parse_sw_vers("ProductName:\tmacOS\nProductVersion:\t\nBuildVersion: 25C56")
    assert parsed["product_version"] is None
    assert parsed["build_version"] == "25C56"


# --- system_profiler SPHardwareDataType ---------------------------------------------------


def test_m2_pro_hardware_splits_cores_into_performance_and_efficiency():
    parsed = parse_sp_hardware(read_fixture("system_profiler-SPHardwareDataType.m2pro.json"))
    assert parsed == {
        "chip": "Apple M2 Pro",
        "model": "Mac14,10",
        "memory_bytes": 16 * GIB,
        "cores": 12,
        "performance_cores": 8,
        "efficiency_cores": 4,
    }


def test_virtual_mac_reports_a_plain_core_count_without_a_split():
    parsed = parse_sp_hardware(read_fixture("system_profiler-SPHardwareDataType.m4max-vm.json"))
    assert parsed == {
        "chip": "Apple M4 Max (Virtual)",
        "model": "VirtualMac2,1",
        "memory_bytes": 4 * GIB,
        "cores": 2,
        "performance_cores": None,
        "efficiency_cores": None,
    }


def test_macos_gigabytes_are_gibibytes():
    document = '{"SPHardwareDataType": [{"chip_type": "Apple M3 Ultra", "physical_memory": "512 GB"}]}'
    assert parse_sp_hardware(document)["memory_bytes"] == 512 * GIB


def test_intel_mac_chip_comes_from_cpu_type():
    document = (
        '{"SPHardwareDataType": [{"cpu_type": "Quad-Core Intel Core i7",'
        ' "machine_model": "MacBookPro15,2", "number_processors": 4, "physical_memory": "16 GB"}]}'
    )
    parsed = parse_sp_hardware(document)
    assert parsed["chip"] == "Quad-Core Intel Core i7"
    assert parsed["cores"] == 4
    assert parsed["performance_cores"] is None


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json at all",
        "[1, 2, 3]",
        "{}",
        '{"SPHardwareDataType": []}',
        '{"SPHardwareDataType": ["hardware_overview"]}',
        '{"SPHardwareDataType": [{"chip_type": "Apple M2 Pro"',
    ],
)
def test_unreadable_hardware_json_is_unknown_not_zero(text):
    assert parse_sp_hardware(text) == dict.fromkeys(HARDWARE_KEYS)


@pytest.mark.parametrize(
    ("memory", "processors"),
    [("lots", "proc"), ("", "twelve"), (16, True), (None, None), ("0 GB", 0), ("16 PB", "proc x:y")],
)
def test_unparseable_memory_and_core_values_are_unknown(memory, processors):
    document = json.dumps(
        {"SPHardwareDataType": [{"chip_type": "Apple M1", "physical_memory": memory,
                                 "number_processors": processors}]}
    )
    parsed = parse_sp_hardware(document)
    assert parsed["chip"] == "Apple M1"
    assert parsed["memory_bytes"] is None
    assert parsed["cores"] is None
    assert parsed["performance_cores"] is None
    assert parsed["efficiency_cores"] is None


# --- /proc/cpuinfo ---------------------------------------------------------------------

X86_CPUINFO = """\
processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
cpu cores\t: 2

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
cpu cores\t: 2
"""

ARM_CPUINFO_WITH_HARDWARE = """\
processor\t: 0
BogoMIPS\t: 108.00
CPU implementer\t: 0x41
CPU part\t: 0xd08

processor\t: 1
CPU implementer\t: 0x41
CPU part\t: 0xd08

processor\t: 2
processor\t: 3

Hardware\t: BCM2835
Model\t\t: Raspberry Pi 4 Model B Rev 1.4
"""

ARM_CPUINFO_IMPLEMENTER_ONLY = """\
processor\t: 0
CPU implementer\t: 0x61
CPU part\t: 0x022
"""


def test_x86_cpuinfo_names_the_model_and_counts_logical_cpus():
    assert parse_proc_cpuinfo(X86_CPUINFO) == {"chip": "AMD EPYC 7B13", "cores": 2}


def test_arm_cpuinfo_without_model_name_falls_back_to_hardware():
    assert parse_proc_cpuinfo(ARM_CPUINFO_WITH_HARDWARE) == {"chip": "BCM2835", "cores": 4}


def test_arm_cpuinfo_with_only_an_implementer_names_the_vendor():
    parsed = parse_proc_cpuinfo(ARM_CPUINFO_IMPLEMENTER_ONLY)
    assert parsed["chip"] is not None and parsed["chip"].startswith("Apple")
    assert parsed["cores"] == 1


def test_empty_cpuinfo_is_unknown_not_zero_cores():
    assert parse_proc_cpuinfo("") == {"chip": None, "cores": None}


# --- /proc/meminfo ----------------------------------------------------------------------


def test_meminfo_total_is_converted_from_kib_to_bytes():
    text = "MemTotal:       24684084 kB\nMemFree:        23917976 kB\n"
    assert parse_meminfo(text) == 24684084 * 1024


@pytest.mark.parametrize(
    "text", ["", "MemFree:  1024 kB\n", "MemTotal:  lots\n", "MemTotal:  0 kB\n"]
)
def test_missing_or_unreadable_memtotal_is_unknown_not_zero(text):
    assert parse_meminfo(text) is None


# --- /etc/os-release --------------------------------------------------------------------


def test_os_release_prefers_pretty_name_and_unquotes_values():
    text = (
        'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian GNU/Linux"\n'
        'VERSION_ID="12"\nID=debian\n'
    )
    assert parse_os_release(text) == {"name": "Debian GNU/Linux 12 (bookworm)", "version": "12"}


def test_os_release_without_pretty_name_uses_name():
    text = "# comment\nNAME='Arch Linux'\nID=arch\n"
    assert parse_os_release(text) == {"name": "Arch Linux", "version": None}


def test_empty_os_release_is_unknown():
    assert parse_os_release("") == {"name": None, "version": None}


# --- pmset -g (synthetic fixtures: no real capture yet) ------------------------------------


@pytest.mark.parametrize(("fixture", "minutes", "disabled", "prevented_by"), [
    ("macstudio.pmset-g.sleep-0.txt", 0, None, []),
    ("macmini.pmset-g.sleep-1.txt", 1, None, ["sharingd", "powerd"]),
    ("macmini.pmset-g.sleep-disabled.txt", 1, True, ["sharingd", "powerd"]),
    ("macbookpro.pmset-g.battery.txt", 1, None, ["powerd", "coreaudiod"]),
    ("macbookpro.pmset-g.ac-sleep-0.txt", 0, None, []),
])
def test_pmset_gives_the_system_sleep_timer_of_the_profile_in_use(fixture, minutes, disabled, prevented_by):
    parsed = parse_pmset((SYNTHETIC / fixture).read_text(encoding="utf-8"))
    assert parsed == {"sleep_minutes": minutes, "sleep_disabled": disabled, "sleep_prevented_by": prevented_by}


def test_pmset_display_and_disk_sleep_are_not_system_sleep():
    # Both fixtures sleep their display (10 min, one with a note) and disk, yet never the system.
    for fixture in ("macstudio.pmset-g.sleep-0.txt", "macbookpro.pmset-g.ac-sleep-0.txt"):
        text = (SYNTHETIC / fixture).read_text(encoding="utf-8")
        assert " displaysleep         10" in text and " disksleep            10" in text
        assert parse_pmset(text)["sleep_minutes"] == 0


def test_pmset_reads_sleep_only_under_currently_in_use_and_names_with_spaces_do_not_confuse_it():
    text = ("System-wide power settings:\n SleepDisabled\t\t0\n sleep 99\n"
            "Currently in use:\n Sleep On Power Button 1\n sleep                 5 (sleep prevented by backupd)\n")
    assert parse_pmset(text) == {"sleep_minutes": 5, "sleep_disabled": False, "sleep_prevented_by": ["backupd"]}


def test_pmset_output_that_is_not_pmset_is_unknown():
    assert parse_pmset("") is None
    assert parse_pmset("pmset: command not found\n") is None
    assert parse_pmset("Currently in use:\n displaysleep 10\n") == {
        "sleep_minutes": None, "sleep_disabled": None, "sleep_prevented_by": []}


# --- collect_facts on this machine ----------------------------------------------------------


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.mark.skipif(platform.system() != "Linux", reason="checks Linux facts on a Linux host")
def test_collected_facts_on_linux_are_real_values(tmp_path):
    collected = facts.collect_facts(workdir=str(tmp_path))
    assert set(collected) == FACT_KEYS
    assert collected["os"] == "Linux"
    assert collected["power"] is None  # system sleep (pmset) is read on macOS only
    assert collected["hostname"] == socket.gethostname() and collected["hostname"]
    assert collected["memory_bytes"] > 0
    assert collected["cores"] >= 1
    assert collected["disk_free_bytes"] > 0
    assert collected["workdir"] == str(tmp_path)
    assert collected["os_build"] == platform.release()
    assert collected["python_version"] == platform.python_version()
    assert collected["python_executable"] == sys.executable
    assert collected["mlx_version"] == installed_version("mlx")
    assert collected["mlx_lm_version"] == installed_version("mlx-lm")
    assert collected["gpu"] in {"metal", "cuda", "none", None}
    with open("/proc/sys/kernel/random/boot_id") as handle:  # a reboot changes it: a marked node rejoins
        assert collected["boot_id"] == handle.read().strip()
    assert collected["gpu_detail"]


def test_collected_facts_are_plain_wire_values():
    msgpack = pytest.importorskip("msgpack")
    collected = facts.collect_facts()
    assert msgpack.unpackb(msgpack.packb(collected)) == collected


def test_without_a_workdir_disk_free_is_unknown():
    collected = facts.collect_facts()
    assert collected["workdir"] is None
    assert collected["disk_free_bytes"] is None


def test_disk_free_of_a_workdir_yet_to_be_made_is_read_from_its_parent(tmp_path):
    missing = tmp_path / "not" / "made" / "yet"
    assert facts.read_disk_free(str(missing)) > 0
    assert not missing.exists()


def test_collecting_facts_never_imports_mlx_in_the_agent():
    probe = "import sys; from agent.facts import collect_facts; collect_facts(); print('mlx' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    completed = subprocess.run(
        [sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=120, check=True
    )
    assert completed.stdout.strip().splitlines()[-1] == "False"


# --- detect_gpu and commands ---------------------------------------------------------------


def fake_python(tmp_path: Path, body: str) -> str:
    """An executable that stands in for a node's Python and answers the GPU probe."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


posix_only = pytest.mark.skipif(os.name != "posix", reason="fake interpreters are shell scripts")


@posix_only
@pytest.mark.parametrize(
    ("answer", "gpu"),
    [
        ('{"metal": true, "cuda": false, "device": "Device(gpu, 0)"}', "metal"),
        ('{"metal": false, "cuda": true, "device": "Device(gpu, 0)"}', "cuda"),
        ('{"metal": false, "cuda": false, "device": "Device(cpu, 0)"}', "none"),
        ('{"metal": null, "cuda": false, "device": "Device(cpu, 0)"}', None),
    ],
)
def test_gpu_kind_follows_what_mlx_reports(tmp_path, answer, gpu):
    python = fake_python(tmp_path, f"echo 'some warning'\necho '{answer}'")
    kind, detail = facts.detect_gpu(python)
    assert kind == gpu
    assert "Device(" in detail


@posix_only
def test_failed_gpu_probe_is_unknown_with_the_reason(tmp_path):
    python = fake_python(tmp_path, "echo \"ModuleNotFoundError: No module named 'mlx'\" >&2\nexit 1")
    kind, detail = facts.detect_gpu(python)
    assert kind is None
    assert "No module named 'mlx'" in detail


@posix_only
def test_gpu_probe_with_garbage_output_is_unknown(tmp_path):
    kind, detail = facts.detect_gpu(fake_python(tmp_path, "echo hello"))
    assert kind is None
    assert "no answer" in detail


def test_gpu_probe_with_a_missing_interpreter_is_unknown(tmp_path):
    kind, detail = facts.detect_gpu(str(tmp_path / "no-such-python"))
    assert kind is None
    assert "could not run" in detail


@pytest.mark.skipif(installed_version("mlx") is None, reason="mlx is not installed here")
def test_gpu_probe_with_real_mlx_gives_a_known_kind():
    kind, detail = facts.detect_gpu(sys.executable)
    assert kind in {"metal", "cuda", "none"}
    assert detail.startswith("Device(")


def test_missing_command_yields_none_not_an_exception():
    assert facts.run_command(["coord-no-such-command-xyz"]) is None


def test_failing_command_yields_none():
    assert facts.run_command([sys.executable, "-c", "raise SystemExit(3)"]) is None


def test_command_past_its_timeout_yields_none():
    assert facts.run_command([sys.executable, "-c", "import time; time.sleep(10)"], timeout=0.5) is None


@posix_only
def test_another_interpreter_is_asked_for_its_own_versions(tmp_path):
    answer = '{"python_version": "3.12.1", "mlx_version": "0.30.0", "mlx_lm_version": null}'
    python = fake_python(tmp_path, f"echo '{answer}'")
    assert facts.read_python_facts(python) == {
        "python_version": "3.12.1",
        "mlx_version": "0.30.0",
        "mlx_lm_version": None,
    }


@posix_only
def test_an_interpreter_that_cannot_answer_has_unknown_versions(tmp_path):
    python = fake_python(tmp_path, "exit 127")
    assert facts.read_python_facts(python) == dict.fromkeys(
        ("python_version", "mlx_version", "mlx_lm_version")
    )
