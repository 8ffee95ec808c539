"""`coord doctor` on the multi-host cluster with two networks: a fast one (``thunderbolt0``, standing in
for Thunderbolt) and the slow one (``eth0`` capped with tc, standing in for Ethernet). Real agents in
real network namespaces, over real OpenSSH; the links are measured by real TCP transfers."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import pytest

from coordinator.control.server import call_daemon
from tests.cluster.test_ready_multihost import ALLSUM
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir

pytestmark = pytest.mark.cluster

SLOW = "50mbit"  # eth0, the slow network


@pytest.fixture(scope="module")
def two_networks(netns_cluster):
    netns_cluster.add_fast_network()
    nodes = [n.name for n in netns_cluster.nodes]
    netns_cluster.cap_links(SLOW, hosts=nodes)
    root = short_tempdir()
    root.chmod(0o755)
    source = root / "project"
    source.mkdir(mode=0o755)
    (source / "allsum.py").write_text(ALLSUM)
    (source / "allsum.py").chmod(0o644)
    config = netns_cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state")
    with config.open("a") as handle:
        handle.write(f'\n[sync]\nsource = "{source}"\nscript = "allsum.py"\n')
    daemon = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", netns_cluster.head_ns]).start()
    try:
        daemon.wait_for(all_up, 60, "all nodes up")
        yield netns_cluster, daemon
    finally:
        daemon.stop()
        netns_cluster.cap_links(None, hosts=nodes)
        netns_cluster.remove_fast_network()
        shutil.rmtree(root, ignore_errors=True)


def doctor(daemon: DaemonProcess, *args: str, timeout: float = 120) -> tuple[int, dict]:
    done = coord("doctor", "--config", str(daemon.config), "--json", *args, env=daemon.env, timeout=timeout)
    assert done.stdout.strip().startswith("{"), done.stderr + done.stdout
    return done.returncode, json.loads(done.stdout)


def by_pair(report: dict) -> dict[frozenset, dict]:
    return {frozenset((link["a"], link["b"])): link for link in report["links"]}


def test_the_job_uses_the_fast_network_and_doctor_measures_it(two_networks) -> None:
    cluster, daemon = two_networks
    hostfile = coord("hostfile", "--config", str(daemon.config), "--json", env=daemon.env, timeout=120)
    assert hostfile.returncode == 0, hostfile.stderr
    hosts = json.loads(hostfile.stdout)["hostfile"]["hosts"]
    fast = {cluster.fast_ip(n.name) for n in cluster.nodes}
    assert {host["ips"][0] for host in hosts} == fast  # the job's ranks meet on the fast network

    status, report = doctor(daemon, "--bytes", str(16 * 2**20), "--set-baseline")
    assert status == 0, report
    assert len(report["links"]) == 3
    for link in report["links"]:
        assert (link["interface"], link["kind"], link["verdict"]) == ("thunderbolt0", "thunderbolt", "ok"), link
        assert link["route_interface"] == link["peer_route_interface"] == "thunderbolt0"
        assert link["address"] in fast and link["peer_address"] in fast
        assert link["mtu"] == link["peer_mtu"] == 1500
        # Faster than the slow network's cap each way: the bytes went over the fast one.
        assert link["bits_per_second"] > 2 * 50e6 and link["reverse_bits_per_second"] > 2 * 50e6, link


def fast_bytes(cluster, node: str) -> int:
    counters = [cluster.exec_in(node, ["cat", f"/sys/class/net/{cluster.FAST_INTERFACE}/statistics/{way}_bytes"])
                for way in ("rx", "tx")]
    return sum(int(done.stdout) for done in counters)


def test_a_job_runs_its_collectives_over_the_fast_network(two_networks) -> None:
    cluster, daemon = two_networks
    assert coord("sync", "--config", str(daemon.config), env=daemon.env, timeout=300).returncode == 0
    prepared = asyncio.run(call_daemon(daemon.config.parent / "state" / "coord.sock", "prepare_job",
                                       {"job": "allsum", "argv": ["python", "allsum.py"]}, timeout=120))
    before = {n.name: fast_bytes(cluster, n.name) for n in cluster.nodes}
    result = cluster.exec_in("head", prepared["argv"], env={**environment(), **prepared["env"]}, timeout=300)
    lines = sorted(line.strip() for line in result.stdout.splitlines() if line.strip().startswith("rank "))
    assert lines == [f"rank {r} of 3 sum [6.0, 6.0, 6.0, 6.0]" for r in range(3)], (result.stdout, result.stderr)
    # Nothing else uses thunderbolt0 (the head is not on it): what it carried was the ring's traffic.
    grown = {n.name: fast_bytes(cluster, n.name) - before[n.name] for n in cluster.nodes}
    assert all(count > 500 for count in grown.values()), grown


def test_a_link_capped_to_a_tenth_is_slow_and_named_within_the_time_limit(two_networks) -> None:
    cluster, daemon = two_networks
    pairs = [("n1", "n2"), ("n2", "n3"), ("n1", "n3")]
    try:
        for a, b in pairs:
            cluster.cap_fast_pair(a, b, "400mbit")
        status, report = doctor(daemon, "--bytes", str(8 * 2**20), "--set-baseline")
        assert status == 0, report
        cluster.cap_fast_pair("n1", "n2", "40mbit")
        started = time.monotonic()
        status, report = doctor(daemon, "--bytes", str(8 * 2**20), "--seconds", "12")
        took = time.monotonic() - started
    finally:
        for a, b in pairs:
            cluster.cap_fast_pair(a, b, None)
    assert status == 1
    assert report["seconds"] <= 12 + 6 and took < 12 + 20, (report["seconds"], took)
    links = by_pair(report)
    capped = links[frozenset(("n1", "n2"))]
    assert capped["verdict"] == "slow", capped
    assert "n1" in capped["cause"] and "n2" in capped["cause"] and "of its baseline" in capped["cause"]
    assert capped["bits_per_second"] < 0.2 * capped["baseline_bits_per_second"]
    assert [links[frozenset(p)]["verdict"] for p in (("n2", "n3"), ("n1", "n3"))] == ["ok", "ok"], report
    assert report["status"] == "slow"


def test_a_fast_link_down_is_named_by_doctor_and_preflight_with_what_the_launch_will_do(two_networks) -> None:
    cluster, daemon = two_networks
    pairs = [("n1", "n2"), ("n2", "n3"), ("n1", "n3")]
    try:
        # Capped, the fast links' figures hold still on this busy machine; uncapped, a veth's rate is its CPUs'.
        for a, b in pairs:
            cluster.cap_fast_pair(a, b, "400mbit")
        status, _ = doctor(daemon, "--bytes", str(8 * 2**20), "--set-baseline")
        assert status == 0
        cluster.cut_fast_link("n2")
        try:
            status, report = doctor(daemon, "--bytes", str(16 * 2**20), "--seconds", "15")
            shown = coord("preflight", "--config", str(daemon.config), "--json", env=daemon.env, timeout=300)
        finally:
            cluster.restore_fast_link("n2")
    finally:
        for a, b in pairs:
            cluster.cap_fast_pair(a, b, None)
    assert status == 1
    links = by_pair(report)
    for pair in (("n1", "n2"), ("n2", "n3")):
        link = links[frozenset(pair)]
        assert link["verdict"] == "down", link
        assert "thunderbolt0 on n2 is down" in link["cause"]
        assert "the launch will go over eth0 (ethernet) instead" in link["cause"], link["cause"]
        # Measured over the slow network (its token bucket lets the first 2 MB through at full speed).
        assert link["interface"] == "eth0" and link["bits_per_second"] < 150e6, link
    assert links[frozenset(("n1", "n3"))]["verdict"] == "ok"
    quick = next(c for c in json.loads(shown.stdout)["checks"] if c["name"] == "links.quick")
    assert quick["status"] == "fail", quick
    assert "thunderbolt0 on n2 is down" in quick["detail"] and "The launch is blocked" in quick["detail"]


def test_traffic_routed_off_the_chosen_interface_is_a_wrong_route(two_networks) -> None:
    cluster, daemon = two_networks
    # n1's kernel sends n2's fast address out of eth0: a host route, as an overlapping subnet would.
    route = ["ip", "route", "add", f"{cluster.fast_ip('n2')}/32", "dev", "eth0"]
    added = cluster.exec_in("n1", route)
    assert added.returncode == 0, added.stderr
    try:
        status, report = doctor(daemon, "--bytes", "0")
    finally:
        cluster.exec_in("n1", ["ip", "route", "del", f"{cluster.fast_ip('n2')}/32", "dev", "eth0"])
    assert status == 1
    link = by_pair(report)[frozenset(("n1", "n2"))]
    assert link["verdict"] == "wrong-route", link
    assert link["route_interface" if link["a"] == "n1" else "peer_route_interface"] == "eth0"
    assert f"n1's traffic for n2 ({cluster.fast_ip('n2')}) leaves by eth0, not by thunderbolt0" in link["cause"]
    assert "ip route get" in link["fix"]
