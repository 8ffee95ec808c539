"""Benchmark: a PyTorch job under coord against bare torchrun, side by side, on the multi-host cluster.

On the multi-host test cluster (network namespaces, one sshd, user and venv per node, torch's CPU
build in each; root on Linux), a small DDP job over Gloo (an MLP of --width on random data, one torch
thread per process on both sides, a checkpoint directory every --save-every steps), at 2 and 3 nodes:

1. launch to first step: `coord run --launcher torchrun` (daemon warm, pre-flight included) vs bare
   torchrun started on every node by hand with a c10d rendezvous (what a user writes: one command per
   node, in its namespace, as its user, with its own venv's Python);
2. training speed: steps/s between the first and the last step;
3. a worker SIGKILLed: to the first step after it, coord's restart from its newest checkpoint vs
   torchrun's own `--max-restarts 3` (c10d rendezvous again, every node's workers restarted, the
   script resuming from its own newest checkpoint);
4. a node lost for good (its link cut): torchrun alone (fixed --nnodes) waits for it and trains no
   further step within the bench's bound; coord (`--min-nodes`, `--node-timeout 5`) goes on with
   the others: the time from the cut to its first step on the smaller world.

Each step's time is the worker's own time stamp (coord_script.report writes it, under coord and
under bare torchrun alike: the bare runs get a progress file of their own).

    sudo python bench/torch_launch_recovery.py [--nodes 2 3] [--runs 2] [--kills 2] [--no-cut] [--steps N]
        [--save-every N] [--width N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.coord_cpu import descendants, processes  # noqa: E402
from tests.cluster.netns import DEFAULT_NODES, NetnsCluster  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir  # noqa: E402

TERMINAL = ("succeeded", "failed", "stopped")


class Job:
    """The job's size, set from the command line: its steps, checkpoint interval and width."""

    steps = 1500
    save_every = 500  # a checkpoint every few seconds here: still far more often than a user's job saves
    width = 1024

    @classmethod
    def argv(cls) -> list[str]:
        return [str(cls.steps), str(cls.save_every), str(cls.width)]

    @classmethod
    def kill_at(cls) -> int:
        """Half an interval after the first checkpoint: both sides resume from it and redo as much."""
        return cls.save_every + cls.save_every // 2

PORT = 29400

#: The job: under coord it resumes from COORD_RESUME_DIR (on every node); under bare torchrun from the
#: newest directory in rank 0's own checkpoint directory, its step sent to the others (what a torchrun
#: user writes for --max-restarts without a shared file system).
SCRIPT = textwrap.dedent('''
    import os, sys, time, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    import coord_script
    steps, save_every, width = (int(word) for word in sys.argv[1:4])
    torch.set_num_threads(1)  # the nodes share the machine's cores: one thread per process, on both sides
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    root = os.environ.get("COORD_CHECKPOINT_DIR") or os.environ["BARE_CHECKPOINTS"]
    resume = coord_script.resume_dir()
    if resume is None and not os.environ.get("COORD_RUN") and os.path.isdir(root):
        done = sorted(d for d in os.listdir(root) if os.path.exists(os.path.join(root, d, "COMPLETE")))
        resume = os.path.join(root, done[-1]) if done else None
    start = 0
    if resume:
        state = torch.load(os.path.join(resume, "state.pt"))
        model.load_state_dict(state["model"]); optimizer.load_state_dict(state["optimizer"]); start = state["step"]
    # Bare torchrun: only rank 0's node holds the checkpoints, so rank 0's step is everyone's (DDP sends
    # rank 0's weights to the others as it starts; SGD without momentum has no other state). Under coord
    # every node holds the same checkpoint, and this changes nothing.
    agreed = torch.tensor([start])
    dist.broadcast(agreed, 0)
    start = int(agreed.item())
    ddp = DistributedDataParallel(model)
    for step in range(start + 1, steps + 1):
        x = torch.randn(32, width, generator=torch.Generator().manual_seed(step * 100 + rank))
        loss = (ddp(x) ** 2).mean()
        optimizer.zero_grad(); loss.backward(); optimizer.step()
        if rank == 0:
            coord_script.report(step, loss=loss.item())
            if step % save_every == 0 or step == steps:
                offset = coord_script.step_offset()
                directory = os.path.join(root, f"{step - offset:07d}")
                os.makedirs(directory, exist_ok=True)
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                           os.path.join(directory, "state.pt"))
                open(os.path.join(directory, "COMPLETE"), "w").close()
    dist.barrier()  # rank 0 may still be saving: Gloo aborts a peer that leaves before the others
    dist.destroy_process_group()
''')


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.endswith("}") and '"train"' in line:
            out.append(json.loads(line))
    return out


