"""Where coordd's control socket is: the one rule the daemon's config and the CLI share.

Every ``coord`` command resolves the socket before it asks the daemon anything, so this module
imports next to nothing: ``coord sync --config FILE`` reads the file's ``[cluster]`` table alone
and leaves the checking of the rest to the daemon that loaded it (``load_config`` runs only
when that table itself cannot be read, to say exactly what is wrong with it). That keeps the
config's dataclasses and validation, about a third of the CLI's start, off every call.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

# Unix socket paths are limited to 104 bytes on macOS (108 on Linux).
MAX_SOCKET_PATH = 103
SOCKET_NAME = "coord.sock"


def default_state_dir() -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "coord"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "coord"


def resolve_under(value: str, base: Path) -> Path:
    """A path from the cluster file: ``~`` expanded, relative ones taken from the file's directory."""
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else base / path


def socket_of(cluster: Mapping[str, str], base: Path) -> tuple[Path, Path]:
    """(state directory, control socket) of a checked ``[cluster]`` table."""
    state_dir = resolve_under(cluster["state_dir"], base) if "state_dir" in cluster else default_state_dir()
    socket = resolve_under(cluster["socket"], base) if "socket" in cluster else state_dir / SOCKET_NAME
    return state_dir, socket


def socket_from_file(path: str | os.PathLike[str]) -> Path | None:
    """The control socket a cluster file names, from its ``[cluster]`` table alone; None when the
    file or that table cannot be used (``load_config`` then says why, with the line)."""
    import tomllib

    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    cluster = raw.get("cluster")
    if not isinstance(cluster, dict) or any(not isinstance(cluster.get(key, "."), str) or not cluster.get(key, ".")
                                            or not cluster.get(key, ".").isprintable()
                                            for key in ("state_dir", "socket")):
        return None
    _, socket = socket_of(cluster, path.resolve().parent)
    if len(str(socket).encode()) > MAX_SOCKET_PATH:
        return None
    return socket
