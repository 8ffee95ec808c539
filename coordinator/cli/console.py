"""The terminal the CLI draws on (rich is imported only when something is drawn)."""

from __future__ import annotations

import sys
from typing import Any


def make_console() -> Any:
    """A console as wide as the terminal, or wide enough for a whole table when piped."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)
