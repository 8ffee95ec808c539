"""What ``coord doctor``'s measurement of a link means: ok, slow, down or wrong-route, with the likely
cause and the fix; and whether the RDMA devices a saved hostfile names are still there.

Pure functions over plain data (the measuring is coordinator/readiness/link_probe.py), so every rule
is tested without a network.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, TypedDict

Verdict = Literal["ok", "slow", "down", "wrong-route"]
VERDICTS: tuple[Verdict, ...] = ("ok", "slow", "down", "wrong-route")

#: A link below this fraction of its baseline, either way, is slow.
BASELINE_FRACTION = 0.5
#: What TCP over a Thunderbolt bridge should carry at least, by Thunderbolt generation: half of
#: 40 Gbit/s on Thunderbolt 5 and of 20 Gbit/s on Thunderbolt 4 ("well under" what the cable gives).
THUNDERBOLT_FLOOR_BPS = {5: 20e9, 4: 10e9}


class LinkFigures(TypedDict):
    """What was measured of one link, from node ``a`` (the connector) to node ``b`` (the listener)."""

    a: str
    b: str
    interface: str | None  # a's interface coord chose (the hostfile's address is on it)
    peer_interface: str | None  # b's
    kind: str | None  # thunderbolt, ethernet, wifi, other
    address: str | None  # a's address on the link
    peer_address: str | None  # b's
    connected: bool
    complete: bool  # every byte asked for went each way within the time
    bits_per_second: float | None  # a to b
    reverse_bits_per_second: float | None  # b to a
    latency_ms: float | None
    route_interface: str | None  # the interface a's kernel sends to b's address by
    peer_route_interface: str | None  # the one b's kernel sends to a's address by
    mtu: int | None  # of a's interface
    peer_mtu: int | None
    speed_bps: float | None  # the interface's nominal speed, where the node says it
    generation: int | None  # Thunderbolt 5 or 4 where a cable joins the pair
    cabled: bool  # a direct Thunderbolt cable joins the pair
    interfaces_down: list[str]  # the baseline's interfaces now down or gone, said as "tb0 on n2 is down"
    detail: str  # the probe's own words


class Baseline(TypedDict):
    """A link's reference figures: its first healthy measurement, or what --set-baseline kept."""

    interface: str | None
    peer_interface: str | None
    kind: str | None
    bits_per_second: float | None
    reverse_bits_per_second: float | None
    latency_ms: float | None
    speed_bps: float | None
    measured_at: float


class Judgement(TypedDict):
    verdict: Verdict
    cause: str
    fix: str


def judge_link(figures: LinkFigures, baseline: Baseline | None, *,
               fraction: float = BASELINE_FRACTION, speed: bool = True) -> Judgement:
    """The verdict on one link: down, wrong-route, slow or ok, the first that holds in that order.
    ``speed=False`` (pre-flight's short burst, too short to judge a rate by): down or wrong-route, else ok."""
    found = _down(figures, baseline) or _wrong_route(figures)
    if found is None and speed:
        found = _slow_against_baseline(figures, baseline, fraction) or _slow_for_its_kind(figures)
    return found or _ok(figures, baseline)


def baseline_from(figures: LinkFigures, measured_at: float) -> Baseline:
    return {"interface": figures["interface"], "peer_interface": figures["peer_interface"], "kind": figures["kind"],
            "bits_per_second": figures["bits_per_second"],
            "reverse_bits_per_second": figures["reverse_bits_per_second"], "latency_ms": figures["latency_ms"],
            "speed_bps": figures["speed_bps"], "measured_at": measured_at}


def keeps_as_first_baseline(figures: LinkFigures, judgement: Judgement) -> bool:
    """A link's first healthy measurement becomes its baseline: connected, every byte each way, ok."""
    return judgement["verdict"] == "ok" and figures["connected"] and figures["complete"] \
        and figures["bits_per_second"] is not None and figures["reverse_bits_per_second"] is not None


def blocks_launch(judgement: Judgement) -> bool:
    """Pre-flight blocks a launch only on a dead or wrong link; a slow one is said, not blocked."""
    return judgement["verdict"] in ("down", "wrong-route")


def _link_name(figures: LinkFigures) -> str:
    return f"{figures['a']} ↔ {figures['b']}"


def _over(figures: LinkFigures) -> str:
    where = figures["interface"] or "the chosen interface"
    return f"{where} ({figures['kind']})" if figures["kind"] else where