def last_record(path: Path) -> dict | None:
    """The newest train record, from the file's tail: cheap enough to ask every 10 ms while the ranks
    train (reading the whole file that often took CPU from the ranks under watch)."""
    try:
        with open(path, "rb") as file:
            start = max(0, file.seek(0, os.SEEK_END) - 4096)
            file.seek(start)
            lines = file.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    whole = lines[1:] if start else lines  # the first line of a tail may be cut
    found = [json.loads(line) for line in whole if line.endswith("}") and '"train"' in line]
    return found[-1] if found else None


def wait_until(check, timeout: float, what: str, every: float = 0.01, ended=lambda: False):
    """``check()`` once it is true; every 10 ms where the moment is measured, less often otherwise.
    ``ended()`` true says nothing more can come (every process gone): no use waiting out the timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = check()
        if found:
            return found
        if ended():
            if found := check():  # the last record may have landed as the processes ended
                return found
            raise RuntimeError(f"no {what}: every process had ended")
        time.sleep(every)
    raise RuntimeError(f"no {what} within {timeout:g} s")


def step_at_least(path: Path, step: int) -> bool:
    last = last_record(path)
    return last is not None and last["step"] >= step


# --- bare torchrun ------------------------------------------------------------------------


class Bare:
    """torchrun on every node by hand: one command each, in its namespace, as its user. The first node
    hosts the c10d store (``is_host``): torchrun finds that by matching the endpoint against its
    hostname's addresses, which the namespaces share with the machine (pytorch#150532's case), and
    each node gives its own address (``--local-addr``) for the same reason: what a user of torchrun
    writes where hostnames do not resolve to the address the nodes reach each other on."""

    def __init__(self, cluster: NetnsCluster, nodes: list[str], tag: str, *, nnodes: str | None = None,
                 max_restarts: int = 0):
        self.cluster, self.nodes, self.tag = cluster, nodes, tag
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.nnodes = nnodes or str(len(nodes))
        self.max_restarts = max_restarts
        first = cluster.node(nodes[0])
        self.progress = Path(first.workdir) / f"bench-{tag}.jsonl"
        self.progress.unlink(missing_ok=True)

    def start(self) -> float:
        endpoint = f"{self.cluster.node_ip(self.nodes[0])}:{PORT}"
        started = time.time()
        for rank, name in enumerate(self.nodes):
            spec = self.cluster.node(name)
            checkpoints = Path(spec.workdir) / f"bench-{self.tag}-ckpt"
            env = (f"PYTHONPATH={REPO} COORD_PROGRESS_FILE={self.progress if rank == 0 else '/dev/null'} "
                   f"BARE_CHECKPOINTS={checkpoints} GLOO_SOCKET_IFNAME=eth0")
            python = self.cluster.torch_python(name)
            command = (f"cd {spec.workdir} && rm -rf {checkpoints} && env {env} {python} -m torch.distributed.run "
                       f"--nnodes {self.nnodes} --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint {endpoint} "
                       f"--rdzv-id bench-{self.tag} --rdzv-conf is_host={'true' if rank == 0 else 'false'} "
                       f"--local-addr {self.cluster.node_ip(name)} "
                       f"--max-restarts {self.max_restarts} "
                       f"bench_ddp.py {' '.join(Job.argv())}")
            log = Path(spec.workdir) / f"bench-{self.tag}-{name}.log"  # kept: what went wrong, if anything did
            self.logs.append(log)
            self.procs.append(self.cluster.popen_in(name, ["sh", "-c", f"{command} > {log} 2>&1"], user=spec.user,
                                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                     start_new_session=True))
        return started

    def ended(self) -> bool:
        """Whether torchrun has exited on every node (its restarts spent, or the job done)."""
        return all(proc.poll() is not None for proc in self.procs)

    def tails(self) -> str:
        """The end of each node's output, torch's C++ stack frames left out."""
        out = []
        for log in self.logs:
            if log.exists():
                text = log.read_text(errors="replace")
                lines = [line for line in text.splitlines() if not line.startswith("frame #")]
                out.append(f"--- {log}:\n" + "\n".join(lines[-25:]))
        return "\n".join(out)

    def worker(self, name: str) -> int:
        spec = self.cluster.node(name)
        found = self.cluster.exec_in(name, ["pgrep", "-u", spec.user, "-f", "python[0-9.]* -u bench_ddp.py"]).stdout
        return int(found.split()[0])

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for name in self.nodes:
            spec = self.cluster.node(name)
            self.cluster.exec_in(name, ["pkill", "-KILL", "-u", spec.user, "-f", "bench_ddp.py|torch.distributed.run"])


def bare_run(cluster: NetnsCluster, nodes: list[str], tag: str, *, kill: bool) -> dict:
    bare = Bare(cluster, nodes, tag, max_restarts=3 if kill else 0)
    try:
        return _bare_run(bare, nodes, kill=kill)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}; bare torchrun's output:\n{bare.tails()}") from None
    finally:
        bare.stop()


def _bare_run(bare: Bare, nodes: list[str], *, kill: bool) -> dict:
    started = bare.start()
    wait_until(lambda: last_record(bare.progress), 300, "first bare step", ended=bare.ended)
    first = records(bare.progress)[0]
    out = {"first_step_s": first["time"] - started}
    after: list[dict] = []
    if kill:
        wait_until(lambda: step_at_least(bare.progress, Job.kill_at()), 300, "the step to kill at", ended=bare.ended)
        killed = time.time()
        os.kill(bare.worker(nodes[1]), signal.SIGKILL)
        wait_until(lambda: (last := last_record(bare.progress)) and last["time"] > killed + 0.05
                   and last["step"] <= Job.kill_at(), 300, "resumed bare step", ended=bare.ended)
        after = [r for r in records(bare.progress) if r["time"] > killed + 0.05 and r["step"] <= Job.kill_at()]
        out["recovery_s"] = after[0]["time"] - killed
    wait_until(lambda: step_at_least(bare.progress, Job.steps), 900, "the last bare step", every=0.5,
               ended=bare.ended)
    tail = [r for r in records(bare.progress) if r["time"] >= (after[-1]["time"] if after else 0)]
    out["steps_per_s"] = (tail[-1]["step"] - tail[0]["step"]) / (tail[-1]["time"] - tail[0]["time"])
    return out


def bare_node_loss(cluster: NetnsCluster, nodes: list[str], bound: float) -> dict:
    bare = Bare(cluster, nodes, "loss", max_restarts=3)
    try:
        bare.start()
        wait_until(lambda: step_at_least(bare.progress, Job.kill_at()), 300, "the step to cut at")
        cut = time.time()
        cluster.cut_link(nodes[-1])
        time.sleep(bound)
        later = [r for r in records(bare.progress) if r["time"] > cut + 5]
        return {"steps_after_cut": len(later), "bound_s": bound}
    finally:
        cluster.restore_link(nodes[-1])
        bare.stop()


# --- coord ------------------------------------------------------------------------------------


def job_progress(cluster: NetnsCluster, daemon: DaemonProcess, name: str, attempt: int) -> Path:
    """Where rank 0 of the job's attempt writes its progress (asked of the daemon: call it once)."""
    job = next(j for j in daemon.status()["jobs"] if j["name"] == name)
    node = cluster.node(job["nodes"][0])
    return Path(node.workdir) / ".coord" / "jobs" / job["run_id"] / f"attempt-{attempt}" / "rank-0" / "progress.jsonl"


