"""PyTorch jobs on the multi-host cluster: torchrun and Accelerate across three nodes, each a namespace
with its own sshd, user, home and venv (torch's CPU build on its path), reached over real SSH; DDP over
Gloo between the namespaces. A worker SIGKILLed, the daemon SIGKILLed and started again, a worker
stopped (a hang), rank 0's node cut for good (the job shrinks to two and keeps its global batch): each
is recovered by coord, and the resumes are exact."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.cgroups import Quota, cpu_controller, rank_processes, show_cgroups_to, start_cpu_hog
from tests.cluster.jobs import events, job_of, rank_pid, wait_event
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir
from tests.torch_jobs import ACCELERATE, DDP, expected_accelerate_weights, expected_weights

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def torch_cluster(netns_cluster) -> Iterator[dict]:
    """Every node with torch, the scripts in a project every node user can read, and a daemon in the head."""
    pytest.importorskip("torch", reason="torch is not installed in this Python (.ci/setup installs its CPU build)")
    with_torch = netns_cluster.add_torch()
    root = short_tempdir()
    root.chmod(0o755)
    project = root / "project"
    project.mkdir(mode=0o755)
    for name, text in (("ddp.py", DDP), ("acc.py", ACCELERATE)):
        (project / name).write_text(text)
        (project / name).chmod(0o644)
    config = netns_cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state",
                                              extra_node_fields=with_torch)
    holder = {"root": root, "project": project, "config": config,
              "daemon": DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", netns_cluster.head_ns],
                                      python=sys.executable)}
    holder["daemon"].start()
    try:
        holder["daemon"].wait_for(all_up, 60, "all nodes up")
        yield holder
    finally:
        holder["daemon"].stop()
        for spec in netns_cluster.nodes:  # nothing of these jobs is left running on any node
            netns_cluster.exec_in(spec.name, ["pkill", "-KILL", "-u", spec.user, "-f", "ddp.py|acc.py"])
        shutil.rmtree(root, ignore_errors=True)


def _submit(holder: dict, name: str, *args: str) -> None:
    daemon = holder["daemon"]
    done = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(holder["project"]),
                 "--save-every", "5", "--detach", *args, env=daemon.env)
    assert done.returncode == 0, done.stderr


def _finish(daemon: DaemonProcess, name: str, steps: int) -> dict:
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), name, env=daemon.env, timeout=600)
    final = json.loads(waited.stdout)
    final["story"] = "\n".join(f"{e['kind']}: {e['message']}" for e in events(daemon, name))
    assert waited.returncode == 0 and final["state"] == "succeeded" and final["step"] == steps, final["story"]
    return final


def _progress(netns_cluster, job: dict) -> Path:
    node = netns_cluster.node(job["nodes"][0])
    return Path(node.workdir) / ".coord" / "jobs" / job["run_id"] / f"attempt-{job['attempt']}" / "rank-0" / \
        "progress.jsonl"


def _at_step(netns_cluster, daemon: DaemonProcess, name: str, step: int, attempt: int = 0) -> dict:
    def story() -> str:
        return "\n".join(f"{e['kind']}: {e['message']}" for e in events(daemon, name))

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = job_of(daemon.status(), name)
        if job["state"] == "running" and job["attempt"] == attempt and job["nodes"]:
            break
        assert job["state"] not in ("failed", "succeeded", "stopped"), story()
        time.sleep(0.2)
    else:
        raise AssertionError(f"{name} attempt {attempt} not running:\n{story()}")
    while time.monotonic() < deadline:
        lines = _progress(netns_cluster, job).read_text().splitlines() if _progress(netns_cluster, job).exists() else []
        if lines and json.loads(lines[-1])["step"] >= step:
            return job
        time.sleep(0.02)
    raise AssertionError(f"{name} did not reach step {step}:\n{story()}")


def _worker(netns_cluster, node: str, script: str) -> int:
    """The pid of the training worker on ``node`` (namespaces share the pid space)."""
    spec = netns_cluster.node(node)
    found = netns_cluster.exec_in(node, ["pgrep", "-u", spec.user, "-f", f"python[0-9.]* -u {script}"])
    pids = [int(p) for p in found.stdout.split()]
    assert len(pids) == 1, f"{script} on {node}: {pids}"
    return pids[0]


def _weights(netns_cluster, final: dict) -> list[float]:
    import torch

    node = netns_cluster.node(final["nodes"][0])
    path = Path(node.workdir) / "checkpoints" / final["run_id"] / f"attempt-{final['attempt']}" / "final.pt"
    state = torch.load(path)
    return [*state["weight"].flatten().tolist(), *state["bias"].tolist()]


def test_torchrun_across_three_nodes_survives_a_killed_worker_and_a_killed_daemon_exactly(netns_cluster,
                                                                                         torch_cluster):
    daemon = torch_cluster["daemon"]
    _submit(torch_cluster, "mh-ddp", "--launcher", "torchrun", "--total-steps", "50", "--", "python", "ddp.py",
            "--steps", "50", "--sleep", "0.1")
    job = _at_step(netns_cluster, daemon, "mh-ddp", 12)
    assert job["nodes"] == ["n1", "n2", "n3"], job
    os.kill(_worker(netns_cluster, "n2", "ddp.py"), signal.SIGKILL)
    # The restart runs; then the daemon is killed and started again under it.
    _at_step(netns_cluster, daemon, "mh-ddp", 30, attempt=1)
    daemon.stop(signal.SIGKILL)
    daemon.start()
    daemon.wait_for(all_up, 60, "all nodes up under the next daemon")
    final = _finish(daemon, "mh-ddp", 50)
    story = final["story"]
    assert final["restarts"] == 1 and final["attempt"] == 1, story
    assert "worker rank 1 failed: Signal 9 (SIGKILL)" in story and "supervising attempt 1 again" in story, story
    assert "(complete: 2 files, 2 float tensors read, no NaN; whole on n1, n2, n3)" in story, story  # rank 0's, everywhere
    launched = [e for e in events(daemon, "mh-ddp") if e["kind"] == "job.launched"][0]
    assert "(gloo)" in launched["message"], launched
    # Three ranks sum their gradients in an order of Gloo's own: equal to the last bits.
    assert _weights(netns_cluster, final) == pytest.approx(expected_weights(50, 3), abs=1e-6)


def test_accelerate_across_three_nodes_resumes_a_stopped_worker_from_every_nodes_part_exactly(netns_cluster,
                                                                                              torch_cluster):
    daemon = torch_cluster["daemon"]
    _submit(torch_cluster, "mh-acc", "--hang-timeout", "6", "--total-steps", "48", "--", "accelerate", "launch",
            "acc.py", "--steps", "48",
            "--sleep", "0.05")
    _at_step(netns_cluster, daemon, "mh-acc", 12)
    os.kill(_worker(netns_cluster, "n3", "acc.py"), signal.SIGSTOP)
    final = _finish(daemon, "mh-acc", 48)
    story = final["story"]
    assert final["restarts"] == 1, story
    hangs = [e for e in events(daemon, "mh-acc") if e["kind"] == "job.hang"]
    assert hangs and "rank 2" in hangs[0]["message"] and "stopped" in hangs[0]["message"], story
    # save_state wrote each rank's random states on its own node: joined, and whole on every node
    assert "(accelerate: 5 files, 2 float tensors read, no NaN, joined from n1, n2, n3; whole on n1, n2, n3)" \
        in story, story
    assert "every node from its own copy, nothing copied" in story, story
    assert _weights(netns_cluster, final) == pytest.approx(expected_accelerate_weights(48, 3), abs=1e-6)


def test_rank0s_node_cut_for_good_the_torchrun_job_finishes_on_two_with_its_global_batch(netns_cluster,
                                                                                         torch_cluster):
    daemon = torch_cluster["daemon"]
    _submit(torch_cluster, "mh-shrink", "--launcher", "torchrun", "--min-nodes", "2", "--node-timeout", "5",
            "--global-batch", "24", "--micro-batch", "4", "--procs-per-node", "1", "--", "python", "ddp.py",
            "--steps", "40", "--sleep", "0.1")
    _at_step(netns_cluster, daemon, "mh-shrink", 12)
    # Cut once the checkpoint of step 10 is whole on every node (rank 0 wrote it on n1 alone).
    deadline = time.monotonic() + 60
    while not any(e["kind"] == "job.checkpoint" and e["data"]["step"] == 10 for e in events(daemon, "mh-shrink")):
        assert time.monotonic() < deadline, "the checkpoint of step 10 was not validated"
        time.sleep(0.1)
    netns_cluster.cut_link("n1")
    try:
        final = _finish(daemon, "mh-shrink", 40)
    finally:
        netns_cluster.restore_link("n1")
    story = final["story"]
    assert final["nodes"] == ["n2", "n3"] and final["restarts"] >= 1, story
    assert "3 → 2 ranks; left out n1" in story and "global batch 24" in story, story
    # n2 and n3 held rank 0's checkpoint directories: the resume needs nothing from the cut node. A
    # newer checkpoint that reached only one of them before the cut (the job trains on while the
    # link goes) is completed from that one.
    resumed = [e for e in events(daemon, "mh-shrink") if e["kind"] == "job.resume_from"]
    assert resumed, story
    said = resumed[-1]["message"]
    assert "every node from its own copy, nothing copied" in said or re.search(r"copied from n[23]:", said), story
    assert resumed[-1]["data"]["step"] >= 10, story
    node = netns_cluster.node("n2")
    logs = sorted((Path(node.workdir) / ".coord" / "jobs" / final["run_id"]).glob("attempt-*/rank-0/output.log"))
    said = [line for line in logs[-1].read_text().splitlines() if line.startswith("global batch")]
    assert said == ["global batch 24 = 4 x 2 x 3"], said  # 3 nodes × 4 × 2 before; 2 nodes × 4 × 3 now


def test_a_torchrun_job_whose_loss_turns_nan_rolls_back_skips_the_batches_and_finishes(netns_cluster, torch_cluster):
    # Every weight NaN at step 17 of the first attempt: its loss is NaN from there. coord rolls the run back
    # to the checkpoint of step 15 (written before it; the one of step 20 is not resumed from), the script
    # skips the 4 batches after it, and the run finishes with finite losses, without using a restart.
    daemon = torch_cluster["daemon"]
    daemon.wait_for(all_up, 120, "every node up again (the test before cut one)")
    _submit(torch_cluster, "mh-nan", "--launcher", "torchrun", "--total-steps", "40", "--skip-on-rollback", "4",
            "--", "python", "ddp.py", "--steps", "40", "--sleep", "0.1", "--nan-at", "17")
    final = _finish(daemon, "mh-nan", 40)
    story = final["story"]
    assert final["restarts"] == 0 and final["rollbacks"] == 1, story
    assert isinstance(final["loss"], float) and final["loss"] == final["loss"], final  # finite, not "nan"
    (diverged,) = [e for e in events(daemon, "mh-nan") if e["kind"] == "job.diverged"]
    assert diverged["data"]["step"] == 17 and "loss is nan at step 17" in diverged["message"], story
    assert "rolling back to the checkpoint of step 15, skipping the 4 batches after it" in diverged["message"], story
    logs = coord("logs", "--config", str(daemon.config), "--rank", "0", "--attempt", "1", "mh-nan", env=daemon.env)
    assert "skipping 4 batches after the rollback" in logs.stdout, logs.stdout[-3000:]


@pytest.mark.skipif(os.geteuid() != 0 or cpu_controller() is None, reason="needs root and a cgroup CPU controller")
def test_a_torchrun_worker_throttled_by_a_cpu_quota_is_named_a_straggler_with_that_cause_and_cleared(netns_cluster,
                                                                                                     torch_cluster):
    # Each DDP worker reports its forward pass's time (coord_script.report(compute_seconds=...)), made a few
    # milliseconds of matrix products (--work); n3's worker is moved into a cgroup held to 5% of a core
    # mid-run: named within the bound, the quota its cause.
    daemon, name = torch_cluster["daemon"], "mh-slow"
    _submit(torch_cluster, name, "--launcher", "torchrun", "--total-steps", "100000", "--hang-timeout", "600", "--",
            "python", "ddp.py", "--steps", "100000", "--sleep", "0.05", "--work", "10")
    quota = None
    try:
        job = _at_step(netns_cluster, daemon, name, 20)
        # The nodes share this machine's cores with whatever else runs: a rank slowed by that is a straggler
        # too, with that cause. The quota comes once none is shown.
        daemon.wait_for(lambda d: not job_of(d, name)["stragglers"], 120, "no straggler shown")
        worker = _worker(netns_cluster, "n3", "ddp.py")
        quota = Quota(0.05)
        show_cgroups_to(worker, quota.version)
        quota.take(sorted({*rank_processes(rank_pid(netns_cluster, job, 2)), worker}))  # torchrun's and its worker
        onset = time.time()
        named = wait_event(daemon, name, "job.straggler", 60, "n3's worker named a straggler after the quota",
                           where=lambda e: e["ts"] >= onset and e["data"]["node"] == "n3")[0]
        print(f"straggler named {named['ts'] - onset:.1f} s after the quota: {named['message']}")
        assert named["data"]["node"] == "n3" and named["data"]["rank"] == job["nodes"].index("n3"), named
        assert named["data"]["cause_kind"] == "quota", named
        assert named["data"]["cause"].startswith("CPU throttled by a quota"), named
        quota.lift()
        lifted = time.time()
        cleared = wait_event(daemon, name, "job.straggler_cleared", 90, "n3's worker cleared once the quota is lifted",
                             where=lambda e: e["ts"] >= lifted and e["data"]["node"] == "n3")[0]
        print(f"straggler cleared {cleared['ts'] - lifted:.1f} s after the quota was lifted")
    finally:
        if quota is not None:
            quota.remove()
        coord("stop", "--config", str(daemon.config), name, env=daemon.env, timeout=120)


@pytest.mark.skipif(os.geteuid() != 0 or (os.cpu_count() or 1) < 2, reason="needs root and two CPUs")
def test_a_cpu_hog_of_another_user_beside_a_torchrun_worker_is_named_by_pid_and_command(netns_cluster,
                                                                                        torch_cluster):
    # n2's worker and a hog of another user on CPU 1, the hog ahead of it (nice -15 in an autogroup of its
    # own); every other worker and torchrun on CPU 0: n2's worker gets a sliver of its CPU, and the cause
    # coord names is the hog, by its pid and command.
    daemon, name = torch_cluster["daemon"], "mh-hog"
    _submit(torch_cluster, name, "--launcher", "torchrun", "--total-steps", "100000", "--hang-timeout", "600", "--",
            "python", "ddp.py", "--steps", "100000", "--sleep", "0.05", "--work", "10")
    hog = None
    try:
        job = _at_step(netns_cluster, daemon, name, 20)
        daemon.wait_for(lambda d: not job_of(d, name)["stragglers"], 120, "no straggler shown")
        slowed = job["nodes"][1]
        for rank, node in enumerate(job["nodes"]):
            cpu = "1" if node == slowed else "0"
            for pid in {*rank_processes(rank_pid(netns_cluster, job, rank)), _worker(netns_cluster, node, "ddp.py")}:
                subprocess.run(["taskset", "-a", "-p", "-c", cpu, str(pid)], capture_output=True)
        hog = start_cpu_hog(Path(torch_cluster["root"]), 1)
        onset = time.time()
        named = wait_event(daemon, name, "job.straggler", 60, f"{slowed}'s worker named a straggler beside the hog",
                           where=lambda e: e["ts"] >= onset and e["data"]["node"] == slowed)[0]
        print(f"named {named['ts'] - onset:.1f} s after the hog: {named['message']}")
        assert named["data"]["rank"] == 1 and named["data"]["cause_kind"] == "process", named
        cause = named["data"]["cause"]
        assert f"pid {hog.pid} (nobody: " in cause and "straggler_hog.py" in cause, named
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        coord("stop", "--config", str(daemon.config), name, env=daemon.env, timeout=120)
