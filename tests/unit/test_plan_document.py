"""The v2.0.0 plan and the orchestration form, built from what the nodes measured.

The inputs are made the way the daemon makes them: topologies from the macOS command
outputs (the real pair in tests/fixtures/macos, the synthetic three-Mac mesh), the
connectivity matrix and backend choice, a hostfile, calibration records, a consistency
report and pre-flight checks from coord's own functions. Outputs are checked against the
JSON Schemas that ship with coord.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jsonschema
import pytest

from agent.launch import rank_command
from agent.topology import build_macos_topology
from coordinator.config.cluster_file import ClusterConfig, NodeConfig, SshSettings
from coordinator.launch.hostfile import build_hostfile
from coordinator.launch.mlx_backend import choose_backend
from coordinator.launch.topology import connectivity_matrix
from coordinator.plan.document import SECTIONS, build_plan, load_schema
from coordinator.plan.inputs import MeasuredTimings, PlanInputs, timings_from_events
from coordinator.plan.options import JobOptions, PlanInputError
from coordinator.plan.orchestration import (
    OrchestrationInputError,
    build_orchestration,
    check_request,
    coord_rules,
    parse_orchestration_input,
    read_orchestration_input,
)
from coordinator.plan.sections.training import scale_learning_rate, split_batch
from coordinator.readiness import checks
from coordinator.readiness.calibration import calibration_record
from coordinator.readiness.consistency import compare_nodes

# The repository is /work/main; the shared fixtures and formats sit beside it in /work/shared.
SHARED = Path(__file__).resolve().parents[1] / "fixtures"  # copies of ../shared/fixtures and ../shared/formats
SYNTHETIC = Path(__file__).resolve().parents[1] / "fixtures" / "macos-synthetic"
GIB = 2**30
MEASURED_AT = 1795168800.0  # 2026-11-20T10:00Z
MESH = {"studio-a": "A", "studio-b": "B", "studio-c": "C"}


def shared_file(relative: str) -> Path:
    path = SHARED / relative
    if not path.is_file():
        reason = f"{path} is missing (expected in tests/fixtures)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def macos_output(name: str) -> str:
    return shared_file(f"macos/{name}").read_text(encoding="utf-8")


def mesh_topology(letter: str) -> dict:
    prefix = f"mesh3-node{letter}"
    synthetic = lambda name: (SYNTHETIC / name).read_text(encoding="utf-8")  # noqa: E731
    return build_macos_topology({
        "rdma_ctl": macos_output("rdma_ctl-status.enabled.txt"),
        "ibv_devices": synthetic("macstudio.ibv_devices.rdma-enabled.txt"),
        "ibv_devinfo": synthetic(f"{prefix}.ibv_devinfo.txt"),
        "system_profiler": synthetic(f"{prefix}.SPThunderboltDataType.json"),
        "networksetup": synthetic("macstudio.networksetup-listallhardwareports.txt"),
        "ifconfig": synthetic(f"{prefix}.ifconfig.txt"),
    }, "26.2")


def real_pair_topologies() -> dict[str, dict]:
    """Two MacBook Pros on one cable: mbp-1 has RDMA disabled, mbp-2 enabled."""
    ports = macos_output("networksetup-listallhardwareports.txt")
    return {
        "mbp-1": build_macos_topology({
            "rdma_ctl": macos_output("rdma_ctl-status.disabled.txt"),
            "ibv_devices": macos_output("ibv_devices.rdma-disabled.txt"), "ibv_devinfo": None,
            "system_profiler": macos_output("system_profiler-SPThunderboltDataType.local-rdma-disabled.json"),
            "networksetup": ports, "ifconfig": None}, "27.0"),
        "mbp-2": build_macos_topology({
            "rdma_ctl": macos_output("rdma_ctl-status.enabled.txt"),
            "ibv_devices": macos_output("ibv_devices.rdma-enabled.txt"),
            "ibv_devinfo": macos_output("ibv_devinfo.rdma-enabled-peer-disabled.txt"),
            "system_profiler": macos_output("system_profiler-SPThunderboltDataType.peer-rdma-enabled.json"),
            "networksetup": ports, "ifconfig": None}, "27.0"),
    }


def node(name: str, user: str, host: str = "10.0.1.11") -> NodeConfig:
    return NodeConfig(name=name, host=host, user=user, python=f"/Users/{user}/venv/bin/python",
                      workdir=f"/Users/{user}/work")


def mac_facts(n: NodeConfig, *, os_version: str = "26.2", mlx: str = "0.32.4") -> dict:
    """What agent.facts.collect_facts returns on a Mac Studio."""
    return {"hostname": n.name, "user": n.user, "home": f"/Users/{n.user}", "os": "macOS", "os_version": os_version,
            "os_build": "25C56", "os_pretty": f"macOS {os_version}", "arch": "arm64", "chip": "Apple M3 Ultra",
            "cores": 28, "performance_cores": 20, "efficiency_cores": 8, "memory_bytes": 96 * GIB,
            "disk_free_bytes": 800 * GIB, "workdir": n.workdir, "python_version": "3.12.8",
            "python_executable": n.python, "mlx_version": mlx, "mlx_lm_version": "0.28.2", "gpu": "metal",
            "gpu_detail": "Device(gpu, 0)"}


def calibration(facts: dict, rate: float) -> dict:
    """A stored record, as StateStore.calibration returns it after coord calibrate."""
    result = {"ok": True, "quick": False, "device": "Device(gpu, 0)", "device_kind": "gpu",
              "mlx_version": facts["mlx_version"], "matmul_gflops": {"float32": 18200.0, "bfloat16": 33900.0},
              "memory_bandwidth_gbps": 690.0, "peak_memory_bytes": 96 * GIB, "train_samples_per_s": rate,
              "train_step_ms": 32 / rate * 1000, "errors": {}, "duration_s": 9.1}
    return {**calibration_record(facts, result), "measured_at": MEASURED_AT}


def manifest(variant: str = "") -> dict:
    return {"train.py": [1200, 0o644, "a" * 64], "lib/model.py": [800, 0o644, ("b" if not variant else "c") * 64]}


def preflight_result(nodes, facts, choice, hostfile, manifests) -> dict:
    views = [{"name": n.name, "state": "up", "host": n.host, "address": n.address} for n in nodes]
    found = checks.reachability(views) + checks.equal_versions({n.name: {"python": n.python, "host": n.host}
                                                                  for n in nodes}, facts)
    found += [checks.equal_os(facts), checks.code_consistency(manifests, {}, 0.95),
              checks.calibration({n.name: True for n in nodes}), checks.sync_hook(None, None)]
    found += checks.backend(choice, None) + [checks.hostfile(hostfile, None)]
    layers = {layer: checks.overall([c for c in found if c["layer"] == layer]) for layer in checks.LAYERS
              if any(c["layer"] == layer for c in found)}
    return {"status": checks.overall(found), "checks": found, "layers": layers}


def cluster_inputs(topologies: dict, *, rates: dict[str, float], options: JobOptions | None = None,
                   divergent: str | None = None, **overrides) -> PlanInputs:
    """PlanInputs made by coord's own functions, as the daemon would make them."""
    nodes = tuple(node(name, f"user{i}", f"10.0.1.{11 + i}") for i, name in enumerate(topologies))
    facts = {n.name: mac_facts(n, os_version=topologies[n.name]["os_version"]) for n in nodes}
    choice = choose_backend(connectivity_matrix(topologies), [n.name for n in nodes])
    config = ClusterConfig(name="lab", state_dir=Path("/state"), socket=Path("/state/coord.sock"),
                           ssh=SshSettings(), nodes=nodes)
    hostfile = build_hostfile(config, backend=choice["backend"], ips={h["node"]: h["ips"] for h in choice["hosts"]},
                              rdma={h["node"]: h["rdma"] for h in choice["hosts"]}, nodes=choice["order"])
    manifests = {n.name: manifest("other" if n.name == divergent else "") for n in nodes}
    hostfile_path = "/state/jobs/tiny/attempt-0/hostfile.json"
    values = dict(
        nodes=nodes, facts=facts, calibrations={name: calibration(facts[name], rate) for name, rate in rates.items()},
        backend=choice, hostfile=hostfile, hostfile_path=hostfile_path,
        launch_argv=["/opt/homebrew/bin/mlx.launch", "--hostfile", hostfile_path, "--", *rank_command("tiny")],
        launch_env={"PATH": "/state/jobs/tiny/attempt-0/bin:/usr/bin:/bin"},
        training_command=["python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data",
                          "--iters", "600"],
        job_name="tiny", consistency=compare_nodes(manifests, what="code"),
        preflight=preflight_result(nodes, facts, choice, hostfile, manifests), keepalive_s=2.0,
        dataset={"examples": 12000, "chunks": 3, "chunk_size": 5000, "source": "data/train.jsonl: 12000 lines"},
        sizing={"checkpoint_bytes": 42 * 2**20, "checkpoint_bytes_with_optimizer": 126 * 2**20,
                "memory_per_rank_bytes": 18 * GIB,
                "source": "model 3.2 GB bf16, LoRA rank 8"},
        options=options or JobOptions(per_rank_batch_size=4, learning_rate=1e-4))
    values.update(overrides)
    return PlanInputs(**values)