def _down(figures: LinkFigures, baseline: Baseline | None) -> Judgement | None:
    if figures["interfaces_down"] and baseline is not None:
        gone = "; ".join(figures["interfaces_down"])
        now = (f"the launch will go over {_over(figures)} instead"
               + (f", measured at {bps_text(_slowest(figures))}" if figures["connected"] and _slowest(figures) else "")
               if figures["interface"] else "no other link joins them: the launch cannot reach this pair")
        return {"verdict": "down",
                "cause": f"{_link_name(figures)}: its baseline link ({baseline['interface']}, {baseline['kind']}) is "
                         f"down: {gone}; {now}",
                "fix": f"bring it back (the cable, then `ip link set IF up` on Linux or the network settings on macOS) "
                       f"and run `coord doctor` again; to launch over {figures['interface'] or 'what is left'} "
                       "anyway, `coord run --force`, or make it the baseline with `coord doctor --set-baseline`"}
    if figures["connected"]:
        return None
    if figures["interface"] is None and not figures["peer_address"]:
        return {"verdict": "down",
                "cause": f"{figures['a']} and {figures['b']} share no network coord could measure "
                         f"({figures['detail']})",
                "fix": "give both nodes an address on one subnet (a Thunderbolt bridge or the LAN), then "
                       "`coord doctor` again"}
    return {"verdict": "down",
            "cause": f"{figures['b']} is unreachable from {figures['a']} over {_over(figures)}, "
                     f"{figures['address'] or 'its address'} → {figures['peer_address']}: {figures['detail']}",
            "fix": f"check the cable and that {figures['interface']} on {figures['a']} and "
                   f"{figures['peer_interface'] or 'its peer'} on {figures['b']} are up with their addresses "
                   "(`ip addr` on Linux, `ifconfig` on macOS), and that no firewall drops the traffic"}


def _wrong_route(figures: LinkFigures) -> Judgement | None:
    for node, chosen, taken, peer, address in (
        (figures["a"], figures["interface"], figures["route_interface"], figures["b"], figures["peer_address"]),
        (figures["b"], figures["peer_interface"], figures["peer_route_interface"], figures["a"], figures["address"]),
    ):
        if chosen and taken and chosen != taken:
            return {"verdict": "wrong-route",
                    "cause": f"{node}'s traffic for {peer} ({address}) leaves by {taken}, not by {chosen}, the "
                             f"interface coord chose: the job's bytes would take the other network",
                    "fix": f"on {node}, give {chosen}'s link a subnet of its own (two interfaces on one subnet "
                           f"let the kernel pick either), or remove the overlapping address from {taken}; "
                           f"`ip route get {address}` (Linux) or `route -n get {address}` (macOS) shows the route"}
    if figures["cabled"] and figures["kind"] not in (None, "thunderbolt"):
        return {"verdict": "wrong-route",
                "cause": f"{figures['a']} and {figures['b']} are joined by a Thunderbolt cable, but their traffic "
                         f"goes over {_over(figures)}: the Thunderbolt interfaces share no subnet",
                "fix": "turn the Thunderbolt Bridge on at both ends with addresses on one subnet (System Settings → "
                       "Network → Thunderbolt Bridge), then `coord doctor` again"}
    return None


def _slow_against_baseline(figures: LinkFigures, baseline: Baseline | None, fraction: float) -> Judgement | None:
    if baseline is None:
        return None
    slow = []
    for label, now, then in (
        (f"{figures['a']} → {figures['b']}", figures["bits_per_second"], baseline["bits_per_second"]),
        (f"{figures['b']} → {figures['a']}", figures["reverse_bits_per_second"], baseline["reverse_bits_per_second"]),
    ):
        if now is not None and then and now < fraction * then:
            slow.append(f"{label} {bps_text(now)}, {now / then:.0%} of its baseline {bps_text(then)}")
    if not slow:
        return None
    return {"verdict": "slow", "cause": f"{_link_name(figures)} over {_over(figures)}: " + "; ".join(slow)
            + f"; likely {_slow_cause(figures, baseline)}",
            "fix": _slow_fix(figures, baseline)}


def _slow_cause(figures: LinkFigures, baseline: Baseline | None) -> str:
    if figures["mtu"] and figures["peer_mtu"] and figures["mtu"] != figures["peer_mtu"]:
        return (f"an MTU mismatch ({figures['interface']} on {figures['a']} has {figures['mtu']}, "
                f"{figures['peer_interface']} on {figures['b']} has {figures['peer_mtu']})")
    if baseline and baseline["speed_bps"] and figures["speed_bps"] and figures["speed_bps"] < baseline["speed_bps"]:
        return (f"the link renegotiated lower: {bps_text(figures['speed_bps'])} now, "
                f"{bps_text(baseline['speed_bps'])} at its baseline (a cable or port fault, or a slower cable)")
    if baseline and (baseline["interface"], baseline["peer_interface"]) != (figures["interface"],
                                                                           figures["peer_interface"]):
        return (f"device names changed since the baseline ({baseline['interface']}/{baseline['peer_interface']} "
                f"then, {figures['interface']}/{figures['peer_interface']} now): another port or network")
    return "another transfer sharing the link, a rate cap, or a cable or port fault"


