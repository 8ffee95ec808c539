"""MLX's compiled CPU kernels, kept across the tests' clusters.

MLX's CPU backend compiles each fused kernel with the system's C++ compiler into
``$TMPDIR/mlx/<version>/cpu`` and keeps it there; coord gives every node one TMPDIR
(``<workdir>/.coord/tmp``), so a user's node compiles them once. Each test module's local cluster has
fresh workdirs, so without this every module's nodes compiled the same fifty-odd kernels again (a
minute of CPU per node on the suite's two cores). A node here starts with the kernels the tests'
earlier nodes compiled, as a user's node does after its first job; whatever it compiles that is new is
kept for the next. The multi-host cluster's nodes too (their workdirs are on this machine, their
users' own): they compiled 336 kernels in a run of the suite, 300 CPU-seconds of the multi-host
tests' worker, as tests emptied their workdirs and new trainers ran. The demo is left as a fresh
machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import tomllib
import uuid
from pathlib import Path

from agent.mlx_kernels import cut_short

CACHE = Path(tempfile.gettempdir()) / "coord-test-mlx-kernels"


def local_workdirs(config: Path) -> list[Path]:
    """The workdirs of a cluster file's nodes on this machine: those of the local transport, and the
    multi-host cluster's (each in its namespace, on this machine's disk)."""
    try:
        nodes = tomllib.loads(config.read_text()).get("nodes", [])
    except (OSError, tomllib.TOMLDecodeError):
        return []
    return [Path(node["workdir"]) for node in nodes
            if str(node.get("workdir", "")).startswith("/") and (node.get("host") == "local"
                                                                 or Path(node["workdir"]).is_dir())]


def seed(workdir: Path) -> None:
    """The kernels kept so far, linked into the node's TMPDIR (read only there: MLX never rewrites one).

    On a node of another user (the multi-host cluster's) every directory made here is that user's, as
    its agent would make it (0700), so that its ranks can add the kernels they compile."""
    coord_dir = workdir / ".coord"
    owner = next(path for path in (coord_dir, *coord_dir.parents) if path.exists()).stat()
    target = coord_dir / "tmp" / "mlx"
    for source in CACHE.rglob("lib*.so") if CACHE.is_dir() else ():
        destination = target / source.relative_to(CACHE)
        if destination.exists():
            continue
        if owner.st_uid != os.getuid() and not source.stat().st_mode & 0o004:
            source.chmod(0o755)  # kept from a node whose user's umask is 077: each node's user reads it
        _make_dirs(destination.parent, owner)
        try:
            os.link(source, destination)
        except FileExistsError:
            continue
        except OSError:  # another filesystem
            with contextlib.suppress(OSError):
                shutil.copy2(source, destination)


def _make_dirs(directory: Path, owner: os.stat_result) -> None:
    """``directory`` and the missing ones above it, made as ``owner``'s where this process is another."""
    made = []
    while not directory.exists():
        made.append(directory)
        directory = directory.parent
    for path in reversed(made):
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o755 if owner.st_uid == os.getuid() else 0o700)
            if owner.st_uid != os.getuid():
                os.chown(path, owner.st_uid, owner.st_gid)


def harvest(workdir: Path) -> None:
    """What the node compiled that is not kept yet, kept (whole files only: a rank killed while its
    compiler ran may leave one cut short)."""
    source_root = workdir / ".coord" / "tmp" / "mlx"
    for source in source_root.rglob("lib*.so") if source_root.is_dir() else ():
        destination = CACHE / source.relative_to(source_root)
        if destination.exists() or not whole_elf(source):
            continue
        destination.parent.mkdir(parents=True, exist_ok=True)
        partial = destination.with_name(f".partial-{os.getpid()}-{uuid.uuid4().hex}")  # the name may be 250 long
        try:
            shutil.copy2(source, partial)
            partial.chmod(0o755)  # every node's user reads it, whoever compiled it (umask 077 or not)
            os.replace(partial, destination)  # whole or absent, for the other test worker too
        except OSError:
            partial.unlink(missing_ok=True)


def whole_elf(path: Path) -> bool:
    """An ELF file the linker finished writing (agent.mlx_kernels judges the node's the same way)."""
    try:
        with open(path, "rb") as handle:
            elf = handle.read(4) == b"\x7fELF"
    except OSError:
        return False
    return elf and not cut_short(str(path))
