"""``python -m agent.train``: options, model and optimizer set-up, resume, and the run.

The options are mlx_lm lora's own (its parser, ``-c`` config file and
defaults), plus ``--fingerprint-every N``. ``--iters`` is the job's total
number of optimizer steps, also after a resume. ``--val-batches`` and
``--test-batches`` count global batches (batch size × accumulation steps), so
evaluations do not change with the split. Environment (all optional):

- ``COORD_PROGRESS_FILE``: JSON lines for coord (train, val, checkpoint, fingerprint).
- ``COORD_STEP_OFFSET``: the global step this attempt starts from; checkpoint
  files are named by the step within the attempt (global step minus it).
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import platform
import signal
import sys
import types
from typing import TYPE_CHECKING

from agent.heartbeat import Heartbeat, silent
from agent.qos import set_user_interactive_qos
from agent.trainer import state as trainer_state
from agent.trainer.safetensors_file import read_metadata, remove_stale_temps

if TYPE_CHECKING:  # imported where used: mlx and mlx_lm load only once the options are read
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm.tuner.datasets import CacheDataset

    from agent.trainer.checkpoint import BackgroundWriter
    from agent.trainer.loop import LoopOptions, Trainer
    from agent.trainer.progress import Reporter
    from agent.trainer.state import TrainerState

OPTIMIZERS = ("adam", "adamw", "muon", "sgd", "adafactor")


class SetupError(ValueError):
    """The run cannot start as asked; the message says why."""


def main(argv: list[str] | None = None) -> None:
    # A hung rank can be looked at before it is killed: coord's agent sends SIGUSR1.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    # Every rank says what it does from its first moments (loading), for coord's watch of hangs.
    heartbeat = Heartbeat.from_environment().start()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # as mlx_lm lora sets it
    args = parse_args(argv)
    # On macOS this thread, which drives MLX, gets the user-interactive QoS class (nice() does not do it).
    qos = set_user_interactive_qos()
    if platform.system() == "Darwin":  # elsewhere a no-op, not worth a line in every log
        print(f"agent.train: QoS {qos['reason']}", file=sys.stderr, flush=True)
    from agent.trainer.checkpoint import CheckpointError
    from agent.trainer.data import BatchError

    try:
        job = prepare(args, heartbeat)
    except (SetupError, trainer_state.StateError, BatchError, CheckpointError) as exc:
        sys.exit(f"agent.train: error: {exc}")
    job.run()
    heartbeat.stop()


def parse_args(argv: list[str] | None) -> types.SimpleNamespace:
    """mlx_lm lora's options, config file and defaults, with coord's additions."""
    import yaml
    from mlx_lm import lora

    parser = lora.build_parser()
    parser.prog = "python -m agent.train"
    parser.description = ("coord's exact-resume trainer: mlx_lm lora's options; each checkpoint also holds the "
                          "optimizer state, the LR schedule position, the RNG key and the data position.")
    parser.add_argument("--fingerprint-every", type=int,
                        help="Every N steps each rank records a SHA256 of its trainable weights (0: off).")
    parser.add_argument("--debug-corrupt", type=_rank_step, help=argparse.SUPPRESS)
    parser.add_argument("--debug-hang", type=_rank_step, help=argparse.SUPPRESS)  # bench/hang_recovery.py
    parser.add_argument("--debug-nan", type=int, help=argparse.SUPPRESS)  # every rank's weights NaN after this step
    args = vars(parser.parse_args(argv))
    if args["config"]:
        with open(args["config"], encoding="utf-8") as handle:
            config = yaml.load(handle, lora.yaml_loader) or {}
        for key, value in config.items():  # the command line wins over the file
            if args.get(key) is None:
                args[key] = value
    for key, value in {**lora.CONFIG_DEFAULTS, "fingerprint_every": 0}.items():
        if args.get(key) is None:
            args[key] = value
    return types.SimpleNamespace(**args)


def _rank_step(text: str) -> tuple[int, int]:
    try:
        rank, step = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:STEP, got {text!r}") from None
    return rank, step


def resume_state(path: str | None) -> TrainerState | None:
    """The coord trainer state of --resume-adapter-file, or None (no file, or plain mlx-lm adapters)."""
    if path is None:
        return None
    if not os.path.isfile(path):
        raise SetupError(f"--resume-adapter-file {path}: no such file")
    return trainer_state.decode(read_metadata(path), path)


def starting_step(state: TrainerState | None, resume_file: str | None, env_offset: str | None) -> tuple[int, int]:
    """(global step to start from, step offset for checkpoint names)."""
    try:
        offset = int(env_offset) if env_offset not in (None, "") else None
    except ValueError:
        raise SetupError(f"COORD_STEP_OFFSET must be a whole number, got {env_offset!r}") from None
    if state is not None:
        saved = state["global_step"]
        if offset is not None and offset != saved:
            raise SetupError(f"COORD_STEP_OFFSET is {offset} but {resume_file} is the checkpoint of global step "
                             f"{saved}: the attempt must start from the checkpoint's step")
        return saved, offset or 0
    if resume_file is None and offset:
        raise SetupError(f"COORD_STEP_OFFSET is {offset} but no --resume-adapter-file was given: "
                         "nothing to resume from")
    return offset or 0, offset or 0


def prepare_model(model: nn.Module, args: types.SimpleNamespace) -> None:
    """Freeze the model and make the trainable part, as mlx_lm.lora.train_model does."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model.freeze()
    if args.num_layers > len(model.layers):
        raise SetupError(f"--num-layers {args.num_layers}: the model has only {len(model.layers)} layers")
    if args.fine_tune_type == "full":
        for layer in model.layers[-max(args.num_layers, 0):]:
            layer.unfreeze()
    elif args.fine_tune_type in ("lora", "dora"):
        linear_to_lora_layers(model, args.num_layers, args.lora_parameters, use_dora=args.fine_tune_type == "dora")
    else:
        raise SetupError(f"--fine-tune-type {args.fine_tune_type!r}: expected lora, dora or full")


