"""``python -m agent.mlx_lm_train [mlx_lm lora options]``: mlx-lm's own trainer, reporting to coord.

It runs ``mlx_lm.lora`` unchanged, with one training callback added beside any
the user asked for: each report (step, loss, tokens/s, peak memory) becomes a
JSON line in ``$COORD_PROGRESS_FILE`` on rank 0, with the global step (mlx-lm
counts from 1 again after a resume; coord adds ``$COORD_STEP_OFFSET``). No
terminal output is parsed. SIGUSR1 dumps every thread's stack into the log,
so a hung rank can be looked at before it is killed.

Every rank also writes heartbeats (``agent.heartbeat``) with its phase: loading
until training starts, compiling until its first step is done, then training,
with saving and evaluating around mlx-lm's saves and evaluations. mlx-lm's loop
is left as it is: a step is known to be done when the loop asks for the next
batch (the batch iterator passed to ``mlx_lm.tuner.trainer.train`` is wrapped).
"""

from __future__ import annotations

import faulthandler
import itertools
import json
import os
import platform
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from agent.heartbeat import Heartbeat

if TYPE_CHECKING:
    from mlx_lm.tuner.callbacks import TrainingCallback

    from shared.agent_api.common import JsonObject
    from shared.agent_api.progress import ProgressRecord


class ProgressCallback:
    def __init__(self, path: str, step_offset: int, wrapped: TrainingCallback | None = None) -> None:
        self.path = path
        self.step_offset = step_offset
        self.wrapped = wrapped

    def _write(self, record: ProgressRecord) -> None:
        line = json.dumps(record, default=float) + "\n"
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)

    def on_train_loss_report(self, info: JsonObject) -> None:  # mlx-lm's report: its keys
        self._write({"kind": "train", "time": time.time(), "step": self.step_offset + int(info["iteration"]),
                     "loss": float(info["train_loss"]), "tokens_per_second": float(info["tokens_per_second"]),
                     "learning_rate": float(info.get("learning_rate", 0.0)),
                     "peak_memory_gb": float(info.get("peak_memory", 0.0))})
        if self.wrapped is not None:
            self.wrapped.on_train_loss_report(info)

    def on_val_loss_report(self, info: JsonObject) -> None:
        self._write({"kind": "val", "time": time.time(), "step": self.step_offset + int(info["iteration"]),
                     "val_loss": float(info["val_loss"])})
        if self.wrapped is not None:
            self.wrapped.on_val_loss_report(info)


def beating_batches(iterate: Callable[..., Iterator[Any]], heartbeat: Heartbeat,
                    step_offset: int, skip: int = 0) -> Callable[..., Iterator[Any]]:
    """mlx-lm's batch iterator, telling the heartbeat of each training step done: the loop asks
    for batch N+1 once step N (and its report and save) is over. Evaluation batches (not looped)
    pass through. ``skip``: the training batches passed over first (a rollback's
    ``$COORD_SKIP_BATCHES``: the data where the loss went wrong)."""

    def batches(*args: Any, **kwargs: Any) -> Iterator[Any]:
        if not kwargs.get("loop"):
            yield from iterate(*args, **kwargs)
            return
        for done, batch in enumerate(itertools.islice(iterate(*args, **kwargs), skip, None)):
            if done:
                heartbeat.step(step_offset + done)
                heartbeat.phase("training")
            yield batch

    return batches


def during(phase: str, func: Callable[..., Any], heartbeat: Heartbeat) -> Callable[..., Any]:
    """``func`` with the heartbeat in ``phase`` while it runs (an evaluation, a save)."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with heartbeat.during(phase):
            return func(*args, **kwargs)

    return wrapped


def with_heartbeats(heartbeat: Heartbeat, step_offset: int, skip: int = 0) -> None:
    """mlx-lm's trainer with the phases in its heartbeats (mlx_lm.lora looks these names up when
    it calls them)."""
    import mlx.core as mx
    import mlx_lm.lora as lora
    from mlx_lm.tuner import trainer

    train = lora.train

    def train_beating(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("iterate_batches", beating_batches(trainer.iterate_batches, heartbeat, step_offset, skip))
        heartbeat.phase("compiling")  # until the first step is done
        return train(*args, **kwargs)

    lora.train = train_beating
    trainer.evaluate = during("evaluating", trainer.evaluate, heartbeat)  # validation, called by train
    lora.evaluate = during("evaluating", lora.evaluate, heartbeat)  # --test
    mx.save_safetensors = during("saving", mx.save_safetensors, heartbeat)  # mlx-lm's adapter saves


def main() -> None:
    from agent.qos import set_user_interactive_qos

    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    offset = int(os.environ.get("COORD_STEP_OFFSET", "0"))
    # Every rank beats from its first moments: importing MLX and loading the model are "loading".
    heartbeat = Heartbeat(os.environ.get("COORD_PROGRESS_FILE") or None, step=offset).start()
    # On macOS the thread that drives MLX gets the user-interactive QoS class; nice() does not do this.
    qos = set_user_interactive_qos()
    if platform.system() == "Darwin":  # elsewhere a no-op, not worth a line in every log
        print(f"coord: QoS {qos['reason']}", file=sys.stderr, flush=True)
    import mlx.core as mx
    import mlx_lm.lora as lora

    progress = os.environ.get("COORD_PROGRESS_FILE")
    skip = int(os.environ.get("COORD_SKIP_BATCHES") or "0")
    if skip:
        print(f"coord: skipping {skip} training batches after the rollback (coord run --skip-on-rollback)",
              file=sys.stderr, flush=True)
    if progress or skip:
        with_heartbeats(heartbeat, offset, skip)
    if progress and mx.distributed.init().rank() == 0:
        original = lora.get_reporting_callbacks

        def with_coord(*args: Any, **kwargs: Any) -> ProgressCallback:
            return ProgressCallback(progress, offset, wrapped=original(*args, **kwargs))

        lora.get_reporting_callbacks = with_coord
    sys.argv = ["mlx_lm.lora", *sys.argv[1:]]
    lora.main()
    if progress and mx.distributed.init().rank() == 0:
        save_final_checkpoint(os.environ)
    heartbeat.stop()


def save_final_checkpoint(env: Mapping[str, str]) -> str | None:
    """The last step's checkpoint, under its step's name, when mlx-lm did not save one: it names a
    checkpoint by its step only at multiples of --save-every, and writes the final weights to
    ``adapters.safetensors`` alone, which coord does not take for a checkpoint (every save overwrites
    it). Without this a run of 1500 steps saved every 200 ends with its newest checkpoint at 1400, and
    a resume would redo the last 100 steps. Copied whole under a temporary name, then renamed."""
    directory, total = env.get("COORD_CHECKPOINT_DIR"), env.get("COORD_TOTAL_STEPS")
    if not directory or not total:
        return None
    iteration = int(total) - int(env.get("COORD_STEP_OFFSET") or "0")
    final = os.path.join(directory, f"{iteration:07d}_adapters.safetensors")
    adapters = os.path.join(directory, "adapters.safetensors")
    if iteration <= 0 or os.path.exists(final) or not os.path.exists(adapters):
        return None
    temporary = f"{final}.{os.getpid()}.tmp"
    shutil.copyfile(adapters, temporary)
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, final)
    print(f"coord: the final weights saved as the checkpoint of step {total} ({final})", file=sys.stderr, flush=True)
    return final


if __name__ == "__main__":
    main()
