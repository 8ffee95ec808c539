"""Benchmark: how long a checkpoint save holds training, coord's trainer vs a synchronous save.

A llama made like the demo's tiny model but wide (default: width 1024, 4 layers, full
fine-tune with Adam: about 42M trainable parameters, so a checkpoint with the optimizer
state is about 500 MB):

1. per save, the seconds the training thread is held: coord's trainer copies the arrays
   to host memory and writes the file (fsynced, renamed) on a background thread, vs
   ``mx.save_safetensors`` of the same arrays on the training thread, as mlx-lm saves
   (it returns once the bytes are in the page cache), and vs the same followed by an
   fsync, the least a synchronous save that survives a crash must do; and how long
   coord's background write takes;
2. the mean step time of coord's trainer with a checkpoint every few steps vs with none,
   in alternating blocks of steps in one process.

    python bench/checkpoint_save.py                       # the defaults below
    python bench/checkpoint_save.py --layers 2 --repeats 3 --blocks 2 --block-steps 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coordinator.cli.tinymodel import write_data, write_model  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5, help="saves timed each way")
    parser.add_argument("--blocks", type=int, default=4, help="blocks of steps, alternately without and with saves")
    parser.add_argument("--block-steps", type=int, default=4, help="training steps per block")
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--dir", help="work directory (default: a temporary one, removed after)")
    return parser.parse_args()


def save_blocking(root: Path, repeats: int) -> dict:
    """Per save: training-thread seconds of coord's save and of synchronous saves; coord's write seconds."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load

    from agent.trainer.checkpoint import BackgroundWriter, optimizer_arrays, trainable_arrays
    from agent.trainer.main import build_optimizer, parse_args as trainer_args, prepare_model

    args = trainer_args(["--model", str(root / "model"), "--train", "--fine-tune-type", "full", "--num-layers", "-1"])
    model, _ = load(args.model)
    prepare_model(model, args)
    optimizer = build_optimizer(args)
    # One update, so the arrays are computed in memory as in training (not views of the loaded file).
    optimizer.update(model, tree_map(mx.ones_like, model.trainable_parameters()))
    arrays = {**trainable_arrays(model), **optimizer_arrays(optimizer)}
    mx.eval(arrays)
    progress = root / "blocking.jsonl"
    held: dict[str, list[float]] = {"coord": [], "sync": [], "durable": []}
    # Round 0 is a warm-up (first touch of the host-copy memory, as in a run's first save) and is not counted.
    for i in range(repeats + 1):
        writer = BackgroundWriter(str(progress), rank=0)
        path = root / f"coord-{i}.safetensors"
        seconds = writer.save(str(path), i, arrays, {})
        writer.close()  # saves are steps apart: the previous write is done when the next save begins
        path.unlink()
        times = [seconds]
        for durable in (False, True):
            path = root / f"sync-{i}.safetensors"
            started = time.perf_counter()
            mx.save_safetensors(str(path), arrays)
            if durable:
                fsync_file(path)
            times.append(time.perf_counter() - started)
            if not durable:
                fsync_file(path)  # untimed: no dirty pages left behind to slow the next measurement
            path.unlink()
        if i > 0:
            for key, value in zip(("coord", "sync", "durable"), times):
                held[key].append(value)
    records = [json.loads(line) for line in progress.read_text().splitlines()]
    return {**held, "write": [r["write_seconds"] for r in records[1:]],
            "bytes": records[0]["bytes"], "parameters": sum(a.size for a in trainable_arrays(model).values())}


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_times(root: Path, blocks: int, block_steps: int, save_every: int) -> dict:
    """Seconds per training step of coord's trainer, in alternating blocks without and with checkpoints.

    Alternating blocks in one process keep a shared machine's changing load from
    landing on one side of the comparison only. A step with a save includes the
    save's hold on the training thread; the background write overlaps the next steps.
    """
    from agent.trainer.main import parse_args as trainer_args, prepare

    os.environ["COORD_PROGRESS_FILE"] = str(root / "steps.jsonl")
    args = trainer_args(["--model", str(root / "model"), "--train", "--data", str(root / "data"),
                         "--fine-tune-type", "full", "--num-layers", "-1", "--batch-size", "2",
                         "--adapter-path", str(root / "adapters")])
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # the trainer's own report lines
        job = prepare(args)
        seconds = _alternate(job.trainer, blocks, block_steps, save_every)
        job.writer.close()
    records = [json.loads(line) for line in (root / "steps.jsonl").read_text().splitlines()]
    return {"without": statistics.mean(seconds[False]), "with": statistics.mean(seconds[True]),
            "held": [r["blocking_seconds"] for r in records if r["kind"] == "checkpoint"]}


