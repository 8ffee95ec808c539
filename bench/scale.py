"""Benchmark: what the head costs as the cluster grows, at 8, 32, 64 and 128 nodes.

Each size is a scale cluster of light nodes (tests/cluster/netns.py ``light_nodes``: a network
namespace, an OpenSSH server, a user and a workdir each, one shared Python) and a daemon in the head's
namespace, fresh for the size. Measured, one run each:

- daemon start to every agent up: on first contact (each node's agent bundle installed), and after a
  restart of the daemon (the bundle there already);
- ``coord status`` over the control socket, p50 and p99 of 200 asks (from this process: the CLI's own
  start is not the head's cost);
- coordd's CPU (share of one core) and RSS while idle with every node up, and while a job of every node
  trains and checkpoints (20 s each);
- submit to the first step of a ``--launcher command`` job on every node (a socket program with its own
  all-reduce through rank 0, a checkpoint every 5 steps);
- one node's link cut: to the head's detection (the node not up in ``coord status``), and to the job's
  first step after the shrink to the others;
- ``coord stop`` to no rank left on any node;
- what the run added to the state database (its file once the daemon stopped), per step and per 10,000
  steps (the job's steps are its checkpoints every 5 and its metrics).

The cluster file is the test cluster's with the default ``keepalive_s`` (2 s), as a user's is.

Goals at 128 nodes (issue): every agent up in 20 s on first contact and 5 s on a restart, status p99 at
most 50 ms, detection within 10 s, submit to running within 10 s, coordd at most 2% of a core idle and
10% training, RSS at most 300 MB. Root on Linux.

    sudo python bench/scale.py [--nodes 8 32 64 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def share_of_a_core(pid: int, seconds: float) -> tuple[float, float]:
    """(coordd's CPU as a share of one core over ``seconds``, its RSS in MB at the end)."""
    before, started = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.monotonic() - started), rss_mb(pid)


