"""coord's trainer resumes exactly: a SIGKILLed run, resumed from its newest checkpoint, matches the
uninterrupted run at every later step, on one rank and on three (mlx.launch, ring backend); a three-rank
checkpoint resumed on two ranks with the same global batch split another way trains on the same examples;
replicas' fingerprints agree until one is corrupted.

Real MLX training of the tiny llama of coordinator/cli/tinymodel.py on the CPU.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from agent.ranks import validate_safetensors
from agent.trainer import state as trainer_state
from agent.trainer.safetensors_file import read_metadata
from coordinator.cli.tinymodel import write_data, write_model
from tests.integration.daemon_harness import REPO
from tests.node_python import mlx_python

HANG_GUARD_S = 300  # per trainer run; only a guard against hangs
pytestmark = pytest.mark.timeout(3 * HANG_GUARD_S)  # a test with its fixtures runs up to three trainers
EXACT = 1e-5        # a resumed run vs the uninterrupted one
SPLIT = 1e-4        # the same global batch split another way: float sums in another order

LORA_CONFIG = """\
lr_schedule:
  name: cosine_decay
  warmup: 3
  warmup_init: 1.0e-5
  arguments: [1.0e-3, 30, 1.0e-5]
lora_parameters:
  rank: 4
  scale: 10.0
  dropout: 0.1
