"""The launcher's own CPU, and what it takes from training: stock mlx.launch vs coord's launcher.

Both start the same two local ring ranks (``-n 2``), each doing matmuls and an all_sum per
step; stdin is /dev/null, as under a daemon. Per run: the launcher process's own CPU seconds
(read from /proc while it runs), and the ranks' steps/s from rank 0's own clock. Runs
alternate between the two launchers.

    python bench/launcher_cpu.py [--steps 400] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

RANK = """
import sys, time
import mlx.core as mx
g = mx.distributed.init()
x = mx.random.normal((256, 256))
steps = int(sys.argv[1])
for step in range(steps):
    if step == 10:
        start = time.perf_counter()
    y = mx.distributed.all_sum(x @ x) / 1000
    mx.eval(y)
if g.rank() == 0:
    print(f"STEPS_PER_S {(steps - 10) / (time.perf_counter() - start):.3f}", flush=True)
"""


def cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def one_run(launcher: list[str], steps: int) -> dict:
    started = time.perf_counter()
    proc = subprocess.Popen([*launcher, "--backend", "ring", "-n", "2", "--", sys.executable, "-c", RANK, str(steps)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cpu = 0.0
    while proc.poll() is None:
        cpu = cpu_seconds(proc.pid) or cpu
        time.sleep(0.05)
    out = proc.stdout.read()
    wall = time.perf_counter() - started
    rate = next((float(line.split()[-1]) for line in out.splitlines() if "STEPS_PER_S" in line), None)
    if rate is None:
        raise SystemExit(f"no result from {launcher[0]}:\n{out}")
    return {"cpu": cpu, "wall": wall, "rate": rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    stock = shutil.which("mlx.launch")
    if stock is None:
        raise SystemExit("mlx.launch is not on PATH: pip install 'mlx[cpu]' (Linux) or mlx (macOS)")
    launchers = {"mlx.launch": [stock], "coord's launcher": [sys.executable, "-m", "coordinator.launch.mlx_launch"]}
    results: dict[str, list[dict]] = {name: [] for name in launchers}
    for _ in range(args.repeats):
        for name, argv in launchers.items():
            results[name].append(one_run(argv, args.steps))
    print(f"{args.repeats} runs each, 2 local ring ranks, {args.steps} steps, {os.cpu_count()} cores; medians\n")
    print("| launcher | launcher CPU (s) | job wall (s) | ranks' steps/s |")
    print("|---|---:|---:|---:|")
    median = {name: {k: statistics.median(r[k] for r in runs) for k in ("cpu", "wall", "rate")}
              for name, runs in results.items()}
    for name, m in median.items():
        print(f"| {name} | {m['cpu']:.2f} | {m['wall']:.2f} | {m['rate']:.1f} |")
    ours, theirs = median["coord's launcher"], median["mlx.launch"]
    print(f"\ncoord's launcher / mlx.launch: CPU {ours['cpu'] / theirs['cpu']:.2f}x, "
          f"steps/s {ours['rate'] / theirs['rate']:.2f}x")


if __name__ == "__main__":
    main()
