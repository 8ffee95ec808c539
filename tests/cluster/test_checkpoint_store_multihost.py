"""The checkpoint store on the multi-host cluster: a real S3 server (moto's, its own process) in the
head's namespace, reached over HTTP by coordd and by every node, which put their checkpoints' parts
through URLs the head signs.

- A 3-node MLX job and a torchrun job upload their checkpoints; then the whole cluster is lost (every
  node's workdir and the head's state directory wiped, the daemon started afresh), and
  `coord run --resume-from` finishes each run exactly: MLX with the losses of an uninterrupted run,
  torchrun with the weights DDP reaches uninterrupted.
- The server is killed in the middle of the uploads: the job trains on with no restart, and once a
  server answers again the uploads finish; nothing half-written is listed as committed.
- With the server down, a node's disk nearly fills: local retention keeps the copies not yet durable,
  and coord says so before the disk is full."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.jobs import at_step, events, finish, job_of, rank_pid, readable_project, wait_event
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir
from tests.s3_server import S3Server
from tests.torch_jobs import DDP, expected_weights

pytestmark = pytest.mark.cluster

STORE = "s3://ckpt/coord"
STEPS = 60


def _train(steps: int) -> list[str]:
    return ["python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data", "--fine-tune-type",
            "full", "--batch-size", "3", "--iters", str(steps), "--learning-rate", "1e-4"]


TRAIN = _train(STEPS)


@pytest.fixture(scope="module")
def store_cluster(netns_cluster) -> Iterator[dict]:
    """The S3 server in the head's namespace, the projects (the tiny model, ddp.py), and what starts a
    daemon whose environment names the store's endpoint and credentials."""
    server = S3Server(host=netns_cluster.head_ip, prefix=["ip", "netns", "exec", netns_cluster.head_ns]).start()
    root = short_tempdir()
    project = readable_project(root)
    (project / "ddp.py").write_text(DDP)
    (project / "ddp.py").chmod(0o644)
    holder = {"root": root, "project": project, "server": server, "daemons": 0}

    def start_daemon(with_torch: dict | None = None) -> DaemonProcess:
        """``with_torch``: the nodes' Pythons with torch (``add_torch``), for a torchrun job."""
        holder["daemons"] += 1
        state = root / f"state{holder['daemons']}"
        config = netns_cluster.write_cluster_toml(root / f"cluster{holder['daemons']}.toml", state_dir=state,
                                                  extra_node_fields=with_torch)
        daemon = DaemonProcess(config, env={**environment(), **server.env},
                               prefix=["ip", "netns", "exec", netns_cluster.head_ns], python=sys.executable)
        daemon.start()
        daemon.wait_for(all_up, 60, "all nodes up")
        holder["state"] = state
        return daemon

    holder["start_daemon"] = start_daemon
    try:
        yield holder
    finally:
        server.stop()
        for spec in netns_cluster.nodes:
            netns_cluster.exec_in(spec.name, ["pkill", "-KILL", "-u", spec.user, "-f", "ddp.py"])
        shutil.rmtree(root, ignore_errors=True)


def _run(daemon: DaemonProcess, project: Path, name: str, *args: str,
         detach: bool = True) -> subprocess.CompletedProcess:
    done = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(project),
                 "--checkpoint-store", STORE, *(["--detach"] if detach else []), *args, env=daemon.env, timeout=900)
    assert done.returncode == 0 or not detach, done.stderr
    return done


def _story(daemon: DaemonProcess, name: str) -> str:
    return "\n".join(f"{e['kind']}: {e['message']}" for e in events(daemon, name))


def _durable_past(daemon: DaemonProcess, name: str, step: int, timeout: float = 300) -> dict:
    def past(doc: dict) -> bool:
        job = next((j for j in doc["jobs"] if j["name"] == name), None)
        return (((job or {}).get("durability") or {}).get("durable_step") or 0) >= step
    return job_of(daemon.wait_for(past, timeout, f"{name}: a checkpoint of step {step} or later committed"), name)


