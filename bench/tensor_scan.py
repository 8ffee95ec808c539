"""Benchmark: what reading a checkpoint's tensor values costs beside hashing it.

The agent hashes every new checkpoint (``shared.manifest.sha256_file``, ``hashlib.file_digest``); it now
reads the same bytes through ``agent.tensor_scan.scan_file``, which hashes them and tests every float
tensor for NaN and infinity in the same pass. Both are timed on the same files, alternately, in one
process, with the files in the page cache (a cold read from disk only adds the same I/O time to both):
real weights (``torch.randn``) written by safetensors (float32, bfloat16), torch.save (a bfloat16 model
and its float32 Adam state) and mlx (``mx.savez``, float32 and bfloat16). Each figure is the least of
``--repeats`` (other work on a shared machine only ever adds time); CPU seconds beside wall seconds.

    python bench/tensor_scan.py                 # about 256 MB a file, 5 repeats
    python bench/tensor_scan.py --mb 64 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.tensor_scan import scan_file  # noqa: E402
from shared.manifest import sha256_file  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="about this many MB per file")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", help="where the files are written (default: a temporary directory, removed after)")
    return parser.parse_args()


def write_files(root: Path, mb: int) -> dict[str, Path]:
    import mlx.core as mx
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    width = 1024
    rows = mb * (1 << 20) // (width * 4)  # float32 rows for the size asked
    files: dict[str, Path] = {}

    def layers(dtype: torch.dtype, count: int) -> dict[str, torch.Tensor]:
        per = max(1, rows * 4 // dtype.itemsize // count)
        return {f"layers.{i}.weight": (torch.randn(per, width) * 0.02).to(dtype) for i in range(count)}

    files["safetensors float32"] = root / "f32.safetensors"
    save_file(layers(torch.float32, 16), str(files["safetensors float32"]))
    files["safetensors bfloat16"] = root / "bf16.safetensors"
    save_file(layers(torch.bfloat16, 16), str(files["safetensors bfloat16"]))
    model = layers(torch.bfloat16, 8)  # a third of the bytes: Adam's two float32 moments are the rest
    model = {name: tensor[: tensor.shape[0] // 3] for name, tensor in model.items()}
    state = {i: {"step": torch.tensor(10.0), "exp_avg": tensor.float() * 0.1, "exp_avg_sq": tensor.float() ** 2}
             for i, tensor in enumerate(model.values())}
    files["torch.save bf16 model + f32 Adam"] = root / "state.pt"
    torch.save({"model": model, "optimizer": {"state": state, "param_groups": [{"lr": 1e-4}]}},
               files["torch.save bf16 model + f32 Adam"])
    arrays = {name: mx.array(tensor.float().numpy()) for name, tensor in layers(torch.float32, 8).items()}
    arrays.update({f"{name}.half": arrays[name][: arrays[name].shape[0] // 2].astype(mx.bfloat16)
                   for name in list(arrays)[:4]})
    files["mx.savez float32 + bfloat16"] = root / "optimizer.npz"
    mx.savez(str(files["mx.savez float32 + bfloat16"]), **arrays)
    return files


def timed(func: Callable[[str], object], path: str) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    func(path)
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(files: dict[str, Path], repeats: int) -> list[tuple[str, float, tuple[float, float], tuple[float, float],
                                                               int]]:
    rows = []
    for label, path in files.items():
        size = path.stat().st_size
        sha256_file(str(path), size)  # into the page cache
        scan = scan_file(str(path))
        assert scan.bad is None and scan.sha256 == sha256_file(str(path), size)
        hashes, scans = [], []
        for _ in range(repeats):  # alternately, so that a busy moment lands on both
            hashes.append(timed(functools.partial(sha256_file, size=size), str(path)))
            scans.append(timed(scan_file, str(path)))
        best_hash = (min(t[0] for t in hashes), min(t[1] for t in hashes))
        best_scan = (min(t[0] for t in scans), min(t[1] for t in scans))
        rows.append((label, size / 1e6, best_hash, best_scan, scan.values_read))
    return rows


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        files = write_files(Path(work), args.mb)
        rows = measure(files, args.repeats)
    print(f"{platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"best of {args.repeats}, files in the page cache\n")
    print("| file | MB | tensors read | hash only MB/s | hash + values MB/s | wall ratio | CPU ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, mb, (hash_wall, hash_cpu), (scan_wall, scan_cpu), tensors in rows:
        print(f"| {label} | {mb:.0f} | {tensors} | {mb / hash_wall:.0f} | {mb / scan_wall:.0f} | "
              f"{scan_wall / hash_wall:.2f}x | {scan_cpu / hash_cpu:.2f}x |")


if __name__ == "__main__":
    main()