def mesh_inputs(**kwargs) -> PlanInputs:
    topologies = {name: mesh_topology(letter) for name, letter in MESH.items()}
    kwargs.setdefault("rates", {"studio-a": 5210.0, "studio-b": 5180.0, "studio-c": 5240.0})
    return cluster_inputs(topologies, **kwargs)


def validate(document: dict, schema: str = "plan-v2.0.0") -> None:
    json.loads(json.dumps(document))  # plain JSON, nothing else
    validator = jsonschema.Draft202012Validator(load_schema(schema))
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]
    assert not errors, "\n".join(errors)


def example() -> dict:
    return json.loads(shared_file("formats/plan-v2.0.0.example.json").read_text(encoding="utf-8"))


# --- the schema -------------------------------------------------------------------------------


def test_the_schema_is_valid_draft_2020_12_and_accepts_the_shipped_example():
    jsonschema.Draft202012Validator.check_schema(load_schema())
    validate(example())


@pytest.mark.parametrize("name", ["orchestration-input", "orchestration-output"])
def test_the_shipped_orchestration_schemas_are_the_formats_own(name):
    shared = json.loads(shared_file(f"formats/{name}.schema.json").read_text(encoding="utf-8"))
    assert load_schema(name) == shared


def test_the_schema_refuses_a_section_without_its_reason_or_with_an_unknown_field():
    document = build_plan(mesh_inputs())
    broken = {**document, "coordinator_chunking": {"enabled": False}}
    with pytest.raises(AssertionError, match="'reason' is a required property"):
        validate(broken)
    broken = {**document, "strategy": {**document["strategy"], "totl_gpus": 3}}
    with pytest.raises(AssertionError, match="totl_gpus"):
        validate(broken)