def _coord_process(cmdline: str) -> str | None:
    """What a node user's process is to coord: one of its own (agent, rank runner, standby, the agent's
    sshd session), or None for the job's (torchrun and its workers)."""
    if "rank_runner" in cmdline:  # its argv names the launcher it runs
        return "rank runner"
    if "standby_runner" in cmdline:
        return "standby"
    if "agent.preload" in cmdline:  # measured in runs with no relaunch, where no standby is claimed (runs torchrun)
        return "standby"
    if "bench_ddp.py" in cmdline or "torch.distributed.run" in cmdline:
        return None
    if "sshd" in cmdline.split(" ")[0]:
        return "sshd"
    return "agent" if ".coord/agent" in cmdline or "-m agent" in cmdline else "other"


def coord_cpu(before: dict, after: dict, daemon_pid: int, users: dict[int, str], seconds: float) -> dict:
    """coord's own CPU (% of one core) between two snapshots of /proc: per node (its agent, rank runners,
    standbys, sshd session) and the head's coordd with its children, shared out over the nodes."""
    def used(pid: int) -> float:
        return 100.0 * (after[pid].cpu_s - (before[pid].cpu_s if pid in before else 0.0)) / seconds

    per_node: dict[str, dict[str, float]] = {name: {} for name in users.values()}
    ranks: dict[str, float] = {name: 0.0 for name in users.values()}
    for pid, proc in after.items():
        node = users.get(proc.uid)
        if node is None:
            continue
        kind = _coord_process(proc.cmdline)
        if kind is None:
            ranks[node] += used(pid)
        else:
            per_node[node][kind] = per_node[node].get(kind, 0.0) + used(pid)
    head = sum(used(pid) for pid in descendants(after, daemon_pid))
    share = head / max(1, len(per_node))
    return {"coordd": round(head, 2),
            "nodes": {name: {**{k: round(v, 2) for k, v in kinds.items()}, "rank": round(ranks[name], 1),
                             "coord": round(sum(kinds.values()) + share, 2)} for name, kinds in per_node.items()}}


