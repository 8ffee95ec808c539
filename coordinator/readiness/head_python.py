"""What the head's own Python needs (mlx, mlx-lm), whether it has them, and the command that adds them.

coordd starts every job with mlx.launch from its own Python, and `coord demo` trains with it.
A head installed without mlx (an install from before mlx was a dependency, or a venv made by
hand) would fail only when a job starts, with an import error; pre-flight and the demo ask
these first and print the command that fixes it, for exactly this Python.
"""

from __future__ import annotations

import importlib
import importlib.util
import shlex
import sys
from collections.abc import Sequence


def mlx_requirements(platform: str = sys.platform) -> list[str]:
    """mlx and mlx-lm as pip names them here: on Linux MLX's library is the mlx-cpu wheel."""
    return ["mlx" if platform == "darwin" else "mlx[cpu]", "mlx-lm"]


def install_command(python: str, packages: Sequence[str], *, has_pip: bool) -> str:
    """The shell command that installs packages into the environment of `python`."""
    names = " ".join(shlex.quote(p) for p in packages)
    if has_pip:
        return f"{shlex.quote(python)} -m pip install {names}"
    # uv's environments (`uv tool install coord` among them) have no pip of their own.
    return f"uv pip install --python {shlex.quote(python)} {names}"


def has_pip() -> bool:
    """Whether this Python can run `python -m pip` (venvs made by uv cannot)."""
    return _can_find("pip")


def install_mlx_command() -> str:
    """The command that gives this very Python mlx and mlx-lm."""
    return install_command(sys.executable, mlx_requirements(), has_pip=has_pip())


def missing_training_modules() -> list[str]:
    """Which of mlx (with its compiled core) and mlx_lm this Python cannot load.

    mlx.core is imported, not only looked up: on Linux a bare `pip install mlx` has the
    package but not the library under it. mlx_lm is only looked up: importing it loads
    transformers, seconds of work the caller does anyway if it is there.
    """
    missing = []
    try:
        importlib.import_module("mlx.core")
    except ImportError:
        missing.append("mlx")
    if not _can_find("mlx_lm"):
        missing.append("mlx_lm")
    return missing


def _can_find(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