# --- a measured cluster -----------------------------------------------------------------------


def test_a_fully_measured_mesh_fills_every_section_and_validates():
    plan = build_plan(mesh_inputs())
    validate(plan)
    assert plan["version"] == "2.0.0"
    assert [key for key in plan if key != "version"] == list(SECTIONS)
    disabled = [name for name in SECTIONS if isinstance(plan[name], dict) and plan[name].get("enabled") is False]
    assert disabled == []
    assert plan["strategy"]["total_gpus"] == 3 and plan["strategy"]["gpus_per_node"] == 1
    assert plan["rdma_config"]["backend"] == "jaccl"


def test_every_value_has_a_source_and_every_format_field_is_filled_or_says_why():
    plan = build_plan(mesh_inputs())
    for name, shape in example().items():
        if not isinstance(shape, dict):
            continue
        section = plan[name]
        for field in shape:
            assert field in section or field in section.get("missing", {}), f"{name}.{field}"
        for field in section:
            if field not in ("enabled", "sources", "missing"):
                assert section["sources"].get(field), f"{name}.{field} has no source"


def test_the_distributed_config_is_the_exact_launch_coord_runs():
    inputs = mesh_inputs()
    config = build_plan(inputs)["distributed_config"]
    assert config["mlx_launch_command"] == ("/opt/homebrew/bin/mlx.launch --hostfile "
                                            "/state/jobs/tiny/attempt-0/hostfile.json -- /bin/sh -c "
                                            "'exec \"$HOME/.coord/jobs/tiny/rank-$MLX_RANK.sh\"'")
    assert config["hostfile"] == inputs.hostfile_path
    assert config["unified_memory"] is True
    assert {"MLX_RANK", "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES"} <= set(config["mlx_env_vars"])
    assert "MLX_HOSTFILE" not in config["mlx_env_vars"]  # that one is the ring backend's
    assert [r["node"] for r in config["ranks"]] == inputs.backend["order"]


def test_an_rdma_mesh_lists_each_link_once_with_its_devices_and_speed():
    rdma = build_plan(mesh_inputs())["rdma_config"]
    assert rdma["enabled"] is True
    assert len(rdma["links"]) == 3
    assert all(link["speed_gbps"] == 80 and link["generation"] == 5 for link in rdma["links"])
    assert all(device.startswith("rdma_en") for link in rdma["links"] for device in link["devices"])
    assert "macOS 26.2 on studio-a" in rdma["platform"] and "Thunderbolt 5" in rdma["platform"]
    assert "expected_speedup" in rdma["missing"]  # never "2-3x" without a measurement


def test_a_node_without_rdma_gives_the_ring_and_the_recovery_fix():
    inputs = cluster_inputs(real_pair_topologies(), rates={"mbp-1": 900.0, "mbp-2": 910.0})
    plan = build_plan(inputs)
    validate(plan)
    rdma = plan["rdma_config"]
    assert rdma["enabled"] is False and rdma["backend"] == "ring"
    assert "mbp-1" in rdma["reason"]
    assert rdma["fixes"][0]["node"] == "mbp-1"
    assert "rdma_ctl enable" in rdma["setup"] and "Recovery" in rdma["setup"]
    assert plan["distributed_config"]["mlx_env_vars"]["MLX_HOSTFILE"]


# --- batch and learning rate ------------------------------------------------------------------


