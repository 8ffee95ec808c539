"""Hangs on a local cluster of two nodes, with real ranks (MLX's ring all_sum between them):
a rank stopped before its first step is caught in seconds and named, a rank stuck outside the
collective its peer waits in is named, coord's own trainer with a rank stuck inside its all_sum
is caught and resumed, and a script that reports nothing is never killed as hung."""

from __future__ import annotations

import json
import shutil

import pytest

from coordinator.cli.tinymodel import write_project
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir

# Every rank beats (agent.heartbeat, from the agent's bundle on the rank's PYTHONPATH); rank 0
# reports its steps. "stop" stops rank 1 (SIGSTOP) before its first step; "wedge" leaves rank 1
# asleep outside the collective before step 4, its heartbeat still beating. Only on attempt 0.
SCRIPT = '''\
import json, os, signal, sys, time
from agent.heartbeat import Heartbeat
beat = Heartbeat.from_environment().start()
import mlx.core as mx
mode, steps = sys.argv[1], int(sys.argv[2])
group = mx.distributed.init()
rank, first = int(os.environ["COORD_RANK"]), os.environ["COORD_ATTEMPT"] == "0"
offset = int(os.environ.get("COORD_STEP_OFFSET", "0"))
beat.phase("compiling")
if mode == "stop" and rank == 1 and first:
    os.kill(os.getpid(), signal.SIGSTOP)
for step in range(offset + 1, steps + 1):
    if mode == "wedge" and rank == 1 and first and step == 4:
        time.sleep(3600)
    with beat.collective():
        mx.eval(mx.distributed.all_sum(mx.ones(4), group=group))
    time.sleep(0.1)
    beat.step(step)
    beat.phase("training")
    if rank == 0:
        with open(os.environ["COORD_PROGRESS_FILE"], "a") as handle:
            handle.write(json.dumps({"kind": "train", "step": step, "time": time.time()}) + "\\n")
'''

SILENT = "import time; time.sleep(12); print('done without a word to coord', flush=True)\n"

CLUSTER = """\
[cluster]
name = "hang-local"
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
    write_project(root / "project")  # the demo's tiny llama, for coord's trainer
    (root / "project" / "beating.py").write_text(SCRIPT)
    (root / "project" / "silent.py").write_text(SILENT)
    config = root / "cluster.toml"
    config.write_text(CLUSTER.format(root=root))
    daemon = DaemonProcess(config, env=environment()).start()
    daemon.wait_for(all_up, 30, "all nodes up")
    yield daemon, root
    daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


def _run(daemon, root, name: str, *args: str) -> dict:
    submitted = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(root / "project"),
                      "--max-restarts", "1", "--detach", *args, env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), name, env=daemon.env, timeout=300)
    return {"submitted": submitted.stdout, "final": json.loads(waited.stdout)}


def _events(daemon, name: str) -> list[dict]:
    doc = json.loads(coord("status", "--json", "--events", "300", "--config", str(daemon.config),
                           env=daemon.env).stdout)
    return [e for e in doc["events"] if e["message"].startswith(name + ":")]


def _first(events: list[dict], kind: str) -> dict:
    return next(e for e in events if e["kind"] == f"job.{kind}")


def test_a_rank_stopped_before_its_first_step_is_caught_in_seconds_and_named(cluster):
    daemon, root = cluster
    ran = _run(daemon, root, "stopped", "--", "python", "beating.py", "stop", "6")
    final = ran["final"]
    assert final["state"] == "succeeded" and final["restarts"] == 1, final
    events = _events(daemon, "stopped")
    hang, launched, ended = _first(events, "hang"), _first(events, "launched"), _first(events, "attempt_ended")
    assert hang["data"]["ranks"] == [1], hang
    assert "rank 1 on" in hang["message"] and "process is stopped: state T" in hang["message"], hang
    # Caught in seconds, not the 600 s the first step used to get: the grace and a poll or two.
    assert ended["ts"] - launched["ts"] < 30, (launched, ended)
    assert any(e["kind"] == "job.hang_watch" and "watched for hangs from now on" in e["message"] for e in events)


def test_a_rank_stuck_outside_the_collective_its_peer_waits_in_is_named(cluster):
    daemon, root = cluster
    ran = _run(daemon, root, "wedged", "--", "python", "beating.py", "wedge", "8")
    assert ran["final"]["state"] == "succeeded" and ran["final"]["restarts"] == 1, ran["final"]
    events = _events(daemon, "wedged")
    hang = _first(events, "hang")
    assert hang["data"]["ranks"] == [1], hang
    assert "not in the collective that rank 0 waits in" in hang["message"], hang
    # After its first step a rank that stops stepping is caught within the 15 s floor and a poll or two.
    step = next(e for e in events if e["kind"] == "job.first_step")
    assert _first(events, "attempt_ended")["ts"] - step["ts"] < 45, events


def test_coords_trainer_with_a_rank_stuck_inside_its_all_sum_is_caught_and_resumed(cluster):
    daemon, root = cluster
    ran = _run(daemon, root, "inside", "--trainer", "coord", "--save-every", "4", "--", "python", "-m", "mlx_lm",
               "lora", "--model", "model", "--train", "--data", "data", "--fine-tune-type", "full", "--batch-size",
               "4", "--iters", "12", "--steps-per-report", "1", "--debug-hang", "1:6")
    assert ran["final"]["state"] == "succeeded" and ran["final"]["restarts"] == 1, ran["final"]
    events = _events(daemon, "inside")
    hang = _first(events, "hang")
    # Both ranks wait in the all_sum of step 6, their heartbeats say so: no single rank stands out.
    assert hang["data"]["ranks"] == [0, 1] and "in a collective" in hang["message"], hang
    assert "while training" in hang["message"], hang
    step = next(e for e in events if e["kind"] == "job.first_step")
    assert _first(events, "attempt_ended")["ts"] - step["ts"] < 60, events
    resumed = [e for e in events if e["kind"] == "job.resume_from"]
    assert resumed and resumed[0]["data"]["step"] == 4, resumed


def test_a_script_that_reports_nothing_is_never_killed_as_hung_and_is_told_so(cluster):
    daemon, root = cluster
    ran = _run(daemon, root, "silent", "--first-step-timeout", "2", "--hang-timeout", "2", "--",
               "python", "silent.py")
    assert "no hang watchdog until the script reports its steps" in ran["submitted"], ran
    assert "coord_script.report(step, loss=loss)" in ran["submitted"]
    assert 'open(os.environ["COORD_PROGRESS_FILE"], "a")' in ran["submitted"]
    final = ran["final"]
    assert final["state"] == "succeeded" and final["restarts"] == 0, final
    assert not any(e["kind"] == "job.hang" for e in _events(daemon, "silent"))
