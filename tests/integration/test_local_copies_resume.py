"""A recovery that moves no checkpoint: under a real daemon with two local agent nodes, coord's
trainer writes each checkpoint on every node (byte-identical, each validated on its own node); a
killed rank is resumed from each node's own copy, with nothing copied or placed, and the resumed
run still has, at every later step, the loss of a run that was never interrupted.

Real MLX training of the tiny llama of coordinator/cli/tinymodel.py on the CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from coordinator.cli.demo import last_train_step
from coordinator.cli.tinymodel import write_project
from tests.integration.daemon_harness import (DaemonProcess, all_up, coord, environment, short_tempdir,
                                              write_local_cluster)

pytestmark = pytest.mark.timeout(900)
EXACT = 1e-5
ITERS = 24
SAVE_EVERY = 4

COMMAND = ["python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data", "--fine-tune-type",
           "full", "--batch-size", "4", "--iters", str(ITERS), "--learning-rate", "1e-3", "--seed", "7",
           "--val-batches", "1", "--steps-per-eval", "1000"]


@pytest.fixture(scope="module")
def cluster():
    root = short_tempdir()
    write_project(root / "project")
    config = write_local_cluster(root, ("a", "b"), name="own-copies", keepalive_s=0.5)
    daemon = DaemonProcess(config, env=environment()).start()
    daemon.wait_for(all_up, 30, "all nodes up")
    yield daemon, root
    daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


def submit(daemon: DaemonProcess, root: Path, name: str) -> None:
    result = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(root / "project"),
                   "--trainer", "coord", "--save-every", str(SAVE_EVERY), "--keep", "10", "--hang-timeout", "300",
                   "--detach", "--", *COMMAND, env=daemon.env)
    assert result.returncode == 0, result.stderr


def job_of(daemon: DaemonProcess, name: str) -> dict:
    return next(j for j in daemon.status()["jobs"] if j["name"] == name)


def events(daemon: DaemonProcess, name: str) -> list[dict]:
    doc = json.loads(coord("status", "--json", "--events", "500", "--config", str(daemon.config),
                           env=daemon.env).stdout)
    return [e for e in doc["events"] if e["message"].startswith(name + ":")]


def finish(daemon: DaemonProcess, name: str) -> dict:
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), name, env=daemon.env, timeout=600)
    final = json.loads(waited.stdout)
    story = "\n".join(f"{e['kind']}: {e['message']}" for e in events(daemon, name))
    assert waited.returncode == 0 and final["state"] == "succeeded" and final["step"] == ITERS, story
    final["story"] = story
    return final


def rank_dir(root: Path, job: dict, node: str, attempt: int, rank: int) -> Path:
    return root / node / ".coord" / "jobs" / job["run_id"] / f"attempt-{attempt}" / f"rank-{rank}"


def losses(progress: Path) -> dict[int, float]:
    out = {}
    for line in progress.read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            out[record["step"]] = record["loss"]
    return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def settle(root: Path, job: dict, progress: Path, pids: list[int]) -> int:
    """With both ranks frozen: each rank's background writer may have been caught mid-write. Let
    each rank run alone (it cannot train a step without its peer) until its own copy of the newest
    checkpoint is whole, and freeze it again; the newest step reached, once nothing moves."""
    for _ in range(5):
        reached = last_train_step(progress)
        newest = reached // SAVE_EVERY * SAVE_EVERY
        for rank, pid in enumerate(pids):
            own = (root / job["nodes"][rank] / "checkpoints" / job["run_id"] / "attempt-0"
                   / f"{newest:07d}_adapters.safetensors")
            if own.exists():
                continue
            os.killpg(pid, signal.SIGCONT)
            deadline = time.monotonic() + 30
            while not own.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.killpg(pid, signal.SIGSTOP)
        if last_train_step(progress) == reached:
            return reached
    raise AssertionError("the ranks did not settle")


def test_a_killed_rank_resumes_from_each_nodes_own_copy_with_nothing_copied_and_exactly(cluster):
    daemon, root = cluster
    submit(daemon, root, "straight")
    straight = finish(daemon, "straight")
    reference = losses(rank_dir(root, straight, straight["nodes"][0], 0, 0) / "progress.jsonl")
    assert sorted(reference) == list(range(1, ITERS + 1))
    # Every node wrote every checkpoint of the attempt itself, and the copies are byte-identical.
    own = {node: sorted((root / node / "checkpoints" / straight["run_id"] / "attempt-0").glob("*_adapters.safetensors"))
           for node in straight["nodes"]}
    assert [p.name for p in own["a"]] == [p.name for p in own["b"]] == \
        [f"{s:07d}_adapters.safetensors" for s in range(SAVE_EVERY, ITERS + 1, SAVE_EVERY)], own
    for ours, theirs in zip(own["a"], own["b"]):
        assert sha(ours) == sha(theirs), (ours, theirs)

    submit(daemon, root, "killed")
    doc = daemon.wait_for(lambda d: any(j["name"] == "killed" and j["state"] == "running" and j["nodes"]
                                        for j in d["jobs"]), 300, "killed running")
    job = next(j for j in doc["jobs"] if j["name"] == "killed")
    progress = rank_dir(root, job, job["nodes"][0], 0, 0) / "progress.jsonl"
    deadline = time.monotonic() + 300
    while last_train_step(progress) < 2 * SAVE_EVERY + 1:
        assert time.monotonic() < deadline, "no step 9 in time"
        time.sleep(0.005)
    pids = [int((rank_dir(root, job, job["nodes"][r], 0, r) / "pid").read_text()) for r in (0, 1)]
    for pid in pids:  # frozen, so that the kill falls between two checkpoints
        os.killpg(pid, signal.SIGSTOP)
    reached = settle(root, job, progress, pids)
    assert reached < ITERS
    time.sleep(3)  # the catalog polls every 2 s
    os.killpg(pids[1], signal.SIGKILL)
    os.killpg(pids[0], signal.SIGCONT)
    final = finish(daemon, "killed")
    found = events(daemon, "killed")
    resumed = [e for e in found if e["kind"] == "job.resume_from"]
    assert len(resumed) == 1 and final["restarts"] == 1, final["story"]
    start = resumed[0]["data"]["step"]
    assert start == reached // SAVE_EVERY * SAVE_EVERY, final["story"]
    # Nothing moved: both nodes resumed from the copy their own rank wrote.
    assert resumed[0]["data"]["copied_to"] == [] and resumed[0]["data"]["bytes_copied"] == 0, resumed
    assert sorted(resumed[0]["data"]["in_place"]) == ["a", "b"], resumed
    assert not [e for e in found if e["kind"] in ("job.replicated", "job.replica_failed")
                and e["data"].get("step") == start and "resume" in e["message"]]
    placed = [e for e in found if e["kind"] == "job.checkpoint_placed"]
    assert placed and placed[-1]["data"]["copied_to"] == [] and "nothing copied" in placed[-1]["message"], placed
    # rank 0 (the rank that speaks) loaded the file its own node's rank wrote
    log = (root / "state" / "jobs" / final["run_id"] / "attempt-1" / "rank-0.log").read_text()
    own_copy = root / final["nodes"][0] / "checkpoints" / final["run_id"] / "attempt-0" / f"{start:07d}_adapters.safetensors"
    assert f"Loading fine-tuned weights from {own_copy}" in log, log[-3000:]
    assert not any((root / node / "checkpoints" / final["run_id"] / "resume").exists() for node in ("a", "b"))
    assert not any((root / node / "checkpoints" / final["run_id"] / "replica").exists() for node in ("a", "b"))
    # Exact resume still holds: every step after the resume has the uninterrupted run's loss.
    after = losses(rank_dir(root, final, final["nodes"][0], 1, 0) / "progress.jsonl")
    assert sorted(after) == list(range(start + 1, ITERS + 1)), sorted(after)
    for step, loss in after.items():
        assert abs(loss - reference[step]) <= EXACT * abs(reference[step]), (step, loss, reference[step])
