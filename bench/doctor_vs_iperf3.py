"""Benchmark: `coord doctor`'s throughput beside iperf3's, on the same link.

Runs on the multi-host test cluster (network namespaces, one sshd, user and venv per node; needs root
on Linux and iperf3: ``apt-get install -y iperf3``), two nodes joined by the cluster's second, fast
network (``thunderbolt0``, tests/cluster/netns.py). The one link between them is capped with tc htb at
each rate in turn (100 Mbit/s, 1 Gbit/s, then uncapped: a veth pair, as fast as this machine's CPUs
move bytes), and on each: `coord doctor --json` (the whole CLI, through the daemon and both agents,
``--bytes`` each way) and iperf3 between the same two addresses, each way (``-R`` for the reverse), for
``--iperf-seconds``. Rounds alternate which tool goes first; the median of the rounds is reported.

    sudo python bench/doctor_vs_iperf3.py [--rounds 3] [--bytes 67108864] [--iperf-seconds 5]
                                          [--rates 100mbit,1gbit,uncapped]

COORD_NETNS_USER_SUFFIX gives the cluster's users a suffix, so the bench runs beside another
checkout's test cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cluster.netns import DEFAULT_NODES, NetnsCluster  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir  # noqa: E402


def nodes() -> tuple:
    suffix = os.environ.get("COORD_NETNS_USER_SUFFIX", "")
    picked = DEFAULT_NODES[:2]
    if suffix:
        picked = tuple(dataclasses.replace(n, user=n.user + suffix, home=n.home + suffix,
                                           venv=n.venv.replace(n.home, n.home + suffix)) for n in picked)
    return picked


def doctor_figures(daemon: DaemonProcess, size: int) -> tuple[float, float, float]:
    done = coord("doctor", "--config", str(daemon.config), "--json", "--bytes", str(size), "--seconds", "60",
                 env=daemon.env, timeout=180)
    link = json.loads(done.stdout)["links"][0]
    assert link["interface"] == NetnsCluster.FAST_INTERFACE, link
    return link["bits_per_second"], link["reverse_bits_per_second"], link["seconds"]


def iperf_figures(cluster: NetnsCluster, seconds: int) -> tuple[float, float]:
    """iperf3 from a to b, then b to a (-R), between the two fast addresses; one server per test (-1)."""
    a, b = (n.name for n in cluster.nodes)
    rates = []
    for reverse in (False, True):
        server = cluster.popen_in(b, ["iperf3", "-s", "-B", cluster.fast_ip(b), "-1"], stdout=subprocess.DEVNULL)
        try:
            time.sleep(0.5)
            done = cluster.exec_in(a, ["iperf3", "-c", cluster.fast_ip(b), "-B", cluster.fast_ip(a), "-t",
                                       str(seconds), "-J", *(["-R"] if reverse else [])], timeout=seconds + 30)
            rates.append(json.loads(done.stdout)["end"]["sum_received"]["bits_per_second"])
        finally:
            server.kill()
            server.wait(5)
    return rates[0], rates[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bytes", type=int, default=64 * 2**20)
    parser.add_argument("--iperf-seconds", type=int, default=5)
    parser.add_argument("--rates", default="100mbit,1gbit,uncapped", help="the caps to measure at, in tc's words")
    args = parser.parse_args()
    rates = [None if rate == "uncapped" else rate for rate in args.rates.split(",")]
    if shutil.which("iperf3") is None:
        sys.exit("iperf3 is not installed: apt-get install -y iperf3")
    rows = []
    with NetnsCluster(nodes()) as cluster:
        cluster.add_fast_network()
        root = short_tempdir()
        root.chmod(0o755)
        config = cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state")
        daemon = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", cluster.head_ns]).start()
        try:
            daemon.wait_for(all_up, 60, "all nodes up")
            a, b = (n.name for n in cluster.nodes)
            for rate in rates:
                cluster.cap_fast_pair(a, b, rate)
                doctor, iperf, took = [], [], []
                for round_ in range(args.rounds):
                    order = ("doctor", "iperf") if round_ % 2 == 0 else ("iperf", "doctor")
                    for tool in order:
                        if tool == "doctor":
                            up, down, seconds = doctor_figures(daemon, args.bytes)
                            doctor.append((up, down))
                            took.append(seconds)
                        else:
                            iperf.append(iperf_figures(cluster, args.iperf_seconds))
                cluster.cap_fast_pair(a, b, None)
                rows.append((rate or "uncapped", doctor, iperf, took))
        finally:
            daemon.stop()
            shutil.rmtree(root, ignore_errors=True)
    print("| link cap | doctor → (Mbit/s) | iperf3 → (Mbit/s) | doctor/iperf3 → | doctor ← (Mbit/s) | "
          "iperf3 ← (Mbit/s) | doctor/iperf3 ← | doctor's time for the link (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for rate, doctor, iperf, took in rows:
        d_up, d_down = (statistics.median(x[i] for x in doctor) / 1e6 for i in (0, 1))
        i_up, i_down = (statistics.median(x[i] for x in iperf) / 1e6 for i in (0, 1))
        print(f"| {rate} | {d_up:,.0f} | {i_up:,.0f} | {d_up / i_up:.2f} | {d_down:,.0f} | {i_down:,.0f} | "
              f"{d_down / i_down:.2f} | {statistics.median(took):.1f} |")
    print(f"\n{args.rounds} rounds, medians; doctor --bytes {args.bytes}, iperf3 -t {args.iperf_seconds}")


if __name__ == "__main__":
    main()
