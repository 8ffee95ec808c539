"""Lose nothing, on the multi-host cluster: rank 0's machine cut off for good. The job goes on
with the two remaining nodes and the same global batch, from the newest checkpoint, whose copies
reached the other nodes in the background; copies whose bytes no longer match their SHA256 (one
node's, the head's) are refused, and the node that held a damaged one is sent a good one."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from tests.cluster.jobs import (TOTAL_STEPS, at_step, events, finish, rank_pid, rank_step, ranks_left, submit,
                                tiny_project_and_daemon, wait_event)
from tests.integration.daemon_harness import coord

pytestmark = pytest.mark.cluster

# A global batch of 6 over three ranks (2 each). On two ranks, with at most 2 examples per rank,
# it becomes 2 per micro-step × 3 accumulation steps: still 6.
TRAIN6 = ["python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data", "--fine-tune-type",
          "full", "--batch-size", "6", "--iters", str(TOTAL_STEPS), "--learning-rate", "1e-4"]


def freeze_ranks(netns_cluster, run_id: str, attempt: int, nodes: list[str], timeout: float = 120) -> list[int]:
    """SIGSTOP each rank of an attempt as soon as its pid file appears; returns their process groups."""
    frozen: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(frozen) < len(nodes) and time.monotonic() < deadline:
        for rank, node in enumerate(nodes):
            pid_file = (Path(netns_cluster.node(node).workdir) / ".coord" / "jobs" / run_id / f"attempt-{attempt}" /
                        f"rank-{rank}" / "pid")
            if rank in frozen or not pid_file.exists():
                continue
            try:
                frozen[rank] = int(pid_file.read_text())
            except ValueError:
                continue  # being written
            os.killpg(frozen[rank], signal.SIGSTOP)
        time.sleep(0.01)
    assert len(frozen) == len(nodes), f"attempt {attempt}'s ranks did not start within {timeout:g} s"
    return list(frozen.values())


@pytest.fixture(scope="module")
def running(netns_cluster):
    with tiny_project_and_daemon(netns_cluster) as holder:
        yield holder


def test_rank0s_node_lost_for_good_the_job_finishes_on_two_from_a_verified_replica(netns_cluster, running):
    daemon = running["daemon"]
    submit(daemon, running["project"], "shrink", "--min-nodes", "2", "--node-timeout", "5", "--hang-timeout", "300",
           command=TRAIN6)
    # frozen at step 25, so that no newer checkpoint appears while a replica is damaged
    job, _ = at_step(netns_cluster, daemon, "shrink", 25,
                     lambda job: [os.killpg(rank_pid(netns_cluster, job, rank), signal.SIGSTOP) for rank in range(3)])
    daemon.wait_for(lambda d: sum(e["kind"] == "job.replicated" and e["message"].startswith("shrink:")
                                  for e in d["events"]) >= 2, 60, "two checkpoints replicated")
    time.sleep(4)  # the catalog polls every 2 s; replication follows it
    replicas = sorted((running["root"] / "state" / "replicas" / job["run_id"] / "attempt-0").glob("*.safetensors"))
    assert len(replicas) >= 2, replicas
    newest = replicas[-1]
    newest_step = int(newest.name[:7])
    lost, second, third = job["nodes"]
    # mlx-lm's newest checkpoint went to every other node too; damage the head's copy and the second node's
    node_copy = (Path(netns_cluster.node(second).workdir) / "checkpoints" / job["run_id"] / "replica" / "attempt-0"
                 / newest.name)
    assert node_copy.exists(), sorted(node_copy.parent.parent.rglob("*"))
    for damaged in (newest, node_copy):
        with open(damaged, "r+b") as handle:  # same size, other bytes
            handle.seek(damaged.stat().st_size // 2)
            handle.write(b"\x00\xff" * 8)
    netns_cluster.cut_link(lost)
    try:
        final = finish(daemon, "shrink")
        found = events(daemon, "shrink")
        story = final["story"]
        refused = [e for e in found if e["kind"] in ("job.checkpoint_rejected", "job.replica_rejected")
                   and e["data"]["step"] == newest_step]
        assert any(f"({second})" in e["message"] for e in refused), story
        resumed = [e for e in found if e["kind"] == "job.resume_from"]
        assert resumed[-1]["data"]["step"] == newest_step, story  # the third node's copy still verified
        placed = [e for e in found if e["kind"] == "job.checkpoint_placed"][-1]
        assert placed["data"]["copied_to"] == [second] and third in placed["data"]["in_place"], story
        resized = [e for e in found if e["kind"] == "job.resized"]
        assert resized and resized[-1]["data"]["left_out"] == [lost], story
        assert "global batch 6" in resized[-1]["message"], story
        assert lost not in final["nodes"] and len(final["nodes"]) == 2
        # the ranks really ran with the recomputed batch: 2 per micro-step, 3 accumulation steps
        node = netns_cluster.node(final["nodes"][0])
        script = (Path(node.home) / ".coord" / "jobs" / job["run_id"] / "rank-0.sh").read_text()
        assert "--batch-size 2 --grad-accumulation-steps 3" in script, script
    finally:
        netns_cluster.restore_link(lost)
    # the rank left behind on the lost node is stopped once its node is back
    daemon.wait_for(lambda d: any(e["kind"] == "job.rank_reaped" for e in d["events"]), 90, "old rank reaped")
    assert ranks_left(netns_cluster) == {}
    logs = coord("logs", "--config", str(daemon.config), "--rank", "1", "shrink", env=daemon.env)
    assert logs.returncode == 0


@pytest.mark.timeout(900)
def test_a_node_left_out_is_brought_back_by_resize_and_replicas_go_to_another_node(netns_cluster, running):
    daemon = running["daemon"]
    submit(daemon, running["project"], "grow", "--min-nodes", "2", "--node-timeout", "3", "--hang-timeout", "300",
           "--replica", "n2", command=[word if word != str(TOTAL_STEPS) else "120" for word in TRAIN6])
    job, _ = at_step(netns_cluster, daemon, "grow", 5, lambda job: netns_cluster.cut_link(job["nodes"][2]))
    away = job["nodes"][2]
    frozen: list[int] = []
    try:
        shrunk = wait_event(daemon, "grow", "job.resized", 120, "the job to shrink to two nodes")[-1]
        # The two-node attempt is frozen as its ranks start, until the resize is asked for: on
        # two cores it can otherwise run to its last step before the node is back.
        frozen = freeze_ranks(netns_cluster, job["run_id"], job["attempt"] + 1, shrunk["data"]["nodes"])
    finally:
        netns_cluster.restore_link(away)
    shrunk_job = {"name": "grow", "run_id": job["run_id"], "attempt": job["attempt"] + 1,
                  "nodes": shrunk["data"]["nodes"]}
    try:
        daemon.wait_for(lambda d: all(n["state"] == "up" for n in d["nodes"]), 60, "the node to be back")
        resized = coord("resize", "--config", str(daemon.config), "grow", env=daemon.env)
        assert resized.returncode == 0, resized.stderr
        assert "after its next checkpoint" in resized.stdout, resized.stdout
        # Let the two ranks run past their next checkpoint, then hold them again: the whole run
        # takes about 3 s here, less than the daemon may need to catalogue a checkpoint (polled
        # every 2 s), and a run that has ended has nothing left to resize. That checkpoint follows
        # the step the attempt resumed from: 10 when the shrink came before step 10, 20 when
        # attempt 0 had saved step 10 before its lost node was seen (a busy machine).
        resumed = [e["data"]["step"] for e in events(daemon, "grow") if e["kind"] == "job.resume_from"]
        past = (max(resumed, default=0) // 10 + 1) * 10 + 5
        for pid in frozen:
            os.killpg(pid, signal.SIGCONT)

        def grown_back() -> bool:  # a daemon quick to catalogue the checkpoint may resize before ``past``
            return any(e["kind"] == "job.resized" and e["data"]["back"] == [away] for e in events(daemon, "grow"))

        deadline, asked = time.monotonic() + 120, time.monotonic()
        while rank_step(netns_cluster, shrunk_job) < past:
            assert time.monotonic() < deadline, (f"the two-node attempt did not reach step {past}",
                                                 [e["message"] for e in events(daemon, "grow")][-8:])
            if time.monotonic() - asked > 0.5:  # the daemon is asked twice a second, the file read every 10 ms
                asked = time.monotonic()
                if grown_back():
                    break
            time.sleep(0.01)
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):  # gone already when the resize came first
                os.killpg(pid, signal.SIGSTOP)
        grown = wait_event(daemon, "grow", "job.resized", 300, "the job to grow back to three nodes",
                           where=lambda e: e["data"]["back"] == [away])
    finally:
        for pid in frozen:  # the resize stopped them; a failed test must not leave them frozen
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)
    final = finish(daemon, "grow", steps=120)
    assert len(final["nodes"]) == 3 and grown, final["story"]
    assert final["restarts"] == 1, final["story"]  # the node loss; the resize is not counted
    # the copies of the checkpoints went to n2 (or to the head while rank 0's node was n2 or n2 was away)
    copies = [e["message"] for e in events(daemon, "grow") if e["kind"] == "job.replicated"]
    assert copies and all(" n2:" in m or "head:" in m for m in copies), copies
    assert any(" n2:" in m for m in copies), copies


@pytest.mark.timeout(900)
def test_a_global_batch_the_remaining_ranks_cannot_split_waits_for_the_node(netns_cluster, running):
    daemon = running["daemon"]
    # --batch-size 3 over three ranks is one example each; two ranks cannot share 3 evenly
    submit(daemon, running["project"], "nodiv", "--min-nodes", "2", "--node-timeout", "3", "--hang-timeout", "300")
    job, _ = at_step(netns_cluster, daemon, "nodiv", 5, lambda job: netns_cluster.cut_link(job["nodes"][2]))
    away = job["nodes"][2]
    try:
        waiting = wait_event(daemon, "nodiv", "job.waiting_for_nodes", 120, "the job to say it cannot shrink",
                             where=lambda e: "cannot be split evenly over 2 ranks" in e["message"])
        assert away in waiting[-1]["message"]
        time.sleep(3)  # still waiting, not shrunk
        assert not [e for e in events(daemon, "nodiv") if e["kind"] == "job.resized"]
    finally:
        netns_cluster.restore_link(away)
    final = finish(daemon, "nodiv")
    assert sorted(final["nodes"]) == sorted(job["nodes"]) and final["restarts"] == 1, final["story"]
    assert any(e["kind"] == "job.nodes_back" for e in events(daemon, "nodiv"))