def test_total_batch_is_per_rank_times_ranks_times_accumulation_and_the_rate_scales_linearly():
    options = JobOptions(per_rank_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-4)
    batch = build_plan(mesh_inputs(options=options))["batch_configuration"]
    assert batch["total_batch_size"] == 4 * 3 * 2
    assert batch["mlx_lm_batch_size"] == 12  # what to pass as mlx-lm's --batch-size: it splits it over ranks
    assert batch["base_batch_size"] == 4  # by default the base rate is one rank's
    assert batch["learning_rate"] == pytest.approx(1e-4 * 24 / 4)
    assert "4 × 3 × 2" in batch["sources"]["total_batch_size"]
    assert batch["warmup_steps"] == 0 and batch["warmup_epochs"] == 0


def test_square_root_scaling_for_adam_and_warmup_in_epochs_from_the_example_count():
    options = JobOptions(per_rank_batch_size=8, learning_rate=2e-5, base_batch_size=8, optimizer="adamw",
                         lr_scaling="sqrt", warmup_steps=100)
    batch = build_plan(mesh_inputs(options=options))["batch_configuration"]
    assert batch["learning_rate"] == pytest.approx(2e-5 * 3**0.5, rel=1e-5)
    assert batch["warmup_epochs"] == pytest.approx(100 * 24 / 12000)
    assert "√(24 / 8)" in batch["sources"]["learning_rate"]


def test_defaults_name_the_tool_they_come_from():
    batch = build_plan(mesh_inputs(options=JobOptions(per_rank_batch_size=2)))["batch_configuration"]
    assert batch["base_learning_rate"] == 1e-5
    assert "mlx-lm's default" in batch["sources"]["base_learning_rate"]
    checkpoint = build_plan(mesh_inputs(options=JobOptions(per_rank_batch_size=2)))["checkpoint_strategy"]
    assert checkpoint["frequency"] == "every 10 steps" and "coord run's default" in checkpoint["sources"]["frequency"]


def test_the_per_rank_batch_may_come_from_sizing():
    inputs = mesh_inputs(options=JobOptions(), sizing={"per_rank_batch_size": 6, "source": "fits 96 GiB"})
    batch = build_plan(inputs)["batch_configuration"]
    assert batch["per_gpu_batch_size"] == 6 and batch["sources"]["per_gpu_batch_size"] == "sizing: fits 96 GiB"


def test_learning_rate_rules():
    assert scale_learning_rate(1e-4, 24, 4, "linear") == pytest.approx(6e-4)
    assert scale_learning_rate(1e-4, 16, 4, "sqrt") == pytest.approx(2e-4)
    assert scale_learning_rate(3e-4, 4, 4, "linear") == 3e-4


@pytest.mark.parametrize("options, message", [
    (JobOptions(lr_scaling="sqrt", optimizer="sgd"), "lr_scaling 'sqrt' is for Adam-family optimizers"),
    (JobOptions(fine_tune_type="qlora"), "fine_tune_type must be one of lora, dora, full, got 'qlora'"),
    (JobOptions(per_rank_batch_size=0), "per_rank_batch_size must be a whole number ≥ 1, got 0"),
    (JobOptions(learning_rate=-1.0), "learning_rate must be a number > 0"),
    (JobOptions(warmup_steps=False), "warmup_steps must be a whole number ≥ 0"),
    (JobOptions(compression="gzip"), "compression must be one of none"),
    (JobOptions(replica="nas"), "replica must be one of head, none, studio-a, studio-b, studio-c, got 'nas'"),
    (JobOptions(min_nodes=4), "min_nodes 4 is more than the 3 nodes of the cluster"),
    (JobOptions(trainer="torch"), "trainer must be one of mlx_lm, coord"),
])
def test_unusable_options_are_refused_naming_the_option(options, message):
    with pytest.raises(PlanInputError, match=message.replace("(", r"\(")):
        build_plan(mesh_inputs(options=options))


# --- trainer, replicas, elasticity ------------------------------------------------------------


def test_the_checkpoint_section_follows_the_trainer():
    mlx_lm = build_plan(mesh_inputs())["checkpoint_strategy"]
    assert mlx_lm["async"] is False and "no optimizer state" in mlx_lm["contents"]
    coord = build_plan(mesh_inputs(options=JobOptions(per_rank_batch_size=4, trainer="coord")))
    assert coord["checkpoint_strategy"]["async"] is True
    assert "optimizer state" in coord["checkpoint_strategy"]["contents"]
    assert "all_sum" in coord["distributed_config"]["gradient_sync"]
    script = build_plan(mesh_inputs(training_command=["python", "train.py"]))
    validate(script)
    assert "its own checkpoints" in script["checkpoint_strategy"]["missing"]["async"]
    assert "gradient_sync" in script["distributed_config"]["missing"]


