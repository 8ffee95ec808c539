"""Benchmark: a recovery that moves no checkpoint, beside a cold launch, in one run.

On the multi-host test cluster (network namespaces; root on Linux), every link capped at
1 Gbit/s each way (``cap_links``), 3 nodes, a ~70M-parameter llama (12 layers, width 768,
built as ``coordinator/cli/tinymodel.py`` builds its tiny one) fully fine-tuned with Adam under
coord's trainer (``--trainer coord``): its checkpoint (weights and both Adam moments) is about
850 MB, written by every rank on its own node.

1. warm-up: one launch to its first step (MLX compiles its CPU kernels on a node's first run),
   then stopped;
2. cold launch: ``coord run`` (daemon warm, sync and pre-flight included) to the first step;
3. recovery: the same job, rank 1 SIGKILLed at step 7 (after the checkpoint of step 5 is
   catalogued), to the first step of the resumed attempt. The ``resume_from`` event says what
   was copied (nothing, when every node holds its own copy).

Steps 2 and 3 run ``--rounds`` times (3 by default), alternating, and the table gives each round
and the mean: on 2 shared cores one training step of this model takes about 10 s and varies by
a few seconds, as much as the difference being measured.

Times are the ranks' own time stamps of their first step. The machine's memory in use is
sampled every 0.5 s and its peak reported.

    sudo .venv/bin/python bench/recovery_copies.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coordinator.cli.tinymodel import write_data, write_model  # noqa: E402
from tests.cluster.netns import NetnsCluster, NodeSpec  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir  # noqa: E402

SAVE_EVERY, KILL_AT, ITERS = 5, 7, 40
# Users of their own, so that the bench runs beside a test cluster (whose users are coordalice, ...).
NODES = tuple(NodeSpec(name, f"coordrc{name}", f"/home/coordrc{name}", f"/home/coordrc{name}/venv")
              for name in ("n1", "n2", "n3"))


def train_command(iters: int) -> list[str]:
    return ["python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data", "--fine-tune-type",
            "full", "--batch-size", "3", "--iters", str(iters), "--learning-rate", "1e-5", "--optimizer", "adam",
            "--val-batches", "1", "--steps-per-eval", "100000", "--max-seq-length", "64"]


class MemoryPeak(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
            used = (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) * 1024
            self.peak = max(self.peak, used)
            time.sleep(0.5)


def status(daemon: DaemonProcess, events: int = 0) -> dict:
    return json.loads(coord("status", "--json", "--events", str(events), "--config", str(daemon.config),
                            env=daemon.env, timeout=60).stdout)


def events_of(daemon: DaemonProcess, name: str) -> list[dict]:
    return [e for e in status(daemon, 2000)["events"] if e["message"].startswith(name + ":")]


def wait_event(daemon: DaemonProcess, name: str, kind: str, where=lambda e: True, timeout: float = 900) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        seen = events_of(daemon, name)
        found = [e for e in seen if e["kind"] == kind and where(e)]
        if found:
            return found[0]
        failed = [e for e in seen if e["kind"] == "job.failed"]
        if failed:
            raise RuntimeError(f"{name} failed: {failed[-1]['message']}")
        time.sleep(0.5)
    raise RuntimeError(f"{name}: no {kind} event in {timeout} s")


def job_of(daemon: DaemonProcess, name: str) -> dict:
    return next(j for j in status(daemon)["jobs"] if j["name"] == name)


def progress_file(cluster: NetnsCluster, job: dict, attempt: int, rank: int = 0) -> Path:
    node = cluster.node(job["nodes"][rank])
    return Path(node.workdir) / ".coord" / "jobs" / job["run_id"] / f"attempt-{attempt}" / f"rank-{rank}" / "progress.jsonl"


def train_records(path: Path) -> list[dict]:
    out = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == "train":
            out.append(record)
    return out


def wait_step(cluster: NetnsCluster, daemon: DaemonProcess, name: str, attempt: int, step: int,
              timeout: float = 900) -> tuple[dict, dict]:
    """(job, the rank-0 train record of the first step >= ``step``) of the attempt, read from the rank's own file."""
    deadline = time.time() + timeout
    job = None
    while time.time() < deadline:
        if job is None or job["attempt"] != attempt or not job["nodes"]:
            job = job_of(daemon, name)
            if job["state"] == "failed":
                raise RuntimeError(f"{name} failed: {job.get('error')}")
            if job["attempt"] != attempt or not job["nodes"]:
                time.sleep(0.2)
                continue
        found = [r for r in train_records(progress_file(cluster, job, attempt)) if r["step"] >= step]
        if found:
            return job, found[0]
        time.sleep(0.02)
    raise RuntimeError(f"{name}: attempt {attempt} reached no step {step} in {timeout} s")


