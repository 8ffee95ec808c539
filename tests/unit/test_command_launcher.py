"""``--launcher command`` with plain data: each process's world in its environment (coord's own, JAX's,
TensorFlow's), the plan, each node's command and files, the job's options checked; and the runner of K
processes on a node (agent/local_ranks.py) with real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.local_ranks import read_envs
from agent.local_ranks import run as run_local_ranks
from coordinator.jobs.spec import JobSpec, JobSpecError, validate
from coordinator.launch.command import RANKS_FILE
from coordinator.launch.command_env import COORDINATOR_PORTS, PORTS_WIDTH, coordinator_port, process_env
from coordinator.launch.registry import capabilities, launcher_named
from coordinator.launch.seam import NodeReadings, PlanError, RankSlot

REPO = Path(__file__).resolve().parents[2]


def _cluster(*names: str, local: bool = False, ips: bool = False):
    nodes = [SimpleNamespace(name=n, is_local=local, ips=[f"10.0.0.{i + 1}"] if ips else [],
                             host="local" if local else f"{n}.lan") for i, n in enumerate(names)]
    return SimpleNamespace(config=SimpleNamespace(nodes=nodes))


def _job(**fields) -> JobSpec:
    return validate(JobSpec(name="j", command=["python", "prog.py", "--lr", "1e-3"], launcher="command", **fields))


def _plan(job: JobSpec, nodes=("a", "b", "c"), **cluster):
    return launcher_named("command").plan(_cluster(*nodes, **cluster), NodeReadings({}), list(nodes), None, job)


# --- each process's environment ---------------------------------------------------------


def test_every_process_finds_its_world_in_coords_own_variables():
    env = process_env(None, node_rank=1, local_rank=1, procs=2, addresses=["10.0.0.1", "10.0.0.2"], port=14500)
    assert env == {"COORD_RANK": "3", "COORD_LOCAL_RANK": "1", "COORD_WORLD_SIZE": "4", "COORD_NODE_RANK": "1",
                   "COORD_NNODES": "2", "COORD_PROCS_PER_NODE": "2", "COORD_COORDINATOR_ADDR": "10.0.0.1:14500"}


def test_jax_style_gives_what_jax_distributed_initialize_reads_without_arguments():
    env = process_env("jax", node_rank=2, local_rank=0, procs=1, addresses=["a", "b", "c"], port=14001)
    assert (env["JAX_COORDINATOR_ADDRESS"], env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == ("a:14001", "3", "2")
    assert env["JAX_LOCAL_PROCESS_ID"] == "0" and env["COORD_COORDINATOR_ADDR"] == "a:14001"
    assert "JAX_LOCAL_DEVICE_IDS" not in env  # one process a node: every device of it
    two = process_env("jax", node_rank=1, local_rank=1, procs=2, addresses=["a", "b"], port=14001)
    assert (two["JAX_PROCESS_ID"], two["JAX_LOCAL_DEVICE_IDS"]) == ("3", "1")  # each process its own GPU


def test_coord_script_gives_jax_distributed_initialize_its_arguments(monkeypatch):
    import coord_script

    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "a:14001")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert coord_script.jax_distributed() == {"coordinator_address": "a:14001", "num_processes": 4, "process_id": 3}
    monkeypatch.delenv("JAX_PROCESS_ID")
    with pytest.raises(RuntimeError, match="JAX_PROCESS_ID"):
        coord_script.jax_distributed()


def test_tf_style_gives_every_process_a_worker_of_its_own_in_tf_config():
    ranks = [json.loads(process_env("tf", node_rank=n, local_rank=local, procs=2, addresses=["a", "b"],
                                    port=15000)["TF_CONFIG"]) for n in range(2) for local in range(2)]
    workers = ["a:15000", "a:15001", "b:15000", "b:15001"]
    assert [r["cluster"] for r in ranks] == [{"worker": workers}] * 4
    assert [r["task"] for r in ranks] == [{"type": "worker", "index": i} for i in range(4)]


def test_an_ipv6_address_goes_in_brackets_before_its_port():
    assert process_env(None, node_rank=0, local_rank=0, procs=1, addresses=["fd00::1"], port=14000)[
        "COORD_COORDINATOR_ADDR"] == "[fd00::1]:14000"
    with pytest.raises(ValueError, match="unknown environment style 'mpi'"):
        process_env("mpi", node_rank=0, local_rank=0, procs=1, addresses=["a"], port=1)


def test_each_attempt_draws_its_own_port_stable_across_a_restart_of_the_daemon():
    ports = {coordinator_port("run-1", attempt) for attempt in range(50)}
    assert len(ports) > 40 and all(COORDINATOR_PORTS[0] <= p < COORDINATOR_PORTS[1] - PORTS_WIDTH for p in ports)
    assert coordinator_port("run-1", 3) == coordinator_port("run-1", 3) != coordinator_port("run-2", 3)


# --- the plan, each node's command and files --------------------------------------------


def test_the_plan_meets_at_the_first_nodes_address_and_each_node_gets_its_own_world():
    job = _job(env_style="jax")
    plan = _plan(job, ips=True)
    assert (plan.launcher, plan.order, plan.rendezvous_address, plan.procs_per_node) == \
        ("command", ("a", "b", "c"), "10.0.0.1", 1)
    command = launcher_named("command")
    envs = [command.rank_env(job, RankSlot(plan, rank, "run-1", 2), None) for rank in range(3)]
    port = coordinator_port("run-1", 2)
    assert [e["COORD_RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["JAX_COORDINATOR_ADDRESS"] for e in envs} == {f"10.0.0.1:{port}"}
    slot = RankSlot(plan, 1, "run-1", 2)
    assert command.rank_command(job, slot, checkpoint_dir="/c", resume_file=None, start_step=0, batch=None) == \
        ["python", "prog.py", "--lr", "1e-3"]  # the program itself is the rank: nothing between
    assert command.rank_files(job, slot, None) == {} and command.batch(job, 3) is None


def test_nodes_of_this_one_machine_meet_on_loopback_and_without_addresses_on_the_cluster_files_hosts():
    assert _plan(_job(), local=True).rendezvous_address == "127.0.0.1"
    plan = _plan(_job(env_style="tf"))
    assert plan.rendezvous_address == "a.lan"
    tf = json.loads(launcher_named("command").rank_env(_job(env_style="tf"), RankSlot(plan, 0, "r", 0), None)[
        "TF_CONFIG"])
    assert [w.rsplit(":", 1)[0] for w in tf["cluster"]["worker"]] == ["a.lan", "b.lan", "c.lan"]


def test_k_processes_a_node_run_under_the_agents_runner_each_with_its_own_rank():
    job = _job(procs_per_node=2)
    plan = _plan(job)
    assert plan.world_size == 6
    command = launcher_named("command")
    slot = RankSlot(plan, 2, "run-1", 0)
    assert command.rank_command(job, slot, checkpoint_dir="/c", resume_file=None, start_step=0, batch=None) == \
        ["python", "-m", "agent.local_ranks", "--ranks", "{rank_dir}/" + RANKS_FILE, "--", "python", "prog.py",
         "--lr", "1e-3"]
    envs = json.loads(command.rank_files(job, slot, None)[RANKS_FILE])
    assert [(e["COORD_RANK"], e["COORD_LOCAL_RANK"], e["COORD_NODE_RANK"]) for e in envs] == [("4", "0", "2"),
                                                                                             ("5", "1", "2")]
    assert command.rank_env(job, slot, None) == {}  # each process's comes from the ranks file


def test_a_command_jobs_options_are_checked_when_it_is_given():
    assert capabilities("command").runs_on == "nodes" and capabilities("command").checkpoint_parts
    with pytest.raises(JobSpecError, match="^--env-style: for --launcher command, not torchrun"):
        validate(JobSpec(name="j", command=["python", "t.py"], launcher="torchrun", env_style="jax"))
    with pytest.raises(JobSpecError, match="^--env-style: for --launcher command, not mlx"):
        validate(JobSpec(name="j", command=["python", "t.py"], env_style="tf"))
    with pytest.raises(JobSpecError, match="env_style must be one of jax, tf|--env-style must be one of"):
        validate(JobSpec(name="j", command=["python", "t.py"], launcher="command", env_style="mpi"))
    with pytest.raises(JobSpecError, match="runs a program of your own"):
        validate(JobSpec(name="j", command=["python", "-m", "mlx_lm", "lora", "--iters", "3"], launcher="command"))
    with pytest.raises(JobSpecError, match="^--global-batch: for --launcher torchrun"):
        validate(JobSpec(name="j", command=["python", "t.py"], launcher="command", global_batch=8))
    with pytest.raises(PlanError, match="--backend ring: a command job's program chooses"):
        launcher_named("command").plan(_cluster("a"), NodeReadings({}), ["a"], "ring", _job())


# --- K processes on a node ----------------------------------------------------------------

CHILD = """
import os, sys, time
out = sys.argv[1]
with open(os.path.join(out, os.environ["COORD_LOCAL_RANK"]), "w") as handle:
    handle.write(os.environ["COORD_RANK"])
