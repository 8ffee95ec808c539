"""A compiled MLX kernel cut short in a node's TMPDIR (its rank killed while the compiler wrote it) is
removed before the next rank starts, and whole ones are kept."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from agent import mlx_kernels
from agent.launch import prepare_rank

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF files: Linux")


def _elf() -> Path:
    # Any ELF file the linker wrote whole: the interpreter running the tests.
    return Path(sys.executable).resolve()


def test_a_kernel_cut_short_is_removed_before_the_rank_starts_and_whole_ones_stay(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cpu = tmp_path / ".coord" / "tmp" / "mlx" / "0.32.4" / "cpu"
    cpu.mkdir(parents=True)
    whole = cpu / "libWhole_f4.so"
    shutil.copy(_elf(), whole)
    data = whole.read_bytes()
    (cpu / "libCut_f4.so").write_bytes(data[: len(data) // 2])
    (cpu / "libEmpty_f4.so").write_bytes(b"")
    (cpu / "Cut_f4.cpp").write_text("void Cut_f4() {}\n")  # the source is MLX's to rewrite: left
    assert not mlx_kernels.cut_short(str(whole))
    prepare_rank("k-0a1b2c3d", 0, str(tmp_path), sys.executable, ["python", "train.py"], {}, attempt=0)
    assert sorted(p.name for p in cpu.iterdir()) == ["Cut_f4.cpp", "libWhole_f4.so"]


def test_files_that_are_not_elf_are_not_judged(tmp_path):
    other = tmp_path / "libMachO.so"
    other.write_bytes(b"\xcf\xfa\xed\xfe" + b"\0" * 100)  # a Mac's Mach-O
    assert not mlx_kernels.cut_short(str(other))
