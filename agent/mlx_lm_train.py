"""``python -m agent.mlx_lm_train [mlx_lm lora options]``: mlx-lm's own trainer, reporting to coord.

It runs ``mlx_lm.lora`` unchanged, with one training callback added beside any
the user asked for: each report (step, loss, tokens/s, peak memory) becomes a
JSON line in ``$COORD_PROGRESS_FILE`` on rank 0, with the global step (mlx-lm
counts from 1 again after a resume; coord adds ``$COORD_STEP_OFFSET``). No
terminal output is parsed. SIGUSR1 dumps every thread's stack into the log,
so a hung rank can be looked at before it is killed.
"""

from __future__ import annotations

import faulthandler
import json
import os
import platform
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

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


def main() -> None:
    from agent.qos import set_user_interactive_qos

    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    # On macOS the thread that drives MLX gets the user-interactive QoS class; nice() does not do this.
    qos = set_user_interactive_qos()
    if platform.system() == "Darwin":  # elsewhere a no-op, not worth a line in every log
        print(f"coord: QoS {qos['reason']}", file=sys.stderr, flush=True)
    import mlx.core as mx
    import mlx_lm.lora as lora

    progress = os.environ.get("COORD_PROGRESS_FILE")
    offset = int(os.environ.get("COORD_STEP_OFFSET", "0"))
    if progress and mx.distributed.init().rank() == 0:
        original = lora.get_reporting_callbacks

        def with_coord(*args: Any, **kwargs: Any) -> ProgressCallback:
            return ProgressCallback(progress, offset, wrapped=original(*args, **kwargs))

        lora.get_reporting_callbacks = with_coord
    sys.argv = ["mlx_lm.lora", *sys.argv[1:]]
    lora.main()


if __name__ == "__main__":
    main()
