"""``--json``: a document printed as strict JSON, a NaN loss as ``"nan"`` (shared/json_values.py)."""

from __future__ import annotations

import json
import sys
from typing import Any

from shared.json_values import strict


def print_json(document: Any, *, sort_keys: bool = True) -> None:
    """``document`` on stdout, indented, ended with a newline; a value JSON cannot hold (NaN, an
    infinity) as its word, so that jq, a browser or any strict reader takes the whole document."""
    json.dump(strict(document), sys.stdout, indent=2, sort_keys=sort_keys, allow_nan=False)
    sys.stdout.write("\n")
