"""Benchmark: false stragglers over a real training run of 30 minutes, with checkpoints and evaluations.

coord's trainer over ``--nodes`` nodes of the multi-host test cluster (MLX's ring between them,
the demo's tiny model, full fine-tune), a checkpoint every ``--save-every`` steps and mlx-lm's
validation every ``--steps-per-eval`` steps, for ``--minutes`` of wall time; nothing slows any rank
on purpose, and nothing else runs on the machine. Every ``job.straggler`` event the run raised is a
false alarm. The nodes are namespaces of one machine: with more ranks than cores (three on two),
the ranks take each other's CPU, a rank that gets less of it for a while is slower for real, and is
named with the other ranks as its cause; two nodes on two cores measure the rule itself. Root on
Linux (network namespaces).

    sudo python bench/straggler_false_alarms.py [--minutes 30] [--nodes 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    from tests.cluster.jobs import events, job_of, submit, tiny_project_and_daemon
    from tests.cluster.netns import NetnsCluster
    from tests.integration.daemon_harness import coord

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the run trains (default 30)")
    parser.add_argument("--save-every", type=int, default=100, help="steps between checkpoints (default 100)")
    parser.add_argument("--nodes", type=int, default=2, choices=[2, 3], help="nodes of the cluster (default 2)")
    parser.add_argument("--steps-per-eval", type=int, default=500, help="steps between validations (default 500)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stop cleans the cluster up as an end does
    name = "false-alarms"
    command = ["python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data",
               "--fine-tune-type", "full", "--batch-size", "6", "--iters", "10000000", "--learning-rate", "1e-5",
               "--steps-per-eval", str(args.steps_per_eval), "--val-batches", "10"]
    loads = []
    with NetnsCluster() as cluster, tiny_project_and_daemon(cluster, [n.name for n in cluster.nodes][:args.nodes]) \
            as holder:
        daemon = holder["daemon"]
        submit(daemon, holder["project"], name, "--trainer", "coord", "--save-every", str(args.save_every),
               "--hang-timeout", "600", command=command)
        daemon.wait_for(lambda d: job_of(d, name)["state"] in ("failed", "stopped")
                        or (job_of(d, name)["state"] == "running" and job_of(d, name)["step"]), 600, f"{name} training")
        if job_of(daemon.status(events=0), name)["state"] != "running":
            raise SystemExit(f"{name} did not train: {job_of(daemon.status(events=0), name)['error']}")
        started = time.monotonic()
        first = job_of(daemon.status(events=0), name)
        while time.monotonic() - started < args.minutes * 60:
            time.sleep(30)
            loads.append(os.getloadavg()[0])
            job = job_of(daemon.status(events=0), name)
            print(f"{(time.monotonic() - started) / 60:5.1f} min: step {job['step']}, state {job['state']}, "
                  f"stragglers {job['stragglers']}, load {loads[-1]:.1f}", file=sys.stderr, flush=True)
            if job["state"] != "running":
                break
        last = job_of(daemon.status(events=0), name)
        story = events(daemon, name)
        coord("stop", "--config", str(daemon.config), name, env=daemon.env, timeout=120)
    named = [e for e in story if e["kind"] == "job.straggler"]
    kinds = {}
    for event in story:
        kinds[event["kind"]] = kinds.get(event["kind"], 0) + 1
    minutes = (time.monotonic() - started) / 60
    steps = (last["step"] or 0) - (first["step"] or 0)
    print(json.dumps({"minutes": round(minutes, 1), "steps": steps, "events": kinds,
                      "stragglers": [e["message"] for e in named]}, indent=1), file=sys.stderr)
    print(f"\nFalse stragglers over {minutes:.1f} minutes of training on {args.nodes} nodes, {os.cpu_count()} cores\n")
    print("| minutes | steps | checkpoints | evaluations | restarts | stragglers named | load average (min-max) |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    print(f"| {minutes:.1f} | {steps} | {kinds.get('job.checkpoint', 0)} | "
          f"{steps // args.steps_per_eval} | {last['restarts']} | {len(named)} | "
          f"{min(loads):.1f}-{max(loads):.1f} |")
    for event in named:
        print(f"- {event['message']}")


if __name__ == "__main__":
    main()