def coord_run(cluster: NetnsCluster, daemon: DaemonProcess, project: Path, name: str, nodes: list[str], *,
              kill: bool = False, cut: bool = False) -> dict:
    extra = ["--min-nodes", str(len(nodes) - 1), "--node-timeout", "5"] if cut else []
    started = time.time()
    done = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(project), "--detach",
                 "--nodes", ",".join(nodes), "--save-every", str(Job.save_every), "--launcher", "torchrun",
                 "--total-steps", str(Job.steps), *extra,
                 "--", "python", "bench_ddp.py", *Job.argv(), env=daemon.env)
    assert done.returncode == 0, done.stderr
    daemon.wait_for(lambda d: any(j["name"] == name and j["state"] == "running" for j in d["jobs"]), 300, "running")
    # The progress file's path once (asking the daemon every 10 ms for it was CPU the ranks lacked).
    first_progress = job_progress(cluster, daemon, name, 0)
    wait_until(lambda: last_record(first_progress), 300, "first step")
    first = records(first_progress)[0]
    out = {"first_step_s": first["time"] - started}
    if not (kill or cut):  # coord's own CPU while it trains: from its first step to near its last
        users = {os.stat(cluster.node(n).home).st_uid: n for n in nodes}
        before, at = processes(), time.monotonic()
        wait_until(lambda: step_at_least(first_progress, Job.steps - Job.steps // 20), 900, "the end of training",
                   every=0.5)
        out["cpu"] = coord_cpu(before, processes(), daemon.proc.pid, users, time.monotonic() - at)
    if kill or cut:
        progress = first_progress
        wait_until(lambda: step_at_least(progress, Job.kill_at()), 300, "the step to kill at")
        at = time.time()
        if kill:
            victim = cluster.node(nodes[1])
            pid = int(cluster.exec_in(nodes[1], ["pgrep", "-u", victim.user, "-f", "python[0-9.]* -u bench_ddp.py"])
                      .stdout.split()[0])
            os.kill(pid, signal.SIGKILL)
        else:
            cluster.cut_link(nodes[-1])
        try:
            def resumed_or_ended(job: dict) -> bool:
                return job["attempt"] >= 1 and job["state"] == "running" or job["state"] in TERMINAL

            doc = daemon.wait_for(lambda d: any(j["name"] == name and resumed_or_ended(j) for j in d["jobs"]), 300,
                                  "attempt 1")
            if next(j for j in doc["jobs"] if j["name"] == name)["state"] != "running":
                raise RuntimeError(f"{name} ended before it resumed:\n{story(daemon, name)}")
            resumed = job_progress(cluster, daemon, name, 1)
            wait_until(lambda: last_record(resumed), 300, "a resumed step")
            after = records(resumed)[0]
            out["recovery_s"] = after["time"] - at
        finally:
            if cut:
                cluster.restore_link(nodes[-1])
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), name, env=daemon.env, timeout=900)
    final = json.loads(waited.stdout)
    last = records(job_progress(cluster, daemon, name, final["attempt"]))
    if final["state"] != "succeeded" or len(last) < 2:
        raise RuntimeError(f"{name}: {final['state']} at attempt {final['attempt']} with {len(last)} steps in its "
                           f"progress file:\n{story(daemon, name)}")
    out["steps_per_s"] = (last[-1]["step"] - last[0]["step"]) / (last[-1]["time"] - last[0]["time"])
    return out


