"""A PyTorch job's pre-flight on a local cluster, through the real daemon, agents and CLI: every
node's torch facts, the rendezvous probe over real TCP (a listener on rank 0's node, a connection
from every node), a master port another process holds named, and an MLX pre-flight left as it was.

The nodes run this interpreter, or COORD_TEST_TORCH_PYTHON: with torch there, the facts come from a
real torch as well (its versions, its backends); without, its absence is the failure said."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir

TORCH_PYTHON = os.environ.get("COORD_TEST_TORCH_PYTHON")
NODE_PYTHON = TORCH_PYTHON or sys.executable
HAS_TORCH = subprocess.run([NODE_PYTHON, "-c", "import importlib.metadata as m; m.version('torch')"],
                           capture_output=True).returncode == 0

CLUSTER = """\
[cluster]
name = "torch-local"
state_dir = "{root}/state"

[[nodes]]
name = "a"
host = "local"
python = "{python}"
workdir = "{root}/a"

[[nodes]]
name = "b"
host = "local"
python = "{python}"
workdir = "{root}/b"
"""


@pytest.fixture(scope="module")
def cluster():
    root = short_tempdir()
    config = root / "cluster.toml"
    config.write_text(CLUSTER.format(root=root, python=NODE_PYTHON))
    daemon = DaemonProcess(config, env=environment(), python=sys.executable).start()  # its nodes need torch
    daemon.wait_for(all_up, 30, "all nodes up")
    yield daemon, root
    daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def preflight(daemon, *args):
    result = coord("preflight", "--config", str(daemon.config), "--json", *args, env=daemon.env, timeout=300)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


def test_a_torch_preflight_reports_every_nodes_facts_and_reaches_rank_0_over_tcp(cluster):
    daemon, _ = cluster
    port = free_port()
    code, report = preflight(daemon, "--torch", "--master-port", str(port))
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["torch.rendezvous"]["status"] == "pass", checks["torch.rendezvous"]
    assert f"127.0.0.1:{port}" in checks["torch.rendezvous"]["detail"]
    probe = report["torch"]["rendezvous"]
    assert sorted(probe["connects"]) == ["a", "b"] and all(c["connected"] for c in probe["connects"].values())
    assert sorted(report["torch"]["facts"]) == ["a", "b"]
    # MLX's own launch checks give way to PyTorch's.
    assert not {"launcher.head", "rdma.backend", "hostfile.valid", "versions.mlx"} & set(checks)
    assert checks["torch.shm.a"]["status"] in ("pass", "warn")
    if HAS_TORCH:  # the same torch on both nodes, and what it says of itself
        assert checks["torch.versions.torch"]["status"] == "pass"
        assert report["torch"]["facts"]["a"]["distributed"] is True
        assert report["torch"]["envs"]["a"]["COORD_TORCH_BACKEND"] in ("gloo", "nccl")
    else:  # no torch in the nodes' interpreter: said, with the command that installs it on each node
        assert code == 1 and checks["torch.versions.torch"]["status"] == "fail"
        assert f"{NODE_PYTHON} -m pip install torch" in checks["torch.versions.torch"]["fix_command"]
    human = coord("preflight", "--config", str(daemon.config), "--torch", "--master-port", str(port),
                  env=daemon.env, timeout=300).stdout
    assert "torch.rendezvous" in human and "each node's PyTorch environment" in human


def test_a_master_port_held_by_another_process_fails_the_rendezvous(cluster):
    daemon, _ = cluster
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        _, report = preflight(daemon, "--launcher", "torchrun", "--master-port", str(port))
    check = next(c for c in report["checks"] if c["name"] == "torch.rendezvous")
    assert check["status"] == "fail" and f"port {port} is in use" in check["detail"], check


def test_an_mlx_preflight_has_no_torch_checks(cluster):
    daemon, _ = cluster
    _, report = preflight(daemon)
    assert "torch" not in report and not [c for c in report["checks"] if c["name"].startswith("torch.")]
    assert any(c["name"] == "rdma.backend" for c in report["checks"])


def test_a_bad_master_port_is_refused_before_the_daemon_is_asked(cluster):
    daemon, _ = cluster
    refused = coord("preflight", "--config", str(daemon.config), "--torch", "--master-port", "70000", env=daemon.env)
    assert refused.returncode == 2 and "--master-port: must be from 1 to 65535, got 70000" in refused.stderr
    # A rendezvous port is a PyTorch job's: alone, it says which option it goes with.
    alone = coord("preflight", "--config", str(daemon.config), "--master-port", "29500", env=daemon.env)
    assert alone.returncode == 2 and "give --torch, or --launcher torchrun|accelerate|deepspeed" in alone.stderr


@pytest.fixture(scope="module")
def model(cluster):
    _, root = cluster
    from coordinator.cli.tinymodel import write_project
    write_project(root / "project")
    return root / "project" / "model"


def test_a_pytorch_plan_shows_each_strategys_memory_and_writes_the_launchers_files(cluster, model, tmp_path):
    import jsonschema
    import yaml

    from coordinator.plan.document import load_schema

    daemon, _ = cluster
    port = free_port()
    out = tmp_path / "accelerate"
    result = coord("plan", "--config", str(daemon.config), "--json", "--launcher", "accelerate", "--model", str(model),
                   "--global-batch-size", "8", "--learning-rate", "1e-4", "--master-port", str(port),
                   "--config-dir", str(out), env=daemon.env, timeout=300)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, load_schema("plan-v2.0.0"))
    torch = doc["pytorch"]
    # The local nodes have no GPU: one CPU rank each, in fp32, and the tiny model fits as a replica.
    assert torch["strategy"] == "DDP" and torch["precision"] == "fp32" and torch["world"] == 2
    assert [row["strategy"] for row in torch["memory"]][:3] == ["DDP", "FSDP-SHARD_GRAD_OP", "FSDP-FULL_SHARD"]
    assert torch["batch"]["global_batch"] == 8 and torch["learning_rate"]["scaled"] == pytest.approx(
        1e-4 * 8 / torch["batch"]["micro_batch"])
    assert doc["memory_sizing"]["enabled"] is False  # MLX's sizing gives way to the PyTorch plan's
    configs = {path.name: yaml.safe_load(path.read_text()) for path in out.glob("*.yaml")}
    assert sorted(configs) == ["accelerate-a.yaml", "accelerate-b.yaml"]
    # and the plan itself, for coord run --plan
    assert json.loads((out / "plan.json").read_text()) == {k: v for k, v in torch.items() if k != "files"}
    assert [configs[f"accelerate-{n}.yaml"]["machine_rank"] for n in "ab"] == [0, 1]
    assert configs["accelerate-a.yaml"]["main_process_ip"] == "127.0.0.1"
    assert configs["accelerate-a.yaml"]["main_process_port"] == port
    assert configs["accelerate-a.yaml"]["distributed_type"] == "MULTI_CPU"
    assert f"wrote {out / 'accelerate-a.yaml'}" in result.stderr


def test_a_deepspeed_plan_on_screen_and_its_json(cluster, model, tmp_path):
    daemon, _ = cluster
    out = tmp_path / "ds"
    result = coord("plan", "--config", str(daemon.config), "--launcher", "deepspeed", "--model", str(model),
                   "--batch-size", "2", "--global-batch-size", "12", "--config-dir", str(out), env=daemon.env,
                   timeout=300)
    assert result.returncode == 0, result.stderr
    assert "ZeRO-3+offload" in result.stdout and "strategy: DDP" in result.stdout
    assert "batch: 2 per GPU × 3 accumulation × 2 ranks = 12" in result.stdout
    config = json.loads((out / "ds_config.json").read_text())
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (12, 2, 3)
    assert config["zero_optimization"] == {"stage": 0} and config["bf16"] == {"enabled": False}
    plain = json.loads(coord("plan", "--config", str(daemon.config), "--json", "--launcher", "deepspeed",
                             env=daemon.env, timeout=300).stdout)
    assert plain["pytorch"] == {"enabled": False,
                                "reason": "no model given: coord plan --launcher deepspeed --model DIR"}
