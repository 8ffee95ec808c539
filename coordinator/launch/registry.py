"""Every launcher coord knows, by the name a job gives (``coord run --launcher NAME``)."""

from __future__ import annotations

from coordinator.launch.launcher import Launcher
from coordinator.launch.mlx import MlxLauncher
from coordinator.launch.torch_launchers import AccelerateLauncher, DeepSpeedLauncher, TorchrunLauncher

DEFAULT_LAUNCHER = "mlx"
LAUNCHERS: dict[str, Launcher] = {launcher.name: launcher for launcher in (
    MlxLauncher(), TorchrunLauncher(), AccelerateLauncher(), DeepSpeedLauncher())}


def launcher_named(name: str) -> Launcher:
    """The launcher a job names; KeyError names the ones there are."""
    try:
        return LAUNCHERS[name]
    except KeyError:
        raise KeyError(f"unknown launcher {name!r} (one of {', '.join(sorted(LAUNCHERS))})") from None
