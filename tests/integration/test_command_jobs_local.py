"""``--launcher command`` on a local cluster of two nodes, through the real daemon, agents and CLI: a
home-made socket program (its own all-reduce through rank 0 at ``COORD_COORDINATOR_ADDR``) run once per
node and twice per node, a process SIGKILLed and a process stopped for good (a hang), each recovered
from its newest checkpoint with the weight an uninterrupted run reaches, exactly; and, where JAX is
installed, a real JAX job over ``jax.distributed`` with ``--env-style jax``."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.command_jobs import JAX, SOCKETS, expected_weight
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir
from tests.integration.test_jobs_local import CLUSTER, job_of
from tests.processes import running_under

HAS_JAX = importlib.util.find_spec("jax") is not None  # not imported: jax takes seconds of CPU to import


@pytest.fixture(scope="module")
def cluster():
    root = short_tempdir()
    (root / "project").mkdir()
    (root / "project" / "sockets.py").write_text(SOCKETS)
    (root / "project" / "jaxprog.py").write_text(JAX)
    config = root / "cluster.toml"
    config.write_text(CLUSTER.format(root=root))
    daemon = DaemonProcess(config, env=environment(), python=sys.executable).start()
    daemon.wait_for(all_up, 30, "all nodes up")
    yield daemon, root
    daemon.stop()
    for pid in _programs(root):  # what a failed test left behind
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


def _run(daemon, root: Path, name: str, *args: str) -> None:
    submitted = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(root / "project"),
                      "--launcher", "command", "--save-every", "5", "--detach", *args, env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr


def _wait(daemon, name: str, timeout: float = 300) -> dict:
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), name, env=daemon.env, timeout=timeout)
    assert waited.stdout, waited.stderr
    final = json.loads(waited.stdout)
    doc = json.loads(coord("status", "--json", "--events", "2000", "--config", str(daemon.config),
                           env=daemon.env).stdout)
    final["story"] = "\n".join(f"{e['kind']}: {e['message']}" for e in doc["events"]
                               if e["message"].startswith(name + ":"))
    return final


def _programs(root: Path, *, node: str | None = None) -> list[int]:
    """The socket program's processes (or JAX's) running in a node's workdir."""
    return [p.pid for p in running_under(root) if (b"sockets.py" in p.words or b"jaxprog.py" in p.words)
            and b"agent.local_ranks" not in p.words and b"agent.rank_runner" not in p.words
            and (node is None or p.cwd == str(root / node))]


def _final(root: Path, final: dict) -> dict:
    node = final["nodes"][0]
    path = root / node / "checkpoints" / final["run_id"] / f"attempt-{final['attempt']}" / "final.json"
    return json.loads(path.read_text())


def _at_step(daemon, root: Path, name: str, step: int, timeout: float = 120) -> dict:
    doc = daemon.wait_for(lambda d: job_of(d, name)["state"] == "running" and job_of(d, name)["nodes"], 120,
                          f"{name} running")
    job = job_of(doc, name)
    progress = root / job["nodes"][0] / ".coord" / "jobs" / job["run_id"] / f"attempt-{job['attempt']}" / "rank-0" \
        / "progress.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = progress.read_text().splitlines() if progress.exists() else []
        if [line for line in lines if '"train"' in line and json.loads(line)["step"] >= step]:
            return job
        time.sleep(0.02)
    raise AssertionError(f"{name} did not reach step {step}")


def test_a_program_of_ones_own_on_both_nodes_survives_a_killed_process_and_resumes_exactly(cluster):
    daemon, root = cluster
    _run(daemon, root, "cmd-kill", "--total-steps", "40", "--", "python", "sockets.py", "--steps", "40",
         "--sleep", "0.1")
    job = _at_step(daemon, root, "cmd-kill", 12)
    (victim,) = _programs(root, node=job["nodes"][1])
    os.kill(victim, signal.SIGKILL)
    final = _wait(daemon, "cmd-kill")
    story = final["story"]
    assert final["state"] == "succeeded" and final["step"] == 40, story
    assert final["restarts"] == 1 and final["attempt"] == 1, story
    assert "resuming from the checkpoint of step 10" in story or "resuming from the checkpoint of step 15" in story, \
        story
    assert _final(root, final) == {"w": expected_weight(40, 2), "world": 2}, story  # exactly, as uninterrupted
    log = coord("logs", "--config", str(daemon.config), "--rank", "1", "cmd-kill", env=daemon.env).stdout
    assert "rank 1 of 2, local 0, node 1 of 2, coordinator 127.0.0.1:" in log, log[-2000:]
    assert not _programs(root)


def test_two_processes_a_node_and_one_held_for_good_is_a_hang_recovered_from_its_checkpoint(cluster):
    daemon, root = cluster
    _run(daemon, root, "cmd-hang", "--procs-per-node", "2", "--total-steps", "30", "--hang-timeout", "15", "--",
         "python", "sockets.py", "--steps", "30", "--sleep", "0.05", "--hold-at", "12")
    final = _wait(daemon, "cmd-hang")
    story = final["story"]
    assert final["state"] == "succeeded" and final["step"] == 30, story
    assert final["attempt"] == 1 and "hang: " in story, story
    assert _final(root, final) == {"w": expected_weight(30, 4), "world": 4}, story
    log = coord("logs", "--config", str(daemon.config), "--rank", "1", "cmd-hang", env=daemon.env).stdout
    assert "rank 3 of 4, local 1, node 1 of 2" in log and "rank 2 of 4, local 0, node 1 of 2" in log, log[-2000:]
    assert not _programs(root)


@pytest.mark.skipif(not HAS_JAX, reason="jax is not installed in this Python")
def test_a_real_jax_job_forms_its_world_from_the_jax_variables(cluster):
    daemon, root = cluster
    _run(daemon, root, "cmd-jax", "--env-style", "jax", "--total-steps", "5", "--", "python", "jaxprog.py", "5")
    final = _wait(daemon, "cmd-jax", timeout=600)
    assert final["state"] == "succeeded" and final["step"] == 5, final["story"]
    assert _final(root, final) == {"total": 11.0, "processes": 2, "devices": 2}, final["story"]  # (0+5) + (1+5)
