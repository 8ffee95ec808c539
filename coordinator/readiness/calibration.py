"""Calibration policy for the daemon: when to re-measure a node, and how to split work.

Pure functions on plain data, no I/O. A stored calibration is the record made by
``calibration_record(facts, result)``::

    {"key": {"chip": ..., "os_version": ..., ...}, "result": {...agent.calibrate output...}}

It stays valid while the node's facts that affect speed (``CALIBRATION_KEY_FIELDS``) are
the same; ``is_stale`` says why it is not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, TypedDict, TypeGuard

if TYPE_CHECKING:
    from coordinator.nodes.session import Facts
    from coordinator.store.state import CalibrationKey, CalibrationRecord
    from shared.agent_api.calibration import CalibrationReply

# Node facts that, when changed, make a stored calibration meaningless.
CALIBRATION_KEY_FIELDS: tuple[str, ...] = (
    "chip",
    "os_version",
    "os_build",
    "mlx_version",
    "python_executable",
    "gpu",
)

_FIELD_LABELS = {
    "chip": "chip",
    "os_version": "OS version",
    "os_build": "OS build",
    "mlx_version": "mlx version",
    "python_executable": "Python interpreter",
    "gpu": "GPU backend",
}

DEFAULT_TOLERANCE = 0.10


class WorkloadShares(TypedDict):
    policy: Literal["equal", "proportional"]
    shares: dict[str, float]  # node -> its fraction of the work; they sum to 1
    reason: str


def calibration_key(facts: Mapping[str, Any]) -> CalibrationKey:
    """The facts (from ``agent.facts.collect_facts``) a calibration depends on, in the order of
    ``CALIBRATION_KEY_FIELDS``; a missing fact is ``None``."""
    return {"chip": facts.get("chip"), "os_version": facts.get("os_version"), "os_build": facts.get("os_build"),
            "mlx_version": facts.get("mlx_version"), "python_executable": facts.get("python_executable"),
            "gpu": facts.get("gpu")}


def calibration_record(facts: Mapping[str, Any], result: CalibrationReply) -> CalibrationRecord:
    """What to store for a node after ``run_calibration``: its key and the result (the agent's answer)."""
    return {"key": calibration_key(facts), "result": result.copy()}


def is_stale(
    stored: Mapping[str, Any] | None, facts: Mapping[str, Any], *, refresh: bool
) -> tuple[bool, str]:
    """(True, why) when the node must be calibrated again, else (False, why not).

    ``stored`` is read back from the state database as it was written (``StoredCalibration``),
    maybe by an older coord, so nothing of its shape is taken for granted.

    Reasons: ``"--refresh"``, ``"no calibration yet"``, ``"last calibration failed: ..."``,
    ``"last calibration was a --quick run"``, or the changed facts, e.g.
    ``"mlx version changed 0.29 → 0.30"`` (several joined with ``"; "``).
    """
    if refresh:
        return True, "--refresh"
    if not stored:
        return True, "no calibration yet"
    key = stored.get("key")
    if not isinstance(key, Mapping):
        return True, "stored calibration has no key (made by an older coord)"
    result = stored.get("result")
    if isinstance(result, Mapping):
        if result.get("ok") is False:
            return True, f"last calibration failed: {result.get('error') or 'unknown error'}"
        if result.get("quick"):
            return True, "last calibration was a --quick run"
    current = calibration_key(facts)
    changes = [
        f"{_FIELD_LABELS[field]} changed {_show(key.get(field))} → {_show(value)}"
        for field, value in current.items()
        if key.get(field) != value
    ]
    if changes:
        return True, "; ".join(changes)
    return False, "calibration is current (same chip, OS, mlx, Python and GPU backend)"


def gpu_memory(calibrations: Mapping[str, Mapping[str, Any] | None],
               facts: Mapping[str, Facts | None]) -> dict[str, tuple[int, str]]:
    """{node: (bytes, source)} of the memory MLX's GPU can use, from each node's current calibration."""
    found = {}
    for name, record in calibrations.items():
        result = (record or {}).get("result") or {}
        node_facts = facts.get(name)
        if not node_facts or result.get("device_kind") != "gpu" or is_stale(record, node_facts, refresh=False)[0]:
            continue
        size = result.get("peak_memory_bytes")
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            where = f"{result.get('peak_memory_source') or 'MLX'} on {result.get('device') or 'the GPU'}"
            found[name] = (size, f"{where} (coord calibrate)")
    return found


def train_rate(stored: Mapping[str, Any] | None) -> float | None:
    """The training-step rate (samples/s) of a stored record or a bare result, if usable."""
    if not stored:
        return None
    result = stored.get("result", stored)
    if not isinstance(result, Mapping) or result.get("ok") is False:
        return None
    rate = result.get("train_samples_per_s")
    return float(rate) if _usable(rate) else None


def workload_shares(
    rates: Mapping[str, float | None], tolerance: float = DEFAULT_TOLERANCE
) -> WorkloadShares:
    """How to split the work across nodes from their measured rates (higher = faster).

    Equal shares when every known rate is within ``tolerance`` of the others
    (max/min ≤ 1 + tolerance); otherwise shares proportional to the rate. A node with no
    usable rate (None, zero, negative, NaN) is given the mean of the known rates, and the
    reason says so; with no known rate at all, shares are equal. Shares sum to 1.

    Returns ``{"policy": "equal" | "proportional", "shares": {node: fraction},
    "reason": str}``.
    """
    if tolerance < 0:
        raise ValueError(f"tolerance must be ≥ 0, got {tolerance}")
    nodes = list(rates)
    if not nodes:
        return {"policy": "equal", "shares": {}, "reason": "no nodes"}
    known = {node: float(rate) for node, rate in rates.items() if _usable(rate)}
    unknown = [node for node in nodes if node not in known]
    equal = {node: 1.0 / len(nodes) for node in nodes}
    if not known:
        return {
            "policy": "equal",
            "shares": equal,
            "reason": f"no measured rate for any node ({_names(unknown)}): equal shares",
        }
    mean = sum(known.values()) / len(known)
    note = ""
    if unknown:
        verb = "has" if len(unknown) == 1 else "have"
        note = (
            f"; {_names(unknown)} {verb} no measured rate, "
            f"counted at the mean of the others ({mean:.4g}/s)"
        )
    fastest = max(known, key=lambda node: known[node])
    slowest = min(known, key=lambda node: known[node])
    spread = known[fastest] / known[slowest]
    if spread <= 1.0 + tolerance + 1e-12:
        return {
            "policy": "equal",
            "shares": equal,
            "reason": (
                f"rates within {tolerance:.0%} of each other (max/min {spread:.3f}): "
                f"equal shares{note}"
            ),
        }
    filled = {node: known.get(node, mean) for node in nodes}
    total = sum(filled.values())
    shares = {node: filled[node] / total for node in nodes}
    return {
        "policy": "proportional",
        "shares": shares,
        "reason": (
            f"rates differ by {spread:.2f}x (fastest {fastest} {known[fastest]:.4g}/s, "
            f"slowest {slowest} {known[slowest]:.4g}/s, more than {tolerance:.0%}): "
            f"shares proportional to rate{note}"
        ),
    }


def _usable(rate: object) -> TypeGuard[float]:
    return (
        isinstance(rate, (int, float))
        and not isinstance(rate, bool)
        and math.isfinite(rate)
        and rate > 0
    )


def _names(nodes: list[str]) -> str:
    return ", ".join(str(node) for node in nodes)


def _show(value: Any) -> str:
    return "unknown" if value is None or value == "" else str(value)
