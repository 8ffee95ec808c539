"""Benchmark: launch time, recovery time and training speed under coord, side by side.

On the multi-host test cluster (network namespaces, one sshd, user and venv per node;
root on Linux), with the tiny llama model of the demo (2 layers, width 64), a full
fine-tune of 200 steps:

1. launch: `coord run` (daemon warm, pre-flight included) to the first training step,
   vs bare `mlx.launch` with a hand-written hostfile and per-node wrappers (what a user
   with different users and venv paths on each Mac has to write);
2. recovery: SIGKILL of one rank to the first step of the resumed run, at 2 and 3 nodes,
   vs a cold launch; and `torchrun --max-restarts` recovering an equivalent small DDP
   job (2 CPU workers) from its checkpoint, when torch is installed;
3. training speed: steps/s between the first and the last step, coord vs bare.

    sudo python bench/launch_recovery.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
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

from tests.cluster.jobs import daemon_on_first, readable_project  # noqa: E402
from tests.cluster.netns import NetnsCluster  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, coord, environment, short_tempdir  # noqa: E402

ITERS = 200  # long enough to measure steps/s now that a step takes tens of milliseconds
TRAIN = ["--model", "model", "--train", "--data", "data", "--fine-tune-type", "full", "--batch-size", "6",
         "--iters", str(ITERS), "--learning-rate", "1e-4"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
REPORT = re.compile(r"^\s*(\d+)\s+\d+\.\d+\s")


def bare_launch(cluster: NetnsCluster, root: Path, nodes: list[str]) -> dict:
    """mlx.launch with a hostfile written by hand; returns first-step time and steps/s."""
    hostfile = root / "bare-hostfile.json"
    hostfile.write_text(json.dumps({"backend": "ring", "envs": [], "hosts": [
        {"ssh": n, "ips": [cluster.node_ip(n)]} for n in nodes]}))
    wrapper_dir = root / "bare-bin"
    wrapper_dir.mkdir(exist_ok=True)
    (wrapper_dir / "ssh").write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {cluster.ssh_config} \"$@\"\n")
    (wrapper_dir / "ssh").chmod(0o755)
    for n in nodes:  # what a user does by hand: a wrapper for each node's own Python at one relative path
        spec = cluster.node(n)
        wrapper = f'#!/bin/sh\nexec {spec.python} "$@"\n'
        cluster.exec_in(n, ["sh", "-c", f"printf '%s' '{wrapper}' > {spec.home}/bare-python && chmod +x {spec.home}/bare-python"],
                        user=spec.user, check=True)
    script = ('cd "$HOME/work" && export TMPDIR="$HOME/tmp-bare" && mkdir -p "$TMPDIR" && '
              'exec "$HOME/bare-python" -m mlx_lm lora ' + " ".join(TRAIN) +
              ' --num-layers -1 --steps-per-report 1 --save-every 1000 --adapter-path "$HOME/bare-adapters"')
    env = {**environment(), "PATH": f"{wrapper_dir}:{os.environ['PATH']}"}
    started = time.time()
    proc = cluster.popen_in("head", ["mlx.launch", "--hostfile", str(hostfile), "--", "/bin/sh", "-c", script],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    stamps: dict[int, float] = {}
    buffer = b""
    while True:
        chunk = proc.stdout.read1(65536)
        if not chunk:
            break
        buffer += chunk
        *lines, buffer = re.split(rb"[\r\n]", buffer)
        for raw in lines:
            match = REPORT.match(ANSI.sub("", raw.decode("utf-8", "replace")))
            if match:
                stamps.setdefault(int(match.group(1)), time.time())
    proc.wait()
    first, last = min(stamps), max(stamps)
    return {"first_step_s": stamps[first] - started, "steps_per_s": (last - first) / (stamps[last] - stamps[first])}


def events_of(daemon: DaemonProcess, job: str) -> list[dict]:
    doc = json.loads(coord("status", "--json", "--events", "50", "--config", str(daemon.config), env=daemon.env).stdout)
    return [e for e in doc["events"] if e["message"].startswith(job + ":")]


def wait_event(daemon: DaemonProcess, job: str, kind: str, count: int = 1, timeout: float = 600) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        seen = events_of(daemon, job)
        found = [e for e in seen if e["kind"] == kind]
        if len(found) >= count:
            return found[count - 1]
        failed = [e for e in seen if e["kind"] == "job.failed"]
        if failed:
            raise RuntimeError(f"{job} failed: {failed[-1]['message']}")
        time.sleep(0.2)
    raise RuntimeError(f"{job}: no {kind} event #{count}")


def first_step_time(cluster: NetnsCluster, daemon: DaemonProcess, name: str, *, attempt: int) -> float:
    doc = json.loads(coord("status", "--json", "--config", str(daemon.config), env=daemon.env).stdout)
    job = next(j for j in doc["jobs"] if j["name"] == name)
    node = cluster.node(job["nodes"][0])
    progress = Path(node.workdir) / ".coord" / "jobs" / job["run_id"] / f"attempt-{attempt}" / "rank-0" / "progress.jsonl"
    first = next(line for line in progress.read_text().splitlines() if '"train"' in line)
    return json.loads(first)["time"]


def last_step(progress: Path) -> int:
    steps = [0]
    for line in progress.read_text().splitlines():
        if '"train"' in line and line.endswith("}"):  # a line still being written is skipped
            steps.append(json.loads(line)["step"])
    return max(steps)


def coord_run(cluster: NetnsCluster, daemon: DaemonProcess, project: Path, name: str, *, kill: bool) -> dict:
    started = time.time()
    result = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(project), "--detach",
                   "--save-every", "10", "--", "python", "-m", "mlx_lm", "lora", *TRAIN, env=daemon.env)
    assert result.returncode == 0, result.stderr
    wait_event(daemon, name, "job.first_step")
    # The rank's own time stamp of its first step, as bare mlx.launch's is the moment its line
    # appears: the daemon's event comes up to one poll later.
    out = {"first_step_s": first_step_time(cluster, daemon, name, attempt=0) - started}
    if kill:
        doc = json.loads(coord("status", "--json", "--config", str(daemon.config), env=daemon.env).stdout)
        job = next(j for j in doc["jobs"] if j["name"] == name)
        progress = (Path(cluster.node(job["nodes"][0]).workdir) / ".coord" / "jobs" / job["run_id"] / "attempt-0" / "rank-0"
                    / "progress.jsonl")
        while last_step(progress) < 25:  # rank 0's own file: the daemon's view is one poll late
            time.sleep(0.01)
        victim = cluster.node(job["nodes"][1])
        pid = int((Path(victim.workdir) / ".coord" / "jobs" / job["run_id"] / "attempt-0" / "rank-1" / "pid").read_text())
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        wait_event(daemon, name, "job.first_step", count=2)
        out["recovery_s"] = first_step_time(cluster, daemon, name, attempt=1) - killed
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), name, env=daemon.env, timeout=900)
    assert json.loads(waited.stdout)["state"] == "succeeded", waited.stdout
    final = json.loads(waited.stdout)
    node = cluster.node(final["nodes"][0])
    attempt = 1 if kill else 0
    progress = Path(node.workdir) / ".coord" / "jobs" / final["run_id"] / f"attempt-{attempt}" / "rank-0" / "progress.jsonl"
    records = [json.loads(line) for line in progress.read_text().splitlines() if '"train"' in line]
    if len(records) > 1:
        out["steps_per_s"] = (records[-1]["step"] - records[0]["step"]) / (records[-1]["time"] - records[0]["time"])
    return out


DDP_JOB = textwrap.dedent('''
    import os, sys, time, torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt, start = sys.argv[1], 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"]
    for step in range(start + 1, 61):
        x = torch.randn(32, 64)
        loss = ((model(x) - x) ** 2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        if rank == 0:
            print(f"STEP {step} {time.time()} pid {os.getpid()}", flush=True)
            if step % 10 == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
        time.sleep(0.05)
''')


def torchrun_recovery(root: Path) -> dict | None:
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    job = root / "ddp_job.py"
    job.write_text(DDP_JOB)
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
                             "3", "--monitor-interval", "0.1", str(job), str(root / "ddp.ckpt")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=root)
    first = killed = resumed = None
    for line in proc.stdout:
        if not line.startswith("STEP"):
            continue
        _, step, stamp, _, pid = line.split()
        now = float(stamp)
        if first is None:
            first = now - started
        if killed is None and int(step) >= 25:
            children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            victims = [p for p in children if p != pid]
            killed = time.time()
            os.kill(int(victims[-1]), signal.SIGKILL)
        elif killed is not None and resumed is None and now > killed + 0.001 and int(step) <= 31:
            resumed = now - killed
    proc.wait()
    return {"first_step_s": first, "recovery_s": resumed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[3, 2], choices=[2, 3], help="cluster sizes to measure")
    parser.add_argument("--repeats", type=int, default=3,
                        help="cold runs of coord and of bare mlx.launch, interleaved (medians are reported)")
    parser.add_argument("--no-torchrun", action="store_true", help="skip the torchrun comparison")
    args = parser.parse_args()
    root = short_tempdir("coord-bench-run-")
    project = readable_project(root)
    results: dict[int, dict[str, list[dict]]] = {}
    with NetnsCluster() as cluster:
        for count in args.nodes:
            names = [n.name for n in cluster.nodes][:count]
            runs: dict[str, list[dict]] = {"coord": [], "bare": [], "recover": []}
            with daemon_on_first(cluster, root, count) as (config, daemon):
                assert coord("sync", "--config", str(config), "--source", str(project), env=daemon.env).returncode == 0
                coord_run(cluster, daemon, project, f"warmup{count}", kill=False)  # MLX compiles its CPU kernels
                bare_launch(cluster, root, names)  # the same warm-up for bare mlx.launch
                for repeat in range(args.repeats):  # interleaved, so that both see the same machine
                    runs["coord"].append(coord_run(cluster, daemon, project, f"cold{count}-{repeat}", kill=False))
                    runs["bare"].append(bare_launch(cluster, root, names))
                runs["recover"].append(coord_run(cluster, daemon, project, f"kill{count}", kill=True))
                print(f"measured {count} nodes: {runs}", file=sys.stderr, flush=True)
            results[count] = runs
    torch = None if args.no_torchrun else torchrun_recovery(root)
    shutil.rmtree(root, ignore_errors=True)

    def median(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(f"\ntiny llama (2 layers, width 64), full fine-tune of {ITERS} steps, ring backend, {os.cpu_count()} cores; "
          f"medians of {args.repeats} interleaved cold runs\n")
    print("| measure | coord | compared with | ratio |")
    print("|---|---:|---:|---:|")
    for count in sorted(results):
        coord_runs, bare_runs, recover = results[count]["coord"], results[count]["bare"], results[count]["recover"]
        ours, theirs = median(coord_runs, "first_step_s"), median(bare_runs, "first_step_s")
        print(f"| launch to first step, {count} nodes (s) | {ours:.2f} | bare mlx.launch {theirs:.2f} | "
              f"{ours / theirs:.2f}x |")
        back = median(recover, "recovery_s")
        print(f"| SIGKILL to first resumed step, {count} nodes (s) | {back:.2f} | cold launch {ours:.2f} | "
              f"{back / ours:.2f}x |")
        ours, theirs = median(coord_runs, "steps_per_s"), median(bare_runs, "steps_per_s")
        print(f"| training speed, {count} nodes (steps/s) | {ours:.2f} | bare mlx.launch {theirs:.2f} | "
              f"{ours / theirs:.2f}x |")
    if torch and torch.get("recovery_s"):
        print(f"| torchrun --max-restarts, 2 CPU workers: SIGKILL to first resumed step (s) | - | "
              f"{torch['recovery_s']:.2f} (cold launch {torch['first_step_s']:.2f}) | "
              f"{torch['recovery_s'] / torch['first_step_s']:.2f}x of its cold launch |")
    elif not args.no_torchrun:
        print("| torchrun --max-restarts | - | torch not installed (pip install torch==2.13.0) | - |")


if __name__ == "__main__":
    main()
