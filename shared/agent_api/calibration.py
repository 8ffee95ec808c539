"""``calibrate``: the request, its progress events and the measurements it answers."""

from __future__ import annotations

from typing import TypedDict


class _CalibrateRequest(TypedDict):
    python: str
    workdir: str


class CalibrateRequest(_CalibrateRequest, total=False):
    quick: bool
    timeout: float


class CalibrationProgress(TypedDict):
    """An event of a ``calibrate`` call (a line the calibration printed on stderr)."""

    progress: str  # the stage
    fraction: float


class TrainModel(TypedDict):
    kind: str
    layers: int
    dim: int
    heads: int
    vocab: int
    seq_len: int
    batch: int


class CalibrationReply(TypedDict, total=False):
    """What ``python -m agent.calibrate`` printed, with what the agent adds; ``ok`` says which half.

    Measurements that failed are None, with the reason in ``errors``. A calibration that
    could not run has ``ok`` False and ``error_kind`` (timeout, mlx_missing, spawn_failed,
    exit_status, bad_output), ``error``, ``exit_code`` and ``stderr_tail``.
    """

    ok: bool
    calibration_version: int
    quick: bool
    mlx_version: str | None
    python_version: str
    cpu_count: int | None
    device: str | None
    device_kind: str | None  # "gpu" or "cpu"
    matmul_gflops: dict[str, float | None]  # by dtype
    matmul_sizes: dict[str, int]
    memory_bandwidth_gbps: float | None
    memory_bandwidth_method: str | None
    peak_memory_bytes: int | None
    peak_memory_source: str | None
    train_samples_per_s: float | None
    train_step_ms: float | None
    train_steps: int | None
    train_model: TrainModel
    mlx_peak_used_bytes: int | None
    errors: dict[str, str]  # measurement: why it failed
    duration_s: float
    mlx_import_s: float
    python_executable: str
    error_kind: str
    error: str
    exit_code: int | None
    stderr_tail: list[str]
    wall_s: float  # added by the agent: the whole run, start to exit
