"""The agent's link probe over loopback (real sockets), and its readers of route and MTU output."""

from __future__ import annotations

import asyncio
import time

import pytest

from agent import link_probe, route_parsers
from shared.rpc import RemoteError


def test_ip_route_get_names_the_interface_source_and_gateway() -> None:
    direct = '[{"dst":"10.9.0.12","dev":"tb0","prefsrc":"10.9.0.11","flags":[],"uid":0,"cache":[]}]'
    assert route_parsers.parse_ip_route_get(direct) == {"interface": "tb0", "source": "10.9.0.11", "gateway": None}
    routed = '[{"dst":"8.8.8.8","gateway":"192.168.1.1","dev":"eth0","prefsrc":"192.168.1.5"}]'
    assert route_parsers.parse_ip_route_get(routed)["gateway"] == "192.168.1.1"
    assert route_parsers.parse_ip_route_get("RTNETLINK answers: Network is unreachable") is None
    assert route_parsers.parse_ip_route_get("[]") is None


def test_macos_route_get_names_the_interface() -> None:
    output = """   route to: 169.254.20.2
destination: 169.254.0.0
       mask: 255.255.0.0
  interface: bridge0
      flags: <UP,DONE,CLONING>
"""
    assert route_parsers.parse_route_get(output) == {"interface": "bridge0", "source": None, "gateway": None}
    via_router = "   route to: 10.0.1.5\ndestination: default\n    gateway: 192.168.1.1\n  interface: en0\n"
    assert route_parsers.parse_route_get(via_router) == {"interface": "en0", "source": None, "gateway": "192.168.1.1"}
    assert route_parsers.parse_route_get("route: writing to routing socket: not in table") is None


def test_ifconfig_header_gives_the_mtu() -> None:
    assert route_parsers.parse_ifconfig_mtu(
        "bridge0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500\n\tether 36:...\n") == 1500
    assert route_parsers.parse_ifconfig_mtu("en5: flags=8863<UP> mtu 9000\n") == 9000
    assert route_parsers.parse_ifconfig_mtu("ifconfig: interface en9 does not exist") is None


def _listen_and_measure(size: int, seconds: float, token: str = "t0k") -> dict:
    async def run() -> dict:
        probes = link_probe.LinkProbes()
        listening = await probes.listen("127.0.0.1", "t0k", 30)
        assert listening["listening"], listening
        try:
            return dict(await asyncio.to_thread(link_probe.measure, "127.0.0.1", listening["port"], token, size,
                                                "127.0.0.1", seconds))
        finally:
            assert (await probes.close(listening["port"]))["closed"]

    return asyncio.run(run())


def test_a_loopback_link_is_measured_both_ways() -> None:
    reply = _listen_and_measure(8 * 2**20, 10.0)
    assert reply["connected"] and reply["complete"], reply
    assert reply["bytes_up"] == reply["bytes_down"] == 8 * 2**20
    assert reply["bits_per_second"] > 1e8 and reply["reverse_bits_per_second"] > 1e8
    assert 0 < reply["latency_ms"] < 100


def test_the_time_limit_bounds_a_measurement_that_asks_for_more_bytes() -> None:
    started = time.monotonic()
    reply = _listen_and_measure(link_probe.MAX_BYTES, 1.0)
    assert time.monotonic() - started < 4.0
    assert reply["connected"] and not reply["complete"]
    assert "time limit" in reply["detail"]
    assert 0 < reply["bytes_up"] < link_probe.MAX_BYTES


def test_a_wrong_token_is_not_measured() -> None:
    reply = _listen_and_measure(2**20, 3.0, token="other")
    assert not reply["connected"]
    assert "not coord's probe" in reply["detail"]


def test_nothing_listening_says_why() -> None:
    reply = link_probe.measure("127.0.0.1", 1, "t0k", 10, None, 2.0)
    assert not reply["connected"] and "127.0.0.1:1" in reply["detail"]


@pytest.mark.parametrize("args", [
    {"host": "127.0.0.1", "port": 0, "token": "t", "size": 1},
    {"host": "127.0.0.1", "port": 5, "token": "has space", "size": 1},
    {"host": "", "port": 5, "token": "t", "size": 1},
    {"host": "127.0.0.1", "port": 5, "token": "t", "size": -1},
    {"host": "127.0.0.1", "port": 5, "token": "t", "size": 1, "seconds": 0},
])
def test_bad_arguments_are_refused_with_a_message(args: dict) -> None:
    with pytest.raises(RemoteError) as caught:
        link_probe.measure(**args)
    assert "must be" in caught.value.message


def test_the_route_toward_loopback_is_read() -> None:
    reply = link_probe.link_route("127.0.0.1", "lo")
    assert reply["route"] is not None and reply["route"]["interface"] == "lo"
    assert reply["interface_mtu"] == reply["route_mtu"] and reply["route_mtu"] > 0


def test_an_interface_without_a_negotiated_speed_has_none(tmp_path) -> None:
    assert link_probe.interface_speed_bps("lo") is None  # loopback negotiates nothing
    assert link_probe.interface_speed_bps(None) is None
    assert link_probe.interface_speed_bps("no-such-interface0") is None
