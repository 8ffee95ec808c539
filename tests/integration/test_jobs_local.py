"""Jobs on a local cluster: a plain MLX script under the COORD_* contract, and `coord stop`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir

PLAIN = '''\
import argparse, json, os, time
import mlx.core as mx

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--sleep", type=float, default=0.05)
parser.add_argument("--quit-at", type=int, help="on the first attempt, every rank exits 0 at this step")
parser.add_argument("--fail-after", type=int, help="on every attempt, rank 1 exits 3 after this many steps")
args = parser.parse_args()
group = mx.distributed.init()
rank = int(os.environ["COORD_RANK"])
offset = int(os.environ.get("COORD_STEP_OFFSET", "0"))
save_every = int(os.environ["COORD_SAVE_EVERY"])
w = mx.zeros(4)
if os.environ.get("COORD_RESUME_FILE"):
    w = mx.load(os.environ["COORD_RESUME_FILE"])["w"]
for local in range(1, args.steps - offset + 1):
    w = w + mx.distributed.all_sum(mx.ones(4), group=group)
    mx.eval(w)
    time.sleep(args.sleep)
    if rank == 0:
        print(f"step {offset + local}", flush=True)
        with open(os.environ["COORD_PROGRESS_FILE"], "a") as handle:
            handle.write(json.dumps({"kind": "train", "step": offset + local, "loss": 1.0 / (offset + local),
                                     "time": time.time()}) + "\\n")
        if local % save_every == 0:
            os.makedirs(os.environ["COORD_CHECKPOINT_DIR"], exist_ok=True)
            mx.save_safetensors(os.path.join(os.environ["COORD_CHECKPOINT_DIR"], f"{local:07d}_adapters.safetensors"),
                                {"w": w})
    if args.quit_at == offset + local and os.environ["COORD_ATTEMPT"] == "0":
        raise SystemExit(0)
    if args.fail_after == local and rank == 1:
        raise SystemExit(3)
'''

# What a large full fine-tune prints on a Mac when Metal gives up on a command buffer.
METAL_TIMEOUT = '''\
import sys
print("libc++abi: terminating due to uncaught exception of type std::runtime_error: [METAL] Command buffer "
      "execution failed: Caused GPU Timeout Error (00000002:kIOGPUCommandBufferCallbackErrorTimeout)", flush=True)
sys.exit(134)
'''

CHECK_DATA = '{"text": "the same on every node"}\n'

CLUSTER = """\
[cluster]
name = "jobs-local"
state_dir = "{root}/state"

[ssh]
keepalive_s = 0.5

[[nodes]]
name = "a"
host = "local"
workdir = "{root}/a"

