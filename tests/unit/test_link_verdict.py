"""coord doctor's verdicts on a link, over plain data."""

from __future__ import annotations

from typing import Any

from coordinator.readiness.link_verdict import (
    Baseline,
    LinkFigures,
    baseline_from,
    blocks_launch,
    bps_text,
    judge_link,
    keeps_as_first_baseline,
    rdma_problems,
)


def figures(**changes: Any) -> LinkFigures:
    base: LinkFigures = {
        "a": "n1", "b": "n2", "interface": "tb0", "peer_interface": "tb0", "kind": "thunderbolt",
        "address": "10.9.0.11", "peer_address": "10.9.0.12", "connected": True, "complete": True,
        "bits_per_second": 30e9, "reverse_bits_per_second": 31e9, "latency_ms": 0.2,
        "route_interface": "tb0", "peer_route_interface": "tb0", "mtu": 9000, "peer_mtu": 9000,
        "speed_bps": None, "generation": 5, "cabled": True, "interfaces_down": [], "detail": "measured",
    }
    base.update(changes)  # type: ignore[typeddict-item]
    return base


def baseline(**changes: Any) -> Baseline:
    made = baseline_from(figures(), 1.0)
    made.update(changes)  # type: ignore[typeddict-item]
    return made


def test_a_healthy_link_is_ok_and_becomes_the_first_baseline() -> None:
    judgement = judge_link(figures(), None)
    assert judgement == {"verdict": "ok", "cause": "", "fix": ""}
    assert keeps_as_first_baseline(figures(), judgement)
    assert not blocks_launch(judgement)


def test_a_link_under_half_its_baseline_is_slow_and_names_the_direction() -> None:
    judgement = judge_link(figures(bits_per_second=3e9), baseline())
    assert judgement["verdict"] == "slow"
    assert "n1 → n2 3 Gbit/s, 10% of its baseline 30 Gbit/s" in judgement["cause"]
    assert "n2 → n1" not in judgement["cause"]
    assert "--set-baseline" in judgement["fix"]
    assert not blocks_launch(judgement)
    assert not keeps_as_first_baseline(figures(bits_per_second=3e9), judgement)


def test_a_slow_link_with_unequal_mtus_blames_the_mtu() -> None:
    judgement = judge_link(figures(reverse_bits_per_second=1e9, peer_mtu=1500), baseline())
    assert judgement["verdict"] == "slow"
    assert "MTU mismatch" in judgement["cause"] and "1500" in judgement["cause"]
    assert "mtu 9000" in judgement["fix"]


def test_a_link_renegotiated_lower_says_so() -> None:
    judgement = judge_link(figures(kind="ethernet", generation=None, cabled=False, speed_bps=1e9,
                                   bits_per_second=0.9e9, reverse_bits_per_second=0.9e9),
                           baseline(kind="ethernet", speed_bps=10e9, bits_per_second=9e9, reverse_bits_per_second=9e9))
    assert judgement["verdict"] == "slow"
    assert "renegotiated lower: 1 Gbit/s now, 10 Gbit/s at its baseline" in judgement["cause"]


def test_thunderbolt_5_well_under_40_gbits_is_slow_without_a_baseline() -> None:
    judgement = judge_link(figures(bits_per_second=12e9, reverse_bits_per_second=12e9), None)
    assert judgement["verdict"] == "slow"
    assert "Thunderbolt 5" in judgement["cause"] and "12 Gbit/s" in judgement["cause"]
    thunderbolt_4 = figures(generation=4, bits_per_second=12e9, reverse_bits_per_second=12e9)
    assert judge_link(thunderbolt_4, None)["verdict"] == "ok"


def test_an_unreachable_peer_is_down_with_the_interface_and_addresses() -> None:
    judgement = judge_link(figures(connected=False, bits_per_second=None, reverse_bits_per_second=None,
                                   detail="timed out"), baseline())
    assert judgement["verdict"] == "down"
    assert judgement["cause"] == "n2 is unreachable from n1 over tb0 (thunderbolt), 10.9.0.11 → 10.9.0.12: timed out"
    assert blocks_launch(judgement)


def test_a_baseline_interface_down_says_what_the_launch_will_use_instead() -> None:
    judgement = judge_link(figures(interface="eth0", peer_interface="eth0", kind="ethernet", cabled=False,
                                   bits_per_second=90e6, reverse_bits_per_second=95e6,
                                   route_interface="eth0", peer_route_interface="eth0",
                                   interfaces_down=["tb0 on n2 is down"]), baseline())
    assert judgement["verdict"] == "down"
    assert "tb0 on n2 is down" in judgement["cause"]
    assert "the launch will go over eth0 (ethernet) instead, measured at 90 Mbit/s" in judgement["cause"]
    assert "--force" in judgement["fix"] and "--set-baseline" in judgement["fix"]


def test_traffic_leaving_by_another_interface_is_a_wrong_route() -> None:
    judgement = judge_link(figures(peer_route_interface="en0"), baseline())
    assert judgement["verdict"] == "wrong-route"
    assert "n2's traffic for n1 (10.9.0.11) leaves by en0, not by tb0" in judgement["cause"]
    assert "route -n get 10.9.0.11" in judgement["fix"]
    assert blocks_launch(judgement)


