"""The training loop: one optimizer step per global batch, with its reports, evals, fingerprints and saves.

The loss is mlx-lm's (token cross-entropy over the unmasked target positions),
but summed rather than averaged per micro-batch: every rank sums its token
losses and token counts over its micro-batches, the sums are added across
ranks (``all_sum``), and the gradient and the reported loss are the global sum
divided by the global token count. So a step's result does not depend on how
its global batch is split, up to the order of floating-point additions.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map, tree_unflatten

from agent.heartbeat import Heartbeat, silent
from agent.trainer import state as trainer_state
from agent.trainer.checkpoint import BackgroundWriter, flatten, mlx_key, optimizer_arrays, trainable_arrays
from agent.trainer.data import GlobalOrder, Split, as_item, pad_batch
from agent.trainer.progress import Reporter

if TYPE_CHECKING:
    import mlx.optimizers as optim
    from mlx_lm.tuner.datasets import CacheDataset

    from shared.agent_api.common import JsonObject

#: What the micro-steps of one optimizer step add up: (loss sum, token count, gradient tree).
Totals = tuple[mx.array, mx.array, Any]

#: Gradients are added across ranks in chunks of about this size (as mlx-lm's average_gradients does).
ALL_SUM_BYTES = 32 << 20


def token_loss_sum(model: nn.Module, batch: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
    """(sum of token cross-entropies, number of tokens), over positions from the offset to the length."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    positions = mx.arange(1, targets.shape[1] + 1)
    mask = mx.logical_and(positions >= lengths[:, 0:1], positions <= lengths[:, 1:])
    losses = nn.losses.cross_entropy(logits, targets) * mask
    return losses.astype(mx.float32).sum(), mask.sum().astype(mx.float32)


def sum_across_ranks(tree: Any, group: mx.distributed.Group) -> Any:
    """The tree of arrays added element-wise over all ranks, in few large all_sum calls."""
    if group.size() == 1:
        return tree
    flat = flatten(tree)
    summed: dict[int, tuple[str, mx.array]] = {}
    for chunk in _chunks(flat):
        joined = mx.concatenate([flat[i][1].reshape(-1) for i in chunk])
        total = mx.distributed.all_sum(joined, group=group)
        bounds, end = [], 0
        for i in chunk[:-1]:
            end += flat[i][1].size
            bounds.append(end)
        for i, piece in zip(chunk, mx.split(total, bounds), strict=True):  # len(bounds) + 1 pieces
            summed[i] = (flat[i][0], piece.reshape(flat[i][1].shape))
    return tree_unflatten([summed[i] for i in range(len(flat))])  # every leaf is in one chunk


