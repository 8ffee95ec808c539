"""PyTorch jobs under coord on a local cluster of two nodes: real torchrun and Accelerate, real DDP over
Gloo, through the real daemon, agents and CLI. A worker SIGKILLed, a worker's exception, torchrun
itself killed, a worker stopped (a hang), a stop: each ends as coord promises, and a resume is exact
(the weights equal an uninterrupted run's)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir
from tests.integration.test_jobs_local import CLUSTER, job_of
from tests.processes import running_under
from tests.torch_jobs import (
    ACCELERATE,
    DDP,
    DEEPSPEED,
    DEEPSPEED_CONFIG,
    HF_TRAINER,
    expected_accelerate_weights,
    expected_weights,
)

HAS_TORCH = importlib.util.find_spec("torch") is not None  # not imported: torch takes seconds of CPU to import
pytestmark = pytest.mark.skipif(not HAS_TORCH and os.environ.get("CI", "").lower() != "true",
                                reason="torch is not installed in this Python (.ci/setup installs its CPU build)")


@pytest.fixture(scope="module")
def cluster():
    root = short_tempdir()
    (root / "project").mkdir()
    (root / "project" / "ddp.py").write_text(DDP)
    (root / "project" / "acc.py").write_text(ACCELERATE)
    (root / "project" / "hf.py").write_text(HF_TRAINER)
    (root / "project" / "ds_train.py").write_text(DEEPSPEED)
    (root / "project" / "ds.json").write_text(json.dumps(DEEPSPEED_CONFIG))
    (root / "project" / "acc.yaml").write_text('mixed_precision: "no"\ndowncast_bf16: "no"\nnum_machines: 7\n')
    config = root / "cluster.toml"
    config.write_text(CLUSTER.format(root=root))
    daemon = DaemonProcess(config, env=environment(), python=sys.executable).start()  # its nodes need torch
    daemon.wait_for(all_up, 30, "all nodes up")
    yield daemon, root
    daemon.stop()
    for pid in _workers(root):  # a worker a failed test left behind
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


def _run(daemon, root, name: str, *args: str) -> None:
    submitted = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(root / "project"),
                      "--save-every", "5", "--detach", *args, env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr


def _wait(daemon, name: str) -> dict:
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), name, env=daemon.env, timeout=300)
    assert waited.stdout, waited.stderr
    final = json.loads(waited.stdout)
    final["story"] = "\n".join(f"{e['kind']}: {e['message']}" for e in _events(daemon, name))
    return final


def _events(daemon, name: str) -> list[dict]:
    doc = json.loads(coord("status", "--json", "--events", "2000", "--config", str(daemon.config),
                           env=daemon.env).stdout)
    return [e for e in doc["events"] if e["message"].startswith(name + ":")]


def _workers(root: Path, *, node: str | None = None, launcher: bool = False) -> list[int]:
    """The job's workers (``ddp.py``), or torchrun itself, running in a node's workdir."""
    found = []
    for process in running_under(root):
        words = process.words
        if node and process.cwd != str(root / node):
            continue
        script = b"ddp.py" in words or b"acc.py" in words or b"ds_train.py" in words
        if words[1:3] == [b"-m", b"torch.distributed.run"] if launcher else (script and b"-m" not in words[:3]):
            found.append(process.pid)
    return found


def _standbys(root: Path) -> list[int]:
    """Warm launchers (agent.standby) still running in a node's workdir under ``root``."""
    return [p.pid for p in running_under(root)
            if b"agent.standby_runner" in p.words or b"agent.preload" in p.words]


def _no_standby_left(root: Path) -> None:
    """Once a job has ended its standbys go (retired by the daemon, gone within a second)."""
    deadline = time.monotonic() + 15
    while _standbys(root):
        assert time.monotonic() < deadline, f"standbys left: {_standbys(root)}"
        time.sleep(0.1)