"""

COMMON = ["--model", "model", "--train", "--data", "data", "--num-layers", "-1", "--steps-per-report", "1",
          "--val-batches", "2", "--seed", "7"]
FULL = [*COMMON, "--fine-tune-type", "full", "--learning-rate", "1e-3"]
# LoRA with dropout (so the RNG key matters), AdamW and a warmup + cosine schedule (so its position matters)
LORA = [*COMMON, "--fine-tune-type", "lora", "--optimizer", "adamw", "-c", "lora.yaml"]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("exact-resume")
    write_model(root / "model")
    write_data(root / "data", train=48, valid=12)
    (root / "lora.yaml").write_text(LORA_CONFIG)
    return root


# --- running the trainer --------------------------------------------------------------------------


def _free_port_block(count: int) -> int:
    """A base port with `count` free ports after it (mlx.launch's ring backend takes one per rank)."""
    for _ in range(100):
        base = random.randrange(20000, 60000)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free port block")


def _command(ranks: int, args: list[str]) -> list[str]:
    train = [mlx_python(), "-m", "agent.train", *args]  # as coord's ranks: an MLX environment without torch
    if ranks == 1:
        return train
    launcher = shutil.which("mlx.launch")
    if launcher is None:
        pytest.skip("mlx.launch is not on PATH")
    return [launcher, "--backend", "ring", "-n", str(ranks), "--starting-port", str(_free_port_block(ranks)),
            "--", *train]


def _env(progress: Path, offset: int | None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("COORD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env["COORD_PROGRESS_FILE"] = str(progress)
    if offset is not None:
        env["COORD_STEP_OFFSET"] = str(offset)
    return env


class Run:
    """One trainer run in the project directory: its adapter path, progress file and output."""

    def __init__(self, project: Path, name: str, ranks: int, args: list[str], offset: int | None = None):
        self.project = project
        self.ranks = ranks
        self.adapters = project / "runs" / name
        self.progress = project / "runs" / f"{name}.jsonl"
        self.log = project / "runs" / f"{name}.log"
        self.adapters.mkdir(parents=True)
        self.argv = _command(ranks, [*args, "--adapter-path", str(self.adapters)])
        self.env = _env(self.progress, offset)

    def _start(self) -> subprocess.Popen:
        with open(self.log, "wb") as log:
            return subprocess.Popen(self.argv, cwd=self.project, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def complete(self) -> "Run":
        proc = self._start()
        try:
            code = proc.wait(HANG_GUARD_S)
        finally:
            _kill_group(proc)
        # mlx.launch can exit 0 after a rank failed: the final weights say the run really finished.
        assert code == 0 and (self.adapters / "adapters.safetensors").exists(), self.output()[-4000:]
        return self

    def kill_at(self, step: int, saved: int = 0) -> "Run":
        """SIGKILL every process of the run once it reports train step `step` or later and its checkpoint
        of step `saved` is on disk (written off the training thread: on a busy machine a few steps later)."""
        proc = self._start()
        deadline = time.monotonic() + HANG_GUARD_S
        try:
            while max(self.records("train"), default=0) < step or max(self.checkpoints(), default=0) < saved:
                assert proc.poll() is None, f"the run ended before it was killed:\n{self.output()[-4000:]}"
                assert time.monotonic() < deadline, f"no train step {step} in time:\n{self.output()[-4000:]}"
                time.sleep(0.01)
        finally:
            _kill_group(proc)
        return self

    def records(self, kind: str) -> dict[int, dict]:
        """Progress records of one kind by step (fingerprints: by step, then rank)."""
        out: dict = {}
        if not self.progress.exists():
            return out
        for line in self.progress.read_text().splitlines():
            record = json.loads(line)
            if record["kind"] != kind:
                continue
            if kind == "fingerprint":
                out.setdefault(record["step"], {})[record["rank"]] = record["sha256"]
            else:
                out[record["step"]] = record
        return out

    def checkpoints(self) -> dict[int, Path]:
        """Checkpoint files by the number in their name (step within the attempt)."""
        return {int(p.name[:7]): p for p in self.adapters.glob("???????_adapters.safetensors")}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


def _trainer_state(path: Path) -> dict:
    return trainer_state.decode(read_metadata(str(path)), str(path))


def _assert_close(reference: dict, other: dict, steps, key: str, rel: float) -> None:
    for step in steps:
        want, got = reference[step][key], other[step][key]
        assert abs(got - want) <= rel * abs(want), f"step {step}: {key} {got!r}, uninterrupted run {want!r}"


def _resume_from_newest(project: Path, killed: Run, name: str, ranks: int, args: list[str],
                        iters: int) -> tuple[Run, int]:
    """Resume from the killed run's newest checkpoint (all of its checkpoints must be complete)."""
    newest = max(killed.checkpoints())
    for path in killed.checkpoints().values():  # a kill mid-write leaves no partial file under a final name
        assert validate_safetensors(str(path))[0], path
    resumed = Run(project, name, ranks, [*args, "--iters", str(iters), "--resume-adapter-file",
                                         str(killed.checkpoints()[newest])], offset=newest).complete()
    return resumed, newest


# --- (a) one rank ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, args", [
    ("full", [*FULL, "--batch-size", "4"]),
    ("lora-accumulated", [*LORA, "--batch-size", "2", "--grad-accumulation-steps", "2"]),
    ("dora", [*COMMON, "--fine-tune-type", "dora", "--learning-rate", "1e-3", "--batch-size", "2"]),
])
def test_one_rank_killed_and_resumed_matches_the_uninterrupted_run(project, kind, args):
    args = [*args, "--save-every", "5", "--steps-per-eval", "10"]
    reference = Run(project, f"one-{kind}-reference", 1, [*args, "--iters", "30"]).complete()
    # The killed run is told a longer job, so it is surely still training when the kill comes.
    killed = Run(project, f"one-{kind}-killed", 1, [*args, "--iters", "1000"]).kill_at(13, saved=10)
    resumed, start = _resume_from_newest(project, killed, f"one-{kind}-resumed", 1, args, iters=30)

    assert 10 <= start < 30
    assert "Resuming at global step" in resumed.output()
    ref_train, got_train = reference.records("train"), resumed.records("train")
    assert sorted(got_train) == list(range(start + 1, 31))
    _assert_close(ref_train, got_train, range(start + 1, 31), "loss", EXACT)
    _assert_close(ref_train, got_train, range(start + 1, 31), "learning_rate", EXACT)
    _assert_close(reference.records("val"), resumed.records("val"), (20, 30), "val_loss", EXACT)

    # Checkpoints are named by the step within the attempt and carry the global step.
    checkpoints = resumed.checkpoints()
    assert sorted(checkpoints) == [s - start for s in range(start + 1, 31) if s % 5 == 0]
    first = min(checkpoints)
    assert _trainer_state(checkpoints[first])["global_step"] == start + first
    saves = resumed.records("checkpoint")
    assert saves[start + first]["bytes"] == checkpoints[first].stat().st_size
    # Both parts of a save are reported. Which is longer is not a property of the code: for a
    # checkpoint of a few kilobytes the write is quick, and on a GPU the blocking part includes
    # the wait for the step's arrays and their copy to host memory (about 20 ms against a 5 ms
    # write, measured on CUDA). That the write runs off the training thread is pinned by
    # tests/unit/test_trainer_checkpoint.py.
    assert saves[start + first]["blocking_seconds"] > 0 and saves[start + first]["write_seconds"] > 0
    _assert_mlx_lm_loads_the_weights(project, reference.checkpoints()[10], kind)
    # The final adapters are weights only, as mlx-lm writes them.
    final = _load(resumed.adapters / "adapters.safetensors")
    assert final and not any(name.startswith(trainer_state.OPTIMIZER_PREFIX) for name in final)


def _load(path: Path) -> dict:
    import mlx.core as mx

    return mx.load(str(path))


def _assert_mlx_lm_loads_the_weights(project: Path, path: Path, kind: str) -> None:
    """What `mlx_lm lora --resume-adapter-file` does: model.load_weights(file, strict=False)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = llama.Model(llama.ModelArgs.from_dict(json.loads((project / "model" / "config.json").read_text())))
    if kind.startswith("lora"):
        linear_to_lora_layers(model, -1, {"rank": 4, "scale": 10.0, "dropout": 0.1})
    elif kind == "dora":  # mlx-lm's defaults for the adapters' shape
        linear_to_lora_layers(model, -1, {"rank": 8, "scale": 20.0, "dropout": 0.0}, use_dora=True)
    model.load_weights(str(path), strict=False)
    params = dict(tree_flatten(model.parameters()))
    saved = _load(path)
    weights = [name for name in saved if not name.startswith(trainer_state.OPTIMIZER_PREFIX)]
    assert len(weights) < len(saved), "the checkpoint holds the optimizer state too"
    assert weights and all(mx.array_equal(params[name], saved[name]).item() for name in weights)


def test_plain_mlx_lm_adapters_resume_with_a_cold_optimizer_from_the_step_offset(project):
    import mlx.core as mx

    plain = project / "plain_adapters.safetensors"  # what mlx-lm writes: weights only, no trainer state
    base = _load(project / "model" / "model.safetensors")
    mx.save_safetensors(str(plain), {k: v for k, v in base.items() if k.startswith("model.layers.")})
    run = Run(project, "plain-resume", 1, [*FULL, "--batch-size", "4", "--iters", "6", "--save-every", "2",
                                           "--resume-adapter-file", str(plain)], offset=4).complete()
    assert "the optimizer starts cold" in run.output()
    assert sorted(run.records("train")) == [5, 6]
    assert _trainer_state(run.checkpoints()[2])["global_step"] == 6


# --- (b), (c), (d) several ranks ------------------------------------------------------------------

THREE_RANKS = [*FULL, "--batch-size", "6", "--save-every", "4", "--steps-per-eval", "6"]
ITERS = 12  # 48 examples in global batches of 6: 8 steps per epoch, so the runs cross an epoch


@pytest.fixture(scope="module")
def three_rank_reference(project) -> Run:
    """The uninterrupted run on three ranks, global batch 6 (one micro-batch of 2 per rank), with fingerprints."""
    args = [*THREE_RANKS, "--iters", str(ITERS), "--fingerprint-every", "4"]
    return Run(project, "three-reference", 3, args).complete()


@pytest.fixture(scope="module")
def two_rank_run(project, three_rank_reference) -> Run:
    """The three-rank job resumed on two ranks from its step-4 checkpoint, as an elastic shrink would:
    global batch 6 again, now 1 example per rank and 3 accumulation steps; rank 1 corrupted after step 10."""
    args = [*FULL, "--batch-size", "2", "--grad-accumulation-steps", "3", "--save-every", "100",
            "--steps-per-eval", "6", "--iters", str(ITERS), "--fingerprint-every", "2", "--debug-corrupt", "1:10",
            "--resume-adapter-file", str(three_rank_reference.checkpoints()[4])]
    return Run(project, "two-ranks", 2, args, offset=4).complete()


def test_three_ranks_killed_and_resumed_match_the_uninterrupted_run(project, three_rank_reference):
    killed = Run(project, "three-killed", 3, [*THREE_RANKS, "--iters", "1000"]).kill_at(6, saved=4)
    resumed, start = _resume_from_newest(project, killed, "three-resumed", 3, THREE_RANKS, iters=ITERS)
    assert 4 <= start < ITERS
    got = resumed.records("train")
    assert sorted(got) == list(range(start + 1, ITERS + 1))
    _assert_close(three_rank_reference.records("train"), got, range(start + 1, ITERS + 1), "loss", EXACT)
    _assert_close(three_rank_reference.records("val"), resumed.records("val"), (ITERS,), "val_loss", EXACT)
    assert _trainer_state(max(resumed.checkpoints().items())[1])["world_size"] == 3


def test_the_fingerprints_of_all_ranks_agree(three_rank_reference):
    fingerprints = three_rank_reference.records("fingerprint")
    assert sorted(fingerprints) == [4, 8, 12]
    for step, by_rank in fingerprints.items():
        assert sorted(by_rank) == [0, 1, 2] and len(set(by_rank.values())) == 1, (step, by_rank)


def test_the_same_global_batch_split_over_two_ranks_trains_on_the_same_examples(three_rank_reference, two_rank_run):
    # Steps 5 to 10 only: after step 10 the two-rank run's rank 1 is corrupted on purpose (see the next test).
    assert sorted(two_rank_run.records("train")) == list(range(5, ITERS + 1))
    _assert_close(three_rank_reference.records("train"), two_rank_run.records("train"), range(5, 11), "loss", SPLIT)
    _assert_close(three_rank_reference.records("val"), two_rank_run.records("val"), (6,), "val_loss", SPLIT)


def test_a_corrupted_replica_shows_in_its_fingerprints(two_rank_run):
    fingerprints = two_rank_run.records("fingerprint")
    assert sorted(fingerprints) == [6, 8, 10, 12]
    for step, by_rank in fingerprints.items():
        assert sorted(by_rank) == [0, 1]
        assert (by_rank[0] == by_rank[1]) == (step <= 10), (step, by_rank)
