"""Benchmark: from a hang to the first resumed step, beside the step time and a plain recovery.

On the multi-host test cluster (network namespaces, one sshd, user and venv per node; root on
Linux), coord's trainer (``--trainer coord``) on the demo's tiny llama (2 layers, width 64), a
full fine-tune reporting every step, checkpoints every 10 steps. For each cluster size, three
runs, each timed from the ranks' own progress files and the daemon's events:

1. kill: rank 1 SIGKILLed after step 25, the plain recovery (its exit is seen in tenths of a
   second): the baseline "recovery" of the goal;
2. stop: rank 1 SIGSTOPped after step 25 (``kill -STOP``): a stopped process, its state T read
   by its node's agent;
3. collective: rank 1 stuck inside the all_sum of step 26 (``--debug-hang 1:26``: it never
   leaves the collective, as a JACCL rank spinning on a lost peer does; its peers wait in theirs).

The goal: hang to first resumed step at most ``max(20 s, 5 x the step time)`` plus the plain
recovery of run 1.

    sudo python bench/hang_recovery.py [--nodes 2 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HANG_AFTER = 25  # the step after which rank 1 is killed or stopped; the collective hang is in the next one
ITERS = 80
TRAIN = ["--model", "model", "--train", "--data", "data", "--fine-tune-type", "full", "--batch-size", "6",
         "--iters", str(ITERS), "--learning-rate", "1e-4", "--steps-per-report", "1"]
SCENARIOS = ("kill", "stop", "collective")
GOAL_FLOOR_S = 20.0
GOAL_STEPS = 5.0


# --- pure: what the progress files and events say ------------------------------------------

def train_records(text: str) -> list[dict[str, Any]]:
    """The whole ``train`` records of a progress file (a line still being written is skipped)."""
    records = []
    for line in text.splitlines():
        if '"train"' not in line or not line.endswith("}"):
            continue
        record = json.loads(line)
        if record.get("kind") == "train" and isinstance(record.get("time"), (int, float)):
            records.append(record)
    return records


def step_seconds(records: list[dict[str, Any]]) -> float | None:
    """The median time of one step, from consecutive train records (their own clock)."""
    gaps = [(b["time"] - a["time"]) / (b["step"] - a["step"])
            for a, b in zip(records, records[1:], strict=False) if b["step"] > a["step"]]
    return statistics.median(gaps) if gaps else None


def record_time(records: list[dict[str, Any]], step: int) -> float | None:
    return next((r["time"] for r in records if r["step"] == step), None)


def goal_s(step_s: float, recovery_s: float) -> float:
    """At most max(20 s, five steps) plus a plain recovery, from the hang to the first resumed step."""
    return max(GOAL_FLOOR_S, GOAL_STEPS * step_s) + recovery_s


@dataclass(frozen=True)
class Measure:
    scenario: str
    nodes: int
    step_s: float
    detected_s: float  # the hang (or kill) to the attempt's end, as the daemon's event has it
    resumed_s: float  # the hang (or kill) to the first step of the next attempt
    named: str = ""  # whom the hang event named


def table(measures: list[Measure]) -> str:
    """The Markdown table: each hang beside the step time, the plain recovery and the goal."""
    lines = ["| nodes | hang | step (s) | detected after (s) | hang to first resumed step (s) | goal (s) | met? "
             "| named |",
             "|---:|---|---:|---:|---:|---:|---|---|"]
    for m in measures:
        if m.scenario == "kill":
            lines.append(f"| {m.nodes} | SIGKILL (the plain recovery) | {m.step_s:.3f} | {m.detected_s:.2f} | "
                         f"{m.resumed_s:.2f} | - | - | - |")
            continue
        base = next((k for k in measures if k.scenario == "kill" and k.nodes == m.nodes), None)
        goal = goal_s(m.step_s, base.resumed_s) if base else None
        met = "-" if goal is None else ("yes" if m.resumed_s <= goal else "no")
        what = "SIGSTOP of one rank" if m.scenario == "stop" else "one rank stuck inside its all_sum"
        lines.append(f"| {m.nodes} | {what} | {m.step_s:.3f} | {m.detected_s:.2f} | {m.resumed_s:.2f} | "
                     f"{'-' if goal is None else f'{goal:.2f}'} | {met} | {m.named or '-'} |")
    return "\n".join(lines)


# --- the cluster ---------------------------------------------------------------------------

def _events(daemon: Any, name: str) -> list[dict[str, Any]]:
    from tests.integration.daemon_harness import coord

    doc = json.loads(coord("status", "--json", "--events", "300", "--config", str(daemon.config),
                           env=daemon.env).stdout)
    return [e for e in doc["events"] if e["message"].startswith(name + ":")]


def _wait_event(daemon: Any, name: str, kind: str, count: int = 1, timeout: float = 900) -> dict[str, Any]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        seen = _events(daemon, name)
        found = [e for e in seen if e["kind"] == kind]
        if len(found) >= count:
            return found[count - 1]
        failed = [e for e in seen if e["kind"] == "job.failed"]
        if failed:
            raise RuntimeError(f"{name} failed: {failed[-1]['message']}")
        time.sleep(0.2)
    raise RuntimeError(f"{name}: no {kind} event #{count}")


def _job(daemon: Any, name: str) -> dict[str, Any]:
    from tests.integration.daemon_harness import coord

    doc = json.loads(coord("status", "--json", "--config", str(daemon.config), env=daemon.env).stdout)
    return next(j for j in doc["jobs"] if j["name"] == name)


def _rank_dir(cluster: Any, job: dict[str, Any], attempt: int, rank: int) -> Path:
    node = cluster.node(job["nodes"][rank])
    return Path(node.workdir) / ".coord" / "jobs" / job["run_id"] / f"attempt-{attempt}" / f"rank-{rank}"


def run_one(cluster: Any, daemon: Any, project: Path, name: str, scenario: str, nodes: int) -> Measure:
    """One job with one hang (or kill) of rank 1, timed."""
    from tests.integration.daemon_harness import coord

    extra = ["--debug-hang", f"1:{HANG_AFTER + 1}"] if scenario == "collective" else []
    submitted = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(project), "--detach",
                      "--trainer", "coord", "--save-every", "10", "--max-restarts", "2", "--",
                      "python", "-m", "mlx_lm", "lora", *TRAIN, *extra, env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    _wait_event(daemon, name, "job.first_step")
    job = _job(daemon, name)
    progress = _rank_dir(cluster, job, 0, 0) / "progress.jsonl"
    while not (records := train_records(progress.read_text())) or records[-1]["step"] < HANG_AFTER:
        time.sleep(0.01)  # rank 0's own file: the daemon's view is a poll late
    if scenario == "collective":
        hung_at = record_time(records, HANG_AFTER) or time.time()  # rank 1 enters step 26's all_sum then
    else:
        pid = int((_rank_dir(cluster, job, 0, 1) / "pid").read_text())
        hung_at = time.time()
        os.kill(pid, signal.SIGKILL if scenario == "kill" else signal.SIGSTOP)
    ended = _wait_event(daemon, name, "job.attempt_ended")
    _wait_event(daemon, name, "job.first_step", count=2)
    resumed = train_records((_rank_dir(cluster, _job(daemon, name), 1, 0) / "progress.jsonl").read_text())
    hang = next((e for e in _events(daemon, name) if e["kind"] == "job.hang"), None)
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), name, env=daemon.env, timeout=900)
    assert json.loads(waited.stdout)["state"] == "succeeded", waited.stdout
    return Measure(scenario, nodes, step_seconds(records) or 0.0, ended["ts"] - hung_at, resumed[0]["time"] - hung_at,
                   hang["message"].split("the ranks that stopped: ", 1)[-1] if hang else "")


def main() -> None:
    from tests.cluster.jobs import daemon_on_first, readable_project
    from tests.cluster.netns import NetnsCluster
    from tests.integration.daemon_harness import coord, short_tempdir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 3], choices=[2, 3], help="cluster sizes")
    args = parser.parse_args()
    root = short_tempdir("coord-bench-hang-")
    project = readable_project(root)
    measures: list[Measure] = []
    with NetnsCluster() as cluster:
        for count in args.nodes:
            with daemon_on_first(cluster, root, count) as (config, daemon):
                assert coord("sync", "--config", str(config), "--source", str(project), env=daemon.env).returncode == 0
                for scenario in SCENARIOS:
                    measures.append(run_one(cluster, daemon, project, f"{scenario}{count}", scenario, count))
                    print(f"measured: {measures[-1]}", file=sys.stderr, flush=True)
    print(f"\ntiny llama (2 layers, width 64), --trainer coord, {os.cpu_count()} cores; rank 1 hangs after step "
          f"{HANG_AFTER}; goal: max({GOAL_FLOOR_S:g} s, {GOAL_STEPS:g} x step) + the plain recovery\n")
    print(table(measures))


if __name__ == "__main__":
    main()