[[nodes]]
name = "b"
host = "local"
workdir = "{root}/b"
"""


@pytest.fixture(scope="module")
def cluster():
    root = short_tempdir()
    (root / "project").mkdir()
    (root / "project" / "plain.py").write_text(PLAIN)
    (root / "project" / "metal_timeout.py").write_text(METAL_TIMEOUT)
    for node in ("a", "b"):  # a data file pre-flight compares across nodes; no sync sends it
        (root / node / "data").mkdir(parents=True)
        (root / node / "data" / "check.txt").write_text(CHECK_DATA)
    config = root / "cluster.toml"
    config.write_text(CLUSTER.format(root=root) + '\n[sync]\ndata = ["data/check.txt"]\n')
    daemon = DaemonProcess(config, env=environment()).start()
    daemon.wait_for(all_up, 30, "all nodes up")
    yield daemon, root
    daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


def job_of(doc, name):
    return next(j for j in doc["jobs"] if j["name"] == name)


def test_a_plain_script_resumes_exactly_through_the_environment_contract(cluster):
    daemon, root = cluster
    submitted = coord("run", "--config", str(daemon.config), "--name", "plain", "--source", str(root / "project"),
                      "--save-every", "5", "--detach", "--", "python", "plain.py", "--steps", "40",
                      "--sleep", "0.2", env=daemon.env)  # slow enough that the kill comes before the end
    assert submitted.returncode == 0, submitted.stderr
    doc = daemon.wait_for(lambda d: job_of(d, "plain")["step"] >= 18 or job_of(d, "plain")["state"] == "failed",
                          300, "step 18")
    job = job_of(doc, "plain")
    assert job["state"] == "running", job
    pid = int((root / job["nodes"][1] / ".coord" / "jobs" / job["run_id"] / "attempt-0" / "rank-1" / "pid").read_text())
    os.kill(pid, signal.SIGKILL)
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), "plain", env=daemon.env, timeout=300)
    final = json.loads(waited.stdout)
    assert waited.returncode == 0 and final["state"] == "succeeded" and final["restarts"] == 1, final
    assert final["step"] == 40 and final["last_checkpoint_step"] == 40
    # Two ranks add 1 each per step: the weights of step 40 are 80 only if the resume was exact.
    import mlx.core as mx
    node = root / job["nodes"][0] / "checkpoints" / job["run_id"] / "attempt-1"
    newest = sorted(node.glob("*_adapters.safetensors"))[-1]
    assert mx.load(str(newest))["w"].tolist() == [80.0] * 4


def test_stop_stops_every_rank_and_logs_are_kept_per_rank(cluster):
    daemon, root = cluster
    submitted = coord("run", "--config", str(daemon.config), "--name", "long", "--source", str(root / "project"),
                      "--detach", "--", "python", "plain.py", "--steps", "100000", "--sleep", "0.2",
                      env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    daemon.wait_for(lambda d: job_of(d, "long")["step"] >= 3, 300, "step 3")
    stopped = coord("stop", "--config", str(daemon.config), "long", env=daemon.env, timeout=120)
    assert stopped.returncode == 0 and "long: stopped" in stopped.stdout
    left = subprocess.run(["pgrep", "-f", f"rank_runner --dir {root}"], capture_output=True, text=True).stdout
    assert left.strip() == ""
    for rank in (0, 1):
        assert (root / "state" / "jobs" / job_of(daemon.status(), "long")["run_id"] / "attempt-0" /
                f"rank-{rank}.log").exists()
    again = coord("stop", "--config", str(daemon.config), "nope", env=daemon.env)
    assert again.returncode == 1 and "no job or run named 'nope'" in again.stderr


def _events(daemon, name):
    doc = json.loads(coord("status", "--json", "--events", "10000", "--config", str(daemon.config),
                           env=daemon.env).stdout)
    return [e for e in doc["events"] if e["message"].startswith(name + ":")]


@pytest.mark.parametrize("replica_damaged", [False, True], ids=["replica-stands-in", "damaged-replica-refused"])
def test_checkpoints_are_replicated_to_the_head_and_a_lost_primary_resumes_from_its_replica(cluster,
                                                                                              replica_damaged):
    import hashlib

    daemon, root = cluster
    name = "replicas-" + ("bad" if replica_damaged else "good")
    submitted = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(root / "project"),
                      "--save-every", "5", "--detach", "--", "python", "plain.py", "--steps", "40",
                      # slow enough that the ranks are still running when step 15's copy is seen
                      "--sleep", "0.4", env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    daemon.wait_for(lambda d: any(e["kind"] == "job.replicated" and e["message"].startswith(name + ":")
                                  and e["data"]["step"] >= 15 for e in d["events"]), 300, "step 15 replicated")
    job = job_of(daemon.status(), name)
    pids = [int((root / job["nodes"][r] / ".coord" / "jobs" / job["run_id"] / "attempt-0" / f"rank-{r}" / "pid").read_text())
            for r in (0, 1)]
    for pid in pids:  # frozen: no newer checkpoint appears while the copies are damaged
        os.killpg(pid, signal.SIGSTOP)
    time.sleep(3)  # the catalog polls every 2 s; replication follows
    replicas = sorted((root / "state" / "replicas" / job["run_id"] / "attempt-0").glob("*_adapters.safetensors"))
    primaries = root / job["nodes"][0] / "checkpoints" / job["run_id"] / "attempt-0"
    assert len(replicas) >= 3
    for replica in replicas:  # each copy is byte for byte its primary
        assert hashlib.sha256(replica.read_bytes()).digest() == \
            hashlib.sha256((primaries / replica.name).read_bytes()).digest()
    newest = replicas[-1]
    newest_step = int(newest.name[:7])
    (primaries / newest.name).unlink()  # rank 0's copy is gone, as with its machine
    if replica_damaged:
        with open(newest, "r+b") as handle:
            handle.seek(0, 2)
            handle.seek(handle.tell() // 2)
            handle.write(b"\xff" * 8)
    os.killpg(pids[1], signal.SIGKILL)
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), name, env=daemon.env, timeout=300)
    final = json.loads(waited.stdout)
    found = _events(daemon, name)
    story = "\n".join(e["message"] for e in found)
    assert waited.returncode == 0 and final["state"] == "succeeded" and final["step"] == 40, story
    resumed = [e for e in found if e["kind"] == "job.resume_from"]
    placed = [e for e in found if e["kind"] == "job.checkpoint_placed"]
    if replica_damaged:
        assert any(e["kind"] == "job.replica_rejected" and e["data"]["step"] == newest_step for e in found), story
        assert resumed[-1]["data"]["step"] == newest_step - 5, story
    else:
        assert resumed[-1]["data"]["step"] == newest_step, story
        assert "head:" in placed[-1]["message"], story
    import mlx.core as mx
    final_dir = root / final["nodes"][0] / "checkpoints" / job["run_id"] / "attempt-1"
    assert mx.load(str(sorted(final_dir.glob("*_adapters.safetensors"))[-1]))["w"].tolist() == [80.0] * 4


def test_a_known_failure_in_a_ranks_log_is_named_in_status_with_its_fix(cluster):
    daemon, root = cluster
    submitted = coord("run", "--config", str(daemon.config), "--name", "metal", "--source", str(root / "project"),
                      "--max-restarts", "0", "--save-every", "2000", "--detach", "--", "python", "metal_timeout.py",
                      env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), "metal", env=daemon.env, timeout=300)
    final = json.loads(waited.stdout)
    assert waited.returncode == 1 and final["state"] == "failed"
    found = {d["id"]: d for d in final["diagnoses"]}
    assert "metal_command_buffer_timeout" in found, final["diagnoses"]
    assert "kIOGPUCommandBufferCallbackErrorTimeout" in found["metal_command_buffer_timeout"]["line"]
    # and one the command itself sets up, seen before the launch
    submitted = coord("run", "--config", str(daemon.config), "--name", "saves", "--max-restarts", "0",
                      "--save-every", "2000", "--detach", "--", "python", "-m", "mlx_lm", "lora", "--model",
                      "no-such-model", "--train", "--data", "data", "--iters", "5", env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), "saves", env=daemon.env, timeout=300)
    assert "save_every_too_large" in {d["id"] for d in json.loads(waited.stdout)["diagnoses"]}
    shown = coord("status", "--config", str(daemon.config), env=daemon.env).stdout
    assert "known failure" in shown and found["metal_command_buffer_timeout"]["fix"][:40] in " ".join(shown.split())


def test_a_failed_preflight_blocks_the_launch_and_a_job_file_with_force_launches_keeping_one_checkpoint(cluster):
    daemon, root = cluster
    changed = root / "b" / "data" / "check.txt"
    changed.write_text('{"text": "changed by hand on b"}\n')
    try:
        submitted = coord("run", "--config", str(daemon.config), "--name", "blocked", "--source",
                          str(root / "project"), "--detach", "--", "python", "plain.py", "--steps", "10",
                          env=daemon.env)
        assert submitted.returncode == 0, submitted.stderr
        waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), "blocked", env=daemon.env,
                       timeout=120)
        final = json.loads(waited.stdout)
        assert waited.returncode == 1 and final["state"] == "failed" and final["attempt"] == -1, final
        assert "pre-flight failed (use --force" in final["error"] and "data.files" in final["error"], final
        assert not list((root / "a" / ".coord" / "jobs").glob("blocked*"))  # no rank was ever started

        job_file = root / "forced.toml"
        job_file.write_text(f'name = "forced"\ncommand = ["python", "plain.py", "--steps", "12"]\n'
                            f'source = "{root / "project"}"\nforce = true\nsave_every = 2\nkeep = 1\n')
        ran = coord("run", "--config", str(daemon.config), str(job_file), env=daemon.env, timeout=300)
        assert ran.returncode == 0, ran.stdout + ran.stderr
    finally:
        changed.write_text(CHECK_DATA)
    found = _events(daemon, "forced")
    assert any(e["kind"] == "job.preflight_forced" for e in found), found
    final = json.loads(coord("wait", "--quiet", "--json", "--config", str(daemon.config), "forced",
                             env=daemon.env).stdout)
    assert final["state"] == "succeeded" and final["step"] == 12
    # --keep 1: of six checkpoints only the newest is left, on rank 0's node and at the head
    kept = root / final["nodes"][0] / "checkpoints" / final["run_id"] / "attempt-0"
    assert sorted(p.name for p in kept.glob("*_adapters.safetensors")) == ["0000012_adapters.safetensors"]
    replicas = root / "state" / "replicas" / final["run_id"] / "attempt-0"
    assert sorted(p.name for p in replicas.glob("*_adapters.safetensors")) == ["0000012_adapters.safetensors"]


def test_a_daemon_killed_mid_run_and_again_mid_recovery_carries_the_job_to_the_end(cluster):
    daemon, root = cluster
    try:
        _phoenix(daemon, root)
    finally:  # the module's other tests need a daemon, whatever happened here
        if daemon.proc is None or daemon.proc.poll() is not None:
            daemon.start()
            daemon.wait_for(all_up, 60, "all nodes up again")


def _phoenix(daemon, root) -> None:
    from coordinator.store.state import StateStore

    name, total = "phoenix", 100
    submitted = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(root / "project"),
                      "--save-every", "5", "--detach", "--", "python", "plain.py", "--steps", str(total), "--sleep",
                      "0.25", env=daemon.env)  # room for two daemon restarts on a loaded machine (0.1 s was not)
    assert submitted.returncode == 0, submitted.stderr
    daemon.wait_for(lambda d: job_of(d, name)["step"] >= 8, 300, "step 8")
    daemon.stop(signal.SIGKILL)  # the ranks run on without it
    daemon.start()
    daemon.wait_for(all_up, 30, "all nodes up under the second daemon")
    # The second daemon's own word that it supervises the attempt again, and a step it read itself: the
    # status shows the first daemon's last step from the store at once, which on a busy machine was
    # already past any fixed step (and the daemon was killed again before it had re-attached at all).
    deadline = time.monotonic() + 120
    while not any(e["kind"] == "job.reattached" for e in _events(daemon, name)):
        assert time.monotonic() < deadline, "the second daemon did not re-attach within 120 s"
        time.sleep(0.2)
    at_restart = job_of(daemon.status(), name)["step"]
    assert at_restart < total - 20, f"the job was at step {at_restart} of {total}: no room left to test the rest"
    daemon.wait_for(lambda d: job_of(d, name)["step"] >= at_restart + 3, 300, "a step read by the second daemon")
    job = job_of(daemon.status(), name)
    assert job["attempt"] == 0 and job["restarts"] == 0, job

    # The daemon dies again, this time between two attempts: the ranks are gone and the restart
    # is decided, as when it dies while recovering from a failure.
    daemon.stop(signal.SIGKILL)
    for rank in (0, 1):
        pid = int((root / job["nodes"][rank] / ".coord" / "jobs" / job["run_id"] / "attempt-0" / f"rank-{rank}" / "pid")
                  .read_text())
        with contextlib.suppress(ProcessLookupError):  # gone already: as the test wants them
            os.killpg(pid, signal.SIGKILL)
    store = StateStore(root / "state" / "coord.db")
    row = next(r for r in store.runs() if r["name"] == name)
    store.save_run(row["run_id"], name, row["spec"], "recovering", {**row["record"], "restarts": 1})
    store.close()
    daemon.start()
    daemon.wait_for(all_up, 30, "all nodes up under the third daemon")
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), name, env=daemon.env, timeout=300)
    assert waited.stdout, waited.stderr
    final = json.loads(waited.stdout)
    story = "\n".join(e["message"] for e in _events(daemon, name))
    assert waited.returncode == 0 and final["state"] == "succeeded", story
    assert final["attempt"] == 1 and final["restarts"] == 1 and final["step"] == total, story
    assert "supervising attempt 0 again" in story and "finishing the recovery after attempt 0" in story
    resumed = [e for e in _events(daemon, name) if e["kind"] == "job.resume_from"]
    assert resumed and resumed[-1]["data"]["step"] >= 20, story  # checkpoints of both daemons were catalogued
    # Two ranks add 1 each per step: the weights of the last step are 2 x total only if the resume was exact.
    import mlx.core as mx
    # Attempt 1's newest (its files are named by its own steps), else attempt 0's: a rank killed after it
    # wrote the last step's checkpoint leaves attempt 1 nothing to train.
    runs = root / final["nodes"][0] / "checkpoints" / job["run_id"]
    written = sorted((runs / "attempt-1").glob("*_adapters.safetensors")) or \
        sorted((runs / "attempt-0").glob("*_adapters.safetensors"))
    assert written, story
    assert mx.load(str(written[-1]))["w"].tolist() == [2.0 * total] * 4
    # The head's copy of rank 0's log was not fetched twice by the second daemon.
    lines = (root / "state" / "jobs" / job["run_id"] / "attempt-0" / "rank-0.log").read_text().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) >= 20 and len(steps) == len(set(steps)), lines[:40]


def test_a_script_with_total_steps_shows_its_progress_and_an_early_clean_exit_is_resumed(cluster):
    daemon, root = cluster
    name = "early"
    submitted = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(root / "project"),
                      "--save-every", "5", "--total-steps", "40", "--detach", "--", "python", "plain.py", "--steps",
                      "40", "--sleep", "0.1", "--quit-at", "30", env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    doc = daemon.wait_for(lambda d: job_of(d, name)["step"] >= 6 and job_of(d, name)["rank_memory_bytes"], 300,
                          "step 6 with the ranks' memory")
    job = job_of(doc, name)
    assert job["total_steps"] == 40 and job["eta_s"] and job["step"] < 30, job
    assert sorted(job["rank_memory_bytes"]) == ["0", "1"] and min(job["rank_memory_bytes"].values()) > 10 << 20
    shown = " ".join(coord("status", "--config", str(daemon.config), env=daemon.env).stdout.split())
    assert f"{name}: running, step " in shown and "/40" in shown and "ETA" in shown, shown
    assert "memory: rank 0 (a)" in shown and f"next: coord logs -f {name} coord stop {name}" in shown, shown
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), name, env=daemon.env, timeout=300)
    final = json.loads(waited.stdout)
    story = "\n".join(e["message"] for e in _events(daemon, name))
    # mlx.launch's "every rank exited 0" is not taken for success before the total step
    assert "every rank exited 0 at step 30 of 40" in story, story
    assert waited.returncode == 0 and final["state"] == "succeeded" and final["restarts"] == 1, story
    assert final["step"] == 40 and final["attempt"] == 1
    import mlx.core as mx
    newest = sorted((root / final["nodes"][0] / "checkpoints" / job["run_id"] / "attempt-1").glob("*_adapters.safetensors"))
    assert mx.load(str(newest[-1]))["w"].tolist() == [80.0] * 4


def test_a_stop_during_a_restarts_backoff_ends_it_at_once_and_launches_nothing_more(cluster):
    daemon, root = cluster
    submitted = coord("run", "--config", str(daemon.config), "--name", "backoff", "--source", str(root / "project"),
                      "--max-restarts", "6", "--detach", "--", "python", "plain.py", "--steps", "1000",
                      "--sleep", "0.05", "--fail-after", "2", env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    # restarts wait 0, 1, 2, 4, then 8 s: the stop lands inside the fifth restart's backoff
    deadline = time.monotonic() + 300
    while not (restarts := [e for e in _events(daemon, "backoff") if e["kind"] == "job.restart"])[4:]:
        assert time.monotonic() < deadline, _events(daemon, "backoff")
        time.sleep(0.2)
    assert [r["data"]["delay_s"] for r in restarts] == [0, 1, 2, 4, 8]
    stopped = coord("stop", "--config", str(daemon.config), "backoff", env=daemon.env, timeout=120)
    assert stopped.returncode == 0 and "backoff: stopped" in stopped.stdout, stopped.stderr
    found = _events(daemon, "backoff")
    end = [e for e in found if e["kind"] == "job.stopped"]
    assert end and "before the next attempt was launched" in end[-1]["message"], found
    assert end[-1]["ts"] - restarts[4]["ts"] < 8  # the backoff was cut short, not waited out
    assert not [e for e in found if e["kind"] == "job.launched" and e["data"]["attempt"] == 5], found
    job = job_of(daemon.status(), "backoff")
    assert job["state"] == "stopped" and job["restarts"] == 5 and job["attempt"] == 4


def test_a_name_run_again_starts_over_and_resume_continues_the_newest_run(cluster):
    import mlx.core as mx

    daemon, root = cluster
    name = "again"
    runs = []
    for _ in range(2):
        ran = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(root / "project"),
                    "--save-every", "5", "--total-steps", "10", "--", "python", "plain.py", "--steps", "10",
                    env=daemon.env, timeout=300)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        runs.append(json.loads(coord("wait", "--quiet", "--json", "--config", str(daemon.config), name,
                                     env=daemon.env).stdout))
    first, second = runs
    assert first["run_id"] != second["run_id"] and second["attempt"] == 0 and second["step"] == 10
    second_events = [e for e in _events(daemon, name) if (e.get("data") or {}).get("run") == second["run_id"]]
    assert not any(e["kind"] == "job.resume_from" for e in second_events), second_events
    # --resume: the newest run goes on, from its own step 10, to a larger total.
    ran = coord("run", "--config", str(daemon.config), "--resume", name, "--save-every", "5", "--total-steps", "20",
                "--", "python", "plain.py", "--steps", "20", env=daemon.env, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    final = json.loads(coord("wait", "--quiet", "--json", "--config", str(daemon.config), name,
                             env=daemon.env).stdout)
    assert final["run_id"] == second["run_id"] and final["state"] == "succeeded" and final["step"] == 20, final
    resumed = [e for e in _events(daemon, name) if e["kind"] == "job.resume_from"]
    assert resumed and resumed[-1]["data"]["step"] == 10 and resumed[-1]["data"]["run"] == second["run_id"]
    # Two ranks add 1 each per step: 40 at step 20 only if the run went on from its own step 10.
    newest = sorted((root / final["nodes"][0] / "checkpoints" / final["run_id"] / f"attempt-{final['attempt']}")
                    .glob("*_adapters.safetensors"))[-1]
    assert mx.load(str(newest))["w"].tolist() == [40.0] * 4
    # The first run is still there to read.
    every = json.loads(coord("status", "--json", "--all", "--config", str(daemon.config), env=daemon.env).stdout)
    assert [j["run_id"] for j in every["jobs"] if j["name"] == name] == [first["run_id"], second["run_id"]]
    assert coord("logs", "--config", str(daemon.config), first["run_id"], env=daemon.env).stdout.count("step ") == 10
    missing = coord("run", "--config", str(daemon.config), "--resume", "never-ran", env=daemon.env)
    assert missing.returncode != 0 and "no run of a job named 'never-ran' to resume" in missing.stderr


def test_jobs_queue_for_their_nodes_survive_a_daemon_restart_and_disjoint_jobs_run_side_by_side(cluster):
    daemon, root = cluster
    config = str(daemon.config)

    def submit(name, *extra, steps="30", more=()):
        ran = coord("run", "--config", config, "--name", name, "--source", str(root / "project"), "--detach",
                    "--save-every", "5", *extra, "--", "python", "plain.py", "--steps", steps, "--sleep", "0.1",
                    *more, env=daemon.env)
        assert ran.returncode == 0, ran.stderr
        return ran.stdout

    # A job that holds both nodes and fails for good; one queued behind it; one cancelled while queued.
    submit("blocker", "--max-restarts", "0", steps="400", more=("--fail-after", "100"))  # 10 s: past a restart on a busy machine
    submit("waiter")
    submit("dropped", "--priority", "-1")
    doc = daemon.status()
    assert job_of(doc, "waiter")["state"] == "queued" and job_of(doc, "waiter")["queue_position"] == 1
    assert job_of(doc, "dropped")["queue_position"] == 2
    shown = coord("status", "--config", config, env=daemon.env).stdout
    assert "waiter: queued (position 1)" in shown, shown
    cancelled = coord("cancel", "--config", config, "dropped", env=daemon.env)
    assert cancelled.returncode == 0 and "never started" in cancelled.stdout, cancelled.stderr
    again = coord("cancel", "--config", config, "blocker", env=daemon.env)
    assert again.returncode != 0 and "coord stop blocker" in again.stderr
    # The queue is kept across a daemon restart.
    daemon.wait_for(lambda d: job_of(d, "blocker")["step"] >= 5, 120, "blocker at step 5")
    daemon.stop(signal.SIGKILL)
    daemon.start()
    daemon.wait_for(all_up, 30, "all nodes up again")
    assert job_of(daemon.status(), "waiter")["state"] == "queued"
    waited = coord("wait", "--quiet", "--json", "--config", config, "waiter", env=daemon.env, timeout=300)
    final = json.loads(waited.stdout)
    assert waited.returncode == 0 and final["state"] == "succeeded" and final["step"] == 30, final
    found = _events(daemon, "blocker") + _events(daemon, "waiter")
    failed_at = next(e["ts"] for e in found if e["kind"] == "job.failed" and e["message"].startswith("blocker:"))
    dequeued_at = next(e["ts"] for e in found if e["kind"] == "job.dequeued" and e["message"].startswith("waiter:"))
    assert dequeued_at >= failed_at  # it waited for the nodes, and ran although the job before it failed
    dropped = job_of(coord_status_all(daemon), "dropped")
    assert dropped["state"] == "stopped" and dropped["attempt"] == -1
    # Disjoint nodes: both run at once.
    submit("left", "--nodes", "a")
    submit("right", "--nodes", "b")
    daemon.wait_for(lambda d: job_of(d, "left")["state"] == job_of(d, "right")["state"] == "running"
                    or "succeeded" in (job_of(d, "left")["state"], job_of(d, "right")["state"]), 120,
                    "both side-by-side jobs running")
    for name, node in (("left", "a"), ("right", "b")):
        done = json.loads(coord("wait", "--quiet", "--json", "--config", config, name, env=daemon.env,
                                timeout=300).stdout)
        assert done["state"] == "succeeded" and done["nodes"] == [node], done
    both = [e for e in _events(daemon, "left") + _events(daemon, "right") if e["kind"] == "job.queued"]
    assert not both, both  # neither waited for the other


def coord_status_all(daemon):
    return json.loads(coord("status", "--json", "--all", "--config", str(daemon.config), env=daemon.env).stdout)
