"""Every launcher coord knows, by the name a job gives (``coord run --launcher NAME``).

A launcher is registered here by its name and where it lives; its module is imported the first
time a job asks for it, so that checking a job's spec (which only needs the names) does not load
every launcher and what it uses (asyncssh, structlog: a third of a second of `coord run`'s start)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.launch.launcher import Launcher

DEFAULT_LAUNCHER = "mlx"
#: name -> (its module, its class)
REGISTERED: dict[str, tuple[str, str]] = {
    "mlx": ("coordinator.launch.mlx", "MlxLauncher"),
    "torchrun": ("coordinator.launch.torch_launchers", "TorchrunLauncher"),
    "accelerate": ("coordinator.launch.torch_launchers", "AccelerateLauncher"),
    "deepspeed": ("coordinator.launch.torch_launchers", "DeepSpeedLauncher"),
}
LAUNCHERS = tuple(REGISTERED)
_made: dict[str, Launcher] = {}


def launcher_named(name: str) -> Launcher:
    """The launcher a job names (one instance each); KeyError names the ones there are."""
    if name not in REGISTERED:
        raise KeyError(f"unknown launcher {name!r} (one of {', '.join(sorted(REGISTERED))})")
    if name not in _made:
        module, cls = REGISTERED[name]
        _made[name] = getattr(importlib.import_module(module), cls)()
    return _made[name]