def story(daemon: DaemonProcess, name: str) -> str:
    """The job's events, for a run that went wrong."""
    shown = coord("status", "--json", "--events", "500", "--config", str(daemon.config), env=daemon.env)
    doc = json.loads(shown.stdout)
    return "\n".join(f"{e['kind']}: {e['message']}" for e in doc["events"] if e["message"].startswith(f"{name}:"))


def attempts(what: str, tries: int, run):
    """``run()``'s result, tried up to ``tries`` times: (result or None, the failures' reasons)."""
    failures = []
    for _ in range(tries):
        try:
            return run(), failures
        except RuntimeError as exc:
            failures.append(str(exc).split(";", 1)[0])
            print(f"{what}: failed: {exc}", file=sys.stderr, flush=True)
    return None, failures


def measure_size(cluster: NetnsCluster, daemon: DaemonProcess, project: Path, size: int, runs: int, kills: int,
                 loss_bound: float, cut: bool = True) -> list[tuple[str, str, str, str]]:
    """One size's rows, each printed as soon as it is measured (a later failure keeps them)."""
    rows: list[tuple[str, str, str, str]] = []

    def row(*cells: str) -> None:
        rows.append(cells)  # type: ignore[arg-type]
        print("| " + " | ".join(cells) + " |", flush=True)

    nodes = [spec.name for spec in cluster.nodes][:size]
    coord_run(cluster, daemon, project, f"warm-{size}", nodes)  # each node imports torch once, cold
    ours, theirs, ours_failed, bare_failed = [], [], [], []
    for run in range(runs):
        # A run that fails (gloo has aborted a worker in its teardown here, now and then) is tried
        # once more and counted; coord restarts such a run by itself, which is not a clean launch.
        done, failed = attempts("coord launch", 2, lambda run=run: coord_run(
            cluster, daemon, project, f"launch-{size}-{run}-{time.monotonic_ns()}", nodes))
        ours += [done] if done else []
        ours_failed += failed
        done, failed = attempts("bare launch", 2, lambda run=run: bare_run(
            cluster, nodes, f"launch-{size}-{run}", kill=False))
        theirs += [done] if done else []
        bare_failed += failed
    print(json.dumps({"nodes": size, "coord": ours, "bare": theirs, "coord_failures": ours_failed,
                      "bare_failures": bare_failed}), flush=True)
    launch = median([r["first_step_s"] for r in ours]), median([r["first_step_s"] for r in theirs])
    speed = median([r["steps_per_s"] for r in ours]), median([r["steps_per_s"] for r in theirs])
    row(f"launch to first step, {size} nodes (s)", f"{launch[0]:.2f}", f"bare torchrun {launch[1]:.2f}",
        f"{launch[0] / launch[1]:.2f}x")
    row(f"training speed, {size} nodes (steps/s)", f"{speed[0]:.1f}", f"bare torchrun {speed[1]:.1f}",
        f"{speed[0] / speed[1]:.2f}x")
    cpu = [r["cpu"] for r in ours if "cpu" in r]
    if cpu:
        per_node = median([max(n["coord"] for n in c["nodes"].values()) for c in cpu])
        rank = median([statistics.mean(n["rank"] for n in c["nodes"].values()) for c in cpu])
        row(f"coord's own CPU while training, {size} nodes (% of a core, the busiest node)", f"{per_node:.2f}",
            f"each node's ranks {rank:.0f}", "-")
    # Each side's worker is killed `kills` times, interleaved (medians); a run that does not recover is
    # tried once more and counted.
    if kills > 0:
        _kill_rows(cluster, daemon, project, size, nodes, kills, row)
    if size >= 3 and cut:
        lost = coord_run(cluster, daemon, project, f"cut-{size}", nodes, cut=True)
        bare_lost = bare_node_loss(cluster, nodes, loss_bound)
        row(f"a node cut for good, {size} nodes: to the first step on {size - 1} (s)", f"{lost['recovery_s']:.2f}",
            f"torchrun: {bare_lost['steps_after_cut']} steps in {bare_lost['bound_s']:.0f} s",
            "-" if bare_lost["steps_after_cut"] == 0 else "?")
    return rows


