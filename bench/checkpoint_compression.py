"""Benchmark: whether zstd compression of a checkpoint pays before it is uploaded to an object store.

Real checkpoints of one small llama (default: width 384, 4 layers, 2048-token vocabulary, untied
embeddings, about 9M parameters), trained ``--steps`` steps with Adam (lr 3e-4) on random tokens so
the weights and moments are not initialisation. Adam moves every weight by about the learning rate a
step however few tokens a step has, so steps are kept small (``--batch`` 3 x ``--sequence`` 32: MLX's
CPU matmul is slow); the tokens are a stream of random permutations of the vocabulary, so every
embedding row has a gradient and no Adam moment is left at zero (a token never seen leaves its rows of
m and v at exactly zero, which compresses: in a short fine-tune of a large vocabulary that is real, but
it is not what this measures). Each file is written by the tool that writes it in a job:

- MLX (``mlx_lm.models.llama``): ``mx.save_safetensors`` of the weights in float32 and in bfloat16,
  and of the optimizer's state (``tree_flatten(optimizer.state)``: Adam's float32 m and v);
- PyTorch (``transformers``' LlamaForCausalLM, the same shapes): ``torch.distributed.checkpoint.save``
  of ``{"model": ..., "optim": ...}`` in one process (``no_dist=True``, no process group), float32;
- DeepSpeed: ``engine.save_checkpoint`` of the same torch model under ZeRO stage 1 with bf16, one
  process (gloo, world size 1), in a child process: ``mp_rank_00_model_states.pt`` (bf16 module) and
  ``bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt`` (fp32 master weights, exp_avg, exp_avg_sq). Where
  DeepSpeed is not installed (or with ``--emulate-deepspeed``) the two files are an EMULATION of that
  layout: ``torch.save`` of the bf16 module state dict, and of flat fp32 master weights with Adam's
  exp_avg/exp_avg_sq, from the PyTorch model above; the output's first line says which was measured.

Each file is read into memory once (an upload reads it from the page cache) and compressed with
``zstandard`` at each ``--levels`` (negative levels are zstd's fast modes): the ratio r (compressed /
original bytes), compression speed C on one thread and on all cores (``threads=-1``), and
decompression speed (always one thread), each speed the best of ``--repeats`` (other work on a shared
machine only ever adds time).

The rule. Compressing while uploading (a pipeline: compress a chunk, send it, compress the next)
takes max(S/C, r*S/U) for S bytes over an uplink of U bytes/s, against S/U without. It is faster iff
r < 1 and C > U; the time saved is 1 - max(U/C, r) of the upload, which reaches its best, 1 - r (also
the bytes stored and billed), once U <= r*C. The compressor then keeps U/C of a core busy, taken
from training. Proposed: compress only when r <= ``--max-ratio`` (0.9: at least 10% saved) and
U <= ``--cpu-share`` * C (0.5: half a core at most, below r*C for every r >= 0.5, so the full saving is
had). Restoring is the mirror: decompression (one thread) must outrun the download link.

    python bench/checkpoint_compression.py                  # the defaults above: about 80 s on 2 cores
    python bench/checkpoint_compression.py --levels=-1,1,3 --repeats 1 --steps 10
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MB = 1e6
#: Uplinks the per-kind choice is shown for: (label, bytes per second).
UPLINKS = (("100 Mbit/s", 100e6 / 8), ("1 Gbit/s", 1e9 / 8), ("10 Gbit/s", 10e9 / 8))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=24, help="Adam steps before the checkpoints are written")
    parser.add_argument("--batch", type=int, default=3, help="sequences per step")
    parser.add_argument("--sequence", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--levels", default="-1,1,3,9",
                        help="zstd levels, comma-separated; negative: fast modes (write --levels=-1,3)")
    parser.add_argument("--repeats", type=int, default=2, help="timings per measurement; the best is kept")
    parser.add_argument("--max-ratio", type=float, default=0.9, help="the rule: compress only at r at most this")
    parser.add_argument("--cpu-share", type=float, default=0.5,
                        help="the rule: compress only when the uplink needs at most this share of a core")
    parser.add_argument("--emulate-deepspeed", action="store_true",
                        help="emulate DeepSpeed's files even where DeepSpeed is installed")
    parser.add_argument("--dir", help="work directory (default: a temporary one, removed after)")
    parser.add_argument("--deepspeed-worker", metavar="DIR", help=argparse.SUPPRESS)  # the child process
    options = parser.parse_args(argv)
    options.level_list = [int(level) for level in options.levels.split(",")]
    return options


def llama_config(options: argparse.Namespace) -> dict[str, Any]:
    return {"model_type": "llama", "hidden_size": options.width, "num_hidden_layers": options.layers,
            "intermediate_size": options.width * 8 // 3 // 64 * 64 or 64, "num_attention_heads": 4,
            "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "vocab_size": options.vocab,
            "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": False}


LEARNING_RATE = 3e-4
#: What each file holds, by its row's name.
CONTENTS = {
    "MLX weights fp32": "mx.save_safetensors of the float32 weights",
    "MLX weights bf16": "mx.save_safetensors of the same weights cast to bfloat16",
    "MLX Adam state fp32": "mx.save_safetensors of tree_flatten(optimizer.state): float32 m and v, step, rate",
    "DCP model + Adam fp32": "torch.distributed.checkpoint.save's data file: float32 weights, exp_avg, exp_avg_sq",
    "DeepSpeed model states bf16": "the bf16 module's state dict (ZeRO-1, bf16)",
    "DeepSpeed optim states fp32": "ZeRO's fp32 master weights and Adam's exp_avg and exp_avg_sq",
}


# --- the checkpoints -------------------------------------------------------------------------------------------

def write_mlx(root: Path, options: argparse.Namespace) -> tuple[dict[str, Path], int, float]:
    """The three MLX files, the model's parameter count, and the share of Adam's m and v exactly zero."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import llama

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(llama_config(options)))
    optimizer = optim.Adam(learning_rate=LEARNING_RATE)

    def loss_fn(model: Any, tokens: Any) -> Any:
        logits = model(tokens[:, :-1])
        return nn.losses.cross_entropy(logits, tokens[:, 1:]).mean()

    step = nn.value_and_grad(model, loss_fn)
    for batch in token_batches(options):
        tokens = mx.array(batch)
        _, grads = step(model, tokens)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state)
    weights = dict(tree_flatten(model.parameters()))
    files = {"MLX weights fp32": root / "mlx" / "model.safetensors",
             "MLX weights bf16": root / "mlx" / "model-bf16.safetensors",
             "MLX Adam state fp32": root / "mlx" / "optimizer.safetensors"}
    files[next(iter(files))].parent.mkdir(parents=True)
    paths = list(files.values())
    mx.save_safetensors(str(paths[0]), weights)
    mx.save_safetensors(str(paths[1]), tree_map(lambda a: a.astype(mx.bfloat16), weights))
    state: dict[str, Any] = dict(tree_flatten(optimizer.state))
    mx.save_safetensors(str(paths[2]), state)
    moments = [a for name, a in state.items() if name.endswith((".m", ".v"))]
    zeros = sum((a == 0).sum().item() for a in moments) / sum(a.size for a in moments)
    return files, sum(a.size for a in weights.values()), zeros


