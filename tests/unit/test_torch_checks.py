"""A PyTorch job's pre-flight over plain data: the versions, GPUs, backend, NCCL environment,
/dev/shm and rendezvous checks with their fixes, the rendezvous address and interfaces chosen from
the measured links, and the environment a torch launcher gives each node's ranks."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from coordinator.launch.registry import capabilities
from coordinator.launch.rendezvous import choose_rendezvous
from coordinator.launch.topology import connectivity_matrix
from coordinator.launch.torch_env import (
    bf16_capable,
    torch_backend,
    torch_env,
    torch_envs,
)
from coordinator.readiness.torch_checks import RendezvousProbe, torch_checks

GIB = 2**30
H100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 80 * GIB, "memory_used_bytes": 0,
        "compute_capability": "9.0"}
IB_PORT = {"port": 1, "state": "PORT_ACTIVE", "link_layer": "InfiniBand", "active_mtu": 4096, "max_mtu": 4096}



def _by(launcher: str) -> dict:
    """What torch_checks is given for a job of ``launcher``: what it declares it needs, and its name."""
    return {"needs": capabilities(launcher).needs, "needed_by": f"the {launcher} launcher"}

def node(*, torch="2.5.1+cu124", cuda="12.4", nccl="2.21.5", gpus=2, ib=False, shm_gib=32.0, memory_gib=512,
         accelerate=None, deepspeed=None, hostname=None, **extra: Any) -> dict[str, Any]:
    facts = {
        "hostname": hostname, "os": "Linux", "python": "/opt/venv/bin/python", "memory_bytes": memory_gib * GIB,
        "versions": {"torch": torch, "cuda": cuda, "nccl": nccl, "accelerate": accelerate, "deepspeed": deepspeed},
        "distributed": True, "gloo": True, "nccl_available": bool(gpus), "cuda_available": bool(gpus),
        "gpus": [{**H100, "index": i} for i in range(gpus)], "gpu_source": "nvidia-smi" if gpus else "no GPU found",
        "infiniband": [{"name": "mlx5_0", "transport": "InfiniBand (0)", "node_guid": None, "phys_port_cnt": 1,
                        "ports": [IB_PORT]}] if ib else [],
        "infiniband_source": "ibv_devinfo",
        "shm": {"path": "/dev/shm", "total_bytes": int(shm_gib * GIB), "free_bytes": int(shm_gib * GIB)},
        "detail": {},
    }
    facts.update(extra)
    return facts


def by_name(checks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in checks}


def test_only_the_torch_launchers_get_these_checks():
    assert all(capabilities(name).preflight == ("pytorch",) for name in ("torchrun", "accelerate", "deepspeed"))
    assert "pytorch" not in capabilities("mlx").preflight and capabilities("command").preflight == ()


def test_the_same_builds_everywhere_pass():
    found = by_name(torch_checks({"a": node(), "b": node()}, **_by("torchrun")))
    assert found["torch.versions.torch"]["status"] == "pass"
    assert found["torch.versions.cuda"]["detail"] == "CUDA (torch.version.cuda) 12.4 on every node"
    assert found["torch.versions.nccl"]["status"] == "pass"
    assert found["torch.versions.accelerate"] == {**found["torch.versions.accelerate"], "status": "pass"}
    assert "not needed by the torchrun launcher" in found["torch.versions.accelerate"]["detail"]
    assert found["torch.backend"]["status"] == "pass" and "nccl" in found["torch.backend"]["detail"]


def test_a_different_torch_build_fails_with_the_install_line_of_the_majoritys_build():
    facts = {"a": node(), "b": node(), "c": node(torch="2.5.1+cu121", cuda="12.1", nccl="2.20.5")}
    found = by_name(torch_checks(facts))
    torch = found["torch.versions.torch"]
    assert torch["status"] == "fail" and "c has 2.5.1+cu121" in torch["detail"]
    assert torch["fix_command"] == ("on c: /opt/venv/bin/python -m pip install torch==2.5.1+cu124 "
                                    "--index-url https://download.pytorch.org/whl/cu124")
    assert found["torch.versions.cuda"]["status"] == "fail" and "c has 12.1" in found["torch.versions.cuda"]["detail"]
    assert "torch==2.5.1+cu124" in found["torch.versions.nccl"]["fix_command"]


def test_torch_missing_on_a_node_fails_and_its_build_checks_wait_for_it():
    found = by_name(torch_checks({"a": node(), "b": node(torch=None, cuda=None, nccl=None, gpus=0)}))
    assert found["torch.versions.torch"]["status"] == "fail"
    assert "b has none" in found["torch.versions.torch"]["detail"]
    assert "torch==2.5.1+cu124" in found["torch.versions.torch"]["fix_command"]
    assert "torch.versions.cuda" not in found and found["torch.backend"]["status"] == "fail"
    nowhere = by_name(torch_checks({"a": node(torch=None, gpus=0)}))["torch.versions.torch"]
    assert nowhere["status"] == "fail" and nowhere["fix_command"] == "on a: /opt/venv/bin/python -m pip install torch"


def test_a_launchers_own_package_is_required_and_must_match():
    missing = by_name(torch_checks({"a": node(), "b": node()}, **_by("deepspeed")))["torch.versions.deepspeed"]
    assert missing["status"] == "fail" and "not installed on a, b" in missing["detail"]
    differs = by_name(torch_checks({"a": node(accelerate="1.2.0"), "b": node(accelerate="1.1.0"),
                                    "c": node(accelerate="1.2.0")}, **_by("accelerate")))
    check = differs["torch.versions.accelerate"]
    assert check["status"] == "fail" and check["fix_command"] == \
        "on b: /opt/venv/bin/python -m pip install accelerate==1.2.0"
    some = by_name(torch_checks({"a": node(deepspeed="0.16.0"), "b": node()}))["torch.versions.deepspeed"]
    assert some["status"] == "fail" and "b has none" in some["detail"]  # installed on one: the same everywhere


def test_a_node_without_gpus_beside_gpu_nodes_fails_with_the_nodes_to_run_on():
    found = by_name(torch_checks({"a": node(), "b": node(gpus=0)}))
    assert found["torch.backend"]["status"] == "fail"
    assert found["torch.backend"]["fix_command"] == "run the job on the GPU nodes only: coord run --nodes a ..."


def test_cpu_only_nodes_get_gloo():
    facts = {"a": node(gpus=0, cuda=None, nccl=None, torch="2.5.1+cpu"),
             "b": node(gpus=0, cuda=None, nccl=None, torch="2.5.1+cpu")}
    found = by_name(torch_checks(facts))
    assert found["torch.backend"]["status"] == "pass" and "gloo" in found["torch.backend"]["detail"]
    assert found["torch.versions.cuda"]["detail"] == "CUDA (torch.version.cuda) a CPU build on every node"
    assert torch_backend(facts) == "gloo"
    env = torch_env(facts["a"], "eth0")
    assert env == {"COORD_TORCH_BACKEND": "gloo", "GLOO_SOCKET_IFNAME": "eth0"}  # no NCCL variables without NCCL
    no_gloo = by_name(torch_checks({"a": {**facts["a"], "gloo": False}}))["torch.backend"]
    assert no_gloo["status"] == "fail" and "is_gloo_available" in no_gloo["detail"]


def test_a_cpu_build_on_a_gpu_node_fails():
    found = by_name(torch_checks({"a": node(torch="2.5.1+cpu", cuda=None, nccl=None)}))
    assert found["torch.backend"]["status"] == "fail" and "a CPU build" in found["torch.backend"]["detail"]


def test_different_or_busy_gpus_are_warned_of():
    small = {**H100, "name": "NVIDIA A100-SXM4-40GB", "memory_total_bytes": 40 * GIB}
    busy = {**H100, "index": 1, "memory_used_bytes": 30 * GIB}
    found = by_name(torch_checks({"a": node() | {"gpus": [H100, busy]},
                                  "b": node() | {"gpus": [small]}}))
    assert found["torch.gpus"]["status"] == "warn" and "smallest, 40.0 GiB" in found["torch.gpus"]["detail"]
    assert found["torch.gpus.busy"]["status"] == "warn"
    assert "GPU 1 on a has 30.0 of 80.0 GiB in use" in found["torch.gpus.busy"]["detail"]
    alike = by_name(torch_checks({"a": node(gpus=8), "b": node(gpus=8)}))
    assert alike["torch.gpus"] == {**alike["torch.gpus"], "status": "pass"}
    assert "8 × NVIDIA H100 80GB HBM3 (80 GiB)" in alike["torch.gpus"]["detail"]


@pytest.mark.parametrize(("shm_gib", "memory_gib", "status"), [(0.0625, 64, "fail"), (2, 256, "warn"),
                                                                (32, 256, "pass")])
def test_dev_shm_is_judged_by_its_room_and_the_nodes_ram(shm_gib, memory_gib, status):
    found = by_name(torch_checks({"a": node(shm_gib=shm_gib, memory_gib=memory_gib)}))["torch.shm.a"]
    assert found["status"] == status, found
    if status != "pass":
        assert "remount,size=" in found["fix_command"] and "--shm-size=" in found["fix_command"]


def test_no_dev_shm_fails_on_linux_and_is_not_asked_of_a_mac():
    found = by_name(torch_checks({"a": node(shm=None, detail={"shm": "/dev/shm does not exist"}),
                                  "m": node(gpus=0, os="Darwin", shm=None)}))
    assert found["torch.shm.a"]["status"] == "fail" and "/dev/shm does not exist" in found["torch.shm.a"]["detail"]
    assert "torch.shm.m" not in found


def test_infiniband_is_on_only_where_every_node_has_an_active_port():
    both = {"a": node(ib=True), "b": node(ib=True)}
    assert {env["NCCL_IB_DISABLE"] for env in torch_envs(both, {"a": "ib0", "b": "ib0"}).values()} == {"0"}
    one = {"a": node(ib=True), "b": node()}
    envs = torch_envs(one, {"a": "eth0", "b": "enp3s0"})
    assert envs["a"] == {"COORD_TORCH_BACKEND": "nccl", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "=eth0",
                         "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}
    assert envs["b"]["NCCL_SOCKET_IFNAME"] == "=enp3s0"
    check = by_name(torch_checks(one, interfaces={"a": "eth0", "b": "enp3s0"}))["torch.nccl_env"]
    assert check["status"] == "warn" and "active on a only" in check["detail"]
    assert "NCCL_NET_GDR_LEVEL is not set" in check["detail"]
    down = node() | {"infiniband": [{"name": "mlx5_0", "ports": [{**IB_PORT, "state": "PORT_DOWN"}]}]}
    assert torch_env(down, None)["NCCL_IB_DISABLE"] == "1"
    assert "mlx5_0 on a" in by_name(torch_checks({"a": down}))["torch.nccl_env"]["detail"]


def test_an_unpinned_interface_between_nodes_is_warned_of():
    check = by_name(torch_checks({"a": node(), "b": node()}, interfaces={"a": None, "b": None}))["torch.nccl_env"]
    assert check["status"] == "warn" and "not pinned" in check["detail"]


# --- the rendezvous ---------------------------------------------------------------------------


def topology(*interfaces: tuple[str, str, str]) -> dict[str, Any]:
    return {"platform": "Linux", "interfaces": [
        {"name": name, "kind": kind, "up": True, "port": None,
         "addresses": [{"family": "ipv4", "address": address.split("/")[0], "prefixlen": int(address.split("/")[1])}]}
        for name, kind, address in interfaces]}


def test_the_master_address_is_rank_0s_on_a_subnet_every_node_shares():
    topologies = {
        "a": topology(("eth0", "ethernet", "10.0.0.1/24"), ("docker0", "other", "172.17.0.1/16"),
                      ("wlan0", "wifi", "192.168.1.10/24")),
        "b": topology(("enp3s0", "ethernet", "10.0.0.2/24"), ("docker0", "other", "172.17.0.1/16"),
                      ("wlan0", "wifi", "192.168.1.11/24")),
        "c": topology(("eno1", "ethernet", "10.0.0.3/24"), ("wlan0", "wifi", "192.168.1.12/24")),
    }
    choice = choose_rendezvous(connectivity_matrix(topologies), ["a", "b", "c"], fallback="head-a")
    assert choice["master_address"] == "10.0.0.1"
    assert choice["interfaces"] == {"a": "eth0", "b": "enp3s0", "c": "eno1"}
    # Without the Ethernet link to c, the only address all share is the Wi-Fi one.
    topologies["c"] = topology(("wlan0", "wifi", "192.168.1.12/24"))
    wifi = choose_rendezvous(connectivity_matrix(topologies), ["a", "b", "c"])
    assert wifi["master_address"] == "192.168.1.10" and wifi["interfaces"]["b"] == "wlan0"
    # A configured address wins; one no link carries is used as it is.
    configured = choose_rendezvous(connectivity_matrix(topologies), ["a", "b", "c"], configured="10.9.9.9")
    assert configured["master_address"] == "10.9.9.9" and set(configured["interfaces"].values()) == {None}
    # No shared subnet: the cluster file's host, judged by each node.
    apart = {"a": topology(("eth0", "ethernet", "10.0.0.1/24")), "b": topology(("eth0", "ethernet", "10.1.0.2/24"))}
    fallback = choose_rendezvous(connectivity_matrix(apart), ["a", "b"], fallback="gpu-a.example")
    assert fallback["master_address"] == "gpu-a.example" and "no IPv4 subnet" in fallback["reason"]
    assert choose_rendezvous(None, ["a"])["master_address"] == "127.0.0.1"


def probe(**changes: Any) -> RendezvousProbe:
    ok = {"host": "gpu-a", "port": 29500, "resolved": ["10.0.0.1"], "loopback": False, "connected": True,
          "detail": "connected to 10.0.0.1:29500 in 1 ms"}
    found: dict[str, Any] = {
        "choice": {"master_node": "a", "master_address": "gpu-a", "interfaces": {"a": None, "b": None},
                   "reason": "no IPv4 subnet measured"},
        "port": 29500, "listen": {"listening": True, "port": 29500, "detail": "listening"},
        "connects": {"a": copy.deepcopy(ok), "b": copy.deepcopy(ok)}, "missing": {}, "colocated": ["a"],
        "suggested": "10.0.0.1"}
    found.update(changes)
    return found  # type: ignore[return-value]


def rendezvous_checks(found: RendezvousProbe) -> dict[str, dict[str, Any]]:
    return by_name([c for c in torch_checks({"a": node(), "b": node()}, rendezvous=found)
                    if c["name"].startswith("torch.rendezvous")])


def test_every_node_reaching_rank_0_passes():
    assert rendezvous_checks(probe())["torch.rendezvous"]["status"] == "pass"


def test_a_name_that_resolves_to_loopback_on_another_machine_is_refused_with_an_address():
    found = probe()
    found["connects"]["b"].update(resolved=["127.0.1.1"], loopback=True)
    checks = rendezvous_checks(found)
    refused = checks["torch.rendezvous.address"]
    assert refused["status"] == "fail" and "b (127.0.1.1)" in refused["detail"]
    assert 'set ips = ["10.0.0.1"] for node a' in refused["fix_command"]
    # On rank 0's own machine loopback is right.
    same = probe()
    same["connects"]["a"].update(resolved=["127.0.1.1"], loopback=True)
    assert rendezvous_checks(same)["torch.rendezvous"]["status"] == "pass"


def test_a_node_that_cannot_connect_fails_with_the_port_to_open():
    found = probe()
    found["connects"]["b"].update(connected=False, detail="10.0.0.1:29500 timed out (a firewall ...)")
    check = rendezvous_checks(found)["torch.rendezvous"]
    assert check["status"] == "fail" and "b: 10.0.0.1:29500 timed out" in check["detail"]
    assert "open TCP port 29500 on a" in check["fix_command"]


def test_a_port_rank_0_cannot_listen_on_fails():
    check = rendezvous_checks(probe(listen={"listening": False, "port": 29500, "detail": "port 29500 is in use"}))
    assert check["torch.rendezvous"]["status"] == "fail" and "in use" in check["torch.rendezvous"]["detail"]
    assert "ss -ltnp" in check["torch.rendezvous"]["fix_command"]


def test_nodes_that_gave_no_facts_are_named():
    found = by_name(torch_checks({"a": node()}, missing={"b": "node is down"}))
    assert found["torch.facts"]["status"] == "fail" and "b: node is down" in found["torch.facts"]["detail"]


@pytest.mark.parametrize(("gpu", "capable"), [
    ({"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}, True),
    ({"name": "Tesla T4", "compute_capability": "7.5"}, False),
    ({"name": "Tesla V100-SXM2-16GB", "compute_capability": None}, False),
    ({"name": "NVIDIA A100-SXM4-40GB", "compute_capability": None}, True),
    ({"name": "NVIDIA GeForce RTX 4090", "compute_capability": None}, True),
    ({"name": "NVIDIA GeForce RTX 2080 Ti", "compute_capability": None}, False),
    ({"name": "Some Future GPU", "compute_capability": None}, None)])
def test_bf16_is_known_from_the_compute_capability_or_else_the_name(gpu, capable):
    assert bf16_capable({"index": 0, "memory_total_bytes": GIB, "memory_used_bytes": 0, **gpu}) is capable


def test_nodes_on_one_machine_meet_on_loopback_with_nothing_to_pin():
    choice = choose_rendezvous(None, ["a", "b"], fallback="gpu-a", one_machine=True)
    assert choice["master_address"] == "127.0.0.1" and "every node is this machine" in choice["reason"]
    check = by_name(torch_checks({"a": node(), "b": node()}, interfaces=choice["interfaces"],
                                 one_machine=True))["torch.nccl_env"]
    assert check["status"] == "pass", check


def test_a_deepspeed_job_needs_a_cpp_compiler_on_every_node_and_fails_without_one_on_cpu_nodes():
    # DeepSpeed's CPU accelerator builds its shared-memory op in deepspeed.comm's init: a fresh
    # Debian without g++ failed every rank with "c++: not found"
    cpu = {"torch": "2.13.0+cpu", "cuda": None, "nccl": None, "gpus": 0, "deepspeed": "0.19.8"}
    both = {"a": node(compiler="/usr/bin/c++", **cpu), "b": node(compiler=None, **cpu)}
    found = by_name(torch_checks(both, **_by("deepspeed")))["torch.compiler"]
    assert found["status"] == "fail" and "b lacks a C++ compiler (c++, or $CXX):" in found["detail"], found
    assert found["fix_command"] == "on b: sudo apt-get install g++"
    # torch's extension builder compiles against Python.h: Debian ships it in python3-dev
    headless = {"a": node(compiler="/usr/bin/c++", python_headers=None, **cpu),
                "b": node(compiler=None, python_headers=None, **cpu)}
    found = by_name(torch_checks(headless, **_by("deepspeed")))["torch.compiler"]
    assert found["status"] == "fail" and "a lacks Python's headers (Python.h); b lacks a C++ compiler (c++, or $CXX) and Python's headers" in \
        found["detail"], found
    assert found["fix_command"] == ("on a: sudo apt-get install python3-dev; "
                                    "on b: sudo apt-get install g++ python3-dev"), found
    # on GPU nodes only the ops built on first use need it: a warning
    gpu = by_name(torch_checks({"a": node(compiler=None, deepspeed="0.19.8"), "b": node(compiler="/usr/bin/c++",
                                                                                        deepspeed="0.19.8")},
                               **_by("deepspeed")))["torch.compiler"]
    assert gpu["status"] == "warn" and "DS_BUILD_OPS=1" in gpu["detail"], gpu
    fine = by_name(torch_checks({"a": node(compiler="/usr/bin/c++", **cpu)}, **_by("deepspeed")))
    assert fine["torch.compiler"]["status"] == "pass"
    # the other launchers do not build ops: not asked
    assert "torch.compiler" not in by_name(torch_checks(both, **_by("torchrun")))
    assert "torch.compiler" not in by_name(torch_checks(both, **_by("accelerate")))