def _chunks(flat: list[tuple[str, mx.array]]) -> Iterator[list[int]]:
    """Runs of leaves of one dtype, each about ALL_SUM_BYTES (all_sum needs one dtype per call)."""
    chunk: list[int] = []
    size = 0
    for i, (_, array) in enumerate(flat):
        if chunk and (array.dtype != flat[chunk[0]][1].dtype or size >= ALL_SUM_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(i)
        size += array.nbytes
    if chunk:
        yield chunk


def make_step_functions(model: nn.Module, optimizer: optim.Optimizer,
                        group: mx.distributed.Group) -> tuple[list[Any], Callable[..., Any], Callable[..., Any]]:
    """Compiled (micro_step, update): accumulate one micro-batch; reduce across ranks and update.

    Like mlx-lm's step, they are compiled with the model, optimizer and RNG
    state as implicit inputs and outputs, so the optimizer state and RNG key
    must already be the restored ones when these are made.
    """
    compiled_state = [model.state, optimizer.state, mx.random.state]
    loss_and_grad = nn.value_and_grad(model, token_loss_sum)

    @partial(mx.compile, inputs=compiled_state, outputs=compiled_state)
    def micro_step(batch: mx.array, lengths: mx.array, totals: Totals | None) -> Totals:
        (loss, tokens), grad = loss_and_grad(model, batch, lengths)
        if totals is not None:
            loss, tokens = loss + totals[0], tokens + totals[1]
            grad = tree_map(lambda g, acc: g + acc, grad, totals[2])
        return loss, tokens, grad

    @partial(mx.compile, inputs=compiled_state, outputs=compiled_state)
    def update(loss: mx.array, tokens: mx.array, grad: Any) -> tuple[mx.array, mx.array]:
        loss, tokens, grad = sum_across_ranks((loss, tokens, grad), group)
        optimizer.update(model, tree_map(lambda g: (g / tokens).astype(g.dtype), grad))
        return loss / tokens, tokens

    return compiled_state, micro_step, update


@dataclass(frozen=True)
class LoopOptions:
    iters: int                  # the job's total optimizer steps
    steps_per_report: int
    steps_per_eval: int
    save_every: int             # 0: no periodic checkpoints
    val_batches: int            # -1: the whole validation set
    max_seq_length: int
    fingerprint_every: int      # 0: no fingerprints
    clear_cache_threshold: int
    adapter_path: str
    step_offset: int            # checkpoint names count from here ($COORD_STEP_OFFSET)
    corrupt_step: int | None    # --debug-corrupt: perturb this rank's weights after this step
    hang_step: int | None = None  # --debug-hang: this rank never leaves the collective of this step
    nan_step: int | None = None  # --debug-nan: every rank's weights turn NaN after this step (a divergence)


class Window:
    """What happened since the last train report."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.tokens = 0
        self.seconds = 0.0
        self.comm_seconds = 0.0  # in the gradient exchange and update, after the micro-batches were computed

    def add(self, loss: float, tokens: int, seconds: float, comm_seconds: float = 0.0) -> None:
        self.losses.append(loss)
        self.tokens += tokens
        self.seconds += seconds
        self.comm_seconds += comm_seconds


class Trainer:
    """Optimizer steps from a start step to ``iters``; after each: report, eval, fingerprint, save as due.

    Reports, evals, fingerprints and saves fall on global steps that are multiples
    of their intervals, so a resumed run does them where the uninterrupted run
    did (only the first report after a resume averages fewer steps, when the
    resume step is not a multiple of --steps-per-report).
    """

    def __init__(self, *, model: nn.Module, optimizer: optim.Optimizer, train_set: CacheDataset,
                 val_set: CacheDataset | None, split: Split, order: GlobalOrder, group: mx.distributed.Group,
                 options: LoopOptions, fixed_options: JsonObject, reporter: Reporter, writer: BackgroundWriter,
                 trained_tokens: int, heartbeat: Heartbeat | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.train_set = train_set
        self.val_set = val_set
        self.split = split
        self.order = order
        self.group = group
        self.options = options
        self.fixed_options = fixed_options
        self.reporter = reporter
        self.writer = writer
        self.trained_tokens = trained_tokens
        self.heartbeat = heartbeat or silent()  # what this rank does, for coord's watch of hangs
        self._truncation_warned = False
        self.last_comm_seconds = 0.0  # the last step's gradient exchange and update (see train_step)
        self.compiled_state, self.micro_step, self.update = make_step_functions(model, optimizer, group)

    def run(self, start_step: int) -> None:
        opts = self.options
        self.model.train()
        if start_step == 0 and self.val_set is not None:
            self.validate(0)
        window = Window()
        self.heartbeat.phase("compiling")  # the first step compiles the graph
        for step in range(start_step + 1, opts.iters + 1):
            started = time.perf_counter()
            loss, tokens = self.train_step(step)
            seconds = time.perf_counter() - started
            # Every rank's compute time (the step less its wait in the all_sum) goes out with its
            # heartbeat: the watch of stragglers compares the ranks by it.
            self.heartbeat.step(step, compute_s=max(0.0, seconds - self.last_comm_seconds))
            self.heartbeat.phase("training")
            window.add(loss, tokens, seconds, self.last_comm_seconds)
            self.trained_tokens += tokens
            last = step == opts.iters
            if step % opts.steps_per_report == 0 or last:
                self.report(step, window)
                window = Window()
            if self.val_set is not None and (step % opts.steps_per_eval == 0 or last):
                self.validate(step)
            if opts.fingerprint_every > 0 and step % opts.fingerprint_every == 0:
                self.writer.fingerprint(step, trainable_arrays(self.model))
            if opts.save_every > 0 and (step % opts.save_every == 0 or last):
                # Every rank saves, on its own node: data parallel ranks hold the same weights and
                # optimizer state, so each node holds the checkpoint a resume needs (nothing is copied).
                # The last step too, whatever the interval: the run's final checkpoint is its result.
                self.save(step)
            if step == opts.corrupt_step:
                self.corrupt(step)
            if step == opts.nan_step:
                self.poison(step)

    def train_step(self, step: int) -> tuple[float, int]:
        totals = None
        for indices in self.split.micro_batches(self.order.examples(step)):
            batch, lengths = self.batch(self.train_set, indices)
            totals = self.micro_step(batch, lengths, totals)
            mx.eval(totals)
        if totals is None:  # pragma: no cover - Split makes at least one micro-batch
            raise ValueError(f"step {step} has no micro-batches")
        exchange = time.perf_counter()
        with self.heartbeat.collective():  # the update adds the gradients across ranks
            if step == self.options.hang_step:
                # --debug-hang: stuck inside the collective, as a JACCL rank spinning on a lost peer
                # is (its peers wait in their all_sum); only SIGKILL ends it.
                threading.Event().wait()
            loss, tokens = self.update(*totals)
            mx.eval(self.compiled_state, loss, tokens)
        # The micro-batches were evaluated above, so this is the wait on the other ranks' gradients, their
        # sum and the optimizer's update: what `coord bench scaling` calls the step's communication.
        self.last_comm_seconds = time.perf_counter() - exchange
        if mx.get_cache_memory() > self.options.clear_cache_threshold:
            mx.clear_cache()  # mlx-lm's --clear-cache-threshold, same rule (0 clears every step)
        return loss.item(), int(tokens.item())

    def batch(self, dataset: CacheDataset, indices: list[int]) -> tuple[mx.array, mx.array]:
        tokens, lengths, truncated = pad_batch([as_item(dataset[i]) for i in indices], self.options.max_seq_length)
        if truncated and not self._truncation_warned:
            self._truncation_warned = True
            self.reporter.say(f"[WARNING] Some sequences are longer than {self.options.max_seq_length} tokens "
                              "and are truncated. Consider pre-splitting your data to save memory.")
        return mx.array(tokens), mx.array(lengths)

    def report(self, step: int, window: Window) -> None:
        seconds = max(window.seconds, 1e-9)
        self.reporter.train(step=step, loss=sum(window.losses) / len(window.losses),
                            learning_rate=self.optimizer.learning_rate.item(),
                            steps_per_second=len(window.losses) / seconds,
                            tokens_per_second=window.tokens / seconds, trained_tokens=self.trained_tokens,
                            peak_memory_gb=mx.get_peak_memory() / 1e9,
                            samples_per_second=len(window.losses) * self.split.global_batch / seconds,
                            comm_seconds=window.comm_seconds / len(window.losses))

    def validate(self, step: int) -> None:
        if self.val_set is None:  # too small for one global batch: no evaluation
            return
        started = time.perf_counter()
        with self.heartbeat.during("evaluating"):
            val_loss = self.evaluate(self.val_set, self.options.val_batches)
        self.reporter.val(step=step, val_loss=val_loss, seconds=time.perf_counter() - started)

    def evaluate(self, dataset: CacheDataset, num_batches: int) -> float:
        """Mean token loss over the first ``num_batches`` global batches of a data set (-1: all of it).

        A batch here is a global batch (G examples, in file order), split into
        micro-batches and ranks as in training: the examples evaluated, and so the
        loss, do not change when a job is relaunched with another split of the same G.
        """
        split = self.split
        batches = len(dataset) // split.global_batch
        if num_batches != -1:
            batches = min(batches, num_batches)
        loss, tokens = mx.array(0.0), mx.array(0.0)
        self.model.eval()
        for b in range(batches):
            examples = list(range(b * split.global_batch, (b + 1) * split.global_batch))
            for indices in split.micro_batches(examples):
                batch_loss, batch_tokens = token_loss_sum(self.model, *self.batch(dataset, indices))
                loss, tokens = loss + batch_loss, tokens + batch_tokens
                mx.eval(loss, tokens)
        self.model.train()
        with self.heartbeat.collective():
            loss, tokens = sum_across_ranks((loss, tokens), self.group)
            return (loss / tokens).item()

    def save(self, step: int) -> None:
        name = f"{step - self.options.step_offset:07d}_adapters.safetensors"
        path = os.path.join(self.options.adapter_path, name)
        epoch, index = self.order.position(step)
        state = trainer_state.build(
            global_step=step, optimizer_step=int(self.optimizer.step.item()), mlx_key=mlx_key(), epoch=epoch,
            index=index, batches_per_epoch=self.order.batches_per_epoch, world_size=self.split.world_size,
            batch_size=self.split.batch_size, grad_accumulation_steps=self.split.accumulation,
            trained_tokens=self.trained_tokens, options=self.fixed_options, skipped=self.order.skipped)
        arrays = {**trainable_arrays(self.model), **optimizer_arrays(self.optimizer)}
        with self.heartbeat.during("saving"):  # training is held while the arrays are copied
            blocking = self.writer.save(path, step, arrays, trainer_state.encode(state))
        if self.split.rank == 0:
            self.reporter.say(f"Iter {step}: Saving adapter weights and trainer state to {path} "
                              f"(training held {blocking * 1000:.1f} ms).")

    def poison(self, step: int) -> None:
        """--debug-nan: every weight NaN from here on, as a run that diverged holds them: the next loss is
        NaN, and so is every checkpoint after."""
        self.model.update(tree_unflatten([(name, value * mx.array(float("nan"), dtype=value.dtype))
                                          for name, value in trainable_arrays(self.model).items()]))
        mx.eval(self.model.parameters())
        print(f"[debug] rank {self.split.rank}: weights made NaN after step {step}", flush=True)

    def corrupt(self, step: int) -> None:
        """--debug-corrupt: make this rank's weights differ, so the replica check has something to find."""
        name, value = sorted(trainable_arrays(self.model).items())[0]
        self.model.update(tree_unflatten([(name, value + 1)]))
        mx.eval(self.model.parameters())
        print(f"[debug] rank {self.split.rank}: perturbed {name} after step {step}", flush=True)