def _kill_rows(cluster: NetnsCluster, daemon: DaemonProcess, project: Path, size: int, nodes: list[str], kills: int,
               row) -> None:
    """Each side's worker killed ``kills`` times, interleaved: the recovery row, given to ``row``."""
    ours_killed, theirs_killed, ours_failed, bare_failed = [], [], [], []
    for kill in range(kills):
        tag = f"{size}-{kill}"
        done, failed = attempts("coord kill", 2, lambda tag=tag: coord_run(
            cluster, daemon, project, f"kill-{tag}-{time.monotonic_ns()}", nodes, kill=True))
        ours_killed += [done] if done else []
        ours_failed += failed
        done, failed = attempts("bare kill", 2, lambda tag=tag: bare_run(cluster, nodes, f"kill-{tag}", kill=True))
        theirs_killed += [done] if done else []
        bare_failed += failed
    print(json.dumps({"nodes": size, "killed": ours_killed, "bare_killed": theirs_killed,
                      "coord_failures": ours_failed, "bare_failures": bare_failed}), flush=True)
    ours_s = median([r["recovery_s"] for r in ours_killed])
    theirs_s = median([r["recovery_s"] for r in theirs_killed])
    theirs_text = f"torchrun --max-restarts 3 {theirs_s:.2f}" if theirs_killed else "torchrun: none"
    theirs_text += f" ({len(bare_failed)} of {len(bare_failed) + len(theirs_killed)} tries did not recover)" \
        if bare_failed else ""
    row(f"worker SIGKILL to first resumed step, {size} nodes (s)",
        f"{ours_s:.2f}" + (f" ({len(ours_failed)} tries did not recover)" if ours_failed else ""), theirs_text,
        f"{ours_s / theirs_s:.2f}x" if ours_killed and theirs_killed else "-")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--runs", type=int, default=2, help="cold runs of each, interleaved (medians reported)")
    parser.add_argument("--kills", type=int, default=2, help="killed runs of each, interleaved (medians reported)")
    parser.add_argument("--loss-bound", type=float, default=60.0, help="how long bare torchrun is given after a cut")
    parser.add_argument("--no-cut", action="store_true", help="leave out the node cut for good (3 nodes or more)")
    parser.add_argument("--steps", type=int, default=Job.steps)
    parser.add_argument("--save-every", type=int, default=Job.save_every)
    parser.add_argument("--width", type=int, default=Job.width, help="the MLP's width (its step time)")
    args = parser.parse_args()
    Job.steps, Job.save_every, Job.width = args.steps, args.save_every, args.width
    if os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    root = short_tempdir()
    root.chmod(0o755)
    project = root / "project"
    project.mkdir(mode=0o755)
    (project / "bench_ddp.py").write_text(SCRIPT)
    (project / "bench_ddp.py").chmod(0o644)
    rows: list[tuple[str, str, str, str]] = []
    with NetnsCluster(DEFAULT_NODES[:max(args.nodes)]) as cluster:
        with_torch = cluster.add_torch()
        for spec in cluster.nodes:  # the bare runs read the script from each node's own workdir
            target = Path(spec.workdir) / "bench_ddp.py"
            shutil.copy(project / "bench_ddp.py", target)
            target.chmod(0o644)
        config = cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state",
                                            extra_node_fields=with_torch)
        daemon = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", cluster.head_ns],
                               python=sys.executable).start()
        try:
            daemon.wait_for(all_up, 60, "all nodes up")
            for size in args.nodes:
                rows += measure_size(cluster, daemon, project, size, args.runs, args.kills, args.loss_bound,
                                     cut=not args.no_cut)
        finally:
            daemon.stop()
    print("\n| measure | coord | compared with | ratio |\n|---|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