@pytest.mark.parametrize("replica, expected", [
    (None, "head: each validated checkpoint is copied in the background to the head's state directory"),
    ("none", "none: a checkpoint lives only on rank 0's node"),
    ("studio-b", "studio-b: each validated checkpoint is copied in the background to studio-b's workdir"),
])
def test_the_replica_says_where_each_checkpoint_is_copied(replica, expected):
    options = JobOptions(per_rank_batch_size=4, replica=replica)
    checkpoint = build_plan(mesh_inputs(options=options))["checkpoint_strategy"]
    assert checkpoint["replica"].startswith(expected)


def test_elastic_training_follows_min_nodes():
    inputs = mesh_inputs(options=JobOptions(per_rank_batch_size=4, min_nodes=2, node_timeout=30.0))
    fault = build_orchestration(inputs)["faultTolerance"]
    assert fault["elasticTraining"] is True
    assert fault["elasticity"]["minNodes"] == 2 and fault["elasticity"]["nodeTimeoutSeconds"] == 30.0
    assert build_orchestration(mesh_inputs())["faultTolerance"]["elasticTraining"] is False


# --- calibration and consistency --------------------------------------------------------------


def test_one_slow_node_gets_a_smaller_share_and_is_named_a_rate_outlier():
    topologies = {**{name: mesh_topology(letter) for name, letter in MESH.items()}}
    rates = {"studio-a": 1000.0, "studio-b": 1000.0, "studio-c": 500.0}
    plan = build_plan(cluster_inputs(topologies, rates=rates))
    hardware = plan["hardware_calibration"]
    assert hardware["workload_distribution"] == {"studio-a": 0.4, "studio-b": 0.4, "studio-c": 0.2}
    assert hardware["batch_split"] == {"studio-a": 5, "studio-b": 5, "studio-c": 2}
    assert hardware["rate_outliers"] == ["studio-c"]
    assert "2026-11-20T10:00Z on studio-c: 500 samples/s" in hardware["sources"]["measured_performance"]
    assert plan["worker_consistency"]["byzantine_detection"]["rate_outliers"] == ["studio-c"]
    assert plan["performance_targets"]["throughput_samples_per_s"] == 1500.0  # 3 ranks × the slowest
    assert plan["performance_targets"]["throughput_if_split_by_rate"] == 2500.0


def test_a_stale_calibration_is_not_used_and_the_plan_says_why():
    inputs = mesh_inputs()
    facts = {**inputs.facts, "studio-b": {**inputs.facts["studio-b"], "mlx_version": "0.33.0"}}
    plan = build_plan(dataclasses.replace(inputs, facts=facts))
    validate(plan)
    assert "studio-b" not in plan["hardware_calibration"]["measured_performance"]
    assert "mlx version changed 0.32.4 → 0.33.0" in plan["hardware_calibration"]["calibration_notes"]
    targets = plan["performance_targets"]  # nothing else measured either, so the whole section says why
    assert targets["enabled"] is False and "studio-b: mlx version changed" in targets["reason"]
    assert any(step.startswith("coord calibrate") for step in plan["verification_steps"])


def test_a_jobs_weight_fingerprints_are_in_worker_consistency_or_the_plan_says_how_to_get_them():
    plan = build_plan(mesh_inputs())
    validate(plan)
    missing = plan["worker_consistency"]["byzantine_detection"]["training_fingerprints"]
    assert missing["enabled"] is False and "--fingerprint-every" in missing["reason"]
    check = {"job": "ft", "steps_compared": 6, "ranks": 3, "attempt": 1, "last_step": 60, "last_agreed": 60,
             "divergences": [{"attempt": 0, "step": 20, "nodes": ["studio-b"],
                              "detail": "rank 1 diverged from the majority's weights at step 20"}]}
    plan = build_plan(dataclasses.replace(mesh_inputs(), replica_check=check))
    validate(plan)
    found = plan["worker_consistency"]["byzantine_detection"]["training_fingerprints"]
    assert found == {"enabled": True, "job": "ft", "steps_compared": 6, "last_step": 60, "last_agreed_step": 60,
                     "divergences": ["attempt 0: rank 1 diverged from the majority's weights at step 20 (studio-b)"]}
    assert "job ft's ranks" in plan["worker_consistency"]["sources"]["byzantine_detection"]


def test_a_divergent_node_is_named_and_the_plan_is_not_consistent():
    plan = build_plan(mesh_inputs(divergent="studio-c"))
    validate(plan)
    consistency = plan["worker_consistency"]
    assert consistency["is_consistent"] is False
    assert consistency["byzantine_detection"]["divergent_workers"] == ["studio-c"]
    assert consistency["agreement_ratio"] == pytest.approx(0.6667)
    assert consistency["script_hash"] == consistency["hashes"]["studio-a"]
    checklist = {entry["name"]: entry for entry in plan["pre_flight_checklist"]["checks"]}
    assert checklist["worker_consistency"]["status"] == "fail"
    assert checklist["worker_consistency"]["fix_command"] == "coord sync"
    assert plan["pre_flight_checklist"]["overall_status"] == "fail"
    assert plan["pre_rdma_sync"]["sync_status"] == "fail"