def _losses(netns_cluster, job: dict, attempt: int) -> dict[int, float]:
    node = netns_cluster.node(job["nodes"][0])
    progress = Path(node.workdir) / ".coord" / "jobs" / job["run_id"] / f"attempt-{attempt}" / "rank-0" / \
        "progress.jsonl"
    records = [json.loads(line) for line in progress.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def _stored(daemon: DaemonProcess, url: str) -> list[dict]:
    listed = coord("checkpoints", "--store", url, "--json", "--config", str(daemon.config), env=daemon.env,
                   timeout=120)
    assert listed.returncode == 0, listed.stderr
    return json.loads(listed.stdout)["checkpoints"]


@pytest.mark.timeout(600)  # four runs and two daemons: 265 to 288 s in full runs of the suite
def test_an_mlx_and_a_torchrun_run_live_on_from_the_store_after_the_whole_cluster_is_lost(netns_cluster,
                                                                                          store_cluster):
    with_torch = netns_cluster.add_torch()
    project = store_cluster["project"]
    daemon = store_cluster["start_daemon"](with_torch)
    try:
        _run(daemon, project, "straight", "--trainer", "coord", "--save-every", "10", "--", *TRAIN)
        reference = _losses(netns_cluster, finish(daemon, "straight", steps=STEPS), attempt=0)
        durable = [e for e in events(daemon, "straight") if e["kind"] == "job.durable"]
        assert durable and all(set(e["data"]["senders"]) <= {"n1", "n2", "n3"} for e in durable), \
            _story(daemon, "straight")

        _run(daemon, project, "mlx-lost", "--trainer", "coord", "--save-every", "10", "--", *TRAIN)
        # Its ranks held still past the checkpoint of step 10, well before the run's end (a step is quicker
        # than an upload), until that checkpoint is durable; then stopped.
        at_step(netns_cluster, daemon, "mlx-lost", 11, lambda job: [
            os.killpg(rank_pid(netns_cluster, job, rank), signal.SIGSTOP) for rank in range(len(job["nodes"]))])
        _durable_past(daemon, "mlx-lost", 10)
        coord("stop", "--config", str(daemon.config), "mlx-lost", env=daemon.env, timeout=180)
        # Half a second a step: the stop comes well before the run's end, whose checkpoint would leave the
        # resume nothing to train.
        _run(daemon, project, "ddp-lost", "--launcher", "torchrun", "--save-every", "5", "--total-steps", "40", "--",
             "python", "ddp.py", "--steps", "40", "--sleep", "0.5")
        ddp = _durable_past(daemon, "ddp-lost", 10)
        coord("stop", "--config", str(daemon.config), "ddp-lost", env=daemon.env, timeout=120)
        mlx, ddp = job_of(daemon.status(), "mlx-lost"), job_of(daemon.status(), "ddp-lost")
        assert mlx["state"] == ddp["state"] == "stopped", (mlx, ddp)
        assert 10 <= mlx["durability"]["durable_step"] < STEPS and ddp["durability"]["durable_step"] < 40, (mlx, ddp)
        stored = {c["run"]: c for c in reversed(_stored(daemon, STORE + "/" + ddp["run_id"]))}
        assert stored[ddp["run_id"]]["format"] == "directory", stored
    finally:
        daemon.stop()
    # The whole cluster is lost: every node's workdir and the head's state directory.
    netns_cluster.empty_workdirs()
    shutil.rmtree(store_cluster["state"], ignore_errors=True)

    daemon = store_cluster["start_daemon"](with_torch)
    try:
        resumed = _run(daemon, project, "mlx-lost", "--trainer", "coord", "--save-every", "10", "--resume-from",
                       f"{STORE}/{mlx['run_id']}", "--", *TRAIN, detach=False)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr + _story(daemon, "mlx-lost")
        again = job_of(daemon.status(), "mlx-lost")
        assert again["run_id"] == mlx["run_id"] and again["state"] == "succeeded" and again["step"] == STEPS, again
        started = [e for e in events(daemon, "mlx-lost") if e["kind"] == "job.resumed_from_store"]
        assert started and started[0]["data"]["step"] >= 10, _story(daemon, "mlx-lost")
        after = _losses(netns_cluster, again, attempt=again["attempt"])
        assert min(after) == started[0]["data"]["step"] + 1 and max(after) == STEPS, sorted(after)
        for step, loss in after.items():
            assert abs(loss - reference[step]) <= 1e-5 * abs(reference[step]), (step, loss, reference[step])

        resumed = _run(daemon, project, "ddp-lost", "--launcher", "torchrun", "--save-every", "5", "--total-steps",
                       "40", "--resume-from", f"{STORE}/{ddp['run_id']}", "--", "python", "ddp.py", "--steps", "40",
                       "--sleep", "0.05", detach=False)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr + _story(daemon, "ddp-lost")
        final = job_of(daemon.status(), "ddp-lost")
        assert final["state"] == "succeeded" and final["step"] == 40, _story(daemon, "ddp-lost")
        import torch

        node = netns_cluster.node(final["nodes"][0])
        state = torch.load(Path(node.workdir) / "checkpoints" / final["run_id"] / f"attempt-{final['attempt']}"
                           / "final.pt")
        weights = [*state["weight"].flatten().tolist(), *state["bias"].tolist()]
        assert weights == pytest.approx(expected_weights(40, 3), abs=1e-6)
    finally:
        daemon.stop()


def test_the_server_killed_mid_upload_costs_no_restart_and_the_uploads_finish_once_it_is_back(netns_cluster,
                                                                                              store_cluster):
    server, project = store_cluster["server"], store_cluster["project"]
    daemon = store_cluster["start_daemon"]()
    try:
        # Uploads at 60 kB/s each: every checkpoint takes seconds to go up, so one is always under way.
        _run(daemon, project, "through", "--trainer", "coord", "--save-every", "5", "--store-bandwidth", "60kB/s",
             "--", *_train(STEPS * 2))
        job = _durable_past(daemon, "through", 5)
        time.sleep(1.0)
        server.stop()  # SIGTERM, then SIGKILL: its in-memory objects go with it
        wait_event(daemon, "through", "job.store_failed", 120, "the failed upload said")
        assert job_of(daemon.status(), "through")["state"] == "running"
        server.start()  # an empty server on the same address, the bucket made again
        final = finish(daemon, "through", steps=STEPS * 2)
        assert final["restarts"] == 0 and final["durability"]["durable_step"] == STEPS * 2, final["story"]
        assert final["durability"]["lag_steps"] == 0 and final["durability"]["error"] is None, final["durability"]
        listed = _stored(daemon, f"{STORE}/{job['run_id']}")
        assert listed and all(c["committed"] for c in listed), listed  # nothing half-written is listed as committed
        assert listed[0]["step"] == STEPS * 2, listed
    finally:
        daemon.stop()


def test_with_the_store_down_a_filling_disk_keeps_what_is_not_durable_and_is_said_before_it_fills(netns_cluster,
                                                                                                    store_cluster):
    server, project = store_cluster["server"], store_cluster["project"]
    node = netns_cluster.node("n2")
    checkpoints = f"{node.workdir}/checkpoints"

    def on_n2(*argv: str) -> str:  # what n2's agent sees of its disk
        done = netns_cluster.in_node_mounts("n2", argv)
        assert done.returncode == 0, (argv, done.stderr)
        return done.stdout

    uid = int(subprocess.run(["id", "-u", node.user], capture_output=True, text=True, check=True).stdout)
    # n2's checkpoints on a small disk of their own, which a ballast file fills but for room for two and
    # a half checkpoints once the run has two left to write: said then, and never full.
    on_n2("mkdir", "-p", checkpoints)
    on_n2("mount", "-t", "tmpfs", "-o", f"size=64m,uid={uid},mode=0755", "coord-small-disk", checkpoints)
    daemon = store_cluster["start_daemon"]()
    server.stop()
    try:
        _run(daemon, project, "filling", "--trainer", "coord", "--save-every", "10", "--keep", "1",
             "--durability-lag-alert", "5", "--", *_train(120))
        wait_event(daemon, "filling", "job.checkpoint", 200, "the first checkpoint")
        job = job_of(daemon.status(), "filling")
        sizes = on_n2("sh", "-c", f"stat -c %s {checkpoints}/{job['run_id']}/attempt-*/*_adapters.safetensors")
        written = [int(size) for size in sizes.split()]
        free = int(on_n2("stat", "-f", "-c", "%a", checkpoints)) * int(on_n2("stat", "-f", "-c", "%S", checkpoints))
        # Room for the checkpoints still to come and a half: the disk never fills, and when two are
        # left it has room for fewer than three. One more written meanwhile leaves half of one free.
        ballast = free - int((12 - len(written) + 1.5) * max(written))
        on_n2("fallocate", "-l", str(ballast), f"{checkpoints}/ballast")
        said = wait_event(daemon, "filling", "job.store_disk", 120, "the disk filling said",
                          where=lambda e: e["data"]["node"] == "n2")[0]
        final = finish(daemon, "filling", steps=120)
        story = final["story"]
        assert said["data"]["room_for"] <= 2 and said["data"]["held"] >= 9, said
        assert "are kept there until they reach the checkpoint store" in said["message"], said
        kinds = [e["kind"] for e in events(daemon, "filling")]
        assert "job.store_failed" in kinds and "job.durability_lag" in kinds, story
        # --keep 1, and every checkpoint still on the disk: none is in the store
        kept = on_n2("sh", "-c", f"ls {checkpoints}/{job['run_id']}/attempt-*/ | grep -c _adapters.safetensors")
        assert int(kept) == 12, kept
        assert "the final checkpoint is not in the checkpoint store" in (final["warning"] or ""), final
    finally:
        daemon.stop()
        netns_cluster.in_node_mounts("n2", ["umount", "-l", checkpoints])
        server.start()
