"""Byte counts for people, as the agent's and the daemon's messages both write them."""

from __future__ import annotations

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def size_text(n: int) -> str:
    """``n`` bytes in the largest unit it holds at least one of, with the exact count beside it."""
    if abs(n) < 1024:
        return f"{n} B"
    value = n / 1024
    unit = _UNITS[0]
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            break
        value /= 1024
    return f"{value:.1f} {unit} ({n} bytes)"