def test_split_batch_hands_out_whole_samples_by_largest_remainder():
    assert split_batch(10, {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}) == {"a": 4, "b": 3, "c": 3}
    assert sum(split_batch(17, {"a": 0.5, "b": 0.3, "c": 0.2}).values()) == 17


def test_a_local_linux_cluster_plans_a_loopback_ring_on_the_cpu():
    nodes = (NodeConfig(name="n1", host="local", python="/usr/bin/python3", workdir="/tmp/n1"),
             NodeConfig(name="n2", host="local", python="/usr/bin/python3", workdir="/tmp/n2"))
    facts = {n.name: {"os": "Linux", "os_version": "12", "os_build": "6.1.0", "arch": "x86_64", "chip": "Xeon",
                      "memory_bytes": 24 * GIB, "mlx_version": "0.32.4", "mlx_lm_version": "0.32.2",
                      "python_executable": n.python, "gpu": "none"} for n in nodes}
    # What plan_backend answers when every node is this machine.
    choice = {"ok": True, "backend": "ring", "transport": "tcp", "order": ["n1", "n2"], "hosts": [],
              "reasons": ["every node is this machine: ring over loopback"], "warnings": [], "fixes": []}
    inputs = PlanInputs(nodes=nodes, facts=facts, backend=choice, launch_argv=["mlx.launch", "--", "true"],
                        calibrations={n: calibration(facts[n], 410.0) for n in facts},
                        options=JobOptions(per_rank_batch_size=2, fine_tune_type="full"))
    plan = build_plan(inputs)
    validate(plan)
    assert plan["rdma_config"] == {"enabled": False, "reason": "every node is this machine: ring over loopback",
                                   "backend": "ring", "os_versions": {"n1": "12", "n2": "12"}, "fixes": []}
    assert "MLX runs on the CPU" in plan["distributed_config"]["missing"]["unified_memory"]
    assert "no training command given" in plan["distributed_config"]["sources"]["gradient_sync"]
    validate(build_orchestration(inputs), "orchestration-output")


# --- nothing measured yet ---------------------------------------------------------------------


def test_with_only_the_cluster_file_every_section_says_why_it_is_empty():
    nodes = (node("studio-a", "alice"), node("studio-b", "bob"))
    plan = build_plan(PlanInputs(nodes=nodes))
    validate(plan)
    reasons = {name: plan[name]["reason"] for name in SECTIONS
               if isinstance(plan[name], dict) and plan[name].get("enabled") is False}
    assert "coord calibrate" in reasons["hardware_calibration"]
    assert "coord preflight" in reasons["pre_flight_checklist"]
    assert "coord preflight" in reasons["pre_rdma_sync"]
    assert "coord sync" in reasons["worker_consistency"]
    assert "--data DIR" in reasons["coordinator_chunking"]
    assert "per-rank batch" in reasons["batch_configuration"]
    assert "no launch command" in reasons["distributed_config"]
    assert "coord hostfile" in reasons["rdma_config"]
    assert "coord calibrate" in reasons["performance_targets"]
    assert "studio-a: no calibration yet" in reasons["hardware_calibration"]
    assert plan["strategy"]["total_gpus"] == 2 and "cluster file order" in plan["strategy"]["sources"]["rank_order"]
    assert "expected_recovery_time" in plan["checkpoint_strategy"]["missing"]


# --- measured timings -------------------------------------------------------------------------


def job_events() -> list[dict]:
    def event(ts, kind, message, **data):
        return {"ts": ts, "kind": kind, "node": None, "message": message, "data": data or None}

    return [
        event(100.0, "job.launched", "tiny: attempt 0 launched", attempt=0, seconds=0.4),
        event(104.2, "job.first_step", "tiny: attempt 0 reached step 1", seconds=4.2, step=1),
        event(110.0, "job.attempt_ended", "tiny: attempt 0: rank_failed: rank 1 exited", outcome="rank_failed"),
        event(110.3, "job.stopped_ranks", "tiny: attempt 0: every rank stopped", seconds=0.3),
        event(110.5, "job.first_step", "other: attempt 0 reached step 1", seconds=3.8, step=1),
        event(111.0, "job.checkpoint_placed", "tiny: checkpoint of step 20 placed on 3 nodes", seconds=0.6),
        event(116.5, "job.first_step", "tiny: attempt 1 reached step 21", seconds=4.4, step=21),
        event(120.0, "job.attempt_ended", "tiny: attempt 1: stopped: stop requested", outcome="stopped"),
    ]


def test_timings_pair_each_failure_with_the_next_first_step_of_the_same_job():
    timings = timings_from_events(job_events())
    assert timings.launch_to_first_step_s == (4.2, 3.8, 4.4)
    assert timings.recovery_s == (6.5,)
    assert timings.checkpoint_place_s == (0.6,)
    assert timings.stop_s == (0.3,)


