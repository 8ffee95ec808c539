"""The launcher seam (coordinator/launch/launcher.py) and mlx.launch behind it, with plain data."""

from __future__ import annotations

import pytest

from coordinator.jobs.spec import JobSpec, JobSpecError, validate
from coordinator.launch.batch import BatchSplit
from coordinator.launch.launcher import LaunchPlan
from coordinator.launch.registry import LAUNCHERS, launcher_named

MLX_LM = ["python", "-m", "mlx_lm", "lora", "--model", "m", "--train", "--data", "d", "--iters", "40"]


def test_a_job_names_a_registered_launcher_and_mlx_launch_is_the_default():
    assert JobSpec(name="j", command=["python", "train.py"]).launcher == "mlx"
    assert set(LAUNCHERS) >= {"mlx"}
    with pytest.raises(JobSpecError, match="launcher must be one of .*mlx.*, got 'nope'"):
        validate(JobSpec(name="j", command=["python", "train.py"], launcher="nope"))
    with pytest.raises(KeyError, match="unknown launcher 'nope'"):
        launcher_named("nope")


def test_a_stored_spec_from_before_launchers_reads_back_as_an_mlx_job():
    stored = JobSpec(name="j", command=["python", "train.py"]).as_dict()
    stored.pop("launcher")
    assert JobSpec.from_dict(stored).launcher == "mlx"


def test_the_mlx_plan_keeps_the_measured_order_and_the_hostfile_environment():
    mlx = launcher_named("mlx")
    choice = {"ok": True, "backend": "jaccl-ring", "order": ["b", "a"], "hosts": []}
    hosts = {"backend": "jaccl-ring", "envs": ["MLX_METAL_FAST_SYNCH=1", "broken"], "hosts": []}
    plan = mlx.adopt(choice, hosts, ["a", "b"])
    assert plan == LaunchPlan("mlx", "jaccl-ring", ("b", "a"), choice, hosts)
    assert plan.envs == {"MLX_METAL_FAST_SYNCH": "1"}
    assert mlx.adopt({"backend": "ring"}, {"backend": "ring"}, ["a", "b"]).order == ("a", "b")
    assert mlx.rank_env(plan, 0) == {}  # mlx.launch gives each rank its own MLX_RANK


def test_mlx_lm_jobs_state_their_batch_and_scripts_of_ones_own_do_not():
    mlx = launcher_named("mlx")
    fine_tune = validate(JobSpec(name="j", command=MLX_LM + ["--batch-size", "8"]))
    assert mlx.batch(fine_tune, 2) == BatchSplit(8, 1, 2)
    script = validate(JobSpec(name="j", command=["python", "train.py"]))
    assert mlx.batch(script, 2) is None
    assert mlx.rank_command(script, checkpoint_dir="/c", resume_file=None, start_step=0, batch=None) == \
        ["python", "train.py"]
    rewritten = mlx.rank_command(fine_tune, checkpoint_dir="/c", resume_file="/r.safetensors", start_step=10,
                                 batch=BatchSplit(8, 2, 1))
    assert rewritten[:3] == ["python", "-m", "agent.mlx_lm_train"]
    assert "--adapter-path" in rewritten and rewritten[rewritten.index("--iters") + 1] == "30"
    assert rewritten[rewritten.index("--grad-accumulation-steps") + 1] == "2"
    assert rewritten[rewritten.index("--resume-adapter-file") + 1] == "/r.safetensors"
