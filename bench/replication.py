"""Benchmark: what replicating checkpoints off rank 0's machine costs, and whether gzip pays.

On a local two-rank cluster (the demo's transport: agents on this machine), a full
fine-tune of a llama large enough for its checkpoints to matter (default 4 layers, width
512: ~50 MB per checkpoint), saving every 5 steps:

1. step time with `--replica none` vs `--replica head`, interleaved and repeated, so the
   copy's effect on training is measured, not assumed;
2. the copy itself: seconds and MB/s from the daemon's `replicated` events;
3. gzip level 6 (what the training-plan format names) vs no compression on the real
   checkpoints those runs wrote: size saved, compression and decompression speed, and the
   time a copy would take each way at the measured copy rate.

    python bench/replication.py [--trainer mlx_lm|coord] [--layers 4] [--width 512] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coordinator.cli.tinymodel import write_data, write_model  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir  # noqa: E402

CLUSTER = """\
[cluster]
name = "bench-replication"
state_dir = "{root}/state"

[[nodes]]
name = "a"
host = "local"
workdir = "{root}/a"

[[nodes]]
name = "b"
host = "local"
workdir = "{root}/b"
"""
ITERS = 40


def run_job(daemon: DaemonProcess, root: Path, name: str, replica: str, trainer: str) -> dict:
    command = ["python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data",
               "--fine-tune-type", "full", "--batch-size", "2", "--iters", str(ITERS), "--learning-rate", "1e-5"]
    submitted = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(root / "project"),
                      "--save-every", "5", "--keep", "3", "--replica", replica, "--trainer", trainer, "--detach",
                      "--", *command, env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), name, env=daemon.env, timeout=1800)
    final = json.loads(waited.stdout)
    assert final["state"] == "succeeded", final
    progress = root / final["nodes"][0] / ".coord" / "jobs" / final["run_id"] / "attempt-0" / "rank-0" / "progress.jsonl"
    steps = [json.loads(line) for line in progress.read_text().splitlines() if '"train"' in line]
    # Step time over the steady part of the run (the first steps compile MLX's kernels).
    steady = steps[len(steps) // 4:]
    step_s = (steady[-1]["time"] - steady[0]["time"]) / (steady[-1]["step"] - steady[0]["step"])
    doc = json.loads(coord("status", "--json", "--events", "400", "--config", str(daemon.config),
                           env=daemon.env).stdout)
    copies = [e["data"] for e in doc["events"] if e["kind"] == "job.replicated" and e["message"].startswith(name + ":")]
    return {"step_s": step_s, "copies": copies}


def gzip_costs(path: Path) -> dict:
    data = path.read_bytes()
    started = time.perf_counter()
    packed = zlib.compress(data, 6)
    packed_s = time.perf_counter() - started
    started = time.perf_counter()
    zlib.decompress(packed)
    unpacked_s = time.perf_counter() - started
    return {"bytes": len(data), "gzip_bytes": len(packed), "compress_s": packed_s, "decompress_s": unpacked_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer", choices=["mlx_lm", "coord"], default="mlx_lm")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    root = short_tempdir("coord-bench-replica-")
    write_model(root / "project" / "model", layers=args.layers, width=args.width)
    write_data(root / "project" / "data", train=400)
    config = root / "cluster.toml"
    config.write_text(CLUSTER.format(root=root))
    daemon = DaemonProcess(config, env=environment()).start()
    results: dict[str, list[dict]] = {"none": [], "head": []}
    try:
        daemon.wait_for(all_up, 60, "all nodes up")
        run_job(daemon, root, "warmup", "none", args.trainer)  # MLX compiles its CPU kernels once
        for i in range(args.repeats):
            for replica in ("none", "head"):
                results[replica].append(run_job(daemon, root, f"{replica}{i}", replica, args.trainer))
                print(f"{replica}{i}: {results[replica][-1]['step_s'] * 1000:.1f} ms/step", file=sys.stderr)
    finally:
        daemon.stop()
    newest = sorted((root / "state" / "replicas").rglob("*_adapters.safetensors"))[-1]
    costs = gzip_costs(newest)
    without = statistics.median(r["step_s"] for r in results["none"])
    with_copies = statistics.median(r["step_s"] for r in results["head"])
    copies = [c for r in results["head"] for c in r["copies"]]
    rate = statistics.median(c["bytes"] / c["seconds"] for c in copies)
    size, packed = costs["bytes"], costs["gzip_bytes"]
    plain_s = size / rate
    gzip_s = costs["compress_s"] + packed / rate + costs["decompress_s"]
    print(f"\nllama {args.layers} layers × width {args.width}, full fine-tune, trainer {args.trainer}, "
          f"2 local ranks, save every 5 of {ITERS} steps, median of {args.repeats} runs each\n")
    print("| measure | value |")
    print("|---|---:|")
    print(f"| step time, --replica none (ms) | {without * 1000:.1f} |")
    print(f"| step time, --replica head (ms) | {with_copies * 1000:.1f} |")
    print(f"| ratio (with copies / without) | {with_copies / without:.3f}x |")
    print(f"| checkpoint size (MB) | {size / 1e6:.1f} |")
    print(f"| copy to the head, median (s) | {statistics.median(c['seconds'] for c in copies):.3f} "
          f"({rate / 1e6:.0f} MB/s, {len(copies)} copies) |")
    print(f"| gzip -6 size (MB) | {packed / 1e6:.1f} ({100 * (1 - packed / size):.1f}% saved) |")
    print(f"| gzip -6 compress / decompress (MB/s) | {size / costs['compress_s'] / 1e6:.0f} / "
          f"{size / costs['decompress_s'] / 1e6:.0f} |")
    print(f"| one copy at the measured rate: none vs gzip -6 (s) | {plain_s:.3f} vs {gzip_s:.3f} |")
    print(f"| gzip pays when the link is slower than (MB/s) | "
          f"{(size - packed) / max(costs['compress_s'] + costs['decompress_s'], 1e-9) / 1e6:.0f} |")


if __name__ == "__main__":
    main()
