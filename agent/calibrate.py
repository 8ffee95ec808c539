"""Measure this node for MLX training: ``python -m agent.calibrate [--quick]``.

Run by the agent as a subprocess with the node's training Python (the one with mlx); the
agent process itself never imports mlx. Prints exactly one JSON line on stdout::

    {"ok": true, "device": "Device(gpu, 0)", "device_kind": "gpu", "mlx_version": "0.32.4",
     "matmul_gflops": {"float32": 9800.0, "bfloat16": 19500.0},
     "memory_bandwidth_gbps": 640.0,
     "peak_memory_bytes": 103079215104, "peak_memory_source": "...",
     "train_samples_per_s": 5200.0, "train_step_ms": 6.1,
     "duration_s": 8.2, "errors": {}, ...}

and progress on stderr as JSON lines ``{"progress": "matmul float32", "fraction": 0.1}``.
A measurement that fails is ``None`` with the reason in ``errors`` (keyed by the
measurement's name); the script still exits 0. If mlx cannot be imported it prints
``{"ok": false, "error": ..., "error_kind": "mlx_missing"}`` and exits 3.

Everything is measured on MLX's default device (Metal on a Mac, CUDA where MLX sees one,
the CPU otherwise). The training-step model is the same on every device, so
``train_samples_per_s`` can be compared across nodes. Stdlib and mlx only; Python 3.10+.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # at run time this module needs the standard library and mlx only
    from shared.agent_api.calibration import CalibrationReply, TrainModel
    from shared.agent_api.common import JsonObject

Measured = TypeVar("Measured")

CALIBRATION_VERSION = 1
EXIT_MLX_MISSING = 3

# The training-step model: a tiny pre-norm transformer, like the test suite's llama.
TRAIN_MODEL: TrainModel = {
    "kind": "transformer",
    "layers": 2,
    "dim": 64,
    "heads": 4,
    "vocab": 256,
    "seq_len": 32,
    "batch": 32,
}

# Seconds each timed loop aims for: (full, quick).
MATMUL_SECONDS = (0.5, 0.12)
BANDWIDTH_SECONDS = (0.5, 0.12)
TRAIN_SECONDS = (1.0, 0.25)


def _emit_progress(stage: str, fraction: float) -> None:
    try:
        sys.stderr.write(json.dumps({"progress": stage, "fraction": round(fraction, 3)}) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # progress is a courtesy; a closed stderr must not stop the measurement


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


class Calibration:
    """The measurements, run in order; each one records a value or an error."""

    def __init__(self, mx: Any, nn: Any, optim: Any, *, quick: bool) -> None:
        self.mx = mx
        self.nn = nn
        self.optim = optim
        self.quick = quick
        self.errors: dict[str, str] = {}
        self.is_gpu = False
        # What the last run() learnt besides its measurements (reset by run()).
        self.matmul_sizes: dict[str, int] = {}
        self.bandwidth_method: str | None = None
        self.train_steps: int | None = None

    # -- helpers ----------------------------------------------------------------------

    def _seconds(self, pair: tuple[float, float]) -> float:
        return pair[1] if self.quick else pair[0]

    def _guard(self, name: str, fn: Callable[[], Measured]) -> Measured | None:
        try:
            return fn()
        except Exception as exc:  # one measurement failing never stops the others
            self.errors[name] = _error_text(exc)
            return None

    # -- device -----------------------------------------------------------------------

    def device(self) -> dict[str, str | None]:
        mx = self.mx
        device = mx.default_device()
        self.is_gpu = device.type == mx.gpu
        return {"device": str(device), "device_kind": "gpu" if self.is_gpu else "cpu"}

    # -- matmul -----------------------------------------------------------------------

    def matmul_gflops(self, dtype_name: str) -> float | None:
        mx = self.mx
        dtype = getattr(mx, dtype_name)
        budget = self._seconds(MATMUL_SECONDS)
        n = (2048 if self.quick else 4096) if self.is_gpu else 512 if self.quick else 1024
        # Shrink until one matmul is a small part of the budget (slow CPUs, small GPUs),
        # so the rate is an average over several products rather than one or two.
        while True:
            a = mx.random.normal((n, n)).astype(dtype)
            b = mx.random.normal((n, n)).astype(dtype)
            mx.eval(a, b)
            mx.eval(a @ b)  # warm-up: kernel selection/compilation, allocation
            start = time.perf_counter()
            mx.eval(a @ b)
            one = time.perf_counter() - start
            if one <= budget / 6 or n <= 256:
                break
            n //= 2
        iterations = 0
        start = time.perf_counter()
        elapsed = 0.0
        while elapsed < budget or iterations < 2:
            mx.eval(a @ b)
            iterations += 1
            elapsed = time.perf_counter() - start
        self.matmul_sizes[dtype_name] = n
        return 2.0 * n**3 * iterations / elapsed / 1e9

    # -- memory bandwidth -------------------------------------------------------------

    def memory_bandwidth_gbps(self) -> float | None:
        mx = self.mx
        mib = 64 if self.quick else 256
        elements = mib * 1024 * 1024 // 4
        a = mx.full((elements,), 1.0, dtype=mx.float32)
        b = mx.full((elements,), 2.0, dtype=mx.float32)
        mx.eval(a, b)
        mx.eval(a + b)  # warm-up: the output buffer comes from the allocator's cache after
        budget = self._seconds(BANDWIDTH_SECONDS)
        moved = 3 * a.nbytes  # read a, read b, write c
        best = 0.0
        iterations = 0
        start = time.perf_counter()
        while time.perf_counter() - start < budget or iterations < 3:
            t0 = time.perf_counter()
            c = a + b
            mx.eval(c)
            took = time.perf_counter() - t0
            del c
            iterations += 1
            if took > 0:
                best = max(best, moved / took / 1e9)
        self.bandwidth_method = (
            f"c = a + b on float32 arrays of {mib} MiB; 3 x {mib} MiB moved per add; "
            f"best of {iterations}"
        )
        return best

    # -- memory MLX can use -----------------------------------------------------------

    def peak_memory(self) -> tuple[int, str]:
        """(bytes, source) of the memory MLX can use on its default device."""
        mx = self.mx
        if self.is_gpu:
            info, source = self._device_info()
            for key in ("max_recommended_working_set_size", "total_memory", "memory_size"):
                value = info.get(key)
                if isinstance(value, int) and value > 0:
                    return value, f"{source}[{key!r}]"
            raise RuntimeError(
                f"MLX reports no memory size for {mx.default_device()} "
                f"(device_info keys: {sorted(info)})"
            )
        pages = os.sysconf("SC_PHYS_PAGES")
        page_size = os.sysconf("SC_PAGE_SIZE")
        if pages <= 0 or page_size <= 0:
            raise RuntimeError("os.sysconf reports no physical memory")
        return pages * page_size, "os.sysconf(SC_PHYS_PAGES * SC_PAGE_SIZE): physical memory"

    def _device_info(self) -> tuple[JsonObject, str]:
        mx = self.mx
        metal = getattr(mx, "metal", None)
        on_metal = False
        try:
            on_metal = bool(metal is not None and metal.is_available())
        except Exception:
            on_metal = False
        if on_metal and metal is not None and hasattr(metal, "device_info"):
            # Older MLX has only mx.metal.device_info; newer warns that it moved.
            if hasattr(mx, "device_info"):
                return dict(mx.device_info()), "mx.device_info()"
            return dict(metal.device_info()), "mx.metal.device_info()"
        if hasattr(mx, "device_info"):
            return dict(mx.device_info()), "mx.device_info()"
        raise RuntimeError(
            f"this MLX ({mx.__version__}) has no device_info for {mx.default_device()}"
        )

    # -- training steps ---------------------------------------------------------------

    def train_step(self) -> tuple[float, float]:
        """(samples/s, ms per step) of a tiny transformer's training step."""
        mx, nn, optim = self.mx, self.nn, self.optim
        cfg = TRAIN_MODEL
        module: Any = nn.Module  # mlx.nn is handed in (this module must import without mlx)

        class Tiny(module):
            def __init__(self) -> None:
                super().__init__()
                self.embedding = nn.Embedding(cfg["vocab"], cfg["dim"])
                self.encoder = nn.TransformerEncoder(
                    cfg["layers"],
                    cfg["dim"],
                    cfg["heads"],
                    mlp_dims=4 * cfg["dim"],
                    norm_first=True,
                )
                self.head = nn.Linear(cfg["dim"], cfg["vocab"])

            def __call__(self, tokens: Any) -> Any:
                mask = nn.MultiHeadAttention.create_additive_causal_mask(tokens.shape[1])
                return self.head(self.encoder(self.embedding(tokens), mask))

        model = Tiny()
        mx.eval(model.parameters())
        optimizer = optim.AdamW(learning_rate=1e-3)

        def loss_fn(m: Any, inputs: Any, targets: Any) -> Any:
            return nn.losses.cross_entropy(m(inputs), targets, reduction="mean")

        value_and_grad = nn.value_and_grad(model, loss_fn)
        tokens = mx.random.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq_len"] + 1))
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        mx.eval(inputs, targets)

        def step() -> Any:
            loss, grads = value_and_grad(model, inputs, targets)
            optimizer.update(model, grads)
            mx.eval(loss, model.parameters(), optimizer.state)
            return loss

        for _ in range(1 if self.quick else 3):
            step()
        budget = self._seconds(TRAIN_SECONDS)
        min_steps = 2 if self.quick else 5
        steps = 0
        start = time.perf_counter()
        elapsed = 0.0
        loss = None
        while (elapsed < budget or steps < min_steps) and steps < 10_000:
            loss = step()
            steps += 1
            elapsed = time.perf_counter() - start
        if loss is not None:
            value = float(loss.item())
            if math.isnan(value):  # the step computed nonsense, its speed means nothing
                raise RuntimeError("training step produced a NaN loss")
        self.train_steps = steps
        return cfg["batch"] * steps / elapsed, elapsed / steps * 1000.0

    # -- all of it --------------------------------------------------------------------

    def run(self) -> CalibrationReply:
        mx = self.mx
        started = time.perf_counter()
        self.matmul_sizes = {}
        self.bandwidth_method = None
        self.train_steps = None
        result: CalibrationReply = {
            "ok": True,
            "calibration_version": CALIBRATION_VERSION,
            "quick": self.quick,
            "mlx_version": getattr(mx, "__version__", None),
            "python_version": platform.python_version(),
            "cpu_count": os.cpu_count(),
        }
        with contextlib.suppress(Exception):
            mx.random.seed(0)
        _emit_progress("device", 0.0)
        device = self._guard("device", self.device) or {"device": None, "device_kind": None}
        result["device"], result["device_kind"] = device["device"], device["device_kind"]

        _emit_progress("matmul float32", 0.05)
        fp32 = self._guard("matmul_gflops.float32", lambda: self.matmul_gflops("float32"))
        _emit_progress("matmul bfloat16", 0.2)
        bf16 = self._guard("matmul_gflops.bfloat16", lambda: self.matmul_gflops("bfloat16"))
        result["matmul_gflops"] = {"float32": fp32, "bfloat16": bf16}
        result["matmul_sizes"] = dict(self.matmul_sizes)

        _emit_progress("memory bandwidth", 0.35)
        bandwidth = self._guard("memory_bandwidth_gbps", self.memory_bandwidth_gbps)
        result["memory_bandwidth_gbps"] = bandwidth
        result["memory_bandwidth_method"] = self.bandwidth_method
        self._release()

        _emit_progress("peak memory", 0.5)
        peak = self._guard("peak_memory_bytes", self.peak_memory)
        result["peak_memory_bytes"], result["peak_memory_source"] = peak or (None, None)

        _emit_progress("training step", 0.55)
        train = self._guard("train_samples_per_s", self.train_step)
        result["train_samples_per_s"], result["train_step_ms"] = train or (None, None)
        result["train_steps"] = self.train_steps
        result["train_model"] = TRAIN_MODEL.copy()

        result["mlx_peak_used_bytes"] = self._guard("mlx_peak_used_bytes", self._mlx_peak_used)
        result["errors"] = dict(self.errors)
        result["duration_s"] = time.perf_counter() - started
        _emit_progress("done", 1.0)
        return result

    def _release(self) -> None:
        clear = self._mlx_function("clear_cache")
        if clear is not None:
            with contextlib.suppress(Exception):
                clear()

    def _mlx_function(self, name: str) -> Any:
        """mx.<name>, or mx.metal.<name> in older MLX that only had the Metal one."""
        return getattr(self.mx, name, None) or getattr(getattr(self.mx, "metal", None), name, None)

    def _mlx_peak_used(self) -> int | None:
        getter = self._mlx_function("get_peak_memory")
        return int(getter()) if getter is not None else None


