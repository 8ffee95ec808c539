"""What `coord doctor` reads on a Mac, from the synthetic macOS fixtures (tests/fixtures/macos-synthetic,
written by generate.py from the documented formats): two cables between one pair, the route the kernel
takes, the MTU in ifconfig, the RDMA devices ibv_devices lists."""

from __future__ import annotations

from agent.rdma_parsers import parse_ibv_devices, parse_ibv_devinfo
from agent.route_parsers import parse_ifconfig_mtu, parse_route_get
from agent.thunderbolt_parsers import parse_networksetup_ports, thunderbolt_receptacles
from coordinator.launch.mlx_backend import choose_backend
from coordinator.launch.topology import connectivity_matrix
from coordinator.readiness.link_verdict import judge_link, rdma_problems
from tests.unit.test_link_verdict import figures
from tests.unit.test_topology import read_synthetic, synthetic_cluster


def test_two_cables_between_one_pair_are_both_seen_and_one_is_used() -> None:
    matrix = connectivity_matrix(synthetic_cluster("pair2", "AB"))
    view = matrix["pairs"]["A"]["B"]
    cables = [(c["local_interface"], c["peer_interface"], c["local_rdma_device"], c["generation"])
              for c in view["cables"]]
    assert cables == [("en2", "en2", "rdma_en2", 5), ("en3", "en3", "rdma_en3", 5)]
    # One link and one RDMA device per pair, the same every time: the load never splits over two cables.
    assert view["best"]["local_interface"] == "en2" and view["rdma_device"] == "rdma_en2"
    choice = choose_backend(matrix, ["A", "B"])
    assert choice["backend"] == "jaccl"
    assert [host["rdma"] for host in choice["hosts"]] == [[None, "rdma_en2"], ["rdma_en2", None]]


def test_route_get_names_the_cable_or_the_wrong_way_out() -> None:
    direct = parse_route_get(read_synthetic("pair2-nodeA.route-get.192.168.0.2.txt"))
    assert direct == {"interface": "en2", "source": None, "gateway": None}
    via_wifi = parse_route_get(read_synthetic("pair2-nodeA.route-get.192.168.0.2.via-wifi.txt"))
    assert via_wifi == {"interface": "en1", "source": None, "gateway": "10.0.1.1"}
    judgement = judge_link(figures(a="A", b="B", interface="en2", peer_interface="en2", address="192.168.0.1",
                                   peer_address="192.168.0.2", route_interface=via_wifi["interface"]), None)
    assert judgement["verdict"] == "wrong-route"
    assert "A's traffic for B (192.168.0.2) leaves by en1, not by en2" in judgement["cause"]


def test_ifconfig_gives_each_interfaces_mtu() -> None:
    text = read_synthetic("pair2-nodeA.ifconfig.txt")
    blocks = {block.split(":", 1)[0]: block for block in _blocks(text)}
    assert parse_ifconfig_mtu(blocks["en2"]) == 1500
    assert parse_ifconfig_mtu(blocks["lo0"]) == 16384


def test_networksetup_names_the_thunderbolt_ports_and_their_rdma_devices() -> None:
    ports = parse_networksetup_ports(read_synthetic("macstudio.networksetup-listallhardwareports.txt"))
    receptacles = thunderbolt_receptacles(ports)
    assert sorted((r["interface"], r["rdma_device"]) for r in receptacles.values()) == [
        ("en2", "rdma_en2"), ("en3", "rdma_en3"), ("en4", "rdma_en4"), ("en5", "rdma_en5")]


def test_rdma_devices_of_a_saved_matrix_are_checked_against_ibv_devices() -> None:
    listed = parse_ibv_devices(read_synthetic("macstudio.ibv_devices.rdma-enabled.txt"))
    assert listed == ["rdma_en2", "rdma_en3", "rdma_en4", "rdma_en5"]
    active = [d["name"] for d in parse_ibv_devinfo(read_synthetic("pair2-nodeA.ibv_devinfo.txt")) or []
              if any(port.get("state") == "PORT_ACTIVE" for port in d.get("ports") or [])]
    assert active == ["rdma_en2", "rdma_en3"]  # the two cabled ports
    # A matrix saved before a reboot renamed the ports (mlx#3207): rdma_en7 is no longer there.
    problems = rdma_problems({"A": ["rdma_en2", "rdma_en7"]}, {"A": listed}, "MLX_IBV_DEVICES")
    assert [(p["node"], p["device"]) for p in problems] == [("A", "rdma_en7")]


def _blocks(text: str) -> list[str]:
    blocks: list[str] = []
    for line in text.splitlines():
        if line and not line[0].isspace():
            blocks.append(line + "\n")
        elif blocks:
            blocks[-1] += line + "\n"
    return blocks
