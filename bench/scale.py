"""Benchmark: what the head costs as the cluster grows, at 8, 32, 64 and 128 nodes.

Each size is a scale cluster of light nodes (tests/cluster/netns.py ``light_nodes``: a network
namespace, an OpenSSH server, a user and a workdir each, one shared Python) and a daemon in the head's
namespace, fresh for the size. Measured, one run each:

- daemon start to every agent up: on first contact (each node's agent bundle installed), and after a
  restart of the daemon (the bundle there already);
- ``coord status`` over the control socket, p50 and p99 of 200 asks (from this process: the CLI's own
  start is not the head's cost);
- coordd's CPU (share of one core) and RSS while idle with every node up, and while a job of every node
  trains (20 s each): once without checkpoints, once with a checkpoint a second;
- for each daemon start and for the submit, coordd's own CPU seconds and the whole machine's (every node
  is a namespace of this one machine: the rest is the nodes' sshds and agents, which on a real cluster
  run on their own machines at once);
- submit to the first step of a ``--launcher command`` job on every node (a socket program with its own
  all-reduce through rank 0, a checkpoint every 5 steps);
- one node's link cut: to the head's detection (the node not up in ``coord status``), and to the job's
  first step after the shrink to the others;
- ``coord stop`` to no rank left on any node (one pgrep of every node's user, this machine's process
  table being every node's), to ``coord stop``'s return, and the daemon's own time stopping the ranks;
  with ``--json``, the job's events during the shrink and the stop, timed from the cut and the stop;
- what the run added to the state database (its file once the daemon stopped), per step and per 10,000
  steps (the job's steps are its checkpoints every 5 and its metrics);
- last, with every link capped (``--rate-mbit``, 1000 by default): a 100 MiB tree (ten files of 10 MiB)
  and one large file (``--relay-mib``, 1 GiB by default) synced to every node, each beside the link
  limit (its bytes once over one link), with coordd's and the machine's CPU.

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


def machine_busy_s() -> float:
    """Core-seconds every CPU of this machine has been busy since boot (user, system, interrupts): the
    nodes' share of a window is the machine's less coordd's, every node being a namespace here."""
    with open("/proc/stat") as handle:
        fields = [int(v) for v in handle.readline().split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) / TICK  # less idle and iowait


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


def profiled(pid: int, seconds: float, out: Path | None) -> tuple[float, float]:
    """``share_of_a_core``, with py-spy sampling coordd meanwhile into ``out`` (raw stacks) when given."""
    if out is None:
        return share_of_a_core(pid, seconds)
    import subprocess

    spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--nonblocking", "-p", str(pid),
                            "-d", str(int(seconds)), "-r", "50", "-f", "raw", "-o", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return share_of_a_core(pid, seconds)
    finally:
        spy.wait(timeout=60)


def timed_sync(daemon, config: Path, source: Path) -> tuple[float, float, float]:
    """``coord sync --source`` to every node: (seconds, coordd's CPU seconds, the machine's busy core-seconds)."""
    from tests.integration.daemon_harness import coord

    pid, began, head, busy = daemon.proc.pid, time.monotonic(), cpu_seconds(daemon.proc.pid), machine_busy_s()
    done = coord("sync", "--json", "--config", str(config), "--source", str(source), env=daemon.env, timeout=3600)
    seconds = time.monotonic() - began
    report = json.loads(done.stdout or "{}")
    if report.get("status") != "ok":
        raise SystemExit(f"sync of {source} failed: {report.get('detail') or done.stderr}")
    return seconds, cpu_seconds(pid) - head, machine_busy_s() - busy


def transfers(cluster, daemon, config: Path, root: Path, count: int, rate_mbit: int, relay_mib: int) -> dict:
    """A 100 MiB tree (ten files of 10 MiB, each relayed) and one large file (``relay_mib``, less where
    the nodes' copies would not fit on this machine's one disk) synced to every node with every link
    capped at ``rate_mbit``, each beside the link limit: the time the head's own link needs for the
    bytes once (what a relay that passes every byte on from node to node can come near)."""
    from bench.broadcast import make_file  # random bytes, written once (its SHA256 is not needed here)

    row: dict = {}
    tree = root / f"tree{count}"
    for i in range(10):
        make_file(tree / f"part{i}.bin", 10 << 20)
    free = shutil.disk_usage(root).free
    size_mib = min(relay_mib, int(free / 2 / count) >> 20)
    big = root / f"big{count}"
    make_file(big / "model.bin", size_mib << 20)
    cluster.cap_links(f"{rate_mbit}mbit")
    try:
        seconds, head, machine = timed_sync(daemon, config, tree)
        limit = (100 << 20) * 8 / (rate_mbit * 1e6)
        row.update(tree_100mib_s=round(seconds, 2), tree_100mib_x_link_limit=round(seconds / limit, 2),
                   tree_100mib_coordd_cpu_s=round(head, 2), tree_100mib_machine_cpu_s=round(machine, 2))
        seconds, head, machine = timed_sync(daemon, config, big)
        limit = (size_mib << 20) * 8 / (rate_mbit * 1e6)
        row.update(relay_mib=size_mib, relay_s=round(seconds, 2), relay_x_link_limit=round(seconds / limit, 2),
                   relay_coordd_cpu_s=round(head, 2), relay_machine_cpu_s=round(machine, 2))
    finally:
        cluster.cap_links(None)
        shutil.rmtree(tree, ignore_errors=True)
        shutil.rmtree(big, ignore_errors=True)
    return row


