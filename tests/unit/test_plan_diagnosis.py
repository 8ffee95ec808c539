"""Known failure modes: found in real-looking rank logs, in the job's command and environment,
and in the nodes' facts and topologies, each with its fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.facts_parsers import parse_sw_vers
from agent.topology import build_macos_topology
from coordinator.jobs.diagnosis import (
    KNOWN_FAILURES,
    diagnose_cluster,
    diagnose_job,
    diagnose_log,
    mlx_lm_lora_args,
)

SHARED_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "macos"
SYNTHETIC = Path(__file__).resolve().parents[1] / "fixtures" / "macos-synthetic"

METAL_TIMEOUT_LINE = ("libc++abi: terminating due to uncaught exception of type std::runtime_error: [METAL] Command "
                      "buffer execution failed: Caused GPU Timeout Error (00000002:kIOGPUCommandBufferCallbackError"
                      "Timeout)")
METAL_OOM_LINE = ("libc++abi: terminating due to uncaught exception of type std::runtime_error: [METAL] Command "
                  "buffer execution failed: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOf"
                  "Memory)")
RANK_LOG = f"""\
Loading pretrained model
Trainable parameters: 100.000% (3633.000M/4022.468M)
Starting training..., iters: 600
Iter 1: Val loss 2.345, Val took 12.1s
Iter 10: Train loss 2.101, Learning Rate 1.000e-05, It/sec 0.412, Tokens/sec 3374.2, Trained Tokens 81920, \
Peak mem 88.214 GB
{METAL_TIMEOUT_LINE}
[WARN] Node with rank 1 exited with code 134
"""


def ids(diagnoses: list[dict]) -> list[str]:
    return [d["id"] for d in diagnoses]


def test_every_known_failure_has_a_detection_and_a_fix():
    assert len({mode.id for mode in KNOWN_FAILURES}) == len(KNOWN_FAILURES)
    assert all(mode.title and mode.detection and mode.fix for mode in KNOWN_FAILURES)


# --- logs -------------------------------------------------------------------------------------


def test_a_metal_timeout_in_a_rank_log_is_named_with_its_line_and_fix():
    (found,) = diagnose_log(RANK_LOG)
    assert found["id"] == "metal_command_buffer_timeout"
    assert found["line"] == METAL_TIMEOUT_LINE and found["line_number"] == 6
    assert "--grad-checkpoint" in found["fix"] and "--batch-size" in found["fix"]


def test_each_failure_is_reported_once_in_the_order_the_log_shows_them():
    log = "\n".join([METAL_OOM_LINE, "noise", METAL_TIMEOUT_LINE, METAL_OOM_LINE,
                     "[METAL] Command buffer execution failed: Ignored (for causing prior/excessive GPU errors) "
                     "(00000004:kIOGPUCommandBufferCallbackErrorSubmissionsIgnored)"])
    found = diagnose_log(log)
    assert ids(found) == ["metal_out_of_memory", "metal_command_buffer_timeout", "gpu_submissions_ignored"]
    assert [d["line_number"] for d in found] == [1, 3, 5]
    assert "reboot" in found[2]["fix"] and "MLX_METAL_FAST_SYNCH" in found[2]["fix"]


def test_a_healthy_log_has_no_diagnosis():
    assert diagnose_log(RANK_LOG.replace(METAL_TIMEOUT_LINE, "Iter 20: Train loss 1.9")) == []
    assert diagnose_log("") == []


# --- the job ----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [
    ["python", "-m", "mlx_lm", "lora", "--train"],
    ["/Users/alice/venv/bin/python3", "-m", "mlx_lm.lora", "--train"],
    ["mlx_lm.lora", "--train"],
    ["python", "-m", "agent.mlx_lm_train", "--train"],  # as coord rewrote it for an attempt
])
def test_mlx_lm_lora_is_recognised_in_every_form(command):
    assert mlx_lm_lora_args(command) == ["--train"]


def test_a_script_that_is_not_mlx_lm_gets_no_mlx_lm_diagnosis():
    assert mlx_lm_lora_args(["python", "train.py", "--save-every", "5000"]) is None
    assert diagnose_job(["python", "train.py", "--save-every", "5000"], {}, "0.20.0") == []


def test_mlx_lm_without_num_layers_trains_only_the_top_16_blocks():
    (found,) = diagnose_job(["python", "-m", "mlx_lm", "lora", "--fine-tune-type", "full", "--iters", "600"])
    assert found["id"] == "mlx_lm_top_layers_only"
    assert "--fine-tune-type full without --num-layers" in found["detail"]
    assert "--num-layers -1" in found["fix"]
    assert diagnose_job(["python", "-m", "mlx_lm", "lora", "--num-layers", "-1"]) == []
    assert diagnose_job(["python", "-m", "mlx_lm", "lora", "--num-layers=-1"]) == []


def test_a_config_file_may_set_num_layers_and_the_detail_says_so():
    (found,) = diagnose_job(["python", "-m", "mlx_lm", "lora", "-c", "lora.yaml"])
    assert "its --config file may set it" in found["detail"]


@pytest.mark.parametrize("every, flagged", [("1000", False), ("1001", True), ("5000", True), ("10", False)])
def test_save_every_above_1000_is_flagged(every, flagged):
    found = diagnose_job(["python", "-m", "mlx_lm", "lora", "--num-layers", "-1", "--save-every", every])
    assert ("save_every_too_large" in ids(found)) is flagged


@pytest.mark.parametrize("version, flagged", [("0.30.1", True), ("0.29.0", True), ("0.30.2", False),
                                              ("0.32.2", False), ("1.0", False), ("0.30.2.dev3", False),
                                              ("0.30.2rc1", False), ("0.30.1rc1", True), (None, False),
                                              ("unknown", False)])
def test_mlx_lm_older_than_0_30_2_is_flagged(version, flagged):
    found = diagnose_job(["python", "-m", "mlx_lm", "lora", "--num-layers", "-1"], {}, version)
    assert ("mlx_lm_validation_graph" in ids(found)) is flagged


@pytest.mark.parametrize("value, flagged", [("1", True), ("0", False), ("", False), ("2", True)])
def test_metal_fast_synch_in_the_environment_is_flagged(value, flagged):
    found = diagnose_job(["python", "train.py"], {"MLX_METAL_FAST_SYNCH": value})
    assert ("metal_fast_synch" in ids(found)) is flagged
    if flagged:
        assert "reboot" in found[0]["title"] and "unset MLX_METAL_FAST_SYNCH" in found[0]["fix"]


def test_metal_fast_synch_set_by_an_env_prefix_on_the_command_is_flagged():
    found = diagnose_job(["env", "MLX_METAL_FAST_SYNCH=1", "python", "train.py"])
    assert ids(found) == ["metal_fast_synch"] and "MLX_METAL_FAST_SYNCH=1" in found[0]["detail"]
    assert diagnose_job(["env", "MLX_METAL_FAST_SYNCH=0", "python", "train.py"]) == []
    assert diagnose_job(["python", "train.py", "MLX_METAL_FAST_SYNCH=1"]) == []  # an argument, not the env


def test_a_node_whose_login_environment_sets_fast_synch_or_has_old_mlx_lm_is_named():
    facts = {"m1": {"mlx_env": {"MLX_METAL_FAST_SYNCH": "1"}, "mlx_lm_version": "0.30.2"},
             "m2": {"mlx_env": {"MLX_METAL_FAST_SYNCH": "0"}, "mlx_lm_version": "0.29.1"},
             "m3": {"mlx_env": {}, "mlx_lm_version": "0.31.0"}, "down": None}
    found = {d["id"]: d for d in diagnose_cluster(facts)}
    assert set(found) == {"metal_fast_synch", "mlx_lm_validation_graph"}
    assert "m1 (MLX_METAL_FAST_SYNCH=1)" in found["metal_fast_synch"]["detail"]
    assert "m1" in found["metal_fast_synch"]["fix"] and "m2" not in found["metal_fast_synch"]["fix"]
    assert found["mlx_lm_validation_graph"]["detail"] == "older than 0.30.2: m2 has mlx-lm 0.29.1"
    assert "Python of m2" in found["mlx_lm_validation_graph"]["fix"]


# --- the cluster ------------------------------------------------------------------------------


def macos_facts(version: str, build: str) -> dict:
    versions = parse_sw_vers(f"ProductName:\t\tmacOS\nProductVersion:\t\t{version}\nBuildVersion:\t\t{build}\n")
    return {"os": "macOS", "os_version": versions["product_version"], "os_build": versions["build_version"]}


def test_different_macos_builds_are_named_with_the_majority_to_update_to():
    facts = {"m1": macos_facts("26.2", "25C56"), "m2": macos_facts("26.2", "25C56"),
             "m3": macos_facts("26.1", "25B78"), "linux": {"os": "Linux", "os_build": "6.8.0-45-generic"}}
    (found,) = diagnose_cluster(facts)
    assert found["id"] == "macos_builds_differ"
    assert "most Macs run macOS 26.2 (25C56); m3 runs 26.1 (25B78)" in found["detail"]
    assert found["fix"] == "update m3 to macOS 26.2 (25C56)"


def test_same_builds_or_unknown_builds_are_not_flagged():
    same = {"m1": macos_facts("26.2", "25C56"), "m2": macos_facts("26.2", "25C56"), "down": None,
            "unknown": {"os": "macOS", "os_build": None}}
    assert diagnose_cluster(same) == []


def read_fixture(directory: Path, name: str) -> str:
    path = directory / name
    if not path.is_file():
        reason = f"macOS fixture {path} is missing (expected in tests/fixtures/macos)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return path.read_text(encoding="utf-8")


def mac_topology(ifconfig: str, rdma: str) -> dict:
    return build_macos_topology({
        "rdma_ctl": read_fixture(SHARED_FIXTURES, f"rdma_ctl-status.{rdma}.txt"),
        "ibv_devices": read_fixture(SYNTHETIC, "macstudio.ibv_devices.rdma-enabled.txt"),
        "ibv_devinfo": read_fixture(SYNTHETIC, "mesh3-nodeA.ibv_devinfo.txt"),
        "system_profiler": read_fixture(SYNTHETIC, "mesh3-nodeA.SPThunderboltDataType.json"),
        "networksetup": read_fixture(SYNTHETIC, "macstudio.networksetup-listallhardwareports.txt"),
        "ifconfig": read_fixture(SYNTHETIC, ifconfig),
    }, "26.2")


def test_thunderbolt_bridge_enabled_with_rdma_is_flagged_with_the_command_that_disables_it():
    topologies = {"a": mac_topology("mesh3-nodeA.bridge-enabled.ifconfig.txt", "enabled"),
                  "b": mac_topology("mesh3-nodeA.ifconfig.txt", "enabled"),
                  "c": mac_topology("mesh3-nodeA.bridge-enabled.ifconfig.txt", "disabled"),
                  "d": None}
    (found,) = diagnose_cluster({}, topologies)
    assert found["id"] == "thunderbolt_bridge_with_rdma"
    assert found["detail"] == "a: bridge0 is up (en2, en3, en4, en5) and RDMA is enabled"
    assert found["fix"].startswith("a: disable Thunderbolt Bridge") and "sudo ifconfig bridge0 down" in found["fix"]