def _alternate(trainer, blocks: int, block_steps: int, save_every: int) -> dict[bool, list[float]]:
    """Step seconds by whether the step's block saves checkpoints."""
    trainer.train_step(1)  # compiles the step
    seconds: dict[bool, list[float]] = {False: [], True: []}
    step = 1
    for block in range(blocks):
        saving = block % 2 == 1
        for _ in range(block_steps):
            step += 1
            started = time.perf_counter()
            trainer.train_step(step)
            if saving and step % save_every == 0:
                trainer.save(step)
            seconds[saving].append(time.perf_counter() - started)
    return seconds


def main() -> None:
    options = parse_args()
    root = Path(options.dir or tempfile.mkdtemp(prefix="coord-bench-ckpt-"))
    root.mkdir(parents=True, exist_ok=True)
    write_model(root / "model", layers=options.layers, width=options.width)
    write_data(root / "data", train=64, valid=8)

    blocking = save_blocking(root, options.repeats)
    steps = step_times(root, options.blocks, options.block_steps, options.save_every)
    report(options, blocking, steps)
    if not options.dir:
        shutil.rmtree(root, ignore_errors=True)


def report(options, blocking: dict, steps: dict) -> None:
    import mlx.core as mx

    coord, sync, durable, write = (statistics.median(blocking[k]) for k in ("coord", "sync", "durable", "write"))
    print(f"llama width {options.width}, {options.layers} layers, full fine-tune, Adam: "
          f"{blocking['parameters'] / 1e6:.1f}M trainable parameters, checkpoint {blocking['bytes'] / 1e6:.0f} MB "
          f"(weights + optimizer state); {platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__}; "
          f"medians of {options.repeats} saves\n")
    print("| per save | coord (async) | mx.save_safetensors (sync) | mx.save_safetensors + fsync (sync) |")
    print("|---|---:|---:|---:|")
    print(f"| training thread held (s) | {coord:.3f} | {sync:.3f} | {durable:.3f} |")
    print(f"| vs coord | 1.0x | {sync / coord:.1f}x | {durable / coord:.1f}x |")
    print(f"| training thread held, saves while training below (s) | {statistics.median(steps['held']):.3f} | | |")
    print(f"| file written in the background, fsynced (s) | {write:.3f} | | |\n")
    base = steps["without"]
    print(f"| training step, {options.blocks // 2} blocks of {options.block_steps} steps each way | "
          "mean step (s) | vs no checkpoints |")
    print("|---|---:|---:|")
    print(f"| no checkpoints | {base:.3f} | 1.00x |")
    print(f"| coord, checkpoint every {options.save_every} steps | {steps['with']:.3f} | {steps['with'] / base:.2f}x |")
    for name, seconds in (("mx.save_safetensors", sync), ("mx.save_safetensors + fsync", durable)):
        step = base + seconds / options.save_every
        print(f"| {name} every {options.save_every} steps (estimate: no checkpoints + held / {options.save_every}) "
              f"| {step:.3f} | {step / base:.2f}x |")
    print("\nreproduce: " + shlex.join(["python", "bench/checkpoint_save.py", "--layers", str(options.layers),
                                        "--width", str(options.width), "--repeats", str(options.repeats),
                                        "--blocks", str(options.blocks), "--block-steps", str(options.block_steps),
                                        "--save-every", str(options.save_every)]))


if __name__ == "__main__":
    main()
