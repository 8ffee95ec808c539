"""RDMA and Thunderbolt topology: the parsers on real macOS outputs, the assembly on
synthetic multi-Mac fixtures, the backend choice, and the collector on this machine."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import msgpack
import pytest

from agent import topology as agent_topology
from agent.interface_parsers import (
    linux_interface_kind,
    parse_ifconfig,
    parse_ip_json_addr,
)
from agent.rdma_parsers import (
    parse_ibv_devices,
    parse_ibv_devinfo,
    parse_rdma_ctl_status,
    parse_sysfs_port_state,
)
from agent.thunderbolt_parsers import (
    annotate_thunderbolt,
    interface_kinds,
    networksetup_port_kind,
    parse_link_speed,
    parse_networksetup_ports,
    parse_thunderbolt,
    rdma_device_name,
    thunderbolt_bridge_device,
    thunderbolt_generation,
    thunderbolt_receptacles,
)
from agent.topology import build_linux_topology, build_macos_topology, collect_topology
from coordinator.launch.mlx_backend import choose_backend, find_ring
from coordinator.launch.topology import (
    RECOVERY_INSTRUCTION,
    UPGRADE_INSTRUCTION,
    connectivity_matrix,
    update_pairs,
)

# The repository is /work/main; the shared fixtures sit beside it in /work/shared.
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "macos"
SYNTHETIC = Path(__file__).resolve().parents[1] / "fixtures" / "macos-synthetic"

LOCAL_TB = "system_profiler-SPThunderboltDataType.local-rdma-disabled.json"
PEER_TB = "system_profiler-SPThunderboltDataType.peer-rdma-enabled.json"
LOCAL_BUS1_UUID = "00000004-0000-4000-8000-000000000004"
PEER_BUS1_UUID = "00000003-0000-4000-8000-000000000003"


def read_fixture(name: str) -> str:
    path = FIXTURES / name
    if not path.is_file():
        reason = f"macOS fixture {path} is missing (expected in tests/fixtures/macos)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return path.read_text(encoding="utf-8")


def read_synthetic(name: str) -> str:
    return (SYNTHETIC / name).read_text(encoding="utf-8")


def bus(parsed: dict, name: str) -> dict:
    return next(b for b in parsed["buses"] if b["bus"] == name)


# --- rdma_ctl ---------------------------------------------------------------------------


def test_rdma_ctl_status_reads_the_two_documented_answers():
    assert parse_rdma_ctl_status(read_fixture("rdma_ctl-status.enabled.txt")) == "enabled"
    assert parse_rdma_ctl_status(read_fixture("rdma_ctl-status.disabled.txt")) == "disabled"


@pytest.mark.parametrize("text", [
    "", "\n", "RDMA is enabled", "enabled?", "not enabled", "enabled\ndisabled\n",
    "rdma_ctl: command not found", None,
])
def test_rdma_ctl_status_anything_else_is_unknown_never_enabled(text):
    assert parse_rdma_ctl_status(text) is None


# --- ibv_devices / ibv_devinfo ------------------------------------------------------------


def test_ibv_devices_on_rdma_enabled_mac_lists_one_rdma_device_per_thunderbolt_port():
    assert parse_ibv_devices(read_fixture("ibv_devices.rdma-enabled.txt")) == [
        "rdma_en1", "rdma_en6", "rdma_en2",
    ]


def test_ibv_devices_header_only_is_no_devices_not_unknown():
    assert parse_ibv_devices(read_fixture("ibv_devices.rdma-disabled.txt")) == []


@pytest.mark.parametrize("text", [
    "", "garbage\n", "Failed to get IB devices list: Function not implemented\n",
    "device   node GUID\n------   ---------\nrdma_en1 not-a-guid\n", None,
])
def test_ibv_devices_unreadable_output_is_unknown(text):
    assert parse_ibv_devices(text) is None


def test_ibv_devinfo_gives_each_device_with_port_state_link_layer_and_mtu():
    devices = parse_ibv_devinfo(read_fixture("ibv_devinfo.rdma-enabled-peer-disabled.txt"))
    assert [d["name"] for d in devices] == ["rdma_en1", "rdma_en6", "rdma_en2"]
    for device in devices:
        assert device["transport"] == "Thunderbolt (100)"
        assert device["phys_port_cnt"] == 1
        assert device["ports"] == [{
            "port": 1, "state": "PORT_DOWN", "link_layer": "Thunderbolt",
            "active_mtu": 4096, "max_mtu": 4096,
        }]


def test_ibv_devinfo_no_devices_message_is_empty_and_garbage_is_unknown():
    assert parse_ibv_devinfo("No IB devices found\n") == []
    assert parse_ibv_devinfo("") is None
    assert parse_ibv_devinfo("something: else\n") is None
    assert parse_ibv_devinfo(None) is None


def test_sysfs_port_state_maps_to_ibv_names():
    assert parse_sysfs_port_state("4: ACTIVE\n") == "PORT_ACTIVE"
    assert parse_sysfs_port_state("1: DOWN") == "PORT_DOWN"
    assert parse_sysfs_port_state("garbage") is None


# --- Thunderbolt -------------------------------------------------------------------------


def test_thunderbolt_local_bus1_is_a_direct_cable_to_the_peer_mac_at_tb5_80gbps():
    parsed = parse_thunderbolt(read_fixture(LOCAL_TB))
    bus1 = bus(parsed, "thunderboltusb4_bus_1")
    assert bus1["domain_uuid"] == LOCAL_BUS1_UUID
    assert bus1["receptacle"] == 2
    assert bus1["connected"] is True
    assert bus1["link_speed"] == "80 Gb/s"
    assert bus1["link_gbps"] == 80
    assert bus1["generation"] == 5
    assert bus1["peer"]["domain_uuid"] == PEER_BUS1_UUID
    assert bus1["peer"]["model"] == "Mac17,6"
    assert parsed["peers"] == [{
        "bus": "thunderboltusb4_bus_1", "receptacle": 2, "domain_uuid": PEER_BUS1_UUID,
        "link_gbps": 80, "generation": 5,
    }]


def test_thunderbolt_dock_on_bus2_is_a_device_not_a_peer():
    parsed = parse_thunderbolt(read_fixture(LOCAL_TB))
    bus2 = bus(parsed, "thunderboltusb4_bus_2")
    assert bus2["peer"] is None
    assert bus2["receptacle"] == 3
    assert [(d["name"], d["vendor"], d["depth"]) for d in bus2["devices"]] == [
        ("SB-XTM5", "Sabrent", 1)
    ]
    assert bus2["indirect_peers"] == []


def test_thunderbolt_up_to_speed_is_a_capability_not_a_link():
    parsed = parse_thunderbolt(read_fixture(LOCAL_TB))
    bus0 = bus(parsed, "thunderboltusb4_bus_0")
    assert bus0["connected"] is False
    assert bus0["link_speed"] is None and bus0["link_gbps"] is None
    assert bus0["generation"] is None
    assert bus0["capability_gbps"] == 120
    assert parse_link_speed("Up to 120 Gb/s") is None
    assert parse_link_speed("80 Gb/s") == 80
    assert parse_link_speed("20 Gb/s x2") == 40


def test_thunderbolt_returns_this_macs_own_domain_uuid_per_bus():
    parsed = parse_thunderbolt(read_fixture(LOCAL_TB))
    assert parsed["own_domain_uuids"] == {
        "thunderboltusb4_bus_0": "00000008-0000-4000-8000-000000000008",
        "thunderboltusb4_bus_1": LOCAL_BUS1_UUID,
        "thunderboltusb4_bus_2": "00000009-0000-4000-8000-000000000009",
    }


def test_thunderbolt_real_pair_is_reciprocal():
    local = parse_thunderbolt(read_fixture(LOCAL_TB))
    peer = parse_thunderbolt(read_fixture(PEER_TB))
    local_bus = bus(local, "thunderboltusb4_bus_1")
    peer_bus = bus(peer, "thunderboltusb4_bus_1")
    assert local_bus["peer"]["domain_uuid"] == peer_bus["domain_uuid"]
    assert peer_bus["peer"]["domain_uuid"] == local_bus["domain_uuid"]
    # The peer's TB3 device on bus 2 runs at 40 Gb/s: a TB4-class link, and not a peer.
    peer_bus2 = bus(peer, "thunderboltusb4_bus_2")
    assert peer_bus2["peer"] is None and peer_bus2["generation"] == 4


def test_thunderbolt_mac_behind_a_dock_is_not_a_direct_cable():
    parsed = parse_thunderbolt(read_synthetic("mesh4-nodeD.SPThunderboltDataType.json"))
    docked = bus(parsed, "thunderboltusb4_bus_3")
    assert docked["peer"] is None
    assert docked["indirect_peers"] == ["5F000000-0000-4000-8000-0000000000FF"]
    assert [d["name"] for d in docked["devices"]] == ["SB-XTM5"]
    assert len(parsed["peers"]) == 3


@pytest.mark.parametrize("text", [
    "", "not json", "[]", '{"SPUSBDataType": []}', '{"SPThunderboltDataType": {}}',
    '{"SPThunderboltDataType": ["bus"]}', None,
])
def test_thunderbolt_malformed_output_is_unreadable_not_zero_ports(text):
    assert parse_thunderbolt(text) is None


def test_thunderbolt_empty_bus_list_is_zero_buses():
    assert parse_thunderbolt('{"SPThunderboltDataType": []}') == {
        "buses": [], "own_domain_uuids": {}, "peers": [],
    }


@pytest.mark.parametrize("speed, generation", [
    (120, 5), (80, 5), (40.5, 5), (40, 4), (20, 4), (0, None), (None, None),
    ("80", None), (True, None),
])
def test_thunderbolt_generation_is_tb5_only_above_40gbps(speed, generation):
    assert thunderbolt_generation(speed) == generation


# --- networksetup ------------------------------------------------------------------------


def test_networksetup_ports_map_thunderbolt_receptacles_to_interfaces_and_rdma_devices():
    ports = parse_networksetup_ports(read_fixture("networksetup-listallhardwareports.txt"))
    assert {"port": "Thunderbolt 2", "device": "en6", "mac": "02:00:00:00:00:02"} in ports
    assert len(ports) == 6
    assert thunderbolt_receptacles(ports) == {
        1: {"port": "Thunderbolt 1", "interface": "en1", "rdma_device": "rdma_en1"},
        2: {"port": "Thunderbolt 2", "interface": "en6", "rdma_device": "rdma_en6"},
        3: {"port": "Thunderbolt 3", "interface": "en2", "rdma_device": "rdma_en2"},
    }
    assert thunderbolt_bridge_device(ports) == "bridge0"
    assert rdma_device_name("en6") == "rdma_en6"


def test_networksetup_port_names_give_interface_kinds():
    ports = parse_networksetup_ports(read_fixture("networksetup-listallhardwareports.txt"))
    assert interface_kinds(ports) == {
        "en3": "ethernet", "bridge0": "thunderbolt", "en0": "wifi",
        "en1": "thunderbolt", "en6": "thunderbolt", "en2": "thunderbolt",
    }
    assert networksetup_port_kind("USB 10/100/1000 LAN") == "ethernet"
    assert networksetup_port_kind("iPhone USB") == "other"


def test_networksetup_garbage_is_unknown():
    assert parse_networksetup_ports("garbage") is None
    assert parse_networksetup_ports("") is None


def test_annotated_cable_bus_carries_its_interface_and_rdma_device():
    ports = parse_networksetup_ports(read_fixture("networksetup-listallhardwareports.txt"))
    annotated = annotate_thunderbolt(parse_thunderbolt(read_fixture(LOCAL_TB)), ports)
    bus1 = bus(annotated, "thunderboltusb4_bus_1")
    assert (bus1["port_name"], bus1["interface"], bus1["rdma_device"]) == (
        "Thunderbolt 2", "en6", "rdma_en6",
    )
    assert annotated["peers"][0]["rdma_device"] == "rdma_en6"


# --- interfaces --------------------------------------------------------------------------

IP_J_ADDR = json.dumps([
    {"ifindex": 1, "ifname": "lo", "flags": ["LOOPBACK", "UP", "LOWER_UP"], "mtu": 65536,
     "operstate": "UNKNOWN", "link_type": "loopback", "address": "00:00:00:00:00:00",
     "addr_info": [
         {"family": "inet", "local": "127.0.0.1", "prefixlen": 8, "scope": "host", "label": "lo"},
         {"family": "inet6", "local": "::1", "prefixlen": 128, "scope": "host"}]},
    {"ifindex": 2, "ifname": "enp5s0", "flags": ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"],
     "mtu": 1500, "operstate": "UP", "link_type": "ether", "address": "3c:ec:ef:00:11:22",
     "addr_info": [
         {"family": "inet", "local": "10.0.0.21", "prefixlen": 24, "broadcast": "10.0.0.255",
          "scope": "global", "dynamic": True, "label": "enp5s0"},
         {"family": "inet6", "local": "fe80::3eec:efff:fe00:1122", "prefixlen": 64,
          "scope": "link"}]},
    {"ifindex": 3, "ifname": "wlp2s0", "flags": ["NO-CARRIER", "BROADCAST", "MULTICAST", "UP"],
     "mtu": 1500, "operstate": "DOWN", "link_type": "ether", "address": "a4:b1:c1:00:00:01",
     "addr_info": []},
    {"ifindex": 4, "ifname": "thunderbolt0", "flags": ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"],
     "mtu": 65520, "master": "br0", "operstate": "UP", "link_type": "ether",
     "address": "02:5f:00:00:00:01", "addr_info": []},
    {"ifindex": 5, "ifname": "br0", "flags": ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"],
     "mtu": 1500, "operstate": "UP", "link_type": "ether", "address": "02:5f:00:00:00:01",
     "addr_info": [{"family": "inet", "local": "169.254.10.1", "prefixlen": 16, "scope": "link"}]},
    {},
])


def test_ip_json_addr_gives_interfaces_with_addresses_and_state():
    interfaces = parse_ip_json_addr(IP_J_ADDR)
    by_name = {i["name"]: i for i in interfaces}
    assert list(by_name) == ["lo", "enp5s0", "wlp2s0", "thunderbolt0", "br0"]
    assert by_name["lo"]["up"] is True
    assert by_name["enp5s0"]["up"] is True
    assert by_name["wlp2s0"]["up"] is False  # UP but no carrier
    assert by_name["enp5s0"]["addresses"] == [
        {"family": "ipv4", "address": "10.0.0.21", "prefixlen": 24, "scope": "global"},
        {"family": "ipv6", "address": "fe80::3eec:efff:fe00:1122", "prefixlen": 64,
         "scope": "link"},
    ]
    assert by_name["thunderbolt0"]["master"] == "br0"
    assert by_name["enp5s0"]["state"] == "UP"


@pytest.mark.parametrize("text", ["", "garbage", '{"ifname": "lo"}', "[1, 2]", None])
def test_ip_json_addr_unreadable_is_unknown(text):
    assert parse_ip_json_addr(text) is None


@pytest.mark.parametrize("entry", [
    {"ifname": "eth0", "flags": 5},
    {"ifname": "eth0", "addr_info": 3},
    {"ifname": "eth0", "addr_info": [{"family": ["inet"], "local": "10.0.0.1"}]},
])
def test_ip_json_addr_odd_fields_are_left_out_not_raised(entry):
    [interface] = parse_ip_json_addr(json.dumps([entry]))
    assert interface["name"] == "eth0"
    assert interface["addresses"] == []


@pytest.mark.parametrize("name, kind", [
    ("lo", "loopback"), ("wlp2s0", "wifi"), ("wlan0", "wifi"), ("enp5s0", "ethernet"),
    ("eth0", "ethernet"), ("thunderbolt0", "thunderbolt"), ("docker0", "other"),
    ("ib0", "other"),
])
def test_linux_interface_kind_from_name(name, kind):
    assert linux_interface_kind(name) == kind


def test_macos_ifconfig_gives_addresses_status_and_bridge_members():
    interfaces = {i["name"]: i for i in parse_ifconfig(read_synthetic("ring4-nodeC.ifconfig.txt"))}
    assert interfaces["en2"]["addresses"] == [
        {"family": "ipv4", "address": "192.168.0.6", "prefixlen": 30, "scope": "global"},
    ]
    assert interfaces["en2"]["up"] is True
    assert interfaces["en4"]["up"] is False  # status: inactive, no cable
    assert interfaces["en0"]["up"] is False
    assert interfaces["bridge0"]["members"] == ["en2", "en3", "en4", "en5"]
    assert "UP" not in interfaces["bridge0"]["flags"]
    lo0 = interfaces["lo0"]
    assert lo0["up"] is True
    assert {"family": "ipv6", "address": "fe80::1", "prefixlen": 64, "scope": "link"} in lo0["addresses"]


def test_linux_net_tools_ifconfig_is_read_too():
    text = (
        "eth0: flags=4163<UP,BROADCAST,RUNNING,MULTICAST>  mtu 1400\n"
        "        inet 192.0.2.2  netmask 255.255.255.0  broadcast 192.0.2.255\n"
        "        inet6 fd00::2  prefixlen 64  scopeid 0x0<global>\n"
        "        ether 02:fc:00:00:00:01  txqueuelen 1000  (Ethernet)\n"
    )
    (eth0,) = parse_ifconfig(text)
    assert eth0["up"] is True
    assert eth0["addresses"][0] == {
        "family": "ipv4", "address": "192.0.2.2", "prefixlen": 24, "scope": "global",
    }


def test_ifconfig_garbage_is_unknown():
    assert parse_ifconfig("nothing here\n") is None
    assert parse_ifconfig(None) is None


# --- assembling a node's topology ----------------------------------------------------------


def real_pair_topologies() -> dict[str, dict]:
    """The two real MacBook Pros: "local" has RDMA disabled, "peer" has it enabled."""
    networksetup = read_fixture("networksetup-listallhardwareports.txt")
    local = build_macos_topology({
        "rdma_ctl": read_fixture("rdma_ctl-status.disabled.txt"),
        "ibv_devices": read_fixture("ibv_devices.rdma-disabled.txt"),
        "ibv_devinfo": None,
        "system_profiler": read_fixture(LOCAL_TB),
        "networksetup": networksetup,
        "ifconfig": None,
    }, "27.0")
    peer = build_macos_topology({
        "rdma_ctl": read_fixture("rdma_ctl-status.enabled.txt"),
        "ibv_devices": read_fixture("ibv_devices.rdma-enabled.txt"),
        "ibv_devinfo": read_fixture("ibv_devinfo.rdma-enabled-peer-disabled.txt"),
        "system_profiler": read_fixture(PEER_TB),
        "networksetup": networksetup,
        "ifconfig": None,
    }, "27.0")
    return {"local": local, "peer": peer}


def synthetic_node(topology: str, node: str, *, ifconfig: str | None = None,
                   rdma: str = "enabled", os_version: str = "26.2") -> dict:
    prefix = f"{topology}-node{node}"
    return build_macos_topology({
        "rdma_ctl": read_fixture(f"rdma_ctl-status.{rdma}.txt"),
        "ibv_devices": read_synthetic("macstudio.ibv_devices.rdma-enabled.txt"),
        "ibv_devinfo": read_synthetic(f"{prefix}.ibv_devinfo.txt"),
        "system_profiler": read_synthetic(f"{prefix}.SPThunderboltDataType.json"),
        "networksetup": read_synthetic("macstudio.networksetup-listallhardwareports.txt"),
        "ifconfig": read_synthetic(ifconfig or f"{prefix}.ifconfig.txt"),
    }, os_version)


def synthetic_cluster(topology: str, nodes: str, **kwargs) -> dict[str, dict]:
    return {node: synthetic_node(topology, node, **kwargs) for node in nodes}


def test_macos_topology_of_rdma_enabled_peer_has_devices_but_no_active_port():
    topology = real_pair_topologies()["peer"]
    assert topology["platform"] == "macOS"
    assert topology["os_version"] == "27.0"
    assert topology["rdma"]["state"] == "enabled"
    assert topology["rdma"]["devices"] == ["rdma_en1", "rdma_en6", "rdma_en2"]
    assert topology["rdma"]["active_ports"] == []
    assert {"device": "rdma_en6", "port": 1, "state": "PORT_DOWN",
            "link_layer": "Thunderbolt", "interface": "en6"} in topology["rdma"]["ports"]
    cable = bus(topology["thunderbolt"], "thunderboltusb4_bus_1")
    assert cable["rdma_device"] == "rdma_en6"


def test_macos_topology_with_nothing_readable_is_unknown_with_reasons():
    topology = build_macos_topology({}, None, {"rdma_ctl": "rdma_ctl not found"})
    assert topology["rdma"] == {"state": None, "devices": None, "active_ports": None, "ports": None}
    assert topology["thunderbolt"] is None
    assert topology["interfaces"] is None
    assert topology["thunderbolt_bridge"]["enabled"] is None
    assert topology["detail"]["rdma_ctl"] == "rdma_ctl not found"
    assert set(topology["detail"]) >= {
        "ibv_devices", "ibv_devinfo", "system_profiler", "networksetup", "ifconfig",
    }


def test_macos_interfaces_get_kinds_from_networksetup_port_names():
    topology = synthetic_node("mesh3", "A")
    kinds = {i["name"]: (i["kind"], i["port"]) for i in topology["interfaces"]}
    assert kinds["en0"] == ("ethernet", "Ethernet")
    assert kinds["en1"] == ("wifi", "Wi-Fi")
    assert kinds["en2"] == ("thunderbolt", "Thunderbolt 1")
    assert kinds["bridge0"] == ("thunderbolt", "Thunderbolt Bridge")
    assert kinds["lo0"] == ("loopback", None)
    assert kinds["awdl0"] == ("other", None)


def test_thunderbolt_bridge_down_is_disabled_and_up_with_members_is_enabled():
    assert synthetic_node("mesh3", "A")["thunderbolt_bridge"] == {
        "enabled": False, "interface": "bridge0", "members": ["en2", "en3", "en4", "en5"],
    }
    enabled = synthetic_node("mesh3", "A", ifconfig="mesh3-nodeA.bridge-enabled.ifconfig.txt")
    assert enabled["thunderbolt_bridge"]["enabled"] is True


def test_topology_crosses_msgpack_unchanged():
    topology = synthetic_node("mesh4", "D")
    assert msgpack.unpackb(msgpack.packb(topology)) == topology


def test_linux_topology_reads_rdma_ports_from_sysfs(tmp_path):
    root = tmp_path / "infiniband"
    port = root / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("Ethernet\n")
    (root / "mlx5_0" / "device" / "net" / "enp65s0f0").mkdir(parents=True)
    sysfs, why = agent_topology.read_sysfs_infiniband(str(root))
    assert why is None
    topology = build_linux_topology(sysfs, None, IP_J_ADDR, "6.8.0")
    assert topology["rdma"]["state"] == "enabled"
    assert topology["rdma"]["devices"] == ["mlx5_0"]
    assert topology["rdma"]["active_ports"] == [{
        "device": "mlx5_0", "port": 1, "state": "PORT_ACTIVE", "link_layer": "Ethernet",
        "active_mtu": None,
    }]
    assert topology["rdma"]["ports"][0]["interface"] == "enp65s0f0"
    assert topology["thunderbolt_bridge"] == {
        "enabled": True, "interface": "br0", "members": ["thunderbolt0"],
    }
    kinds = {i["name"]: i["kind"] for i in topology["interfaces"]}
    assert kinds == {"lo": "loopback", "enp5s0": "ethernet", "wlp2s0": "wifi",
                     "thunderbolt0": "thunderbolt", "br0": "other"}


def test_linux_topology_without_infiniband_dir_is_rdma_disabled(tmp_path):
    sysfs, why = agent_topology.read_sysfs_infiniband(str(tmp_path / "infiniband"))
    assert (sysfs, why) == ({}, None)
    topology = build_linux_topology(sysfs, None, None, "6.8.0")
    assert topology["rdma"]["state"] == "disabled"
    assert topology["interfaces"] is None
    assert "interfaces" in topology["detail"]


def test_collect_topology_on_this_linux_machine_is_sane():
    if os.uname().sysname != "Linux":
        pytest.skip("this check is for a Linux machine")
    topology = collect_topology()
    assert topology["platform"] == "Linux"
    assert topology["rdma"]["state"] in ("enabled", "disabled", None)
    assert topology["thunderbolt"] is None
    assert isinstance(topology["detail"], dict)
    names = {i["name"]: i for i in topology["interfaces"]}
    assert names["lo"]["kind"] == "loopback"
    assert any(a["address"] == "127.0.0.1" for a in names["lo"]["addresses"])
    assert msgpack.unpackb(msgpack.packb(topology)) == topology


def test_missing_command_is_none_with_a_reason():
    result = agent_topology.run_command(["coord-no-such-command-xyz"])
    assert result.stdout is None
    assert result.why == "coord-no-such-command-xyz not found"


# --- the connectivity matrix ----------------------------------------------------------------


def test_real_pair_is_one_tb5_cable_without_rdma_because_one_side_is_disabled():
    matrix = connectivity_matrix(real_pair_topologies())
    view = matrix["pairs"]["local"]["peer"]
    assert view["thunderbolt"] is True
    assert len(view["cables"]) == 1
    cable = view["cables"][0]
    assert (cable["local_receptacle"], cable["peer_receptacle"]) == (2, 2)
    assert (cable["local_rdma_device"], cable["peer_rdma_device"]) == ("rdma_en6", "rdma_en6")
    assert (view["speed_gbps"], view["generation"]) == (80, 5)
    assert view["rdma"] is False
    assert "RDMA is disabled on local" in view["rdma_detail"]
    assert matrix["pairs"]["peer"]["local"]["thunderbolt"] is True
    # the dock on the local bus 2 and the peer's TB3 device are not nodes
    assert matrix["notes"] == []


def test_real_pair_backend_is_tcp_ring_and_local_gets_the_recovery_instruction():
    result = choose_backend(connectivity_matrix(real_pair_topologies()), ["local", "peer"])
    assert result["backend"] == "ring"
    assert {"node": "local", "instruction": RECOVERY_INSTRUCTION, "command": None} in result["fixes"]
    assert not any(fix["node"] == "peer" for fix in result["fixes"])


def test_one_sided_thunderbolt_listing_is_not_a_cable():
    topologies = synthetic_cluster("mesh3", "ABC")
    for b in topologies["B"]["thunderbolt"]["buses"]:
        if b["bus"] == "thunderboltusb4_bus_0":
            b["peer"] = None  # B no longer sees A
    matrix = connectivity_matrix(topologies)
    view = matrix["pairs"]["A"]["B"]
    assert view["thunderbolt"] is False and view["rdma"] is False
    assert "does not see A" in view["rdma_detail"]


def test_ring4_cable_at_40gbps_is_thunderbolt_4():
    matrix = connectivity_matrix(synthetic_cluster("ring4", "ABCD"))
    assert matrix["pairs"]["C"]["D"]["generation"] == 4
    assert matrix["pairs"]["C"]["D"]["speed_gbps"] == 40
    assert matrix["pairs"]["A"]["B"]["generation"] == 5
    assert matrix["pairs"]["A"]["C"]["thunderbolt"] is False


def test_pairs_kept_up_to_date_node_by_node_are_the_whole_matrixs_and_only_a_new_nodes_are_made(monkeypatch):
    """Nodes answering one after another (a checkpoint's copies reaching them in turn): each answer makes
    that node's pairs, never the whole matrix again, and the result is the matrix made at once."""
    from coordinator.launch import topology

    cluster = synthetic_cluster("ring4", "ABCD")
    whole = connectivity_matrix(cluster)["pairs"]
    made: list[tuple[str, str]] = []
    real = topology._pair
    monkeypatch.setattr(topology, "_pair", lambda a, b, *rest: made.append((a, b)) or real(a, b, *rest))
    pairs: dict = {}
    known: dict = {}
    for name in "ABCD":
        known[name] = cluster[name]
        update_pairs(known, [name], pairs)
    assert pairs == whole
    assert len(made) == 6 and len(set(map(frozenset, made))) == 6  # each pair made once
    made.clear()
    known["C"] = cluster["C"]  # C's answer again (a new session): its three pairs only
    update_pairs(known, ["C"], pairs)
    assert sorted(map(sorted, made)) == [["A", "C"], ["B", "C"], ["C", "D"]] and pairs == whole
    del known["D"]  # D no longer answers: its pairs go
    update_pairs(known, [], pairs)
    assert set(pairs) == {"A", "B", "C"} and all("D" not in row for row in pairs.values())


def test_best_link_prefers_thunderbolt_then_ethernet_then_wifi():
    matrix = connectivity_matrix(synthetic_cluster("line3", "ABC"))
    ab = matrix["pairs"]["A"]["B"]
    assert [link["kind"] for link in ab["links"]] == ["thunderbolt", "wifi"]
    assert (ab["best"]["local_ip"], ab["best"]["peer_ip"]) == ("192.168.0.1", "192.168.0.2")
    ac = matrix["pairs"]["A"]["C"]
    assert [link["kind"] for link in ac["links"]] == ["ethernet", "wifi"]
    assert (ac["best"]["local_ip"], ac["best"]["peer_ip"]) == ("10.0.0.11", "10.0.0.13")
    assert matrix["pairs"]["C"]["A"]["best"]["local_ip"] == "10.0.0.13"


def test_link_local_only_thunderbolt_addresses_are_no_link_and_said_so():
    def node(address: str) -> dict:
        return {"platform": "macOS", "os_version": "26.2", "interfaces": [{
            "name": "bridge0", "kind": "thunderbolt", "up": True, "port": "Thunderbolt Bridge",
            "addresses": [{"family": "ipv4", "address": address, "prefixlen": 16}],
        }]}
    matrix = connectivity_matrix({"A": node("169.254.1.1"), "B": node("169.254.1.2")})
    view = matrix["pairs"]["A"]["B"]
    assert view["best"] is None
    assert "link-local" in view["link_detail"]


def test_thunderbolt_buses_are_in_natural_order():
    buses = [{"_name": f"thunderboltusb4_bus_{i}", "domain_uuid_key": f"u{i}"} for i in (10, 2, 1)]
    parsed = parse_thunderbolt(json.dumps({"SPThunderboltDataType": buses}))
    assert [b["bus"] for b in parsed["buses"]] == [
        "thunderboltusb4_bus_1", "thunderboltusb4_bus_2", "thunderboltusb4_bus_10",
    ]


# --- choosing the backend -------------------------------------------------------------------


@pytest.mark.parametrize("topology, nodes", [("mesh3", "ABC"), ("mesh4", "ABCD")])
def test_full_rdma_mesh_chooses_jaccl_with_a_device_per_peer(topology, nodes):
    result = choose_backend(connectivity_matrix(synthetic_cluster(topology, nodes)), list(nodes))
    assert result["ok"] is True
    assert result["backend"] == "jaccl"
    assert result["order"] == list(nodes)
    for rank, host in enumerate(result["hosts"]):
        assert host["rdma"][rank] is None
        assert all(d and d.startswith("rdma_en") for i, d in enumerate(host["rdma"]) if i != rank)
        # the coordinator address must be one every node can reach: the shared Wi-Fi LAN here
        assert host["ip"] == f"10.0.1.{11 + rank}"
        assert all(t["kind"] == "thunderbolt" for t in host["toward"].values())
    assert result["fixes"] == [] and result["warnings"] == []


def test_mesh3_rdma_devices_match_the_cables():
    result = choose_backend(connectivity_matrix(synthetic_cluster("mesh3", "ABC")), ["A", "B", "C"])
    hosts = {h["node"]: h for h in result["hosts"]}
    assert hosts["A"]["rdma"] == [None, "rdma_en2", "rdma_en3"]  # A0-B0, A1-C0
    assert hosts["C"]["rdma"] == ["rdma_en2", "rdma_en3", None]  # C0-A1, C1-B1


def assert_valid_ring(ring, matrix):
    assert sorted(ring) == sorted(matrix["names"])
    for i, node in enumerate(ring):
        assert matrix["pairs"][node][ring[(i + 1) % len(ring)]]["rdma"] is True


def test_rdma_ring_chooses_jaccl_ring_with_a_valid_ring_order():
    matrix = connectivity_matrix(synthetic_cluster("ring4", "ABCD"))
    result = choose_backend(matrix, ["A", "C", "B", "D"])  # the given order is no ring
    assert result["backend"] == "jaccl-ring"
    assert result["ring"][0] == "A"
    assert_valid_ring(result["ring"], matrix)
    assert result["order"] == result["ring"]
    for rank, host in enumerate(result["hosts"]):
        left, right = result["ring"][rank - 1], result["ring"][(rank + 1) % 4]
        assert set(host["neighbours"]) == {left, right}
        devices = dict(zip(result["order"], host["rdma"]))
        assert devices[left] and devices[right]
        assert [n for n, d in devices.items() if d is None] == [
            n for n in result["order"] if n not in (left, right)
        ]


def test_missing_cable_falls_back_to_tcp_ring_with_best_link_ips():
    matrix = connectivity_matrix(synthetic_cluster("line3", "ABC"))
    result = choose_backend(matrix, ["A", "B", "C"])
    assert result["backend"] == "ring"
    assert result["transport"] == "tcp"
    assert "A–C: no direct Thunderbolt cable" in result["reasons"][0]
    hosts = {h["node"]: h for h in result["hosts"]}
    # A rank's ring address is the one its left neighbour reaches it on.
    assert hosts["A"]["ip"] == "10.0.0.11"      # from C over Ethernet
    assert hosts["B"]["ip"] == "192.168.0.2"    # from A over Thunderbolt
    assert hosts["C"]["ip"] == "192.168.0.6"    # from B over Thunderbolt
    assert hosts["A"]["toward"]["B"]["kind"] == "thunderbolt"
    assert hosts["A"]["toward"]["C"]["kind"] == "ethernet"
    assert all(h["rdma"] == [] for h in result["hosts"])


def test_tcp_ring_uses_wifi_only_where_nothing_better_is_shared():
    topologies = synthetic_cluster("line3", "ABC")
    for interface in topologies["C"]["interfaces"]:
        if interface["name"] == "en0":
            interface["up"] = False
    result = choose_backend(connectivity_matrix(topologies), ["A", "B", "C"])
    hosts = {h["node"]: h for h in result["hosts"]}
    assert hosts["A"]["ip"] == "10.0.1.11"
    assert hosts["A"]["toward"]["C"]["kind"] == "wifi"
    assert any("over Wi-Fi" in w for w in result["warnings"])


def test_tcp_ring_follows_thunderbolt_links_when_rdma_is_off():
    topologies = synthetic_cluster("ring4", "ABCD", rdma="disabled")
    matrix = connectivity_matrix(topologies)
    result = choose_backend(matrix, ["A", "C", "B", "D"])
    assert result["backend"] == "ring"
    ring = result["ring"]
    for i, node in enumerate(ring):
        assert matrix["pairs"][node][ring[(i + 1) % 4]]["best"]["kind"] == "thunderbolt"
    assert all(h["ip"].startswith("192.168.0.") for h in result["hosts"])
    assert {f["node"] for f in result["fixes"] if f["instruction"] == RECOVERY_INSTRUCTION} == set("ABCD")


def test_thunderbolt_bridge_enabled_alongside_rdma_is_a_warning():
    topologies = synthetic_cluster("mesh3", "ABC")
    topologies["A"] = synthetic_node("mesh3", "A", ifconfig="mesh3-nodeA.bridge-enabled.ifconfig.txt")
    result = choose_backend(connectivity_matrix(topologies), ["A", "B", "C"])
    assert result["backend"] == "jaccl"
    assert any("Thunderbolt Bridge is enabled on A" in w and "must be disabled" in w
               for w in result["warnings"])
    assert [f["node"] for f in result["fixes"]] == ["A"]


def test_rdma_disabled_node_gets_the_recovery_instruction_not_a_command():
    topologies = synthetic_cluster("mesh3", "ABC")
    topologies["B"] = synthetic_node("mesh3", "B", rdma="disabled")
    result = choose_backend(connectivity_matrix(topologies), ["A", "B", "C"])
    assert result["backend"] == "ring"
    assert result["fixes"] == [{"node": "B", "instruction": RECOVERY_INSTRUCTION, "command": None}]
    assert "Recovery" in RECOVERY_INSTRUCTION and "rdma_ctl enable" in RECOVERY_INSTRUCTION


def test_macos_below_26_2_is_told_to_upgrade():
    topologies = synthetic_cluster("mesh3", "ABC")
    topologies["C"] = synthetic_node("mesh3", "C", os_version="15.6.1")
    matrix = connectivity_matrix(topologies)
    assert matrix["pairs"]["A"]["C"]["rdma"] is False
    assert "RDMA needs 26.2 or later" in matrix["pairs"]["A"]["C"]["rdma_detail"]
    result = choose_backend(matrix, ["A", "B", "C"])
    assert result["backend"] == "ring"
    assert {"node": "C", "instruction": UPGRADE_INSTRUCTION, "command": None} in result["fixes"]


def test_forcing_jaccl_without_a_full_rdma_mesh_fails_with_the_reason():
    matrix = connectivity_matrix(synthetic_cluster("ring4", "ABCD"))
    result = choose_backend(matrix, ["A", "B", "C", "D"], forced="jaccl")
    assert result["ok"] is False
    assert result["backend"] is None
    assert "A–C: no direct Thunderbolt cable" in result["error"]


def test_forcing_jaccl_when_rdma_is_disabled_fails_naming_the_node():
    topologies = synthetic_cluster("mesh3", "ABC")
    topologies["B"] = synthetic_node("mesh3", "B", rdma="disabled")
    result = choose_backend(connectivity_matrix(topologies), ["A", "B", "C"], forced="jaccl")
    assert result["ok"] is False
    assert "RDMA is disabled on B" in result["error"]


def test_forcing_a_possible_backend_is_honoured():
    matrix = connectivity_matrix(synthetic_cluster("mesh4", "ABCD"))
    ring = choose_backend(matrix, list("ABCD"), forced="jaccl-ring")
    assert ring["ok"] and ring["backend"] == "jaccl-ring"
    assert_valid_ring(ring["ring"], matrix)
    tcp = choose_backend(matrix, list("ABCD"), forced="ring")
    assert tcp["ok"] and tcp["backend"] == "ring" and tcp["transport"] == "tcp"
    assert "jaccl was possible" in tcp["reasons"][0]


def test_forcing_an_unknown_backend_fails():
    matrix = connectivity_matrix(synthetic_cluster("mesh3", "ABC"))
    result = choose_backend(matrix, ["A", "B", "C"], forced="mpi")
    assert result["ok"] is False and "unknown backend 'mpi'" in result["error"]


def test_single_node_is_ring_with_nothing_to_connect():
    matrix = connectivity_matrix({"solo": synthetic_node("mesh3", "A")})
    result = choose_backend(matrix, ["solo"])
    assert result["ok"] is True and result["backend"] == "ring"
    assert "nothing to connect" in result["reasons"][0]
    assert result["hosts"] == [{
        "node": "solo", "rank": 0, "ip": None, "ips": [], "rdma": [],
        "neighbours": [], "toward": {},
    }]


def test_unknown_topology_is_no_link_and_said_so():
    topologies = {"A": synthetic_node("mesh3", "A"), "B": None}
    matrix = connectivity_matrix(topologies)
    assert matrix["pairs"]["A"]["B"]["rdma"] is False
    result = choose_backend(matrix, ["A", "B"])
    assert any("B: no topology" in w for w in result["warnings"])
    # Addresses unmeasured are the cluster file's to give, not a reason to refuse.
    assert result["ok"] is True and result["backend"] == "ring"
    # A's own LAN address is the best guess for it; B's is unknown.
    assert {h["node"]: h["ip"] for h in result["hosts"]} == {"A": "10.0.1.11", "B": None}
    assert any("must be routable" in w for w in result["warnings"])
    assert any("no address measured for B" in w for w in result["warnings"])


def test_node_order_must_name_known_nodes_once():
    matrix = connectivity_matrix(synthetic_cluster("mesh3", "ABC"))
    with pytest.raises(ValueError, match="not in the matrix"):
        choose_backend(matrix, ["A", "Z"])
    with pytest.raises(ValueError, match="twice"):
        choose_backend(matrix, ["A", "A"])


def test_linux_nodes_form_a_tcp_ring_over_their_lan():
    def linux(address: str) -> dict:
        return build_linux_topology({}, None, json.dumps([
            {"ifname": "lo", "flags": ["LOOPBACK", "UP", "LOWER_UP"], "operstate": "UNKNOWN",
             "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
            {"ifname": "eth0", "flags": ["UP", "LOWER_UP"], "operstate": "UP",
             "addr_info": [{"family": "inet", "local": address, "prefixlen": 24}]},
        ]), "6.8.0")
    matrix = connectivity_matrix({"n1": linux("10.231.0.11"), "n2": linux("10.231.0.12"),
                                  "n3": linux("10.231.0.13")})
    result = choose_backend(matrix, ["n1", "n2", "n3"])
    assert result["ok"] and result["backend"] == "ring"
    assert [h["ip"] for h in result["hosts"]] == ["10.231.0.11", "10.231.0.12", "10.231.0.13"]
    assert result["fixes"] == []  # the Recovery instruction is for Macs only


# --- ring search -----------------------------------------------------------------------------


def test_find_ring_finds_a_hamiltonian_cycle_in_a_scrambled_16_node_ring_quickly():
    cycle = [f"n{i}" for i in range(16)]
    edges = {frozenset((cycle[i], cycle[(i + 1) % 16])) for i in range(16)}
    scrambled = cycle[::3] + [n for n in cycle if n not in cycle[::3]]
    started = time.monotonic()
    ring = find_ring(scrambled, lambda a, b: frozenset((a, b)) in edges)
    assert time.monotonic() - started < 5
    assert ring[0] == scrambled[0] and sorted(ring) == sorted(cycle)
    assert all(frozenset((ring[i], ring[(i + 1) % 16])) in edges for i in range(16))


def test_find_ring_none_when_no_cycle_covers_every_node():
    star = {frozenset(("hub", leaf)) for leaf in "abc"}
    assert find_ring(["hub", "a", "b", "c"], lambda x, y: frozenset((x, y)) in star) is None
    assert find_ring(["a", "b"], lambda x, y: False) is None


def test_matrix_and_choice_are_plain_data():
    matrix = connectivity_matrix(synthetic_cluster("ring4", "ABCD"))
    result = choose_backend(matrix, list("ABCD"))
    for value in (matrix, result):
        assert msgpack.unpackb(msgpack.packb(value)) == json.loads(json.dumps(value))
    assert copy.deepcopy(result) == result
