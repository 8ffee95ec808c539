"""Benchmark: `coord drill` on the multi-host test cluster, at 2 and 3 nodes.

The drill's own report, as a user would read it on their cluster: for a SIGKILLed rank and a
SIGSTOPped one, the time to detection, to the first step trained again and the steps done
twice, beside the step time and the cold launch; and the drill's own wall time, which is what it
costs a user's nodes. Root on Linux (network namespaces).

    sudo python bench/drill_cluster.py [--nodes 2 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    from tests.cluster.jobs import daemon_on_first
    from tests.cluster.netns import NetnsCluster
    from tests.integration.daemon_harness import coord, short_tempdir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 3], choices=[2, 3], help="cluster sizes")
    args = parser.parse_args()
    root = short_tempdir("coord-bench-drill-")
    rows = []
    with NetnsCluster() as cluster:
        for count in args.nodes:
            with daemon_on_first(cluster, root, count) as (config, daemon):
                started = time.monotonic()
                done = coord("drill", "--config", str(config), "--json", env=daemon.env, timeout=1200)
                wall = time.monotonic() - started
                report = json.loads(done.stdout)
                print(json.dumps(report), file=sys.stderr, flush=True)
                rows.append((count, wall, report))
    print(f"\n`coord drill` on the multi-host test cluster, {os.cpu_count()} cores\n")
    print("| nodes | fault | detected after (s) | first step again after (s) | steps lost | step time (s) | "
          "cold launch (s) | drill wall time (s) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for count, wall, report in rows:
        for fault in report.get("faults", []):
            print(f"| {count} | {fault['signal']} | {fault['detected_seconds']} | {fault['resumed_seconds']} | "
                  f"{fault['steps_lost']} | {report['step_seconds']} | {report['cold_launch_seconds']} | {wall:.1f} |")
        if report.get("status") != "ok":
            print(f"| {count} | failed: {report.get('detail')} | | | | | | {wall:.1f} |")


if __name__ == "__main__":
    main()
