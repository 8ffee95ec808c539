"""The straggler, named with its cause, on the multi-host cluster: coord's trainer over three nodes
(MLX's ring between them, the demo's tiny model), checkpoints every 10 steps throughout.

- One rank's processes are moved mid-run into a cgroup with a CPU quota of 5% of a core: that rank
  is named a straggler, with a throttled-CPU cause, within 60 s (the bound of 30 s, and 30 s of
  slack for two shared cores; the delay is printed: 20-22 s in the runs so far), shown in ``coord
  status`` and ``--json``; once the quota is lifted, it is cleared.
- A CPU hog started as another user on one node, pinned with that node's rank to one CPU and ahead
  of it (a higher priority): the rank is named, and the hog by its pid and command.
- With ``--straggler-policy drop --min-nodes 2`` the throttled rank's node is shrunk out after its
  grace, and the job goes on on the other two from its last checkpoint.
- Before the quota, the run's warm-up and its checkpoints raise no false alarm.

The nodes are network namespaces of one machine, so they share its CPUs and its process table:
the cgroup and the pinning make one node's rank slower than the others'. This machine's CPU
controller may be cgroup v1's (``cpu.cfs_quota_us``) or v2's (``cpu.max``); both are read alike."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster.cgroups import Quota, cpu_controller, rank_processes, show_cgroups_to, start_cpu_hog
from tests.cluster.jobs import at_step, events, job_of, rank_pid, submit, tiny_project_and_daemon, wait_event
from tests.integration.daemon_harness import coord

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

STEPS = 100000  # stopped by the test long before
TRAIN = ["python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data", "--fine-tune-type",
         "full", "--batch-size", "3", "--iters", str(STEPS), "--learning-rate", "1e-4"]
BOUND_S = 30.0  # the bound: 30 s or 20 steps, whichever is longer (these steps are short)
SLACK_S = 30.0  # two shared cores: the daemon's poll and the agent's sample may wait their turn
@pytest.fixture(scope="module")
def running(netns_cluster):
    with tiny_project_and_daemon(netns_cluster) as holder:
        yield holder


def _stop(daemon, name: str) -> None:
    coord("stop", "--config", str(daemon.config), name, env=daemon.env, timeout=120)
    daemon.wait_for(lambda d: job_of(d, name)["state"] in ("stopped", "failed", "succeeded"), 120, f"{name} stopped")


def _wait_watching(daemon, name: str, kind: str, timeout: float, what: str, rank: int) -> dict:
    """The first event of ``kind`` for ``rank``, printing the job's step and the ranks' compute times
    and scores every few seconds meanwhile (shown with a failure, to tell why it came late)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return wait_event(daemon, name, kind, min(5.0, max(0.1, deadline - time.monotonic())), what,
                              where=lambda event: event["data"].get("rank") == rank)[0]
        except AssertionError:
            if time.monotonic() >= deadline:
                raise
        shown = job_of(daemon.status(events=0), name)
        print(f"{time.strftime('%H:%M:%S')} step {shown.get('step')}, compute {shown.get('rank_compute_seconds')}, "
              f"scores {shown.get('rank_scores')}, named {[s['rank'] for s in shown.get('stragglers') or []]}")


def _story(daemon, name: str) -> str:
    return "\n".join(f"{e['kind']}: {e['message']}" for e in events(daemon, name))