def timed_stop(cluster, daemon, config: Path, name: str, leave_out: str) -> dict:
    """``coord stop`` to no rank left on any node but ``leave_out`` (cut off: its rank is stopped once it
    is back), read from this machine's process table with one pgrep for every node's user (the nodes
    share this machine's processes); and, apart, to ``coord stop``'s return (the job ``stopped``: its last
    checkpoints catalogued and completed too) and the daemon's own time for stopping every rank."""
    import subprocess

    from tests.cluster.jobs import events

    users = ",".join(n.user for n in cluster.nodes if n.name != leave_out)
    began = time.monotonic()
    command = subprocess.Popen([sys.executable, "-m", "coordinator.cli.main", "stop", "--config", str(config), name],
                               env=daemon.env, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    none_left = None
    while none_left is None or command.poll() is None:
        if none_left is None and not subprocess.run(["pgrep", "-u", users, "-f", "sockets.py"],
                                                    capture_output=True, text=True).stdout.strip():
            none_left = time.monotonic() - began
        if time.monotonic() - began > 600:
            command.kill()
            raise SystemExit("ranks still running, or coord stop not back, 600 s after the stop")
        time.sleep(0.1)
    returned = time.monotonic() - began
    if command.returncode != 0:
        raise SystemExit(f"coord stop failed: {command.stderr.read().decode(errors='replace')}")
    since = time.time() - returned
    story = [e for e in events(daemon, name) if e["ts"] >= since - 1]
    stopped = [e for e in story if e["kind"] == "job.stopped_ranks"]
    return {"stop_to_none_left_s": round(none_left, 2), "stop_command_s": round(returned, 2),
            "stop_daemon_stopping_ranks_s": stopped[-1]["data"].get("seconds") if stopped else None,
            "stop_events": [f"{e['ts'] - since:+.1f} s {e['kind']}: {e['message'][:160]}" for e in story]}


def measure(count: int, root: Path, suffix: str, profile: Path | None = None, rate_mbit: int = 1000,
            relay_mib: int = 1024) -> dict:
    from tests.cluster.jobs import events, job_of
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
            began, busy = time.monotonic(), machine_busy_s()
            daemon.start()
            daemon.wait_for(all_up, 600, f"all {count} agents up")
            daemon.up_s = round(time.monotonic() - began, 2)
            daemon.cpu_s = round(cpu_seconds(daemon.proc.pid), 2)
            daemon.machine_s = round(machine_busy_s() - busy, 2)
            return daemon

        daemon = start()
        row["up_first_contact_s"] = daemon.up_s
        row["up_first_contact_coordd_cpu_s"], row["up_first_contact_machine_cpu_s"] = daemon.cpu_s, daemon.machine_s
        daemon.stop()
        daemon = start()
        row["up_restart_s"] = daemon.up_s
        row["up_restart_coordd_cpu_s"], row["up_restart_machine_cpu_s"] = daemon.cpu_s, daemon.machine_s
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
            share, rss = profiled(pid, 20, profile and profile / f"idle-{count}.txt")
            row["idle_cpu_share"], row["idle_rss_mb"] = round(share, 4), round(rss, 1)

            def submit(name: str, *save: str) -> None:
                done = coord("run", "--config", str(config), "--name", name, "--source", str(project), "--launcher",
                             "command", *save, "--min-nodes", str(count - 1), "--node-timeout", "5",
                             "--total-steps", "1000000", "--hang-timeout", "600", "--detach", "--", "python",
                             "sockets.py", "--steps", "1000000", "--sleep", "0.2", env=daemon.env, timeout=300)
                if done.returncode != 0:
                    raise SystemExit(done.stderr)
                daemon.wait_for(lambda d: job_of(d, name)["state"] in ("failed", "stopped")
                                or (job_of(d, name)["state"] == "running" and job_of(d, name)["step"] >= 1), 900,
                                "the first step")
                job = job_of(daemon.status(events=0), name)
                if job["state"] != "running":
                    raise SystemExit(f"the job did not train: {job['error']}")

            # First without checkpoints (coord's default is one every 10 steps): what watching the ranks
            # costs, the checkpoints' share apart.
            submit("steady", "--save-every", "1000000")
            share, _ = profiled(pid, 20, profile and profile / f"steady-{count}.txt")
            row["training_no_checkpoints_cpu_share"] = round(share, 4)
            coord("stop", "--config", str(config), "steady", env=daemon.env, timeout=600)
            daemon.wait_for(lambda d: job_of(d, "steady")["state"] in ("stopped", "failed"), 600, "steady stopped")

            submitted, busy, head = time.monotonic(), machine_busy_s(), cpu_seconds(pid)
            submit("wide", "--save-every", "5")
            row["submit_to_first_step_s"] = round(time.monotonic() - submitted, 2)
            row["submit_coordd_cpu_s"] = round(cpu_seconds(pid) - head, 2)
            row["submit_machine_cpu_s"] = round(machine_busy_s() - busy, 2)
            share, rss = profiled(pid, 20, profile and profile / f"training-{count}.txt")
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
                # Where the shrink's time went (in --json only): the job's events since the cut, timed from it.
                since = time.time() - (time.monotonic() - cut_at)
                row["shrink_events"] = [f"{e['ts'] - since:+.1f} s {e['kind']}: {e['message'][:160]}"
                                        for e in events(daemon, "wide") if e["ts"] >= since - 1]
                steps = job_of(daemon.status(events=0), "wide")["step"]
                row.update(timed_stop(cluster, daemon, config, "wide", leave_out=cut))
            finally:
                cluster.restore_link(cut)
            row["steps"] = steps
            if relay_mib:  # last: the job's own sync would delete what they leave
                daemon.wait_for(all_up, 600, f"all {count} agents up again")
                row.update(transfers(cluster, daemon, config, root, count, rate_mbit, relay_mib))
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
           ("idle_rss_mb", "coordd RSS idle (MB)"),
           ("training_no_checkpoints_cpu_share", "coordd CPU training, no checkpoints"),
           ("training_cpu_share", "coordd CPU training, a checkpoint a second"),
           ("training_rss_mb", "coordd RSS training (MB)"), ("submit_to_first_step_s", "submit to first step (s)"),
           ("cut_detected_s", "cut to detection (s)"),
           ("cut_to_step_after_shrink_s", "cut to a step after the shrink (s)"),
           ("stop_to_none_left_s", "stop to no rank left (s)"), ("stop_command_s", "coord stop back (s)"),
           ("stop_daemon_stopping_ranks_s", "daemon stopping the ranks (s)"),
           ("db_kb_per_step", "state DB per step (KB)"), ("db_mb_per_10k_steps", "state DB per 10,000 steps (MB)"),
           ("tree_100mib_s", "100 MiB tree synced (s)"), ("tree_100mib_x_link_limit", "tree / link limit"),
           ("relay_mib", "large file (MiB)"), ("relay_s", "large file relayed (s)"),
           ("relay_x_link_limit", "large file / link limit")]


