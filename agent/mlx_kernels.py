"""MLX's compiled CPU kernels on this node: the ones cut short are removed before a rank starts.

MLX's CPU backend compiles each fused kernel with the system's C++ compiler straight into
``$TMPDIR/mlx/<version>/cpu/lib<name>.so`` (no temporary name) and loads whatever is there on the
next run. A rank killed while its compiler ran (a hang caught in the compile phase, a stop, a lost
node) can leave a file cut short there, and every later job on the node then fails to load it
("Could not load C++ shared library"). An ELF file's section header table is written last, at its
end: a file whose table does not end where the file does is removed, and MLX compiles it again.
Only ELF files are judged (a Mac's are Mach-O, and left alone). Stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import struct

HEADER = 64


def cut_short(path: str) -> bool:
    """Whether ``path`` is an ELF shared library cut short (empty counts too)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            head = handle.read(HEADER)
    except OSError:
        return False
    if size == 0:
        return True
    if head[:4] != b"\x7fELF":
        return False  # not ELF (a Mac's Mach-O): not judged here
    if len(head) < HEADER or head[4] != 2 or head[5] != 1:
        return len(head) < HEADER  # 64-bit little-endian only; shorter than its own header is cut
    (shoff,) = struct.unpack_from("<Q", head, 0x28)
    entsize, count = struct.unpack_from("<HH", head, 0x3A)
    return shoff == 0 or shoff + entsize * count != size


def remove_cut_kernels(tmpdir: str) -> list[str]:
    """The kernels under ``tmpdir`` cut short, removed; their paths."""
    removed = []
    root = os.path.join(tmpdir, "mlx")
    for base, _dirs, names in os.walk(root):
        for name in names:
            if name.startswith("lib") and name.endswith(".so"):
                path = os.path.join(base, name)
                if cut_short(path):
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                        removed.append(path)
    return removed