def test_recovery_time_is_measured_when_known_else_estimated_and_says_which():
    measured = build_plan(mesh_inputs(timings=timings_from_events(job_events())))["checkpoint_strategy"]
    assert measured["expected_recovery_seconds"] == 6.5
    assert measured["sources"]["expected_recovery_time"].startswith("measured: median of 1 recovery")
    estimate = build_plan(mesh_inputs(timings=MeasuredTimings(launch_to_first_step_s=(4.0, 5.0), stop_s=(0.5,))))
    checkpoint = estimate["checkpoint_strategy"]
    assert checkpoint["expected_recovery_seconds"] == 5.0  # no wait before a first restart + 0.5 s stop + 4.5 s launch
    how = checkpoint["sources"]["expected_recovery_time"]
    assert how.startswith("estimate: first restart at once")
    assert "copying the checkpoint to every node not included (not measured yet)" in how


def test_the_trainers_save_events_give_the_median_save_and_step_time():
    def saved(ts, held, step_s):
        return {"ts": ts, "kind": "job.checkpoint_saved", "node": None, "message": "tiny: checkpoint saved",
                "data": {"step": 10, "blocking_seconds": held, "write_seconds": 0.5, "step_seconds": step_s}}

    timings = timings_from_events([*job_events(), saved(101, 0.02, 0.4), saved(102, 0.04, None),
                                   saved(103, 0.9, 0.6), saved(104, 0.03, 0.5)])
    assert timings.checkpoint_save_s == 0.035  # median of 0.02, 0.04, 0.9, 0.03
    assert timings.step_s == 0.5  # median of the known step times
    assert timings_from_events(job_events()).checkpoint_save_s is None


def test_the_checkpoint_size_holds_the_optimizer_state_when_coords_trainer_saves_it():
    plain = build_plan(mesh_inputs())["checkpoint_strategy"]
    assert plain["checkpoint_bytes"] == 42 * 2**20
    exact = build_plan(mesh_inputs(options=JobOptions(per_rank_batch_size=4, learning_rate=1e-4, trainer="coord")))
    assert exact["checkpoint_strategy"]["checkpoint_bytes"] == 126 * 2**20
    assert "optimizer state" in exact["checkpoint_strategy"]["sources"]["checkpoint_bytes"]


def test_checkpoint_overhead_comes_from_measured_save_and_step_times():
    timings = MeasuredTimings(step_s=0.5, checkpoint_save_s=0.25)
    targets = build_plan(mesh_inputs(timings=timings))["performance_targets"]
    assert targets["checkpoint_overhead"] == "4.8%"  # 0.25 / (10 × 0.5 + 0.25)
    assert "gpu_utilization" in targets["missing"]


# --- the orchestration form -------------------------------------------------------------------

REQUEST = {"modelConfig": {"path": "model", "size": "3B", "framework": "mlx"},
           "dataConfig": {"path": "data", "size": "40MB", "sharding": "by-file"},
           "clusterConfig": {"numNodes": 4, "gpusPerNode": 8, "networkBandwidth": "80Gbps"},
           "trainingConfig": {"batchSize": 24, "epochs": 2, "parallelismStrategy": "data", "lr": 3}}