def submit(daemon: DaemonProcess, project: Path, name: str) -> float:
    started = time.time()
    result = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(project), "--detach",
                   "--trainer", "coord", "--save-every", str(SAVE_EVERY), "--keep", "2", "--hang-timeout", "900",
                   "--", *train_command(ITERS), env=daemon.env, timeout=300)
    assert result.returncode == 0, result.stderr
    return started


def stop(daemon: DaemonProcess, name: str) -> None:
    coord("stop", "--config", str(daemon.config), name, env=daemon.env, timeout=120)
    coord("wait", "--quiet", "--config", str(daemon.config), name, env=daemon.env, timeout=600)


def launch_to_first_step(cluster, daemon, project, name) -> float:
    started = submit(daemon, project, name)
    _, first = wait_step(cluster, daemon, name, 0, 1)
    stop(daemon, name)
    return first["time"] - started


def killed_recovery(cluster, daemon, project, name) -> dict:
    submit(daemon, project, name)
    # the checkpoint of step 5 validated (rank 0's), and every node's own copy catalogued
    wait_event(daemon, name, "job.checkpoint", where=lambda e: e["data"].get("step") == SAVE_EVERY)
    job, at = wait_step(cluster, daemon, name, 0, KILL_AT)
    victim = cluster.node(job["nodes"][1])
    pid = int((Path(victim.workdir) / ".coord" / "jobs" / job["run_id"] / "attempt-0" / "rank-1" / "pid").read_text())
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    _, first = wait_step(cluster, daemon, name, 1, 1)
    resumed = wait_event(daemon, name, "job.resume_from")
    events = events_of(daemon, name)
    phases = {e["kind"]: e["data"].get("seconds") for e in events
              if e["kind"] in ("job.attempt_ended", "job.stopped_ranks", "job.checkpoint_placed", "job.resume_from",
                               "job.launched")}
    # When each phase ended, from the kill; and the background copies to the head that overlapped the
    # relaunch (they share rank 0's link and these 2 cores with the new ranks).
    timeline = {e["kind"]: round(e["ts"] - killed, 2) for e in events
                if e["ts"] >= killed and e["kind"] in ("job.attempt_ended", "job.stopped_ranks", "job.restart",
                                                         "job.launched")}
    overlapping = [{"step": e["data"].get("step"), "started": round(e["ts"] - e["data"]["seconds"] - killed, 1),
                    "ended": round(e["ts"] - killed, 1)} for e in events
                   if e["kind"] == "job.replicated" and e["ts"] >= killed]
    steps = [r["time"] for r in train_records(progress_file(cluster, job, 0))]
    stop(daemon, name)
    gaps = sorted(b - a for a, b in zip(steps[1:], steps[2:]))  # after the first step, which compiles
    return {"recovery_s": first["time"] - killed, "killed_at_step": at["step"], "resumed_step": first["step"],
            "resume": resumed["data"], "phases": phases, "timeline": timeline, "copies_during_relaunch": overlapping,
            "first_step_after_launch_s": first["time"] - killed - timeline.get("job.launched", 0.0),
            "step_s": gaps[len(gaps) // 2] if gaps else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--rounds", type=int, default=3, help="cold launches and recoveries, alternating")
    args = parser.parse_args()
    root = short_tempdir("coord-bench-copies-")
    root.chmod(0o755)
    project = root / "project"
    write_model(project / "model", layers=args.layers, width=args.width)
    write_data(project / "data", train=96, valid=12)
    for path in [project, *project.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    params = (project / "model" / "model.safetensors").stat().st_size / 4
    memory = MemoryPeak()
    memory.start()
    out: dict = {"parameters": params, "cold_first_step_s": [], "kills": []}
    with NetnsCluster(NODES) as cluster:
        cluster.cap_links(args.rate)
        names = [n.name for n in cluster.nodes][:3]
        config = cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state", nodes=names)
        daemon = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", cluster.head_ns]).start()
        try:
            daemon.wait_for(all_up, 60, "all nodes up")
            synced = coord("sync", "--config", str(config), "--source", str(project), env=daemon.env, timeout=900)
            assert synced.returncode == 0, synced.stderr
            out["warmup_first_step_s"] = launch_to_first_step(cluster, daemon, project, "warmup")
            print(f"warm-up: {out['warmup_first_step_s']:.1f} s", file=sys.stderr, flush=True)
            for round_ in range(args.rounds):
                out["cold_first_step_s"].append(launch_to_first_step(cluster, daemon, project, f"cold{round_}"))
                out["kills"].append(killed_recovery(cluster, daemon, project, f"kill{round_}"))
                print(f"round {round_ + 1}: cold {out['cold_first_step_s'][-1]:.1f} s, recovery "
                      f"{out['kills'][-1]['recovery_s']:.1f} s", file=sys.stderr, flush=True)
            files = sorted(Path(cluster.node(names[0]).workdir).glob("checkpoints/kill0-*/attempt-0/*_adapters.safetensors"))
            out["checkpoint_bytes"] = files[0].stat().st_size if files else None
        finally:
            daemon.stop()
            cluster.cap_links(None)
    memory.stopped.set()
    out["peak_memory_bytes"] = memory.peak
    shutil.rmtree(root, ignore_errors=True)
    colds, kills = out["cold_first_step_s"], out["kills"]
    recoveries = [k["recovery_s"] for k in kills]
    print(json.dumps(out, indent=1))
    print(f"\n{params / 1e6:.0f}M-parameter llama, full fine-tune with Adam, checkpoint "
          f"{(out['checkpoint_bytes'] or 0) / 1e6:.0f} MB, 3 nodes, links {args.rate}, {os.cpu_count()} cores, "
          f"{args.rounds} rounds (cold launch, then a kill)\n")
    print("| measure | " + " | ".join(f"round {i + 1}" for i in range(len(kills))) + " | mean |")
    print("|---|" + "---:|" * (len(kills) + 1))

    def row(label: str, values: list[float], fmt: str = "{:.1f}") -> None:
        print(f"| {label} | " + " | ".join(fmt.format(v) for v in values) + f" | {fmt.format(sum(values) / len(values))} |")

    row("cold launch to first step (s)", colds)
    row(f"SIGKILL at step {KILL_AT} to first resumed step (s)", recoveries)
    row("recovery / cold launch", [r / c for r, c in zip(recoveries, colds)], "{:.2f}x")
    row("kill to the relaunch (s): detect, stop, choose", [k["timeline"].get("job.launched", float("nan")) for k in kills])
    row("relaunch to its first step (s)", [k["first_step_after_launch_s"] for k in kills])
    row("one training step, steady (s, median)", [k["step_s"] or float("nan") for k in kills])
    row("checkpoint bytes copied for the resume", [k["resume"].get("bytes_copied") or 0 for k in kills], "{:.0f}")
    print(f"\nratio of the means: {sum(recoveries) / sum(colds):.2f}x; peak memory in use on the machine: "
          f"{out['peak_memory_bytes'] / 2**30:.1f} GiB; head copies during a relaunch: "
          f"{[k['copies_during_relaunch'] for k in kills]}")


if __name__ == "__main__":
    main()
