"""Run and keep running, on the multi-host cluster: a real mlx_lm fine-tune over three nodes
(different users, homes and venvs), one rank SIGKILLed midway."""

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
def running(netns_cluster):
    root = short_tempdir()
    root.chmod(0o755)
    project = write_project(root / "project")
    for path in [project, *project.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    config = netns_cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state")
    daemon = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", netns_cluster.head_ns]).start()
    daemon.wait_for(all_up, 30, "all nodes up")
    yield daemon, project
    daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


def job(daemon: DaemonProcess, name: str) -> dict:
    return next(j for j in daemon.status()["jobs"] if j["name"] == name)


def test_a_killed_rank_resumes_from_the_newest_checkpoint_on_three_nodes(netns_cluster, running):
    daemon, project = running
    submitted = coord("run", "--config", str(daemon.config), "--name", "tiny3", "--source", str(project),
                      "--save-every", "10", "--hang-timeout", "120", "--detach", "--", *TRAIN, env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    doc = daemon.wait_for(lambda d: job_of(d, "tiny3")["step"] >= 25 or job_of(d, "tiny3")["state"] == "failed",
                          600, "step 25")
    current = job_of(doc, "tiny3")
    assert current["state"] == "running", current
    killed_at = current["step"]
    victim = netns_cluster.node(current["nodes"][1])
    pid = int((Path(victim.workdir) / ".coord" / "jobs" / "tiny3" / "attempt-0" / "rank-1" / "pid").read_text())
    os.kill(pid, signal.SIGKILL)
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), "tiny3", env=daemon.env, timeout=900)
    final = json.loads(waited.stdout)
    events = _all_events(daemon)
    story = "\n".join(e["message"] for e in events)
    assert waited.returncode == 0, story
    assert final["state"] == "succeeded" and final["step"] == 60 and final["restarts"] == 1, story
    resumed = [e for e in events if e["kind"] == "job.resume_from"]
    assert resumed, events
    resume_step = resumed[-1]["data"]["step"]
    assert killed_at - resume_step <= 10 + 2  # at most one checkpoint interval redone (+ polling slack)
    assert any("exited with status 137 (SIGKILL)" in e["message"] for e in events)
    # no rank is left running anywhere
    for spec in netns_cluster.nodes:
        left = netns_cluster.exec_in(spec.name, ["pgrep", "-u", spec.user, "-f", "mlx_lm_train"])
        assert left.stdout.strip() == "", (spec.name, left.stdout)
    # each rank's output is kept on the head, per attempt and per rank
    logs = coord("logs", "--config", str(daemon.config), "--rank", "0", "--attempt", "1", "tiny3", env=daemon.env)
    assert logs.returncode == 0 and logs.stdout


def job_of(doc: dict, name: str) -> dict:
    return next(j for j in doc["jobs"] if j["name"] == name)


def _all_events(daemon: DaemonProcess) -> list[dict]:
    result = coord("status", "--json", "--events", "200", "--config", str(daemon.config), env=daemon.env)
    return json.loads(result.stdout)["events"]
