"""Why a straggler is slow, from what its node's agent sampled (``agent/rank_signals.py``). Pure.

The causes, in the order they are tried (the first that holds is the cause; the rank's CPU against
the wall clock is said with every one):

1. **CPU throttled by a quota**: the rank's cgroup (or one above it) has a CPU quota and was held
   by it for at least ``THROTTLED_SHARE`` of the sample, or the rank used nearly all of it.
2. **CPU throttled by heat**: a Mac's ``pmset -g therm`` CPU_Speed_Limit under 100.
3. **Swapping or memory pressure**: pages swapped in at ``SWAPINS_PER_S`` or more a second, or
   Linux's memory pressure (some avg10) at ``PRESSURE_PERCENT`` or more.
4. **Another process taking the CPU**: a process that is not the rank's used ``BUSY_CORES`` of a
   core or more, on a node whose CPUs were short (the rank got under ``STARVED`` of a core per
   process, or the busy ones together came near the node's CPU count): named by pid, user and
   command, with the others close behind it.
5. **Its link below baseline**: what ``coord doctor`` last found wrong with the node's links (slow
   against its baseline or its kind, down, or a wrong route: ``link_findings``).

When none holds, the cause says so, with the rank's CPU and the GPU's utilisation, so that a person
can look where coord cannot (a slower machine, a GPU of another kind, a data set on a slow disk)."""

from __future__ import annotations

from collections.abc import Mapping

from shared.agent_api.ranks import BusyProcess, RankSignalsReply

THROTTLED_SHARE = 0.10
QUOTA_USED = 0.9  # the rank used this share of its quota or more: the quota is what holds it
SWAPINS_PER_S = 100.0
PRESSURE_PERCENT = 10.0
BUSY_CORES = 0.1  # a tenth of a core: a VM's stolen time can leave a hog little more than a rank it starves
STARVED = 0.7
NAMED = 3  # how many busy processes a cause names


LINK_FINDINGS = ("down", "wrong-route", "slow")


def link_findings(last: Mapping[tuple[str, str], Mapping[str, object]], node: str) -> list[str]:
    """What ``coord doctor``'s last figures (link (a, b) -> its report) say is wrong with ``node``'s links."""
    found = []
    for (a, b), link in sorted(last.items()):
        verdict = link.get("verdict")
        if node in (a, b) and verdict in LINK_FINDINGS:
            found.append(f"its link {a} - {b} was {verdict} when coord doctor last measured it"
                         + (f" ({link['cause']})" if link.get("cause") else ""))
    return found


def straggler_cause(signals: RankSignalsReply | None, *, link_cause: str | None = None) -> str:
    """One line: the likely cause first, then what else was seen."""
    if signals is None:
        return link_cause or "not known: its node could not be asked"
    cpu = _cpu_said(signals)
    for found in (_quota(signals), _thermal(signals), _memory(signals), _busy(signals), link_cause):
        if found:
            return f"{found}; {cpu}"
    gpu = signals["gpu_utilization"]
    return (f"no cause seen on its node: {cpu}" + (f", GPU {gpu:.0f}% busy" if gpu is not None else "")
            + "; a slower machine or GPU, or its data on a slow disk, would look like this")


def cause_kind(signals: RankSignalsReply | None, *, link_cause: str | None = None) -> str:
    """A word for the cause, for alerts and metrics: quota, thermal, memory, process, link or unknown."""
    if signals is None:
        return "link" if link_cause else "unknown"
    for kind, found in (("quota", _quota(signals)), ("thermal", _thermal(signals)), ("memory", _memory(signals)),
                        ("process", _busy(signals)), ("link", link_cause)):
        if found:
            return kind
    return "unknown"


def _cpu_said(signals: RankSignalsReply) -> str:
    used = signals["rank_cpu"]
    if used is None:
        return "its CPU time could not be read"
    return f"the rank used {used:.2f} CPU over {signals['seconds']:.1f} s of wall time"


def _quota(signals: RankSignalsReply) -> str | None:
    quota = signals["quota"]
    if quota is None or quota["cores"] is None:
        return None
    held, used = quota["throttled_share"], signals["rank_cpu"]
    if (held is not None and held >= THROTTLED_SHARE) or (used is not None and used >= QUOTA_USED * quota["cores"]):
        share = f", held {held:.0%} of the time" if held is not None else ""
        return (f"CPU throttled by a quota: {quota['source']} allows {quota['cores']:.2f} CPU "
                f"({quota['group']}){share}")
    return None


def _thermal(signals: RankSignalsReply) -> str | None:
    limit = signals["speed_limit"]
    if limit is not None and limit < 100:
        return f"CPU throttled by heat: pmset -g therm CPU_Speed_Limit {limit}%"
    return None


def _memory(signals: RankSignalsReply) -> str | None:
    swap, pressure = signals["swapins_per_s"], signals["memory_pressure"]
    if swap is not None and swap >= SWAPINS_PER_S:
        return f"swapping: {swap:.0f} pages swapped in a second"
    if pressure is not None and pressure >= PRESSURE_PERCENT:
        return f"memory pressure: tasks waited for memory {pressure:.0f}% of the last 10 s"
    return None


def _busy(signals: RankSignalsReply) -> str | None:
    busy = [p for p in signals["others"] if p["cpu"] >= BUSY_CORES]
    if not busy:
        return None
    used, pids = signals["rank_cpu"], max(1, len(signals["rank_pids"]))
    crowded = sum(p["cpu"] for p in signals["others"]) + (used or 0.0) >= 0.8 * signals["cores"]
    if not crowded and used is not None and used / pids >= STARVED:
        return None  # the rank had its CPU: the busy ones did not hold it back
    named = "; ".join(_process(p) for p in busy[:NAMED])
    return f"another process takes the CPU: {named}"


def _process(process: BusyProcess) -> str:
    return f"pid {process['pid']} ({process['user']}: {process['command']}) {process['cpu']:.2f} CPU"