def token_batches(options: argparse.Namespace) -> Any:
    """``--steps`` batches of ``--sequence`` + 1 tokens: the first ``--sequence`` of each row (the inputs) cut
    from a stream of random permutations of the vocabulary, the last (a target only) drawn at random."""
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (options.steps, options.batch, options.sequence)
    needed = shape[0] * shape[1] * shape[2]
    stream = np.concatenate([rng.permutation(options.vocab) for _ in range(-(-needed // options.vocab))])
    last = rng.integers(0, options.vocab, (*shape[:2], 1))
    return np.concatenate([stream[:needed].reshape(shape), last], axis=2).astype(np.int32)


def torch_model(options: argparse.Namespace, dtype: Any = None) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = {k: v for k, v in llama_config(options).items() if k != "model_type"}
    model = LlamaForCausalLM(LlamaConfig(**config))
    return model.to(dtype) if dtype is not None else model


def train_torch(model: Any, step: Any, options: argparse.Namespace) -> None:
    """``options.steps`` steps on random tokens; ``step(loss)`` does the backward pass and the update."""
    import torch

    for batch in token_batches(options):
        tokens = torch.from_numpy(batch).long()
        step(model(input_ids=tokens, labels=tokens).loss)  # the model shifts the labels itself


def write_dcp(root: Path, options: argparse.Namespace) -> tuple[dict[str, Path], Any, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    model = torch_model(options)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)

    def step(loss: Any) -> None:
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    train_torch(model, step, options)
    directory = root / "dcp"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=str(directory),
                 no_dist=True)
    data = sorted(directory.glob("*.distcp"))
    if len(data) != 1:
        raise RuntimeError(f"expected one DCP data file, found {[p.name for p in data]}")
    return {"DCP model + Adam fp32": data[0]}, model, optimizer


def write_deepspeed(root: Path, options: argparse.Namespace) -> dict[str, Path]:
    """DeepSpeed's own files, written by a child process (DeepSpeed's log lines stay out of the table)."""
    directory = root / "deepspeed"
    argv = [sys.executable, str(Path(__file__).resolve()), "--deepspeed-worker", str(directory),
            "--width", str(options.width), "--layers", str(options.layers), "--vocab", str(options.vocab),
            "--steps", str(options.steps), "--batch", str(options.batch), "--sequence", str(options.sequence)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the DeepSpeed child failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    (tag,) = [p for p in directory.iterdir() if p.is_dir()]
    return {"DeepSpeed model states bf16": tag / "mp_rank_00_model_states.pt",
            "DeepSpeed optim states fp32": tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"}


def deepspeed_worker(options: argparse.Namespace) -> None:
    with socket.socket() as probe:  # a free port for the world-size-1 rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed  # type: ignore[import-untyped]
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    model = torch_model(options)
    config = {"train_batch_size": options.batch, "train_micro_batch_size_per_gpu": options.batch,
              "gradient_accumulation_steps": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(),
                                                                                  lr=LEARNING_RATE), config=config)

    def step(loss: Any) -> None:
        engine.backward(loss)
        engine.step()

    train_torch(engine, step, options)
    engine.save_checkpoint(options.deepspeed_worker, tag=f"global_step{options.steps}")
    torch.distributed.destroy_process_group()


def emulate_deepspeed(root: Path, model: Any, optimizer: Any) -> dict[str, Path]:
    """torch.save of what DeepSpeed's two files hold, from a trained float32 model and its Adam state."""
    import torch

    directory = root / "deepspeed-emulated" / "global_step"
    directory.mkdir(parents=True)
    params = [p for p in model.parameters() if p.requires_grad]
    state = optimizer.state_dict()["state"]
    flat = {name: torch.cat([state[i][name].flatten() for i in range(len(params))])
            for name in ("exp_avg", "exp_avg_sq")}
    master = torch.cat([p.detach().flatten() for p in params])
    model_file = directory / "mp_rank_00_model_states.pt"
    optim_file = directory / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"module": {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, "global_steps": 0,
                "dp_world_size": 1, "mp_world_size": 1}, model_file)
    base = {"state": {0: {"step": state[0]["step"], **flat}}, "param_groups": optimizer.state_dict()["param_groups"]}
    torch.save({"optimizer_state_dict": {"zero_stage": 1, "loss_scaler": None, "partition_count": [1],
                                         "base_optimizer_state": base, "single_partition_of_fp32_groups": [master]},
                "ds_config": {}, "ds_version": "emulated"}, optim_file)
    return {"DeepSpeed model states bf16 (emulated)": model_file, "DeepSpeed optim states fp32 (emulated)": optim_file}


# --- the measurements ------------------------------------------------------------------------------------------

@dataclass
class Measure:
    kind: str
    size: int
    level: int
    ratio: float
    compress: float  # bytes/s, one thread
    compress_all: float  # bytes/s, threads=-1
    decompress: float  # bytes/s


def best_seconds(function: Any, repeats: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - started)
    return best, result


def measure(kind: str, path: Path, levels: list[int], repeats: int) -> list[Measure]:
    import zstandard

    data = path.read_bytes()
    rows = []
    for level in levels:
        single = zstandard.ZstdCompressor(level=level)
        every = zstandard.ZstdCompressor(level=level, threads=-1)
        compress_s, packed = best_seconds(lambda c=single: c.compress(data), repeats)
        compress_all_s, _ = best_seconds(lambda c=every: c.compress(data), repeats)
        decompressor = zstandard.ZstdDecompressor()
        decompress_s, unpacked = best_seconds(lambda d=decompressor, p=packed: d.decompress(p), repeats)
        if unpacked != data:
            raise AssertionError(f"{path}: zstd level {level} did not round-trip")
        rows.append(Measure(kind, len(data), level, len(packed) / len(data), len(data) / compress_s,
                            len(data) / compress_all_s, len(data) / decompress_s))
    return rows


# --- the rule --------------------------------------------------------------------------------------------------

def recommended_uplink(row: Measure, options: argparse.Namespace) -> float:
    """Bytes/s of uplink below which the rule compresses (0: never)."""
    return options.cpu_share * row.compress if row.ratio <= options.max_ratio else 0.0


def upload_seconds(row: Measure, uplink: float) -> float:
    """Seconds per byte of a pipelined compressed upload: max(1/C, r/U)."""
    return max(1 / row.compress, row.ratio / uplink)


def choice(rows: list[Measure], uplink: float, options: argparse.Namespace) -> str:
    """The level the rule picks at this uplink, or none: of the levels it allows, the cheapest (fastest to
    compress) whose upload is within 2% of the fastest upload."""
    allowed = [row for row in rows if uplink <= recommended_uplink(row, options)]
    if not allowed:
        return "none"
    fastest = min(upload_seconds(row, uplink) for row in allowed)
    pick = max((row for row in allowed if upload_seconds(row, uplink) <= 1.02 * fastest), key=lambda r: r.compress)
    return (f"{pick.level}: {100 * (1 - upload_seconds(pick, uplink) * uplink):.0f}% faster, "
            f"{100 * uplink / pick.compress:.0f}% of a core")


def rate(value: float) -> str:
    return f"{value / MB:,.0f} MB/s ({value * 8 / 1e9:.2f} Gbit/s)"


def report(options: argparse.Namespace, files: dict[str, Path], rows: list[Measure], model: tuple[int, float],
           deepspeed: str, seconds: tuple[float, float]) -> None:
    import zstandard

    versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in ("mlx", "torch", "zstandard"))
    print(f"llama width {options.width}, {options.layers} layers, vocabulary {options.vocab}: "
          f"{model[0] / 1e6:.1f}M parameters, {options.steps} Adam steps of {options.batch} x {options.sequence} "
          f"random tokens (MLX's Adam m and v: {100 * model[1]:.2f}% exactly zero); DeepSpeed files: "
          f"{deepspeed}; {platform.machine()}, {os.cpu_count()} cores, {versions} "
          f"(zstd {'.'.join(map(str, zstandard.ZSTD_VERSION))}); best of {options.repeats}; "
          f"checkpoints written in {seconds[0]:.0f} s, measured in {seconds[1]:.0f} s; load average "
          f"{os.getloadavg()[0]:.1f} at the end\n")
    for kind, path in files.items():
        print(f"- {kind}: `{path.name}`, {CONTENTS[kind.removesuffix(' (emulated)')]}")
    print()
    print(f"| file | MB | zstd level | ratio r | saved | compress MB/s, 1 thread | compress MB/s, "
          f"{os.cpu_count()} threads | decompress MB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row.kind} | {row.size / MB:.1f} | {row.level} | {row.ratio:.3f} | {100 * (1 - row.ratio):.1f}% "
              f"| {row.compress / MB:,.0f} | {row.compress_all / MB:,.0f} | {row.decompress / MB:,.0f} |")

    print(f"\nPipelined upload of S bytes at uplink U: max(S/C, r*S/U) compressed vs S/U plain (C: one thread). "
          f"Faster iff r < 1 and U < C; the full saving 1 - r once U <= r*C. Rule: compress iff r <= "
          f"{options.max_ratio:g} and U <= {options.cpu_share:g}*C.\n")
    print("| file | zstd level | r | faster below U = C | full saving (1 - r) below U = r*C | "
          "rule: compress below |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        below = recommended_uplink(row, options)
        rule = rate(below) if below else f"never (r > {options.max_ratio:g})"
        faster = rate(row.compress) if row.ratio < 1 else "never (r >= 1)"
        full = rate(row.ratio * row.compress) if row.ratio < 1 else "never"
        print(f"| {row.kind} | {row.level} | {row.ratio:.3f} | {faster} | {full} | {rule} |")

    print("\nThe level the rule picks, by uplink: the upload's time saved against uncompressed, and the share of "
          "one core compressing at the uplink's pace takes:\n")
    print("| file | " + " | ".join(label for label, _ in UPLINKS) + " |")
    print("|---|" + "---|" * len(UPLINKS))
    for kind in dict.fromkeys(row.kind for row in rows):
        kind_rows = [row for row in rows if row.kind == kind]
        print(f"| {kind} | " + " | ".join(choice(kind_rows, uplink, options) for _, uplink in UPLINKS) + " |")
    slowest = min(rows, key=lambda row: row.decompress)
    print(f"\nRestore: the slowest decompression measured is {rate(slowest.decompress)} ({slowest.kind}, "
          f"level {slowest.level}), so decompressing while downloading is limited by the link below that.")
    argv = ["python", "bench/checkpoint_compression.py", "--width", str(options.width), "--layers",
            str(options.layers), "--vocab", str(options.vocab), "--steps", str(options.steps),
            f"--levels={options.levels}", "--repeats", str(options.repeats), "--max-ratio", str(options.max_ratio),
            "--cpu-share", str(options.cpu_share)]
    print("\nreproduce: " + shlex.join(argv + (["--emulate-deepspeed"] if options.emulate_deepspeed else [])))


def main() -> None:
    options = parse_args()
    if options.deepspeed_worker:
        deepspeed_worker(options)
        return
    root = Path(options.dir or tempfile.mkdtemp(prefix="coord-bench-compression-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    files, parameters, zeros = write_mlx(root, options)
    dcp_files, model, optimizer = write_dcp(root, options)
    files.update(dcp_files)
    if options.emulate_deepspeed or importlib.util.find_spec("deepspeed") is None:
        files.update(emulate_deepspeed(root, model, optimizer))
        deepspeed = "EMULATED (torch.save of the layout)"
    else:
        files.update(write_deepspeed(root, options))
        deepspeed = f"written by DeepSpeed {importlib.metadata.version('deepspeed')}"
    written = time.perf_counter()
    rows = [row for kind, path in files.items() for row in measure(kind, path, options.level_list, options.repeats)]
    report(options, files, rows, (parameters, zeros), deepspeed, (written - started, time.perf_counter() - written))
    if not options.dir:
        with contextlib.suppress(OSError):
            shutil.rmtree(root)


if __name__ == "__main__":
    main()
