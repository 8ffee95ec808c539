"""The launcher seam (coordinator/launch/seam.py) and mlx.launch behind it, with plain data."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest

from coordinator.jobs.spec import JobSpec, JobSpecError, validate
from coordinator.launch.batch import BatchSplit
from coordinator.launch.mlx import MlxPlan
from coordinator.launch.mlx_backend import launch_links
from coordinator.launch.registry import (
    GPU_PLANNERS,
    LAUNCHERS,
    capabilities,
    gpu_plan_of,
    launcher_named,
    planned,
    planners_of,
)
from coordinator.launch.seam import LaunchPlan, RankSlot, no_links
from coordinator.launch.trainers import TRAINERS

MLX_LM = ["python", "-m", "mlx_lm", "lora", "--model", "m", "--train", "--data", "d", "--iters", "40"]


def test_a_job_names_a_registered_launcher_and_mlx_launch_is_the_default():
    assert JobSpec(name="j", command=["python", "train.py"]).launcher == "mlx"
    assert set(LAUNCHERS) >= {"mlx"}
    with pytest.raises(JobSpecError, match="launcher must be one of .*mlx.*, got 'nope'"):
        validate(JobSpec(name="j", command=["python", "train.py"], launcher="nope"))
    with pytest.raises(KeyError, match="unknown launcher 'nope'"):
        launcher_named("nope")


def test_every_registered_launcher_is_made_once_under_its_own_name():
    for name in LAUNCHERS:
        assert launcher_named(name).name == name and launcher_named(name) is launcher_named(name)


def test_checking_a_jobs_spec_loads_no_launcher_module():
    # `coord run` checks its job before it asks the daemon: the launchers (and asyncssh, structlog under
    # them) would be a third of a second of its start.
    code = ("import sys; from coordinator.jobs.spec import JobSpec, validate; "
            "validate(JobSpec(name='j', command=['python', 't.py'], launcher='torchrun')); "
            "print(sorted(m for m in sys.modules if m in ('asyncssh', 'structlog', 'coordinator.launch.mlx', "
            "'coordinator.launch.torch_launchers')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_a_stored_spec_from_before_launchers_reads_back_as_an_mlx_job():
    stored = JobSpec(name="j", command=["python", "train.py"]).as_dict()
    stored.pop("launcher")
    assert JobSpec.from_dict(stored).launcher == "mlx"


def test_the_mlx_plan_keeps_the_measured_order_and_the_hostfile_environment():
    mlx = launcher_named("mlx")
    choice = {"ok": True, "backend": "jaccl-ring", "order": ["b", "a"], "hosts": []}
    hosts = {"backend": "jaccl-ring", "envs": ["MLX_METAL_FAST_SYNCH=1", "broken"], "hosts": []}
    plan = mlx.adopt({"backend": choice, "hostfile": hosts}, ["a", "b"])
    assert plan == MlxPlan("mlx", "jaccl-ring", ("b", "a"), launch_links(choice), {"MLX_METAL_FAST_SYNCH": "1"},
                           choice=choice, hosts=hosts)
    assert plan.envs == {"MLX_METAL_FAST_SYNCH": "1"}
    assert mlx.adopt({"backend": {"backend": "ring"}, "hostfile": {"backend": "ring"}}, ["a", "b"]).order == ("a", "b")
    # Pre-flight without a hostfile (it could not plan one): the first attempt plans from the nodes.
    assert mlx.adopt({"backend": None, "hostfile": None}, ["a", "b"]) is None
    job = JobSpec(name="j", command=["python", "train.py"])
    assert mlx.rank_env(job, RankSlot(plan, 0, "run", 0), None) == {}  # mlx.launch gives each rank its own MLX_RANK


def test_mlx_lm_jobs_state_their_batch_and_scripts_of_ones_own_do_not():
    mlx = launcher_named("mlx")
    fine_tune = validate(JobSpec(name="j", command=MLX_LM + ["--batch-size", "8"]))
    assert mlx.batch(fine_tune, 2) == BatchSplit(8, 1, 2)
    script = validate(JobSpec(name="j", command=["python", "train.py"]))
    assert mlx.batch(script, 2) is None
    slot = RankSlot(mlx.adopt({"backend": {"backend": "ring"}, "hostfile": {"backend": "ring"}}, ["a"]), 0, "run", 0)
    assert mlx.rank_command(script, slot, checkpoint_dir="/c", resume_file=None, start_step=0, batch=None) == \
        ["python", "train.py"]
    rewritten = mlx.rank_command(fine_tune, slot, checkpoint_dir="/c", resume_file="/r.safetensors", start_step=10,
                                 batch=BatchSplit(8, 2, 1))
    assert rewritten[:3] == ["python", "-m", "agent.mlx_lm_train"]
    assert "--adapter-path" in rewritten and rewritten[rewritten.index("--iters") + 1] == "30"
    assert rewritten[rewritten.index("--grad-accumulation-steps") + 1] == "2"
    assert rewritten[rewritten.index("--resume-adapter-file") + 1] == "/r.safetensors"


class _SleepLauncher:
    """A launcher that starts ``sleep``, in a session of its own or not."""

    name = "sleep"

    def __init__(self, own_session: bool):
        self.own_session = own_session
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, directory, config, plan, run_id, attempt):
        proc = subprocess.Popen(["sleep", "60"], start_new_session=self.own_session)
        self.started.append(proc)
        return proc


def _effects_with(launcher: _SleepLauncher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from coordinator.jobs import daemon_effects

    monkeypatch.setattr(daemon_effects, "launcher_named", lambda name: launcher)
    cluster = SimpleNamespace(config=SimpleNamespace(state_dir=tmp_path))
    return daemon_effects.DaemonEffects(cluster, links=None, metrics=None, spawn=lambda task, name: None)  # type: ignore[arg-type]


def test_a_launcher_in_the_daemons_own_session_is_refused_and_killed(tmp_path, monkeypatch):
    """A launcher left in the daemon's process group dies when a service manager stops the daemon
    (launchd kills the group), and its ranks with it."""
    from coordinator.jobs.effects import LaunchError

    launcher = _SleepLauncher(own_session=False)
    effects = _effects_with(launcher, tmp_path, monkeypatch)
    plan = LaunchPlan("sleep", "ring", ("a",), no_links("ring"))
    with pytest.raises(LaunchError, match="session of its own"):
        effects.start_launcher("run-1", 0, plan)
    (proc,) = launcher.started
    assert proc.poll() is not None, "the refused launcher was left running"


def test_a_launcher_in_a_session_of_its_own_is_kept(tmp_path, monkeypatch):
    launcher = _SleepLauncher(own_session=True)
    effects = _effects_with(launcher, tmp_path, monkeypatch)
    plan = LaunchPlan("sleep", "ring", ("a",), no_links("ring"))
    pid = effects.start_launcher("run-1", 0, plan)
    try:
        assert os.getsid(pid) == pid and effects.launcher_exit(pid) is None
    finally:
        anyio.run(lambda: effects.stop_launcher(pid, final=True))
    assert effects.launcher_exit(pid) is not None


def test_what_coord_plan_plans_is_declared_by_each_launcher():
    # The PyTorch plan's strategies exist for exactly the launchers that declare a per-GPU plan.
    assert {name for name in LAUNCHERS if capabilities(name).plan == "per_gpu"} == set(GPU_PLANNERS) \
        == {name for name in LAUNCHERS if capabilities(name).gpu_plan is not None}
    assert gpu_plan_of("deepspeed").config_file("n1") == "ds_config.json"
    with pytest.raises(KeyError, match="one of accelerate, deepspeed for a PyTorch plan, got 'torchrun'"):
        gpu_plan_of("torchrun")
    assert planned(None) == "per_node" and planned("mlx") == "per_node" and planned("deepspeed") == "per_gpu"
    with pytest.raises(KeyError, match="coord plan plans for --launcher mlx, accelerate, deepspeed, not command"):
        planned("command")
    assert planners_of("PyTorch") == ["accelerate", "deepspeed"] and planners_of("MLX") == ["mlx"]
    assert planners_of("jax") == []  # run by --launcher command, which coord plan does not size


def test_what_a_launcher_asks_of_the_nodes_and_of_pre_flight_is_there_to_answer_it():
    """A launcher is its module and a line in the registry: the agent call its plan's facts come from,
    and the pre-flight checks it declares, are found by what it declares, with no edit elsewhere."""
    from coordinator.readiness.preflight import CHECK_SETS
    from shared.agent_api.methods import REPLIES

    for name in LAUNCHERS:
        declared = capabilities(name)
        assert declared.node_facts is None or declared.node_facts in REPLIES, name
        assert set(declared.preflight) <= set(CHECK_SETS), name


def test_no_module_outside_the_launch_package_compares_a_launcher_or_trainer_name():
    # The seam's promise (coordinator/launch/registry.py): whatever differs by launcher is read from its
    # capabilities, so a new launcher is its module, its tests and a line in the registry. A comparison of
    # a launcher (or a framework) with a name, or with None (the default's stand-in), is a branch on which
    # launcher a job has; so is a launcher's name compared with anything. The same holds for the trainers
    # an mlx_lm run takes (coordinator/launch/trainers.py).
    root = Path(__file__).resolve().parents[2] / "coordinator"

    def ends_in_launcher(side: ast.expr) -> bool:
        last = side.attr if isinstance(side, ast.Attribute) else side.id if isinstance(side, ast.Name) else ""
        return last in ("launcher", "framework", "trainer")

    def words(side: ast.expr) -> list[object]:
        return [e.value for e in (side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side])
                if isinstance(e, ast.Constant)]

    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "launch":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BoolOp) and any(ends_in_launcher(value) for value in node.values):
                # ``launcher or DEFAULT_LAUNCHER``: a launcher of None standing in for the default, read
                # wherever it is used rather than resolved once (registry.chosen)
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            constants = [word for side in sides for word in words(side)]
            # "command" is also a field's name; "coord" the program's, and the source of an alert's payload
            by_name = set(constants) & ((set(LAUNCHERS) - {"command"}) | (set(TRAINERS) - {"coord"}))
            if by_name or (any(ends_in_launcher(side) for side in sides) and constants):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    assert found == [], "\n".join(found)
