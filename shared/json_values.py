"""Numbers that JSON cannot hold, made into words it can: NaN and infinities as ``"nan"``, ``"inf"``, ``"-inf"``.

A diverged run's loss is NaN, and coord shows it as what it is (docs/recovery.md). Python's ``json``
writes it as the bare token ``NaN``, which is not JSON: a browser's ``JSON.parse``, jq and most
readers refuse the whole document. So every document coord prints (``--json``) or serves (the
dashboard's API) goes through ``strict`` first, and is written with ``allow_nan=False`` so that a
value missed here is an error, not a document nobody can read.
"""

from __future__ import annotations

import math
from typing import Any


def number_word(value: float) -> str:
    """``nan``, ``inf`` or ``-inf`` for a value that is not finite."""
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def value_text(value: float) -> str:
    """A value as coord shows it in words: four significant digits, or ``nan``, ``inf``, ``-inf``."""
    return f"{value:.4g}" if math.isfinite(value) else number_word(value)


def strict(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by its word, at any depth (dicts, lists
    and tuples are copied; anything else is returned as it is)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else number_word(value)
    if isinstance(value, dict):
        return {key: strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(item) for item in value]
    return value
