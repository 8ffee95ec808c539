"""Before the first step, a rank that works is not hung: on the multi-host cluster, three real ranks
(MLX's ring between the nodes) compile on a loaded machine for longer than their allowance and are
left to finish, and a rank that sleeps before its first step is still caught and named.

The load: busy processes of the test's own (outside the ranks' process trees) pinned to CPU 0,
where the ranks pin themselves too, so a fixed amount of CPU work takes several times its CPU
time on the clock, whatever else the machine runs. The allowance before the first step is
``--first-step-timeout 5``: wall time alone called such a compile hung after 5 s (the issue: "hung
... while compiling (allowance 30 s, before the first step)" at a load of 8)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.jobs import events, job_of, submit, tiny_project_and_daemon
from tests.integration.daemon_harness import coord

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

ALLOWANCE_S = 5
BUSY_PROCESSES = 3  # with the three ranks, six on CPU 0: a rank gets a sixth of it at most

# Every rank beats (agent.heartbeat); rank 0 reports its steps. "loaded": each rank pins itself to
# CPU 0 (shared with the test's busy processes) and works WORK CPU-seconds in mx.eval before its
# first step, as a first step's compile does. "sleep": rank 1 of attempt 0 sleeps before its first
# step instead, using no CPU, while the others work.
SCRIPT = '''\
import json, os, sys, time
mode, steps, work = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
if mode == "loaded":
    os.sched_setaffinity(0, {0})
from agent.heartbeat import Heartbeat
beat = Heartbeat.from_environment().start()
import mlx.core as mx
with beat.collective():  # init waits for every rank
    group = mx.distributed.init()
rank, first = int(os.environ["COORD_RANK"]), os.environ["COORD_ATTEMPT"] == "0"
offset = int(os.environ.get("COORD_STEP_OFFSET", "0"))
beat.phase("compiling")
if mode == "sleep" and rank == 1 and first:
    time.sleep(3600)
a = mx.random.normal((256, 256))
began = time.process_time()
while time.process_time() - began < work:
    mx.eval(a @ a)
for step in range(offset + 1, steps + 1):
    with beat.collective():
        mx.eval(mx.distributed.all_sum(mx.ones(4), group=group))
    beat.step(step)
    beat.phase("training")
    if rank == 0:
        with open(os.environ["COORD_PROGRESS_FILE"], "a") as handle:
            handle.write(json.dumps({"kind": "train", "step": step, "time": time.time()}) + "\\n")
    time.sleep(0.1)
'''

BUSY = "import os\nos.sched_setaffinity(0, {0})\nwhile True:\n    pass\n"


@pytest.fixture(scope="module")
def running(netns_cluster):
    with tiny_project_and_daemon(netns_cluster) as holder:
        script = Path(holder["project"]) / "busy_first_step.py"
        script.write_text(SCRIPT)
        script.chmod(0o644)
        yield holder


def _wait(daemon, name: str) -> dict:
    result = coord("wait", "--quiet", "--json", "--config", str(daemon.config), name, env=daemon.env, timeout=600)
    return json.loads(result.stdout)


def _compile_seconds(netns_cluster, job: dict, rank: int) -> float:
    """How long the rank was in its compiling phase before its first step, by its own heartbeats."""
    node = netns_cluster.node(job["nodes"][rank])
    path = (Path(node.workdir) / ".coord" / "jobs" / job["run_id"] / f"attempt-{job['attempt']}" / f"rank-{rank}"
            / "progress.jsonl")
    beats = [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "heartbeat"]
    began = next(b["time"] for b in beats if b["phase"] == "compiling")
    stepped = next(b["time"] for b in beats if b.get("step", 0) >= 1)
    return stepped - began


def test_ranks_compiling_on_a_loaded_machine_past_their_allowance_are_not_killed_as_hung(netns_cluster, running):
    daemon = running["daemon"]
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(BUSY_PROCESSES)]
    try:
        submit(daemon, running["project"], "loaded", "--first-step-timeout", str(ALLOWANCE_S), "--max-restarts", "0",
               command=["python", "busy_first_step.py", "loaded", "6", "3.0"])
        final = _wait(daemon, "loaded")
    finally:
        for process in busy:
            process.kill()
            process.wait()
    story = "\n".join(f"{e['kind']}: {e['message']}" for e in events(daemon, "loaded"))
    assert final["state"] == "succeeded" and final["restarts"] == 0, story
    assert not any(e["kind"] == "job.hang" for e in events(daemon, "loaded")), story
    # The load did delay the first step past the allowance, or this test tested nothing.
    job = job_of(daemon.status(events=0), "loaded")
    compiled = [_compile_seconds(netns_cluster, job, rank) for rank in range(3)]
    assert max(compiled) > ALLOWANCE_S, (compiled, story)
    step = next(e for e in events(daemon, "loaded") if e["kind"] == "job.first_step")
    assert step["data"]["seconds"] > ALLOWANCE_S, (step, story)


def test_a_rank_asleep_before_its_first_step_is_still_caught_and_named(netns_cluster, running):
    daemon = running["daemon"]
    submit(daemon, running["project"], "asleep", "--first-step-timeout", str(ALLOWANCE_S), "--max-restarts", "1",
           command=["python", "busy_first_step.py", "sleep", "6", "0.5"])
    final = _wait(daemon, "asleep")
    found = events(daemon, "asleep")
    story = "\n".join(f"{e['kind']}: {e['message']}" for e in found)
    assert final["state"] == "succeeded" and final["restarts"] == 1, story
    hang = next(e for e in found if e["kind"] == "job.hang")
    assert hang["data"]["ranks"] == [1], story
    assert "while compiling" in hang["message"] and "using no CPU" in hang["message"], story
    assert "before the first step" in hang["message"], story
    launched = next(e for e in found if e["kind"] == "job.launched")
    ended = next(e for e in found if e["kind"] == "job.attempt_ended")
    # Caught within its allowance and a few polls of a loaded machine, not at the busy ceiling (780 s).
    assert ended["ts"] - launched["ts"] < 120, story