def measure(count: int, root: Path, suffix: str) -> dict:
    from tests.cluster.jobs import job_of
    from tests.cluster.netns import NetnsCluster, light_nodes
    from tests.command_jobs import SOCKETS
    from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment

    row: dict = {"nodes": count}
    built = time.monotonic()
    with NetnsCluster(light_nodes(count, suffix)) as cluster:
        row["cluster_build_s"] = round(time.monotonic() - built, 1)
        project = root / f"project{count}"
        project.mkdir(mode=0o755)
        (project / "sockets.py").write_text(SOCKETS)
        (project / "sockets.py").chmod(0o644)
        config = cluster.write_cluster_toml(root / f"cluster{count}.toml", state_dir=root / f"state{count}")
        # The watch of each node at a user's default (keepalive_s 2), not the tests' quicker 1 s.
        config.write_text(config.read_text().replace("keepalive_s = 1\n", ""))
        env = environment()

        def start() -> DaemonProcess:
            daemon = DaemonProcess(config, env=env, prefix=["ip", "netns", "exec", cluster.head_ns],
                                   python=sys.executable)
            began = time.monotonic()
            daemon.start()
            daemon.wait_for(all_up, 600, f"all {count} agents up")
            daemon.up_s = round(time.monotonic() - began, 2)
            return daemon

        daemon = start()
        row["up_first_contact_s"] = daemon.up_s
        daemon.stop()
        daemon = start()
        row["up_restart_s"] = daemon.up_s
        try:
            pid = daemon.proc.pid
            asks = []
            for _ in range(200):
                began = time.perf_counter()
                daemon.status(events=10)
                asks.append((time.perf_counter() - began) * 1000)
            asks.sort()
            row["status_p50_ms"] = round(statistics.median(asks), 1)
            row["status_p99_ms"] = round(asks[int(len(asks) * 0.99) - 1], 1)
            time.sleep(5)  # the status asks' own work done
            database = root / f"state{count}" / "coord.db"
            empty_db = database.stat().st_size
            share, rss = share_of_a_core(pid, 20)
            row["idle_cpu_share"], row["idle_rss_mb"] = round(share, 4), round(rss, 1)

            submitted = time.monotonic()
            done = coord("run", "--config", str(config), "--name", "wide", "--source", str(project), "--launcher",
                         "command", "--save-every", "5", "--min-nodes", str(count - 1), "--node-timeout", "5",
                         "--total-steps", "1000000", "--hang-timeout", "600", "--detach", "--", "python",
                         "sockets.py", "--steps", "1000000", "--sleep", "0.2", env=daemon.env, timeout=300)
            if done.returncode != 0:
                raise SystemExit(done.stderr)
            daemon.wait_for(lambda d: job_of(d, "wide")["state"] in ("failed", "stopped")
                            or (job_of(d, "wide")["state"] == "running" and job_of(d, "wide")["step"] >= 1), 900,
                            "the first step")
            job = job_of(daemon.status(events=0), "wide")
            if job["state"] != "running":
                raise SystemExit(f"the job did not train: {job['error']}")
            row["submit_to_first_step_s"] = round(time.monotonic() - submitted, 2)
            share, rss = share_of_a_core(pid, 20)
            row["training_cpu_share"], row["training_rss_mb"] = round(share, 4), round(rss, 1)

            cut = cluster.nodes[-1].name
            cluster.cut_link(cut)
            cut_at = time.monotonic()
            try:
                daemon.wait_for(lambda d: next(n for n in d["nodes"] if n["name"] == cut)["state"] != "up", 300,
                                f"{cut} seen gone")
                row["cut_detected_s"] = round(time.monotonic() - cut_at, 2)
                doc = daemon.wait_for(lambda d: job_of(d, "wide")["state"] == "running"
                                      and len(job_of(d, "wide")["nodes"]) == count - 1
                                      and job_of(d, "wide")["attempt"] >= 1, 900, "the job shrunk")
                first = job_of(doc, "wide")["step"]
                daemon.wait_for(lambda d: job_of(d, "wide")["step"] > first, 900, "a step after the shrink")
                row["cut_to_step_after_shrink_s"] = round(time.monotonic() - cut_at, 2)
                steps = job_of(daemon.status(events=0), "wide")["step"]
                stopped = time.monotonic()
                coord("stop", "--config", str(config), "wide", env=daemon.env, timeout=600)
                while any(cluster.exec_in(n.name, ["pgrep", "-u", n.user, "-f", "sockets.py"]).stdout.strip()
                          for n in cluster.nodes if n.name != cut):
                    if time.monotonic() - stopped > 600:
                        raise SystemExit("ranks still running 600 s after the stop")
                    time.sleep(0.2)
                row["stop_to_none_left_s"] = round(time.monotonic() - stopped, 2)
            finally:
                cluster.restore_link(cut)
            row["steps"] = steps
        finally:
            daemon.stop()
            for node in cluster.nodes:
                cluster.exec_in(node.name, ["pkill", "-KILL", "-u", node.user, "-f", "sockets.py"])
        # Its write-ahead log folded into it once the daemon stopped: what the run added, per step.
        grown = database.stat().st_size - empty_db
        row["db_kb_per_step"] = round(grown / 1024 / max(steps, 1), 2)
        row["db_mb_per_10k_steps"] = round(grown / 2**20 / max(steps, 1) * 10_000, 1)
    return row


COLUMNS = [("nodes", "nodes"), ("up_first_contact_s", "agents up, first contact (s)"),
           ("up_restart_s", "agents up, restart (s)"), ("status_p50_ms", "status p50 (ms)"),
           ("status_p99_ms", "status p99 (ms)"), ("idle_cpu_share", "coordd CPU idle"),
           ("idle_rss_mb", "coordd RSS idle (MB)"), ("training_cpu_share", "coordd CPU training"),
           ("training_rss_mb", "coordd RSS training (MB)"), ("submit_to_first_step_s", "submit to first step (s)"),
           ("cut_detected_s", "cut to detection (s)"),
           ("cut_to_step_after_shrink_s", "cut to a step after the shrink (s)"),
           ("stop_to_none_left_s", "stop to no rank left (s)"),
           ("db_kb_per_step", "state DB per step (KB)"), ("db_mb_per_10k_steps", "state DB per 10,000 steps (MB)")]


def main() -> None:
    from tests.integration.daemon_harness import short_tempdir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 64, 128], help="cluster sizes (at most 200)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stop cleans up as an end does
    root = short_tempdir("coord-bench-scale-")
    root.chmod(0o755)
    rows = []
    try:
        for count in args.nodes:
            rows.append(measure(count, root, os.environ.get("COORD_NETNS_USER_SUFFIX", "")))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps({"cores": os.cpu_count(), "rows": rows}, indent=1))
        return
    print(f"\nThe head's cost by cluster size ({os.cpu_count()} cores, one machine: every node a namespace)\n")
    print("| " + " | ".join(label for _, label in COLUMNS) + " |")
    print("|" + "---:|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(str(row.get(key, "-")) for key, _ in COLUMNS) + " |")


if __name__ == "__main__":
    main()