def main() -> None:
    from tests.integration.daemon_harness import short_tempdir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 64, 128], help="cluster sizes (at most 200)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--rate-mbit", type=int, default=1000,
                        help="every link's cap while the tree and the large file are synced (default 1000)")
    parser.add_argument("--relay-mib", type=int, default=1024,
                        help="the large file relayed to every node (default 1024; less where the nodes' copies "
                             "would not fit on this machine's disk: the row says what was sent); 0 skips both "
                             "transfers")
    parser.add_argument("--py-spy", type=Path, metavar="DIR",
                        help="sample coordd with py-spy (from this Python's environment) while idle and while "
                             "training, into DIR/idle-N.txt and DIR/training-N.txt (raw stacks; each sample "
                             "costs coordd a little, so read the CPU shares of such a run as upper bounds)")
    args = parser.parse_args()
    if args.py_spy and not (Path(sys.executable).parent / "py-spy").is_file():
        parser.error(f"--py-spy needs py-spy beside {sys.executable} (pip install py-spy into that environment)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stop cleans up as an end does
    root = short_tempdir("coord-bench-scale-")
    root.chmod(0o755)
    rows = []
    try:
        for count in args.nodes:
            if args.py_spy:
                args.py_spy.mkdir(parents=True, exist_ok=True)
            rows.append(measure(count, root, os.environ.get("COORD_NETNS_USER_SUFFIX", ""), args.py_spy,
                                args.rate_mbit, args.relay_mib))
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