@pytest.mark.skipif(os.geteuid() != 0 or cpu_controller() is None, reason="needs root and a cgroup CPU controller")
def test_a_rank_throttled_by_a_cpu_quota_is_named_with_its_cause_and_cleared_once_the_quota_is_lifted(
        netns_cluster, running):
    daemon, name = running["daemon"], "throttled"
    submit(daemon, running["project"], name, "--trainer", "coord", "--hang-timeout", "600", command=TRAIN)
    quota = None
    try:
        job, _ = at_step(netns_cluster, daemon, name, 40, lambda job: None)
        # Ranks 0 and 1 share CPU 0, rank 2 has CPU 1: rank 2 is the fastest by about two, so once its
        # quota is lifted it is cleared even where the machine's other work slows one core (without the
        # pins, rank 2 stayed at 1.6x the median after the lift on a loaded machine, twice in three runs).
        for rank, cpu in ((0, 0), (1, 0), (2, 1)):
            for pid in rank_processes(rank_pid(netns_cluster, job, rank)):
                subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)], capture_output=True)
        time.sleep(10)  # past the warm-up, through checkpoints: no straggler yet
        assert not [e for e in events(daemon, name) if e["kind"] == "job.straggler"], _story(daemon, name)
        quota = Quota(0.05)
        show_cgroups_to(rank_pid(netns_cluster, job, 2), quota.version)
        quota.take(rank_processes(rank_pid(netns_cluster, job, 2)))
        onset = time.time()
        print(f"{time.strftime('%H:%M:%S')} quota on at step {job_of(daemon.status(events=0), name)['step']}")
        # Rank 2, whatever else is named meanwhile: ranks 0 and 1 share a core with the machine's other work,
        # and one of them was once named first, rightly, with that work as its cause.
        named = _wait_watching(daemon, name, "job.straggler", BOUND_S + SLACK_S, "rank 2 named a straggler", rank=2)
        delay = named["ts"] - onset
        print(f"straggler named {delay:.1f} s after the quota: {named['message']}")
        assert named["data"]["rank"] == 2 and named["data"]["node"] == job["nodes"][2], named
        assert named["data"]["cause"].startswith("CPU throttled by a quota"), named
        assert named["data"]["cause_kind"] == "quota" and named["data"]["score"] >= 1.5, named
        assert delay <= BOUND_S + SLACK_S, delay
        shown = [s for s in job_of(daemon.status(events=0), name)["stragglers"] if s["rank"] == 2]
        assert [(s["rank"], s["node"]) for s in shown] == [(2, job["nodes"][2])], shown
        assert shown[0]["cause"].startswith("CPU throttled by a quota") and shown[0]["score"] >= 1.5, shown
        text = coord("status", "--config", str(daemon.config), env=daemon.env, timeout=60).stdout
        assert f"straggler: rank 2 on {job['nodes'][2]}" in text and "CPU throttled by a quota" in text, text
        quota.lift()
        lifted = time.time()
        # Rank 2's clearing (rank 0 or 1, named meanwhile for the machine's other work, may be cleared too).
        cleared = _wait_watching(daemon, name, "job.straggler_cleared", 60 + SLACK_S, "rank 2 cleared", rank=2)
        print(f"straggler cleared {cleared['ts'] - lifted:.1f} s after the quota was lifted")
        assert cleared["data"]["rank"] == 2, cleared
        # Rank 2 is no longer shown. (Another rank may be, with its cause: the nodes share this
        # machine's two cores with whatever else runs on it, and a busy process there is a real one.)
        assert 2 not in [s["rank"] for s in job_of(daemon.status(events=0), name)["stragglers"]]
    finally:
        if quota is not None:
            quota.remove()
        _stop(daemon, name)


@pytest.mark.skipif(os.geteuid() != 0 or (os.cpu_count() or 1) < 2, reason="needs root and two CPUs")
def test_a_cpu_hog_of_another_user_is_named_by_pid_and_command(netns_cluster, running):
    daemon, name = running["daemon"], "hogged"
    submit(daemon, running["project"], name, "--trainer", "coord", "--hang-timeout", "600", command=TRAIN)
    hog = None
    try:
        job, _ = at_step(netns_cluster, daemon, name, 40, lambda job: None)
        # Rank 1 and the hog on CPU 1, the hog ahead of it (nice -15, set as root before it drops to
        # nobody); the other ranks on CPU 0: rank 1 gets a sliver of its CPU.
        for rank, cpu in ((0, 0), (1, 1), (2, 0)):
            for pid in rank_processes(rank_pid(netns_cluster, job, rank)):
                subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)], capture_output=True)
        hog = start_cpu_hog(Path(running["root"]), 1)
        named = wait_event(daemon, name, "job.straggler", BOUND_S + SLACK_S, "rank 1 named a straggler")[0]
        print(f"named: {named['message']}")
        assert named["data"]["rank"] == 1, named
        assert named["data"]["cause_kind"] == "process", named
        cause = named["data"]["cause"]
        assert f"pid {hog.pid} (nobody: " in cause and "straggler_hog.py" in cause, named
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        _stop(daemon, name)


@pytest.mark.skipif(os.geteuid() != 0 or cpu_controller() is None, reason="needs root and a cgroup CPU controller")
def test_drop_shrinks_a_stragglers_node_out_after_its_grace_and_the_job_trains_on(netns_cluster, running):
    daemon, name = running["daemon"], "dropped"  # a global batch of 6: kept on two nodes (3 each, or 1 x 3 steps)
    submit(daemon, running["project"], name, "--trainer", "coord", "--hang-timeout", "600", "--min-nodes", "2",
           "--straggler-policy", "drop", "--straggler-grace", "5",
           command=[*TRAIN[:TRAIN.index("--batch-size") + 1], "6", *TRAIN[TRAIN.index("--batch-size") + 2:]])
    quota = None
    try:
        job, _ = at_step(netns_cluster, daemon, name, 40, lambda job: None)
        slow = job["nodes"][2]
        quota = Quota(0.05)
        show_cgroups_to(rank_pid(netns_cluster, job, 2), quota.version)
        quota.take(rank_processes(rank_pid(netns_cluster, job, 2)))
        dropped = wait_event(daemon, name, "job.straggler_dropped", BOUND_S + SLACK_S + 60, "the straggler dropped")[0]
        assert dropped["data"]["node"] == slow, dropped
        again = daemon.wait_for(lambda d: job_of(d, name)["attempt"] >= 1 and job_of(d, name)["state"] == "running"
                                and job_of(d, name)["step"] > job["step"], 300, f"{name} relaunched")
        relaunched = job_of(again, name)
        assert slow not in relaunched["nodes"] and len(relaunched["nodes"]) == 2, relaunched
        assert relaunched["restarts"] == 0, relaunched  # a shrink, not a failure
        wait_event(daemon, name, "job.first_step", 300, "the relaunch's first step", count=2)
    finally:
        if quota is not None:
            quota.remove()
        _stop(daemon, name)
