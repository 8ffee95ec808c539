"""A recovery that moves no checkpoint, on the multi-host cluster: with coord's trainer every
rank writes each checkpoint on its own node. Rank 0's machine is cut off for good; the job goes
on with the two remaining nodes from their own copies of the newest checkpoint, and nothing is
copied or placed for the resume."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import pytest

from tests.cluster.jobs import at_step, events, finish, rank_pid, submit, tiny_project_and_daemon

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

TOTAL = 60
TRAIN6 = ["python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data", "--fine-tune-type",
          "full", "--batch-size", "6", "--iters", str(TOTAL), "--learning-rate", "1e-4"]


@pytest.fixture(scope="module")
def running(netns_cluster):
    with tiny_project_and_daemon(netns_cluster) as holder:
        yield holder


def own_copy(netns_cluster, node: str, run_id: str, step: int) -> Path:
    return (Path(netns_cluster.node(node).workdir) / "checkpoints" / run_id / "attempt-0"
            / f"{step:07d}_adapters.safetensors")


def test_rank0s_node_lost_the_others_resume_from_their_own_copies_and_nothing_is_copied(netns_cluster, running):
    daemon = running["daemon"]
    submit(daemon, running["project"], "own", "--trainer", "coord", "--min-nodes", "2", "--node-timeout", "5",
           "--hang-timeout", "300", command=TRAIN6)
    # frozen at step 25: the checkpoints of steps 10 and 20 are on every node
    job, _ = at_step(netns_cluster, daemon, "own", 25,
                     lambda job: [os.killpg(rank_pid(netns_cluster, job, rank), signal.SIGSTOP) for rank in range(3)])
    deadline = time.monotonic() + 60
    while not all(own_copy(netns_cluster, node, job["run_id"], 20).exists() for node in job["nodes"]):
        # a rank frozen mid-write: let it finish the file (it cannot train a step alone)
        for rank, node in enumerate(job["nodes"]):
            if not own_copy(netns_cluster, node, job["run_id"], 20).exists():
                os.killpg(rank_pid(netns_cluster, job, rank), signal.SIGCONT)
                time.sleep(0.5)
                os.killpg(rank_pid(netns_cluster, job, rank), signal.SIGSTOP)
        assert time.monotonic() < deadline, "the checkpoint of step 20 is not on every node"
    digests = {hashlib.sha256(own_copy(netns_cluster, node, job["run_id"], 20).read_bytes()).hexdigest()
               for node in job["nodes"]}
    assert len(digests) == 1, "the ranks' own copies of one checkpoint are byte-identical"
    time.sleep(5)  # the catalog polls every 2 s and hashes each node's copy on its node
    lost = job["nodes"][0]
    netns_cluster.cut_link(lost)
    try:
        final = finish(daemon, "own", steps=TOTAL)
        found = events(daemon, "own")
        story = final["story"]
        resumed = [e for e in found if e["kind"] == "job.resume_from"]
        assert resumed and resumed[-1]["data"]["step"] == 20, story
        assert resumed[-1]["data"]["copied_to"] == [] and resumed[-1]["data"]["bytes_copied"] == 0, story
        assert sorted(resumed[-1]["data"]["in_place"]) == sorted(job["nodes"][1:]), story
        assert f"({lost}:" not in resumed[-1]["message"], story  # not rank 0's copy, on the lost machine
        placed = [e for e in found if e["kind"] == "job.checkpoint_placed"]
        assert placed and placed[-1]["data"]["copied_to"] == [], story
        assert lost not in final["nodes"] and len(final["nodes"]) == 2, story
        for node in final["nodes"]:  # nothing was sent to the remaining nodes for the resume
            replica_dir = Path(netns_cluster.node(node).workdir) / "checkpoints" / job["run_id"] / "replica"
            assert not replica_dir.exists() or not list(replica_dir.rglob("*.safetensors")), story
    finally:
        netns_cluster.restore_link(lost)
