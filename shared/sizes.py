"""Byte counts for people, as the agent's and the daemon's messages both write them."""

from __future__ import annotations

import re

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


_RATE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
               "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3,
               "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8}


_RATE = re.compile(r"^((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[+-]?[0-9]+)?) ?([a-z]*)(?:/s)?$")


def parse_rate(text: str) -> float:
    """A rate as people write it, in bytes per second: ``50MB/s``, ``40MiB/s``, ``400Mbit/s``,
    ``1Gbps``, or a plain number of bytes per second. ValueError, saying what it takes, otherwise."""
    found = _RATE.match(text.strip().lower()) if text.isascii() else None
    if found is None or found.group(2) not in _RATE_UNITS:
        raise ValueError(f"{text!r} is not a rate: give e.g. 50MB/s, 40MiB/s, 400Mbit/s or 1Gbps")
    value = float(found.group(1)) * _RATE_UNITS[found.group(2)]
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{text!r}: a rate must be a positive, finite number")
    return value


def rate_text(bytes_per_s: float) -> str:
    """Bytes per second for people: MB/s, with the Mbit/s a link is sold by beside it."""
    return f"{bytes_per_s / 1e6:.1f} MB/s ({bytes_per_s * 8 / 1e6:.0f} Mbit/s)"