if os.environ.get("FAIL") == os.environ["COORD_LOCAL_RANK"]:
    sys.exit(7)
time.sleep(float(os.environ.get("SLEEP", "0")))
"""


def _envs(count: int, **extra: str) -> list[dict[str, str]]:
    return [{"COORD_RANK": str(10 + i), "COORD_LOCAL_RANK": str(i), **extra} for i in range(count)]


def test_every_process_runs_with_its_own_environment_and_all_ending_well_is_zero(tmp_path):
    (tmp_path / "child.py").write_text(CHILD)
    assert run_local_ranks(["python", str(tmp_path / "child.py"), str(tmp_path)], _envs(3)) == 0
    assert sorted((p.name, p.read_text()) for p in tmp_path.iterdir() if p.name.isdigit()) == \
        [("0", "10"), ("1", "11"), ("2", "12")]


def test_the_first_process_to_fail_ends_the_others_and_its_status_is_the_ranks(tmp_path):
    (tmp_path / "child.py").write_text(CHILD)
    started = time.monotonic()
    status = run_local_ranks([sys.executable, str(tmp_path / "child.py"), str(tmp_path)],
                             _envs(3, FAIL="1", SLEEP="60"), grace=5)
    assert status == 7 and time.monotonic() - started < 30  # the sleepers were ended, not waited for


def test_a_stop_of_the_runner_reaches_every_process(tmp_path):
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "ranks.json").write_text(json.dumps(_envs(2, SLEEP="60")))
    runner = subprocess.Popen([sys.executable, "-m", "agent.local_ranks", "--ranks", str(tmp_path / "ranks.json"),
                               "--", "python", str(tmp_path / "child.py"), str(tmp_path)], cwd=REPO)
    deadline = time.monotonic() + 30
    while len([p for p in tmp_path.iterdir() if p.name.isdigit()]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=30) == 128 + signal.SIGTERM


def test_a_ranks_file_that_is_not_a_list_of_environments_is_refused(tmp_path):
    for text in ("{}", "[]", '[{"A": 1}]', "not json"):
        (tmp_path / "ranks.json").write_text(text)
        with pytest.raises(ValueError):
            read_envs(str(tmp_path / "ranks.json"))
    done = subprocess.run([sys.executable, "-m", "agent.local_ranks", "--ranks", str(tmp_path / "nope.json"), "--",
                           "true"], cwd=REPO, capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and "nope.json" in done.stderr


def test_the_ports_a_rank_listens_on_are_checked_free_on_its_node_first():
    import socket

    from agent.launch import _check_port_free
    from shared.rpc import RemoteError

    job = _job()
    plan = _plan(job)
    command = launcher_named("command")
    port = coordinator_port("run-1", 0)
    assert command.rank_ports(job, RankSlot(plan, 0, "run-1", 0)) == [port]
    assert command.rank_ports(job, RankSlot(plan, 1, "run-1", 0)) == []
    tf = _job(env_style="tf", procs_per_node=2)
    assert command.rank_ports(tf, RankSlot(_plan(tf), 2, "run-1", 0)) == [port, port + 1]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RemoteError, match=f"port {taken.getsockname()[1]} is in use on this node"):
            _check_port_free(taken.getsockname()[1])
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        number = free.getsockname()[1]
    _check_port_free(number)  # free again once closed