def test_the_orchestration_document_validates_and_says_what_it_could_not_obey():
    inputs = mesh_inputs(options=JobOptions())
    document = build_orchestration(inputs, parse_orchestration_input(REQUEST))
    validate(document, "orchestration-output")
    assert document["distributedConfig"]["worldSize"] == 3
    assert document["distributedConfig"]["backend"] == "jaccl"
    assert document["faultTolerance"]["elasticTraining"] is False
    assert document["faultTolerance"]["elasticity"]["minNodes"] == 3
    assert [check["name"] for check in document["faultTolerance"]["healthChecks"]][:2] == ["rank_exit", "node_lost"]
    assert "6 s (3 keepalives of 2 s)" in document["faultTolerance"]["healthChecks"][1]["within"]
    assert document["checkpointStrategy"]["frequency"] == "every 10 steps"
    notes = "\n".join(document["requestNotes"])
    assert "numNodes asks for 4 nodes; the cluster file has 3" in notes
    assert "gpusPerNode 8" in notes
    assert "trainingConfig.lr" in notes  # an unknown field is named, not silently dropped
    assert "--iters 1000" in notes  # 2 epochs × 12000 examples / 24
    assert "batchSize 24 = 8 per rank × 3 ranks" in notes
    assert "framework" not in notes  # MLX's own: nothing to say
    torch = build_orchestration(inputs, parse_orchestration_input(
        {**REQUEST, "modelConfig": {**REQUEST["modelConfig"], "framework": "pytorch"}}))
    assert any("'pytorch'" in note and "coord plan --launcher accelerate or deepspeed" in note
               for note in torch["requestNotes"]), torch["requestNotes"]
    jax = build_orchestration(inputs, parse_orchestration_input(
        {**REQUEST, "modelConfig": {**REQUEST["modelConfig"], "framework": "JAX"}}))
    assert any("'JAX'" in note and "coord plan does not plan a JAX job" in note for note in jax["requestNotes"])
    assignments = document["resourceAllocation"]["nodeAssignments"]
    assert [a["node"] for a in assignments] == inputs.backend["order"]
    plan = build_plan(dataclasses.replace(inputs, options=JobOptions(per_rank_batch_size=24 // 3)))
    assert plan["batch_configuration"]["total_batch_size"] == 24


def test_the_orchestration_document_without_measurements_still_validates():
    document = build_orchestration(PlanInputs(nodes=(node("studio-a", "alice"),)))
    validate(document, "orchestration-output")
    assert "coord hostfile" in document["distributedConfig"]["missing"]["backend"]
    assert "requestNotes" not in document


@pytest.mark.parametrize("data, message", [
    ([], "the input must be an object, got an array"),
    ({"modelConfig": {}, "dataConfig": {}}, "clusterConfig is required"),
    ({**REQUEST, "clusterConfig": {"numNodes": "4"}},
     'clusterConfig.numNodes must be an integer, got a string ("4")'),
    ({**REQUEST, "trainingConfig": {"batchSize": True}}, "trainingConfig.batchSize must be an integer, got a boolean"),
    ({**REQUEST, "trainingConfig": {"epochs": 0}}, "trainingConfig.epochs must be at least 1, got 0"),
    ({**REQUEST, "modelConfig": "llama"}, "modelConfig must be an object, got a string"),
])
def test_orchestration_input_errors_name_the_field(data, message):
    with pytest.raises(OrchestrationInputError) as caught:
        parse_orchestration_input(data)
    assert message in str(caught.value)


def test_an_orchestration_input_file_that_is_not_json_names_the_line_and_column():
    with pytest.raises(OrchestrationInputError, match=r"^request.json:3:5: not JSON"):
        read_orchestration_input('{\n  "modelConfig": {},\n    oops\n}', "request.json")


def test_every_error_in_an_orchestration_input_is_reported_at_once():
    with pytest.raises(OrchestrationInputError) as caught:
        parse_orchestration_input({"modelConfig": {"path": 1}, "dataConfig": {"size": 2}})
    assert str(caught.value).splitlines() == ["clusterConfig is required", "modelConfig.path must be a string, "
                                              "got an integer (1)", "dataConfig.size must be a string, got an "
                                              "integer (2)"]


def test_orchestration_input_names_unknown_fields_as_ignored_and_reports_counts_below_1_with_type_errors():
    errors, ignored = check_request({**REQUEST, "modelConfig": {"path": "m", "pth": "x"}, "extra": 1,
                                     "clusterConfig": {"numNodes": 0, "gpusPerNode": 1.5}})
    assert errors == ["clusterConfig.numNodes must be at least 1, got 0",
                      "clusterConfig.gpusPerNode must be an integer, got a number (1.5)"]
    assert sorted(ignored) == ["extra (known: modelConfig, dataConfig, clusterConfig, trainingConfig)",
                               "modelConfig.pth (known: path, size, framework)",
                               "trainingConfig.lr (known: batchSize, epochs, parallelismStrategy)"]
    request = parse_orchestration_input({**REQUEST, "modelConfig": {"path": "m", "pth": "x"}})
    assert request.model_path == "m" and "modelConfig.pth (known: path, size, framework)" in request.ignored


def test_coord_rules_leave_the_formats_schema_as_it_is():
    schema = load_schema("orchestration-input")
    strict = coord_rules(schema)
    assert schema == load_schema("orchestration-input")  # not changed in place
    assert strict["additionalProperties"] is False
    assert strict["properties"]["clusterConfig"]["properties"]["numNodes"] == {"type": "integer", "minimum": 1}
    jsonschema.Draft202012Validator.check_schema(strict)


def test_the_checkpoint_section_says_what_every_nodes_own_copies_cost():
    exact = build_plan(mesh_inputs(options=JobOptions(per_rank_batch_size=4, learning_rate=1e-4, trainer="coord")))
    validate(exact)
    checkpoint = exact["checkpoint_strategy"]
    assert checkpoint["storage"].startswith("every node:")
    assert "a resume copies nothing" in checkpoint["copies"]
    assert checkpoint["disk_bytes_per_node"] == 3 * 126 * 2**20  # keep 3 on every node
    assert checkpoint["host_memory_bytes_per_rank"] == 126 * 2**20
    plain = build_plan(mesh_inputs())["checkpoint_strategy"]
    assert "copied in the background to every other node" in plain["copies"]
    assert "host_memory_bytes_per_rank" not in plain