def _at_step(daemon, root, name: str, step: int, timeout: float = 120) -> dict:
    """The job once rank 0 of its attempt reported ``step`` (read from its progress file)."""
    doc = daemon.wait_for(lambda d: job_of(d, name)["state"] == "running" and job_of(d, name)["nodes"], 120,
                          f"{name} running")
    job = job_of(doc, name)
    progress = root / job["nodes"][0] / ".coord" / "jobs" / job["run_id"] / f"attempt-{job['attempt']}" / "rank-0" \
        / "progress.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = progress.read_text().splitlines() if progress.exists() else []
        if lines and json.loads(lines[-1])["step"] >= step:
            return job
        time.sleep(0.02)
    logs = coord("logs", "--config", str(daemon.config), name, env=daemon.env)  # what its ranks were doing
    story = "\n".join(f"{e['kind']}: {e['message']}" for e in _events(daemon, name))
    raise AssertionError(f"{name} did not reach step {step}\n{story}\n{logs.stdout[-3000:]}{logs.stderr[-500:]}")


def _final_weights(root: Path, final: dict) -> list[float]:
    import torch

    path = root / final["nodes"][0] / "checkpoints" / final["run_id"] / f"attempt-{final['attempt']}" / "final.pt"
    state = torch.load(path)
    return [*state["weight"].flatten().tolist(), *state["bias"].tolist()]


def test_a_killed_worker_is_named_and_the_job_resumes_exactly_from_its_checkpoint_directory(cluster):
    daemon, root = cluster
    _run(daemon, root, "ddp-kill", "--launcher", "torchrun", "--total-steps", "40", "--", "python", "ddp.py",
         "--steps", "40", "--sleep", "0.05")
    job = _at_step(daemon, root, "ddp-kill", 12)
    (worker,) = _workers(root, node=job["nodes"][1])
    os.kill(worker, signal.SIGKILL)
    final = _wait(daemon, "ddp-kill")
    story = final["story"]
    assert final["state"] == "succeeded" and final["restarts"] == 1 and final["step"] == 40, story
    assert "worker rank 1 failed: Signal 9 (SIGKILL)" in story, story  # from torchrun's own summary
    resumed = [e for e in _events(daemon, "ddp-kill") if e["kind"] == "job.resume_from"]
    assert resumed and resumed[0]["data"]["step"] >= 10, story
    assert "every node from its own copy, nothing copied" in resumed[0]["message"]  # rank 0's copy was spread
    assert "(complete: 2 files, 2 float tensors read, no NaN; whole on a, b)" in story  # judged by its COMPLETE file
    assert _final_weights(root, final) == expected_weights(40, 2)
    assert not _workers(root) and not _workers(root, launcher=True)
    # The relaunch ran in each node's standby, its torchrun imported while attempt 0 trained.
    launched = [e for e in _events(daemon, "ddp-kill") if e["kind"] == "job.launched"]
    assert launched[0]["data"]["warm"] == [] and launched[1]["data"]["warm"] == job["nodes"], story
    _no_standby_left(root)


def test_a_worker_that_aborts_after_the_last_checkpoint_ends_the_job_succeeded_at_once_and_said(cluster):
    daemon, root = cluster
    _run(daemon, root, "ddp-abort", "--launcher", "torchrun", "--total-steps", "10", "--", "python", "ddp.py",
         "--steps", "10", "--abort-at-exit")
    final = _wait(daemon, "ddp-abort")
    story = final["story"]
    assert final["state"] == "succeeded" and final["restarts"] == 0 and final["attempt"] == 0, story
    assert "checkpoint of step 10 validated" in story, story
    said = [e for e in _events(daemon, "ddp-abort") if e["kind"] == "job.failed_after_last_step"]
    assert len(said) == 1 and "rank 1 on" in said[0]["message"] and "SIGABRT" in said[0]["message"], story
    assert "after its last step" in final["warning"] and "nothing rerun" in final["warning"], final
    assert _final_weights(root, final) == expected_weights(10, 2)
    # Without --total-steps coord cannot tell the last step: the same abort is a failure, and the job
    # is run again from its newest checkpoint (the script finds nothing left to train and ends).
    _run(daemon, root, "ddp-abort-open", "--launcher", "torchrun", "--", "python", "ddp.py", "--steps", "10",
         "--abort-at-exit")
    again = _wait(daemon, "ddp-abort-open")
    assert again["state"] == "succeeded" and again["restarts"] == 1 and not again["warning"], again["story"]


