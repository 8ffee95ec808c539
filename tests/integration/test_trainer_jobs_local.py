"""coord's trainer under coord on a local three-node cluster: replicas whose weights diverge are
caught by their fingerprints, and the job resumes from a checkpoint taken before."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from coordinator.cli.tinymodel import write_project
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir

CLUSTER = """\
[cluster]
name = "trainer-local"
state_dir = "{root}/state"

[ssh]
keepalive_s = 0.5
""" + "".join(f"""
[[nodes]]
name = "{name}"
host = "local"
workdir = "{{root}}/{name}"
""" for name in ("a", "b", "c"))


@pytest.fixture(scope="module")
def cluster():
    root = short_tempdir()
    write_project(root / "project")
    config = root / "cluster.toml"
    config.write_text(CLUSTER.format(root=root))
    daemon = DaemonProcess(config, env=environment()).start()
    daemon.wait_for(all_up, 30, "all nodes up")
    yield daemon, root
    daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_a_rank_whose_weights_diverge_is_named_and_the_job_resumes_from_before(cluster):
    daemon, root = cluster
    submitted = coord("run", "--config", str(daemon.config), "--name", "diverge", "--source", str(root / "project"),
                      "--trainer", "coord", "--save-every", "2", "--keep", "10", "--hang-timeout", "300",
                      "--detach", "--", "python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data",
                      "data", "--fine-tune-type", "full", "--batch-size", "3", "--iters", "16", "--learning-rate",
                      "1e-4", "--fingerprint-every", "2", "--debug-corrupt", "1:7", env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), "diverge", env=daemon.env,
                   timeout=600)
    final = json.loads(waited.stdout)
    doc = json.loads(coord("status", "--json", "--events", "200", "--config", str(daemon.config),
                           env=daemon.env).stdout)
    found = [e for e in doc["events"] if e["message"].startswith("diverge:")]
    story = "\n".join(e["message"] for e in found)
    assert waited.returncode == 0 and final["state"] == "succeeded" and final["step"] == 16, story
    diverged = [e for e in found if e["kind"] == "job.replica_diverged"]
    assert len(diverged) == 1 and diverged[0]["data"]["ranks"] == [1] and diverged[0]["data"]["step"] == 8, story
    resumed = [e for e in found if e["kind"] == "job.resume_from"]
    assert resumed and resumed[-1]["data"]["step"] == 6, story  # the last step at which every rank agreed
    assert final["restarts"] == 1
    # the trainer's own measure of each save reaches the daemon (the plan's checkpoint overhead)
    saved = [e["data"] for e in found if e["kind"] == "job.checkpoint_saved"]
    assert {2, 4, 6} <= {d["step"] for d in saved}, story
    # both measured and reported; which is larger for a checkpoint of a few kilobytes on two busy
    # cores is a race (that the write runs off the training thread is pinned by a unit test)
    assert all(d["blocking_seconds"] >= 0 and d["write_seconds"] > 0 for d in saved), saved
    # what the fingerprints found is in the plan's worker_consistency, with the node named
    plan = coord("plan", "--json", "--config", str(daemon.config), "--name", "diverge", env=daemon.env, timeout=300)
    assert plan.returncode == 0, plan.stderr
    training = json.loads(plan.stdout)["worker_consistency"]["byzantine_detection"]["training_fingerprints"]
    assert training["enabled"] and training["job"] == "diverge", training
    assert training["last_step"] == 16 and training["last_agreed_step"] == 16  # the resumed attempt agreed
    assert training["steps_compared"] >= 8  # 4 before the divergence, the divergent step, 5 after the resume
    assert training["divergences"] == [f"attempt 0: rank 1 diverged from the majority's weights at step 8 "
                                       f"({final['nodes'][1]})"], training


def test_bench_scaling_runs_the_job_on_one_then_two_nodes_and_measures_each(cluster):
    daemon, root = cluster
    svg = root / "scaling.svg"
    done = coord("bench", "scaling", "--config", str(daemon.config), "--nodes", "b,a", "--json", "--svg", str(svg),
                 "--source", str(root / "project"), "--trainer", "coord", "--hang-timeout", "300", "--",
                 "python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data",
                 "--fine-tune-type", "full", "--batch-size", "4", "--iters", "20", "--steps-per-report", "2",
                 "--learning-rate", "1e-4", env=daemon.env, timeout=600)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    rows = {row["nodes"]: row for row in answer["rows"]}
    assert sorted(rows) == [1, 2] and sorted(answer["runs"]) == ["1", "2"]
    for row in rows.values():
        # coord's trainer reports its samples (4 a step, whatever the number of ranks: a rank's own 2 would be
        # half) and its exchange's time. Its rate is over its steps' own time, the row's steps/s over the wall
        # with the saves and reports between them: higher, by up to 1.6x measured on a loaded 2-core machine.
        assert row["unit"] == "samples/s" and row["throughput"] > 0 and row["steps_per_second"] > 0, row
        assert 0.65 * 4 * row["steps_per_second"] <= row["throughput"] <= 3 * 4 * row["steps_per_second"], row
        assert 0 < row["comm_share"] < 1, row
    assert rows[1]["speedup"] == 1.0 and rows[1]["efficiency"] == 1.0
    assert rows[2]["efficiency"] == pytest.approx(rows[2]["speedup"] / 2)
    # each size ran as a job of its own, on the nodes in the order given, and trained to the end
    doc = json.loads(coord("status", "--json", "--all", "--config", str(daemon.config), env=daemon.env).stdout)
    jobs = {job["run_id"]: job for job in doc["jobs"]}
    assert jobs[answer["runs"]["1"]]["nodes"] == ["b"] and jobs[answer["runs"]["2"]]["nodes"] == ["b", "a"]
    assert all(jobs[run]["state"] == "succeeded" and jobs[run]["step"] == 20 for run in answer["runs"].values())
    chart = svg.read_text()
    assert chart.startswith("<svg") and len(re.findall(r'<rect [^>]*fill="#3366aa"', chart)) == 2  # a bar a size


@pytest.mark.parametrize("trainer", ["mlx_lm", "coord"])
def test_the_last_step_is_a_validated_checkpoint_whatever_the_save_interval(cluster, trainer):
    # 25 steps saved every 10: mlx-lm names checkpoints at 10 and 20 only and writes its final weights to
    # adapters.safetensors; coord's trainer saves at 10 and 20. Either way the run ends with a validated
    # checkpoint of step 25, its result (a resume from 20 would redo the last 5 steps).
    daemon, root = cluster
    name = f"final-{trainer}"
    submitted = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(root / "project"),
                      "--trainer", trainer, "--save-every", "10", "--detach", "--", "python", "-m", "mlx_lm",
                      "lora", "--model", "model", "--train", "--data", "data", "--fine-tune-type", "full",
                      "--batch-size", "3", "--iters", "25", "--learning-rate", "1e-4", env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), name, env=daemon.env, timeout=600)
    final = json.loads(waited.stdout)
    doc = json.loads(coord("status", "--json", "--events", "200", "--config", str(daemon.config),
                           env=daemon.env).stdout)
    found = [e for e in doc["events"] if e["message"].startswith(name + ":")]
    story = "\n".join(e["message"] for e in found)
    assert waited.returncode == 0 and final["state"] == "succeeded" and final["step"] == 25, story
    assert final["last_checkpoint_step"] == 25 and final["restarts"] == 0 and not final["warning"], story
    validated = [e["data"]["step"] for e in found if e["kind"] == "job.checkpoint"]
    assert validated == [10, 20, 25], story