def _clean(value: Any) -> Any:
    """Round floats for the JSON line; a NaN or infinity (never a real rate) is None."""
    if isinstance(value, float):
        return round(value, 3) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agent.calibrate", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="short timed loops (a few seconds in all)")
    args = parser.parse_args(argv)

    # The result line gets a private copy of fd 1; fd 1 itself now points at stderr, so
    # anything MLX or Python prints during the measurements cannot corrupt that line.
    result_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    started = time.perf_counter()
    try:
        import mlx.core as mx
        import mlx.nn as nn
        import mlx.optimizers as optim
    except Exception as exc:
        result_out.write(
            json.dumps(
                {
                    "ok": False,
                    "error_kind": "mlx_missing",
                    "error": f"mlx cannot be imported by {sys.executable}: {_error_text(exc)}",
                    "python_executable": sys.executable,
                    "python_version": platform.python_version(),
                }
            )
            + "\n"
        )
        result_out.flush()
        return EXIT_MLX_MISSING
    import_s = time.perf_counter() - started

    result = Calibration(mx, nn, optim, quick=args.quick).run()
    result["mlx_import_s"] = import_s
    result["duration_s"] = time.perf_counter() - started
    result["python_executable"] = sys.executable
    result_out.write(json.dumps(_clean(result), allow_nan=False, default=str) + "\n")
    result_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