def test_a_torchrun_command_runs_its_processes_per_node_and_a_workers_exception_is_named(cluster):
    daemon, root = cluster
    refused = coord("run", "--config", str(daemon.config), "--name", "bad", "--", "torchrun", "--nnodes", "2",
                    "ddp.py", env=daemon.env)
    assert refused.returncode == 2 and "--nnodes: coord gives the number of nodes" in refused.stderr, refused.stderr
    _run(daemon, root, "ddp-four", "--max-restarts", "1", "--total-steps", "20", "--", "torchrun", "--nproc-per-node", "2", "ddp.py",
         "--steps", "20", "--fail-at", "7")
    final = _wait(daemon, "ddp-four")
    story = final["story"]
    assert final["state"] == "succeeded" and final["restarts"] == 1 and final["step"] == 20, story
    # The worker's own exception, from its TORCHELASTIC_ERROR_FILE (the script's @record)
    assert "worker 1 on a: RuntimeError: the data loader broke at step 7" in story, story
    assert "gloo" in story
    assert _final_weights(root, final) == pytest.approx(expected_weights(20, 4), abs=1e-6)


def test_a_killed_torchrun_leaves_no_worker_and_a_stop_ends_every_process(cluster):
    """On one node, so that no peer's loss ends the orphan for coord: a worker of a killed torchrun runs on
    in a session of its own, unless the rank runner (its subreaper) ends it."""
    daemon, root = cluster
    _run(daemon, root, "ddp-orphans", "--launcher", "torchrun", "--nodes", "b", "--", "python", "ddp.py",
         "--steps", "100000", "--sleep", "0.05")
    _at_step(daemon, root, "ddp-orphans", 5)
    (launcher,) = _workers(root, node="b", launcher=True)
    (orphan,) = _workers(root, node="b")
    os.kill(launcher, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while Path(f"/proc/{orphan}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{orphan}").exists(), "torchrun's worker outlived it"
    daemon.wait_for(lambda d: job_of(d, "ddp-orphans")["attempt"] == 1 and job_of(d, "ddp-orphans")["step"] >= 7,
                    120, "attempt 1 training")
    stopped = coord("stop", "--config", str(daemon.config), "ddp-orphans", env=daemon.env, timeout=120)
    assert stopped.returncode == 0 and "ddp-orphans: stopped" in stopped.stdout, stopped.stderr
    assert not _workers(root) and not _workers(root, launcher=True)
    _no_standby_left(root)


def test_a_stopped_worker_is_caught_as_a_hang_named_and_resumed(cluster):
    daemon, root = cluster
    # 8 s: after its last step the script saves, meets its peer at a barrier, tears the process group
    # down and exits with torch loaded, then torchrun exits: no step comes meanwhile, and on a loaded
    # 2-core machine that took over 4 s (a second, needless restart)
    _run(daemon, root, "ddp-hang", "--launcher", "torchrun", "--hang-timeout", "8", "--total-steps", "30", "--",
         "python", "ddp.py",
         "--steps", "30", "--sleep", "0.05", "--hang-at", "12")
    final = _wait(daemon, "ddp-hang")
    story = final["story"]
    assert final["state"] == "succeeded" and final["restarts"] == 1 and final["step"] == 30, story
    hangs = [e for e in _events(daemon, "ddp-hang") if e["kind"] == "job.hang"]
    assert hangs and "rank 1" in hangs[0]["message"] and "stopped" in hangs[0]["message"], story
    assert _final_weights(root, final) == expected_weights(30, 2)


def test_an_accelerate_job_joins_each_nodes_random_states_and_resumes_exactly_after_a_killed_worker(cluster):
    daemon, root = cluster
    _run(daemon, root, "acc-kill", "--total-steps", "40", "--", "accelerate", "launch", "--config_file", "acc.yaml", "acc.py", "--steps",
         "40", "--sleep", "0.05")
    job = _at_step(daemon, root, "acc-kill", 12)
    (worker,) = _workers(root, node=job["nodes"][1])
    os.kill(worker, signal.SIGKILL)
    final = _wait(daemon, "acc-kill")
    story = final["story"]
    assert final["state"] == "succeeded" and final["restarts"] == 1 and final["step"] == 40, story
    # save_state wrote random_states_1.pkl on b alone: the whole is joined and on both nodes
    assert "(accelerate: 4 files, 2 float tensors read, no NaN, joined from a, b; whole on a, b)" in story, story
    resumed = [e for e in _events(daemon, "acc-kill") if e["kind"] == "job.resume_from"]
    assert resumed and resumed[0]["data"]["step"] >= 10 and "nothing copied" in resumed[0]["message"], story
    newest = 40 - resumed[0]["data"]["step"]  # the last checkpoint, numbered within attempt 1
    step_dir = root / "b" / "checkpoints" / final["run_id"] / "attempt-1" / f"{newest:07d}"
    assert sorted(p.name for p in step_dir.iterdir()) == ["model.safetensors", "optimizer.bin", "random_states_0.pkl",
                                                          "random_states_1.pkl"]
    # coord's config for each node kept the user's own keys, its machines are coord's
    config = (root / "a" / ".coord" / "jobs" / final["run_id"] / "attempt-1" / "rank-0" / "accelerate.yaml").read_text()
    assert "downcast_bf16: 'no'" in config and "num_machines: 2" in config and "machine_rank: 0" in config
    assert _final_weights(root, final) == expected_accelerate_weights(40, 2)


def test_hugging_face_trainers_steps_and_logged_loss_are_coords_progress(cluster):
    daemon, root = cluster
    _run(daemon, root, "hf", "--total-steps", "20", "--launcher", "torchrun", "--", "python", "hf.py", "20")
    final = _wait(daemon, "hf")
    assert final["state"] == "succeeded" and final["step"] == 20 and final["restarts"] == 0, final["story"]
    assert final["loss"] is not None  # logged every 5 steps, kept between
    assert "rank 0 reports its progress: watched for hangs" in final["story"]
    progress = root / "a" / ".coord" / "jobs" / final["run_id"] / "attempt-0" / "rank-0" / "progress.jsonl"
    records = [json.loads(line) for line in progress.read_text().splitlines()]
    assert sorted({r["step"] for r in records}) == list(range(1, 21))  # every step, from the main process only
    assert [r["step"] for r in records if "loss" in r] == [5, 10, 15, 20]


def _plan(daemon, root: Path, launcher: str, batch: int, global_batch: int) -> Path:
    """What `coord plan --launcher L` writes for the tiny model on this cluster, and where."""
    from coordinator.cli.tinymodel import write_model

    model = write_model(root / f"{launcher}-plan-model")
    out = root / f"coord-{launcher}"
    planned = coord("plan", "--config", str(daemon.config), "--launcher", launcher, "--model", str(model),
                    "--batch-size", str(batch), "--global-batch-size", str(global_batch), "--config-dir", str(out),
                    env=daemon.env, timeout=300)
    assert planned.returncode == 0, planned.stderr
    return out


def test_a_plan_written_by_coord_plan_and_edited_is_what_the_run_uses(cluster):
    import yaml

    daemon, root = cluster
    out = _plan(daemon, root, "accelerate", 4, 8)
    assert sorted(p.name for p in out.iterdir()) == ["accelerate-a.yaml", "accelerate-b.yaml", "plan.json"]
    first = out / "accelerate-a.yaml"
    first.write_text(first.read_text() + 'dynamo_backend: "NO"\n')  # the user's own edit, kept
    _run(daemon, root, "acc-plan", "--plan", str(out), "--", "python", "acc.py", "--steps", "12")
    final = _wait(daemon, "acc-plan")
    assert final["state"] == "succeeded" and final["step"] == 12 and final["nodes"] == ["a", "b"], final["story"]
    rank_dir = root / "b" / ".coord" / "jobs" / final["run_id"] / "attempt-0" / "rank-1"
    config = yaml.safe_load((rank_dir / "accelerate.yaml").read_text())
    assert config["dynamo_backend"] == "NO" and config["main_training_function"] == "main"  # edited, and the plan's
    assert config["num_machines"] == 2 and config["machine_rank"] == 1 and config["main_process_ip"] == "127.0.0.1"
    # the plan's batch: 4 per process × 1 process × 2 nodes × 1 accumulation = 8
    logs = coord("logs", "--config", str(daemon.config), "acc-plan", env=daemon.env)
    assert "batch: global 8, accumulation 1" in logs.stdout, logs.stdout[-2000:]
    assert _final_weights(root, final) == expected_accelerate_weights(12, 2)
    # a launcher that is not the plan's is refused before anything is submitted
    refused = coord("run", "--config", str(daemon.config), "--plan", str(out), "--launcher", "torchrun", "--",
                    "python", "acc.py", env=daemon.env)
    assert refused.returncode == 2 and "the plan's launcher, accelerate" in refused.stderr


HAS_DEEPSPEED = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; m.version('deepspeed')"],
                               capture_output=True).returncode == 0
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED and os.environ.get("CI", "").lower() != "true",
                                     reason="deepspeed is not installed in this Python (.ci/setup installs it)")