def test_a_thunderbolt_pair_talking_over_ethernet_is_a_wrong_route() -> None:
    judgement = judge_link(figures(interface="en0", peer_interface="en0", kind="ethernet", route_interface="en0",
                                   peer_route_interface="en0", generation=None), None)
    assert judgement["verdict"] == "wrong-route"
    assert "Thunderbolt cable" in judgement["cause"] and "en0 (ethernet)" in judgement["cause"]


def test_changed_device_names_at_full_speed_are_ok_with_a_note() -> None:
    judgement = judge_link(figures(interface="tb1", route_interface="tb1"), baseline())
    assert judgement["verdict"] == "ok"
    assert "device names changed since the baseline (tb0/tb0 then, tb1/tb0 now)" in judgement["cause"]


def test_a_measurement_cut_by_the_time_limit_is_not_a_first_baseline() -> None:
    cut = figures(complete=False, detail="stopped at the time limit")
    assert not keeps_as_first_baseline(cut, judge_link(cut, None))


def test_rdma_devices_named_by_a_saved_matrix_but_gone_are_named() -> None:
    problems = rdma_problems({"n1": ["rdma_en5", "rdma_en6"], "n2": ["rdma_en3"], "n3": ["rdma_en2"]},
                             {"n1": ["rdma_en3", "rdma_en6"], "n2": ["rdma_en3"], "n3": None}, "the saved hostfile")
    assert [(p["node"], p["device"]) for p in problems] == [("n1", "rdma_en5")]
    assert "no longer has (it has rdma_en3, rdma_en6)" in problems[0]["cause"]
    assert "coord hostfile" in problems[0]["fix"]


def test_rates_read_as_words() -> None:
    assert bps_text(None) == "unknown"
    assert bps_text(40e9) == "40 Gbit/s"
    assert bps_text(123.4e6) == "123 Mbit/s"


def test_preflight_blocks_only_a_dead_or_wrong_link() -> None:
    from coordinator.readiness.checks import links_quick

    ok = {"a": "n1", "b": "n2", "verdict": "ok", "latency_ms": 0.3, "cause": "", "fix": ""}
    slow = {**ok, "a": "n2", "b": "n3", "verdict": "slow", "cause": "under half its baseline"}
    assert links_quick([ok, slow], 1.2)["status"] == "pass"
    assert links_quick([], 0.0)["status"] == "pass"
    down = {**ok, "b": "n3", "verdict": "down", "cause": "tb0 on n3 is down; the launch will go over eth0",
            "fix": "bring it back"}
    failed = links_quick([ok, down], 2.0)
    assert failed["status"] == "fail"
    assert "n1 ↔ n3 down: tb0 on n3 is down; the launch will go over eth0 (fix: bring it back)" in failed["detail"]
    assert "The launch is blocked" in failed["detail"] and "--force" in failed["detail"]
    assert failed["fix_command"] == "coord doctor"


def test_the_quick_form_judges_no_rate() -> None:
    slow = figures(bits_per_second=1e6)
    assert judge_link(slow, baseline(), speed=False)["verdict"] == "ok"
    assert judge_link(figures(connected=False), baseline(), speed=False)["verdict"] == "down"


def test_the_links_measured_are_ring_neighbours_once_or_every_pair() -> None:
    from coordinator.readiness.doctor import link_pairs, worst

    assert link_pairs(["a", "b", "c", "d"], all_pairs=False) == [("a", "b"), ("b", "c"), ("c", "d"), ("d", "a")]
    assert link_pairs(["a", "b"], all_pairs=False) == [("a", "b")]
    assert len(link_pairs(["a", "b", "c", "d"], all_pairs=True)) == 6
    assert link_pairs(["a"], all_pairs=True) == []
    assert worst(["ok", "slow", "wrong-route"]) == "wrong-route" and worst(["ok"]) == "ok"


def test_the_address_measured_is_the_hostfiles() -> None:
    from types import SimpleNamespace

    from coordinator.config.cluster_file import NodeConfig
    from coordinator.readiness.doctor import chosen_link

    best = {"kind": "thunderbolt", "local_interface": "en2", "local_ip": "192.168.0.1", "peer_interface": "en2",
            "peer_ip": "192.168.0.2", "network": "192.168.0.0/30"}
    matrix: Any = {"pairs": {"a": {"b": {"best": best}}}}

    def cluster(*ips: tuple[str, ...]) -> Any:
        return SimpleNamespace(config=SimpleNamespace(nodes=[
            NodeConfig(name=name, host=f"h-{name}", python="python3", workdir="/w", ips=given)
            for name, given in zip("ab", ips, strict=True)]))

    assert chosen_link(cluster((), ()), matrix, "a", "b") == best  # measured: the best shared subnet
    assert chosen_link(cluster((), ("192.168.0.2",)), matrix, "a", "b") == best
    configured = chosen_link(cluster(("10.0.0.1",), ("10.0.0.2",)), matrix, "a", "b")
    assert configured is not None
    assert (configured["local_ip"], configured["peer_ip"], configured["local_interface"]) == ("10.0.0.1", "10.0.0.2",
                                                                                             None)
