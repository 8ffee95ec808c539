"""Exact resume on the multi-host cluster: coord's trainer over three nodes (different users,
homes and venvs), one rank SIGKILLed; every step after the resume has the loss of the run that
was never interrupted."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.cluster.jobs import at_step, finish, rank_pid, submit, tiny_project_and_daemon

pytestmark = pytest.mark.cluster

STEPS = 60
TRAIN = ["python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data", "--fine-tune-type",
         "full", "--batch-size", "3", "--iters", str(STEPS), "--learning-rate", "1e-4"]


def losses(netns_cluster, job: dict, attempt: int) -> dict[int, float]:
    node = netns_cluster.node(job["nodes"][0])
    progress = Path(node.workdir) / ".coord" / "jobs" / job["run_id"] / f"attempt-{attempt}" / "rank-0" / "progress.jsonl"
    records = [json.loads(line) for line in progress.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.fixture(scope="module")
def running(netns_cluster):
    with tiny_project_and_daemon(netns_cluster) as holder:
        yield holder


def test_a_run_killed_on_three_nodes_resumes_with_the_losses_of_an_uninterrupted_one(netns_cluster, running):
    daemon, project = running["daemon"], running["project"]
    submit(daemon, project, "straight", "--trainer", "coord", command=TRAIN)
    reference = losses(netns_cluster, finish(daemon, "straight", steps=STEPS), attempt=0)
    submit(daemon, project, "killed", "--trainer", "coord", "--hang-timeout", "120", command=TRAIN)
    at_step(netns_cluster, daemon, "killed", 15, lambda job: os.kill(rank_pid(netns_cluster, job, 1), signal.SIGKILL))
    final = finish(daemon, "killed", steps=STEPS)
    assert final["restarts"] == 1, final["story"]
    resumed = losses(netns_cluster, final, attempt=1)
    start = min(resumed) - 1
    assert start in (10, 20, 30, 40) and sorted(resumed) == list(range(start + 1, STEPS + 1)), final["story"]
    for step, loss in resumed.items():
        assert abs(loss - reference[step]) <= 1e-5 * abs(reference[step]), (step, loss, reference[step])