def _slow_fix(figures: LinkFigures, baseline: Baseline | None) -> str:
    if figures["mtu"] and figures["peer_mtu"] and figures["mtu"] != figures["peer_mtu"]:
        mtu = max(figures["mtu"], figures["peer_mtu"])
        return (f"set one MTU at both ends (`ip link set {figures['interface']} mtu {mtu}` on Linux, "
                f"`networksetup -setMTU` on macOS), then `coord doctor` again")
    return ("look for another transfer on the link (`coord status`, a sync, a backup), reseat or swap the cable, "
            "then `coord doctor` again; once the slower figure is right for this link, `coord doctor --set-baseline`")


def _slow_for_its_kind(figures: LinkFigures) -> Judgement | None:
    floor = THUNDERBOLT_FLOOR_BPS.get(figures["generation"] or 0) if figures["kind"] == "thunderbolt" else None
    slowest = _slowest(figures)
    if floor is None or slowest is None or slowest >= floor:
        return None
    return {"verdict": "slow",
            "cause": f"{_link_name(figures)} over Thunderbolt {figures['generation']} carries "
                     f"{bps_text(slowest)}, well under what its kind should give ({bps_text(2 * floor)}); likely "
                     + ("an MTU mismatch" if figures["mtu"] != figures["peer_mtu"]
                        else "a port of a lower generation at one end, a slower cable, or a hub between"),
            "fix": "plug the cable straight into a Thunderbolt 5 port at both ends (System Information → "
                   "Thunderbolt/USB4 names each port's speed), use a Thunderbolt 5 cable, then `coord doctor`"}


def _ok(figures: LinkFigures, baseline: Baseline | None) -> Judgement:
    notes = []
    if figures["mtu"] and figures["peer_mtu"] and figures["mtu"] != figures["peer_mtu"]:
        notes.append(f"the MTU differs ({figures['mtu']} on {figures['a']}, {figures['peer_mtu']} on "
                     f"{figures['b']}): large frames may be dropped")
    if baseline and (baseline["interface"], baseline["peer_interface"]) != (figures["interface"],
                                                                           figures["peer_interface"]):
        notes.append(f"device names changed since the baseline ({baseline['interface']}/"
                     f"{baseline['peer_interface']} then, {figures['interface']}/{figures['peer_interface']} now)")
    if not figures["complete"]:
        notes.append(f"measured within the time limit, on fewer bytes than asked ({figures['detail']})")
    return {"verdict": "ok", "cause": "; ".join(notes),
            "fix": "`coord doctor --set-baseline` once this is how the link should be" if notes else ""}


def _slowest(figures: LinkFigures) -> float | None:
    rates = [r for r in (figures["bits_per_second"], figures["reverse_bits_per_second"]) if r is not None]
    return min(rates) if rates else None


def bps_text(bps: float | None) -> str:
    if bps is None:
        return "unknown"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.0f} bit/s"


# --- RDMA ------------------------------------------------------------------------------------------


class RdmaProblem(TypedDict):
    node: str
    device: str
    cause: str
    fix: str


def rdma_problems(named: Mapping[str, list[str]], present: Mapping[str, list[str] | None],
                  source: str) -> list[RdmaProblem]:
    """The RDMA devices ``source`` (a saved hostfile, MLX_IBV_DEVICES) names for each node that the
    node does not have now (``present``: what ibv_devices lists there now; None: could not be read)."""
    problems: list[RdmaProblem] = []
    for node, devices in sorted(named.items()):
        have = present.get(node)
        if have is None:
            continue  # unknown is not missing: the topology's own detail says why
        for device in dict.fromkeys(devices):
            if device not in have:
                problems.append({
                    "node": node, "device": device,
                    "cause": f"{source} names {device} on {node}, which {node} no longer has (it has "
                             f"{', '.join(have) or 'no RDMA device'}): the device names changed, as they do "
                             "after a reboot or a cable moved to another port",
                    "fix": "write the matrix again from what the nodes have now: `coord hostfile` (or drop "
                           "MLX_IBV_DEVICES and let coord choose the devices)"})
    return problems
