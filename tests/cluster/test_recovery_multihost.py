"""Recovery on the multi-host cluster: a hung rank, a cut link, a daemon restart, a damaged checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from coordinator.tinymodel import write_project
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir

pytestmark = pytest.mark.cluster

TRAIN = ["python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data", "--fine-tune-type",
         "full", "--batch-size", "3", "--iters", "60", "--learning-rate", "1e-4"]


@pytest.fixture(scope="module")
def setup(netns_cluster):
    root = short_tempdir()
    root.chmod(0o755)
    project = write_project(root / "project")
    for path in [project, *project.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    config = netns_cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state")
    holder = {"daemon": DaemonProcess(config, env=environment(),
                                      prefix=["ip", "netns", "exec", netns_cluster.head_ns]).start()}
    holder["daemon"].wait_for(all_up, 30, "all nodes up")
    yield holder, project, root
    holder["daemon"].stop()
    shutil.rmtree(root, ignore_errors=True)


def job_of(doc: dict, name: str) -> dict:
    return next(j for j in doc["jobs"] if j["name"] == name)


def submit(daemon: DaemonProcess, project: Path, name: str, *extra: str) -> None:
    result = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(project),
                   "--save-every", "10", "--detach", *extra, "--", *TRAIN, env=daemon.env)
    assert result.returncode == 0, result.stderr


def wait_step(daemon: DaemonProcess, name: str, step: int) -> dict:
    doc = daemon.wait_for(lambda d: job_of(d, name)["step"] >= step or job_of(d, name)["state"] == "failed",
                          600, f"{name} at step {step}")
    job = job_of(doc, name)
    assert job["state"] == "running", job
    return job


def finish(daemon: DaemonProcess, name: str) -> dict:
    result = coord("wait", "--quiet", "--json", "--config", str(daemon.config), name, env=daemon.env, timeout=900)
    final = json.loads(result.stdout)
    story = "\n".join(e["message"] for e in events(daemon, name))
    assert result.returncode == 0 and final["state"] == "succeeded" and final["step"] == 60, story
    final["story"] = story
    return final


def events(daemon: DaemonProcess, name: str) -> list[dict]:
    doc = json.loads(coord("status", "--json", "--events", "50", "--config", str(daemon.config),
                           env=daemon.env).stdout)
    return [e for e in doc["events"] if e["message"].startswith(name + ":")]


def rank_pid(netns_cluster, job: dict, rank: int) -> int:
    node = netns_cluster.node(job["nodes"][rank])
    path = Path(node.workdir) / ".coord" / "jobs" / job["name"] / f"attempt-{job['attempt']}" / f"rank-{rank}" / "pid"
    return int(path.read_text())


def test_a_stopped_rank_is_caught_by_the_hang_watchdog_and_recovered(netns_cluster, setup):
    holder, project, _ = setup
    daemon = holder["daemon"]
    submit(daemon, project, "hang", "--hang-timeout", "8")
    job = wait_step(daemon, "hang", 15)
    os.kill(rank_pid(netns_cluster, job, 2), signal.SIGSTOP)
    final = finish(daemon, "hang")
    assert final["restarts"] == 1, final["story"]
    kinds = [e["kind"] for e in events(daemon, "hang")]
    assert "job.stacks" in kinds and "job.resume_from" in kinds
    assert any("hung" in e["message"] for e in events(daemon, "hang"))


def test_a_cut_link_is_seen_within_10_s_and_the_job_waits_for_the_node(netns_cluster, setup):
    holder, project, _ = setup
    daemon = holder["daemon"]
    submit(daemon, project, "link")
    wait_step(daemon, "link", 15)
    netns_cluster.cut_link("n3")
    cut = time.monotonic()
    try:
        daemon.wait_for(lambda d: any(e["kind"] == "job.attempt_ended" and "node_lost" in e["message"]
                                      for e in d["events"]), 10, "node loss seen by the job")
        assert time.monotonic() - cut < 10
        daemon.wait_for(lambda d: job_of(d, "link")["state"] == "recovering", 30, "job waiting for the node")
        time.sleep(3)
    finally:
        netns_cluster.restore_link("n3")
    final = finish(daemon, "link")
    assert final["restarts"] == 1
    assert any(e["kind"] == "job.waiting_for_nodes" for e in events(daemon, "link"))
    for spec in netns_cluster.nodes:  # the old attempt's rank on n3 was stopped too
        left = netns_cluster.exec_in(spec.name, ["pgrep", "-u", spec.user, "-f", "mlx_lm_train"])
        assert left.stdout.strip() == ""


def test_a_restarted_daemon_reattaches_and_the_job_finishes(netns_cluster, setup):
    holder, project, _ = setup
    daemon = holder["daemon"]
    submit(daemon, project, "reattach")
    job = wait_step(daemon, "reattach", 15)
    first_attempt = job["attempt"]
    daemon.stop(signal.SIGKILL)
    holder["daemon"] = daemon = DaemonProcess(daemon.config, env=daemon.env, prefix=daemon.prefix).start()
    daemon.wait_for(all_up, 30, "all nodes up under the new daemon")
    final = finish(daemon, "reattach")
    assert final["attempt"] == first_attempt and final["restarts"] == 0  # supervised, not relaunched
    assert any(e["kind"] == "job.reattached" for e in events(daemon, "reattach"))


def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(netns_cluster, setup):
    holder, project, _ = setup
    daemon = holder["daemon"]
    submit(daemon, project, "damaged", "--hang-timeout", "300")
    job = wait_step(daemon, "damaged", 25)
    for rank in range(3):  # freeze the ranks so no newer checkpoint appears meanwhile
        os.killpg(rank_pid(netns_cluster, job, rank), signal.SIGSTOP)
    time.sleep(3)  # the catalog polls every 2 s
    doc = json.loads(coord("status", "--json", "--config", str(daemon.config), env=daemon.env).stdout)
    newest = job_of(doc, "damaged")["last_checkpoint_step"]
    assert newest and newest >= 20
    node = netns_cluster.node(job["nodes"][0])
    path = (Path(node.workdir) / "checkpoints" / "damaged" / f"attempt-{job['attempt']}"
            / f"{newest:07d}_adapters.safetensors")
    with open(path, "r+b") as handle:  # damaged after it was validated
        handle.seek(100)
        handle.write(b"\xff" * 64)
    os.killpg(rank_pid(netns_cluster, job, 1), signal.SIGKILL)
    final = finish(daemon, "damaged")
    assert final["restarts"] == 1
    found = events(daemon, "damaged")
    assert any(e["kind"] == "job.checkpoint_rejected" and e["data"]["step"] == newest for e in found), found
    resumed = [e for e in found if e["kind"] == "job.resume_from"]
    assert resumed and resumed[-1]["data"]["step"] == newest - 10
