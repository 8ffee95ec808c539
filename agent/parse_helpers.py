"""Small readers of the values the topology parsers find in command output and JSON."""

from __future__ import annotations

import re
from typing import Any


def stripped_text(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    value = value.strip()
    return value or None


def json_list(value: Any) -> list[Any]:
    """A JSON list, or [] for anything else (null, a number or a string where a list belongs)."""
    return value if isinstance(value, list) else []


def leading_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        return None
    match = re.match(r"^\s*(\d+)", value)
    return int(match.group(1)) if match else None


def int_if_whole(value: float) -> int | float:
    return int(value) if value == int(value) else value
