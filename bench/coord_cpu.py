"""Benchmark: what coord itself costs the ranks, per node, while a job trains.

On the multi-host test cluster (network namespaces, one sshd, user and venv per node; root on
Linux), a full fine-tune of the demo's tiny llama runs under coord on 2 and on 3 nodes. In the
middle of training, over a window of ``--window`` seconds, the CPU time (user + system, from
``/proc/PID/stat``) of every process is read twice and charged to:

- on each node: coord's agent, the rank runner in front of each rank, and the sshd session that
  carries the agent's connection (all run as that node's user, or as its sshd);
- on the head: coordd, and the launcher (coord's mlx.launch and the ssh processes it starts),
  whose cost is shared out over the nodes ("the node's share");
- the ranks themselves, for scale.

Each figure is a percentage of one core. The goal: coord's own cost at most 1% of a core per node.

    sudo python bench/coord_cpu.py [--nodes 2 3] [--window 20] [--save-every 100]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.launch_recovery import TRAIN, wait_event  # noqa: E402
from coordinator.cli.tinymodel import write_project  # noqa: E402
from tests.cluster.netns import NetnsCluster  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
ITERS = 4000  # long enough that the window sits in the middle of training


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    uid: int
    cmdline: str
    cpu_s: float


def processes() -> dict[int, Proc]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            uid = entry.stat().st_uid
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        found[int(entry.name)] = Proc(int(entry.name), int(fields[1]), uid, cmdline,
                                      (int(fields[11]) + int(fields[12])) / TICKS)
    return found


def descendants(procs: dict[int, Proc], root: int) -> set[int]:
    out, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for proc in procs.values():
            if proc.ppid == parent and proc.pid not in out:
                out.add(proc.pid)
                frontier.append(proc.pid)
    return out


def classify(procs: dict[int, Proc], daemon_pid: int, users: dict[int, str]) -> dict[int, tuple[str, str]]:
    """pid -> (where, what): where is "head" or a node name."""
    kinds: dict[int, tuple[str, str]] = {}
    for pid in descendants(procs, daemon_pid):
        proc = procs[pid]
        if pid == daemon_pid:
            kinds[pid] = ("head", "coordd")
        elif "mlx_launch" in proc.cmdline or "mlx.launch" in proc.cmdline or proc.cmdline.startswith("ssh ") \
                or "/ssh " in proc.cmdline.split(" -- ")[0]:
            kinds[pid] = ("head", "launcher")
        else:
            kinds[pid] = ("head", "coordd")  # its own helpers (agent over the local transport, ssh control)
    for proc in procs.values():
        node = users.get(proc.uid)
        if node is None or proc.pid in kinds:
            continue
        if "rank_runner" in proc.cmdline:
            kinds[proc.pid] = (node, "rank runner")
        elif "agent" in proc.cmdline and ("mlx_lm_train" in proc.cmdline or "agent.train" in proc.cmdline):
            kinds[proc.pid] = (node, "rank")
        elif ".coord/agent" in proc.cmdline or "-m agent" in proc.cmdline:
            kinds[proc.pid] = (node, "agent")
        elif proc.cmdline.startswith("sshd"):
            kinds[proc.pid] = (node, "sshd (agent session)" if "notty" in proc.cmdline else "sshd")
        else:
            kinds[proc.pid] = (node, "other: " + proc.cmdline[:40])
    return kinds


def job_step(config: Path, env: dict, name: str) -> tuple[str, int]:
    doc = json.loads(coord("status", "--json", "--config", str(config), env=env).stdout)
    job = next(j for j in doc["jobs"] if j["name"] == name)
    return job["state"], int(job["step"] or 0)


def measure(count: int, cluster: NetnsCluster, root: Path, project: Path, window: float,
            save_every: int) -> dict[str, dict[str, float]]:
    names = [n.name for n in cluster.nodes][:count]
    config = cluster.write_cluster_toml(root / f"cluster{count}.toml", state_dir=root / f"state{count}", nodes=names)
    daemon = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", cluster.head_ns]).start()
    users = {int(cluster.exec_in(n, ["id", "-u"], user=cluster.node(n).user, check=True).stdout.strip()): n
             for n in names}
    try:
        daemon.wait_for(all_up, 60, "all nodes up")
        assert coord("sync", "--config", str(config), "--source", str(project), env=daemon.env).returncode == 0
        train = [*TRAIN[:-4], "--iters", str(ITERS), *TRAIN[-2:]]
        name = f"cpu{count}"
        submitted = coord("run", "--config", str(config), "--name", name, "--source", str(project), "--detach",
                          "--save-every", str(save_every), "--", "python", "-m", "mlx_lm", "lora", *train,
                          env=daemon.env)
        assert submitted.returncode == 0, submitted.stderr
        wait_event(daemon, name, "job.first_step")
        time.sleep(5.0)  # past the first steps' compilation
        daemon_pid = daemon.proc.pid
        _, first = job_step(config, daemon.env, name)
        before = processes()
        started = time.monotonic()
        time.sleep(window)
        after = processes()
        seconds = time.monotonic() - started
        state, last = job_step(config, daemon.env, name)
        kinds = classify(after, daemon_pid, users)
        totals: dict[str, dict[str, float]] = {}
        for pid, (where, what) in kinds.items():
            used = after[pid].cpu_s - (before[pid].cpu_s if pid in before else 0.0)
            totals.setdefault(where, {}).setdefault(what, 0.0)
            totals[where][what] += 100.0 * used / seconds
        coord("stop", "--config", str(config), name, env=daemon.env)
        # The steps are the daemon's view (a poll behind the ranks at both ends): the rate is the window's.
        totals["job"] = {"state_at_end": 1.0 if state == "running" else 0.0, "step": float(last),
                         "steps_per_s": (last - first) / seconds}
        return totals
    finally:
        daemon.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 3], choices=[2, 3])
    parser.add_argument("--window", type=float, default=20.0, help="seconds of training measured")
    parser.add_argument("--save-every", type=int, default=100,
                        help="steps between checkpoints (100: one every few seconds here, each catalogued, hashed "
                             f"and copied to the head; {ITERS} or more: none in the window, which leaves polling, "
                             "sampling and progress reading alone)")
    args = parser.parse_args()
    root = short_tempdir("coord-bench-cpu-")
    root.chmod(0o755)
    project = write_project(root / "project")
    for path in [project, *project.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    with NetnsCluster() as cluster:
        for count in args.nodes:
            totals = measure(count, cluster, root, project, args.window, args.save_every)
            print(f"\n{count} nodes, a checkpoint every {args.save_every} steps, % of one core over "
                  f"{args.window:g} s of training:")
            head = totals.pop("head", {})
            job = totals.pop("job", {})
            share = sum(head.values()) / count
            for where in sorted(totals):
                own = {k: v for k, v in totals[where].items() if k not in ("rank",) and not k.startswith("other")}
                print(f"  {where}: " + ", ".join(f"{k} {v:.2f}%" for k, v in sorted(own.items()))
                      + f"; head's share {share:.2f}% -> coord {sum(own.values()) + share:.2f}% per node"
                      + f" (rank {totals[where].get('rank', 0.0):.0f}%)")
            print("  head: " + ", ".join(f"{k} {v:.2f}%" for k, v in sorted(head.items()))
                  + f"; job still running: {bool(job.get('state_at_end'))}, at step {job.get('step', 0):.0f}, "
                  + f"{job.get('steps_per_s', 0.0):.1f} steps/s in the window")


if __name__ == "__main__":
    main()