@needs_deepspeed
def test_a_deepspeed_plan_edited_to_zero2_joins_each_ranks_states_and_resumes_a_killed_worker(cluster):
    daemon, root = cluster
    out = _plan(daemon, root, "deepspeed", 8, 16)
    config = json.loads((out / "ds_config.json").read_text())
    assert config["zero_optimization"] == {"stage": 0}  # CPU nodes: a replica fits, DDP is ZeRO stage 0
    config["zero_optimization"] = {"stage": 2}  # the user's edit: ZeRO-2 all the same
    config.update(zero_allow_untested_optimizer=True, gradient_clipping=0.0)
    (out / "ds_config.json").write_text(json.dumps(config))
    _run(daemon, root, "ds-kill", "--plan", str(out), "--keep", "10", "--total-steps", "30", "--", "python",
         "ds_train.py", "--steps", "30",
         "--sleep", "0.05")
    job = _at_step(daemon, root, "ds-kill", 12, timeout=240)
    (worker,) = _workers(root, node=job["nodes"][1])
    os.kill(worker, signal.SIGKILL)
    final = _wait(daemon, "ds-kill")
    story = final["story"]
    assert final["state"] == "succeeded" and final["restarts"] == 1 and final["step"] == 30, story
    # rank 0 wrote the model states and latest on a, rank 1 its ZeRO states on b: joined, and whole on both
    assert "(deepspeed:" in story and "joined from a, b; whole on a, b)" in story, story
    resumed = [e for e in _events(daemon, "ds-kill") if e["kind"] == "job.resume_from"]
    assert resumed and resumed[0]["data"]["step"] >= 10, story
    step_dir = root / "b" / "checkpoints" / final["run_id"] / "attempt-0" / "0000010"
    tag = (step_dir / "latest").read_text().strip()
    assert sorted(p.name for p in (step_dir / tag).iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    # each attempt ran with the plan's JSON as edited, its batch the attempt's
    written = root / "b" / ".coord" / "jobs" / final["run_id"] / "attempt-1" / "rank-1" / "ds_config.json"
    used = json.loads(written.read_text())
    assert used["zero_optimization"] == {"stage": 2} and (used["train_batch_size"],
                                                           used["train_micro_batch_size_per_gpu"],
                                                           used["gradient_accumulation_steps"]) == (16, 8, 1)
    logs = coord("logs", "--config", str(daemon.config), "ds-kill", env=daemon.env)
    assert "ds config: stage 2, batch 16" in logs.stdout, logs.stdout[-2000:]
    # the uninterrupted run's weights (ZeRO-2 sums the ranks' gradients in its own order: float32 rounding)
    assert _final_weights(root, final) == pytest.approx(expected_weights(30, 2), rel=1e-5, abs=1e-6)
