"""``facts`` and ``usage``: what a node is (system, Python, MLX) and how busy it is."""

from __future__ import annotations

from typing import TypedDict


class FactsRequest(TypedDict, total=False):
    workdir: str | None


class PowerSettings(TypedDict):
    """``pmset -g`` on a Mac: the system sleep timer and what holds sleep off."""

    sleep_minutes: int | None
    sleep_disabled: bool | None
    sleep_prevented_by: list[str]


class HardwareFacts(TypedDict):
    """``system_profiler SPHardwareDataType`` on a Mac."""

    chip: str | None
    model: str | None
    memory_bytes: int | None
    cores: int | None
    performance_cores: int | None
    efficiency_cores: int | None


class CpuInfo(TypedDict):
    chip: str | None
    cores: int | None


class SystemFacts(TypedDict):
    os: str | None
    os_version: str | None
    os_build: str | None
    os_pretty: str | None
    chip: str | None
    cores: int | None
    performance_cores: int | None
    efficiency_cores: int | None
    memory_bytes: int | None
    power: PowerSettings | None


class PythonFacts(TypedDict):
    python_version: str | None
    mlx_version: str | None
    mlx_lm_version: str | None


class _FactsReply(SystemFacts, PythonFacts):
    hostname: str | None
    user: str | None
    home: str | None
    arch: str | None
    workdir: str | None
    disk_free_bytes: int | None
    python_executable: str
    mlx_env: dict[str, str]  # the MLX_* environment variables ranks inherit
    gpu: str | None  # "metal", "cuda", "none", or None when MLX could not say
    gpu_detail: str


class FactsReply(_FactsReply, total=False):
    boot_id: str | None  # this boot of the machine (a reboot changes it); None when unknown


# --- usage -----------------------------------------------------------------------------


class GpuStatistics(TypedDict):
    gpu_utilization: float | None
    gpu_memory_bytes: int | None


class UsageSources(TypedDict):
    """Where each reading came from, or why there is none."""

    memory: str
    gpu: str
    power: str
    temperature: str


class _UsageSample(TypedDict):
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    gpu_utilization: float | None
    gpu_memory_bytes: int | None
    power_watts: float | None
    temperature_c: float | None
    sources: UsageSources


class UsageSample(_UsageSample, total=False):
    wired_bytes: int | None  # macOS: memory the kernel holds wired (vm_stat); None elsewhere


class UsageReply(UsageSample):
    time: float