def build_optimizer(args: types.SimpleNamespace) -> optim.Optimizer:
    import mlx.optimizers as optim
    from mlx_lm.tuner.utils import build_schedule

    name = args.optimizer.lower()
    if name not in OPTIMIZERS:
        raise SetupError(f"--optimizer {args.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
    classes = {"adam": optim.Adam, "adamw": optim.AdamW, "muon": optim.Muon, "sgd": optim.SGD,
               "adafactor": optim.Adafactor}
    learning_rate = build_schedule(args.lr_schedule) if args.lr_schedule else args.learning_rate
    return classes[name](learning_rate=learning_rate, **(args.optimizer_config or {}).get(name, {}))


def restore(model: nn.Module, optimizer: optim.Optimizer, state: TrainerState | None, path: str, start_step: int,
            reporter: Reporter) -> None:
    """Weights from --resume-adapter-file; with coord trainer state also the optimizer state and RNG key."""
    import mlx.core as mx

    from agent.trainer import checkpoint

    reporter.say(f"Loading fine-tuned weights from {path}")
    loaded = mx.load(path)
    if not isinstance(loaded, dict):  # a .npy file holds one unnamed array
        raise SetupError(f"--resume-adapter-file {path}: not a file of named tensors (safetensors)")
    weights, saved_optimizer = checkpoint.split_checkpoint(loaded)
    checkpoint.restore_weights(model, weights, path, complete=state is not None)
    if state is None:
        # The schedule follows the job's global step; the moments start from zero.
        optimizer.init(model.trainable_parameters())
        optimizer.state["step"] = mx.array(start_step, mx.uint64)
        reporter.say(f"[WARNING] {path} holds weights only (no coord trainer state): the optimizer starts "
                     f"cold (no moments); the step count, LR schedule and data order continue from step "
                     f"{start_step}.")
        return
    checkpoint.restore_optimizer(optimizer, model, saved_optimizer, path)
    if int(optimizer.step.item()) != state["optimizer_step"]:
        raise SetupError(f"{path}: optimizer step {int(optimizer.step.item())} in the tensors, "
                         f"{state['optimizer_step']} in the trainer state")
    checkpoint.set_mlx_key(state["rng"]["mlx_key"])
    reporter.say(f"Resuming at global step {start_step}: weights, optimizer state, LR schedule, RNG key and "
                 f"data position (epoch {state['data']['epoch']}, batch {state['data']['index']}) restored.")


class Job:
    """A prepared run: the trainer, where it starts, and what follows the last step."""

    def __init__(self, *, args: types.SimpleNamespace, trainer: Trainer, writer: BackgroundWriter, start_step: int,
                 test_set: CacheDataset) -> None:
        self.args = args
        self.trainer = trainer
        self.writer = writer
        self.start_step = start_step
        self.test_set = test_set

    def run(self) -> None:
        from agent.trainer.checkpoint import trainable_arrays

        trainer = self.trainer
        try:
            trainer.run(self.start_step)
            if trainer.split.rank == 0:
                final = os.path.join(self.args.adapter_path, "adapters.safetensors")
                with trainer.heartbeat.during("saving"):
                    self.writer.write_now(final, trainable_arrays(trainer.model))
                trainer.reporter.say(f"Saved final weights to {final}.")
        finally:
            with trainer.heartbeat.during("saving"):
                self.writer.close()  # the last checkpoint must be complete before the process exits
        if self.args.test:
            with trainer.heartbeat.during("evaluating"):
                test_loss = trainer.evaluate(self.test_set, self.args.test_batches)
            trainer.reporter.say(f"Test loss {test_loss:.3f}, Test ppl {math.exp(test_loss):.3f}.")


def prepare(args: types.SimpleNamespace, heartbeat: Heartbeat | None = None) -> Job:
    """Everything before the first step, with every check that can refuse the run."""
    import mlx.core as mx
    from mlx_lm.tuner.datasets import CacheDataset, load_dataset
    from mlx_lm.tuner.trainer import grad_checkpoint
    from mlx_lm.utils import load, maybe_set_recommended_wired_limit

    from agent.trainer.checkpoint import BackgroundWriter
    from agent.trainer.data import GlobalOrder, Split
    from agent.trainer.loop import Trainer

    if not args.train:
        raise SetupError("give --train (agent.train trains; for --test alone use mlx_lm lora --test)")
    state = resume_state(args.resume_adapter_file)
    start_step, offset = starting_step(state, args.resume_adapter_file, os.environ.get("COORD_STEP_OFFSET"))
    heartbeat = heartbeat or silent()
    heartbeat.step(start_step)
    group = mx.distributed.init()
    split = Split(group.size(), group.rank(), args.batch_size, args.grad_accumulation_steps)
    reporter = make_reporter(args, split.rank)
    maybe_set_recommended_wired_limit()

    reporter.say("Loading pretrained model")
    model, tokenizer = load(args.model, tokenizer_config={"trust_remote_code": args.trust_remote_code},
                            trust_remote_code=args.trust_remote_code)[:2]  # (model, tokenizer[, config])
    reporter.say("Loading datasets")
    # load_dataset is annotated with the Hugging Face tokenizer, but mlx_lm lora itself passes this
    # TokenizerWrapper, which forwards every attribute to that tokenizer.
    train_set, valid_set, test_set = load_dataset(args, tokenizer)  # type: ignore[arg-type]
    order = GlobalOrder(len(train_set), split.global_batch, args.seed,
                        skipped=state["data"].get("skipped", 0) if state is not None else 0)
    fixed = trainer_state.fixed_options(args, split.global_batch, len(train_set))
    if state is not None:
        trainer_state.check_compatible(state, fixed, args.resume_adapter_file)
        trainer_state.check_data_position(state, order.batches_per_epoch, args.resume_adapter_file)
    skip = skip_after_rollback()
    if skip:
        order.skipped += skip
        reporter.say(f"Skipping {skip} global batches after the rollback (coord run --skip-on-rollback): step "
                     f"{start_step + 1} trains on the batch after them ({order.skipped} skipped in all)")

    mx.random.seed(args.seed)  # before the LoRA layers are made: their initial weights are random
    prepare_model(model, args)
    optimizer = build_optimizer(args)
    if args.resume_adapter_file is not None:
        restore(model, optimizer, state, args.resume_adapter_file, start_step, reporter)
    else:
        optimizer.init(model.trainable_parameters())
    if args.grad_checkpoint:
        grad_checkpoint(model.layers[0])
    prepare_adapter_path(args, split.rank, model)
    reporter.say(f"Training: {split.world_size} rank(s), global batch {split.global_batch} = batch size "
                 f"{split.batch_size} x {split.accumulation} accumulation step(s); steps {start_step + 1} to "
                 f"{args.iters}, {order.batches_per_epoch} per epoch")

    writer = BackgroundWriter(reporter.progress_file, split.rank)
    trainer = Trainer(
        model=model, optimizer=optimizer, train_set=CacheDataset(train_set),
        val_set=CacheDataset(valid_set) if len(valid_set) >= split.global_batch else None,
        split=split, order=order, group=group, options=loop_options(args, offset, split.rank),
        fixed_options=fixed, reporter=reporter, writer=writer,
        trained_tokens=state["trained_tokens"] if state else 0, heartbeat=heartbeat)
    return Job(args=args, trainer=trainer, writer=writer, start_step=start_step, test_set=CacheDataset(test_set))


def skip_after_rollback() -> int:
    """``$COORD_SKIP_BATCHES``: the global batches after the resume's checkpoint to pass over (a rollback)."""
    text = os.environ.get("COORD_SKIP_BATCHES") or "0"
    try:
        count = int(text)
    except ValueError:
        raise SetupError(f"COORD_SKIP_BATCHES must be a whole number, got {text!r}") from None
    if count < 0:
        raise SetupError(f"COORD_SKIP_BATCHES must be at least 0, got {count}")
    return count


def make_reporter(args: types.SimpleNamespace, rank: int) -> Reporter:
    from mlx_lm.tuner.callbacks import get_reporting_callbacks

    from agent.trainer.progress import Reporter

    callback = None
    if rank == 0:  # --report-to services (wandb, swanlab) hear from rank 0, as with mlx_lm lora
        # config is annotated str, but the callbacks take the options dict, and mlx_lm lora passes vars(args).
        callback = get_reporting_callbacks(args.report_to, project_name=args.project_name,
                                           log_dir=args.adapter_path, config=vars(args))  # type: ignore[arg-type]
    return Reporter(rank=rank, progress_file=os.environ.get("COORD_PROGRESS_FILE") or None, callback=callback)


def prepare_adapter_path(args: types.SimpleNamespace, rank: int, model: nn.Module) -> None:
    """The adapter directory (each rank saves its own checkpoints in its own node's), with mlx-lm's
    adapter_config.json written by rank 0."""
    from mlx_lm.tuner.utils import print_trainable_parameters
    from mlx_lm.utils import save_config

    os.makedirs(args.adapter_path, exist_ok=True)
    remove_stale_temps(args.adapter_path)
    if rank == 0:
        save_config(dict(vars(args)), os.path.join(args.adapter_path, "adapter_config.json"))
        print_trainable_parameters(model)


def loop_options(args: types.SimpleNamespace, step_offset: int, rank: int) -> LoopOptions:
    from agent.trainer.loop import LoopOptions

    # coord's first attempt only: its relaunch replays the steps after the checkpoint, and perturbing
    # them again would make the replica check fire on every attempt.
    first = os.environ.get("COORD_ATTEMPT", "0") == "0"
    corrupt = args.debug_corrupt if first else None
    hang = args.debug_hang if first else None  # a relaunch must get past it
    return LoopOptions(iters=args.iters, steps_per_report=args.steps_per_report, steps_per_eval=args.steps_per_eval,
                       save_every=args.save_every, val_batches=args.val_batches, max_seq_length=args.max_seq_length,
                       fingerprint_every=args.fingerprint_every, clear_cache_threshold=args.clear_cache_threshold,
                       adapter_path=args.adapter_path, step_offset=step_offset,
                       corrupt_step=corrupt[1] if corrupt and corrupt[0] == rank else None,
                       nan_step=args.debug_nan if first else None,
                       hang_step=hang[1] if hang and hang[0] == rank else None)
