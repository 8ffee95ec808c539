"""`coord drill`: a fire drill on the user's own cluster.

A short real job (the demo's tiny model, synced into a directory of its own in each node's
workdir), one rank killed with SIGKILL, then, once the run trains again, one rank stopped with
SIGSTOP, and with ``--cut-node`` one node's link taken down a while (root on that node, by sudo).
For each fault: how long coord took to see it, to train again, and how many steps were done
twice, beside the step time and the cold launch. Afterwards the run is stopped and forgotten:
its job record, events and files go from the head and the nodes, and so does the drill's project.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.cli.client import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CliError, ask_daemon, resolve_socket
from coordinator.cli.json_output import print_json

if TYPE_CHECKING:
    from coordinator.commands.drill import FaultAnswer
    from coordinator.jobs.view import RunView
    from coordinator.observe.drill_report import DrillReport, Fault

#: Steps of the first attempt before the kill (the step time is measured over them), and of each
#: resumed attempt before the next fault: enough for a checkpoint (every SAVE_EVERY) to exist.
STEPS_BEFORE_FAULT, SAVE_EVERY = 20, 10
TERMINAL = ("succeeded", "failed", "stopped")


def batch_size(nodes: int) -> int:
    """Two examples per rank: mlx_lm wants a batch every rank's share divides."""
    return 2 * nodes


def drill_command(tree: str, iters: int, nodes: int) -> list[str]:
    """The drill's job: a real full fine-tune of the tiny model in the drill's own directory."""
    return ["python", "-m", "mlx_lm", "lora", "--model", f"{tree}/model", "--train", "--data", f"{tree}/data",
            "--fine-tune-type", "full", "--batch-size", str(batch_size(nodes)), "--iters", str(iters),
            "--learning-rate", "1e-4"]


def write_drill_project(directory: Path, nodes: int) -> None:
    """The demo's tiny model and data, with a validation set at least two batches long (mlx_lm needs one)."""
    from coordinator.cli.tinymodel import write_data, write_model

    write_model(directory / "model")
    write_data(directory / "data", train=max(200, 8 * batch_size(nodes)), valid=max(20, 2 * batch_size(nodes)))


class _Follow:
    """The drill's job, asked for often: its view, and the (time, step) samples of its first attempt."""

    def __init__(self, socket: Path, run_id: str, hint: str | None, deadline: float, say: Callable[[str], None]):
        self.socket, self.run_id, self.hint, self.deadline, self.say = socket, run_id, hint, deadline, say
        self.samples: list[tuple[float, int]] = []

    def job(self) -> RunView:
        job: RunView = ask_daemon(self.socket, "job", {"name": self.run_id}, config_hint=self.hint)
        if job["attempt"] == 0 and job["state"] == "running":
            self.samples.append((time.time(), job["step"]))
        return job

    def until(self, what: str, done: Callable[[RunView], bool]) -> RunView:
        while True:
            job = self.job()
            if done(job):
                return job
            if job["state"] in TERMINAL:
                raise CliError(f"the drill's job ended {job['state']} while waiting for {what}: "
                               f"{job.get('detail') or ''}".rstrip(": "), EXIT_FAILED)
            if time.monotonic() > self.deadline:
                raise CliError(f"the drill ran past --timeout while waiting for {what} (job {job['state']} at "
                               f"step {job['step']}, attempt {job['attempt']})", EXIT_FAILED)
            time.sleep(0.1)


def _fault(socket: Path, hint: str | None, run_id: str, fault: str, rank: int, seconds: float) -> Fault:
    asked = time.time()
    answer: FaultAnswer = ask_daemon(socket, "drill_fault", {"name": run_id, "fault": fault, "rank": rank,
                                                             "seconds": seconds}, config_hint=hint)
    # A link goes down a moment after the answer (the node's clock says when): timed from then.
    at = asked + max(0.0, answer["time"] - time.time()) if fault == "cut" else asked
    return {"fault": fault, "rank": rank, "node": answer["node"], "time": at, "step": answer["step"]}


def _nodes(args: argparse.Namespace, socket: Path, hint: str | None) -> list[str]:
    status = ask_daemon(socket, "status", {"events": 0}, config_hint=hint)
    known = {node["name"]: node["state"] for node in status["nodes"]}
    chosen = args.nodes or [name for name, state in known.items() if state == "up"]
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise CliError(f"--nodes: no node named {', '.join(unknown)} (nodes: {', '.join(known)})", EXIT_USAGE)
    busy = [job["name"] for job in status.get("jobs", []) if job["state"] in ("running", "starting", "recovering")
            and set(job.get("nodes") or []) & set(chosen)]
    if busy and not args.while_training:
        raise CliError(f"job {', '.join(busy)} trains on these nodes: a drill would wait for them and then take their "
                       "time (pass --nodes for free ones)", EXIT_USAGE)
    if len(chosen) < 2:
        raise CliError(f"a drill needs 2 nodes that are up, and has {len(chosen)} "
                       f"({', '.join(f'{n} {s}' for n, s in known.items())})", EXIT_USAGE)
    addresses = {node["name"]: node["address"] for node in status["nodes"]}
    if args.cut_node and addresses.get(chosen[-1]) == "local":  # said now, not after two faults
        raise CliError(f"--cut-node takes {chosen[-1]}'s link down, and {chosen[-1]} runs on the head's own machine "
                       "(host local): it has no link of its own", EXIT_USAGE)
    return chosen


def run_drill(args: argparse.Namespace, say: Callable[[str], None]) -> DrillReport:
    """The drill, start to end, its report as a document. The job is stopped and forgotten however it ends."""
    from coordinator.observe.drill_report import drill_figures, step_seconds

    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")
    nodes = _nodes(args, socket, hint)
    stamp = secrets.token_hex(4)
    tree, name = f"coord-drill-{stamp}", f"drill-{stamp}"
    report: DrillReport = {"job": name, "nodes": nodes, "status": "failed", "step_seconds": None,
                           "cold_launch_seconds": None, "faults": []}
    faults: list[Fault] = []
    with tempfile.TemporaryDirectory(prefix="coord-drill-") as source:
        say(f"making the tiny model and data set of the drill in {source}/{tree}")
        write_drill_project(Path(source) / tree, len(nodes))
        spec = {"name": name, "command": drill_command(tree, args.iters, len(nodes)), "source": source,
                "nodes": nodes,
                "save_every": SAVE_EVERY, "max_restarts": 3, "replica": "none", "keep": 2}
        job = ask_daemon(socket, "run", {"spec": spec, "resume": False}, config_hint=hint)
        run_id = report["run_id"] = job["run_id"]
        follow = _Follow(socket, run_id, hint, time.monotonic() + args.timeout, say)
        try:
            say(f"submitted {name} on {', '.join(nodes)} (run {run_id}); waiting for step {STEPS_BEFORE_FAULT}")
            # ... and until its step time is known: the steps seen moving twice (a busy daemon reads in bursts).
            job = follow.until(f"step {STEPS_BEFORE_FAULT}", lambda j: j["state"] == "running"
                               and j["step"] >= STEPS_BEFORE_FAULT and step_seconds(follow.samples) is not None)
            drills = [("kill", len(nodes) - 1), ("stop", 0)] + ([("cut", len(nodes) - 1)] if args.cut_node else [])
            for fault, rank in drills:
                attempt = job["attempt"]
                faults.append(_fault(socket, hint, run_id, fault, rank, args.cut_seconds))
                what = {"kill": f"SIGKILL to rank {rank}", "stop": f"SIGSTOP to rank {rank}",
                        "cut": f"the link down for {args.cut_seconds:g} s"}[fault]
                say(f"{what} on {faults[-1]['node']} at step {faults[-1]['step']}; waiting for the run to train again")
                job = follow.until("the run to train again", _trains_again(attempt))
            report["status"] = "ok"
        except CliError as exc:
            report["detail"] = str(exc)
        finally:
            ask_daemon(socket, "stop", {"name": run_id}, config_hint=hint)
            final = _stopped(follow)
            doc = ask_daemon(socket, "status", {"events": 10_000}, config_hint=hint)
            events = [event for event in doc["events"] if (event.get("data") or {}).get("run") == run_id]
            report.update(drill_figures(faults, events, follow.samples))
            report["restarts"] = final["restarts"] if final else None
            forgot = ask_daemon(socket, "forget_run", {"name": run_id, "tree": tree, "source": source},
                                config_hint=hint, timeout=300)
            report["left_behind"] = forgot["unreached"]
            if forgot["unreached"]:
                report["status"] = "failed"
                report.setdefault("detail", "files of the drill are left on " + ", ".join(
                    f"{node} ({why})" for node, why in forgot["unreached"].items()))
    return report


def _trains_again(attempt: int) -> Callable[[RunView], bool]:
    """Whether a later attempt than ``attempt`` runs and trained SAVE_EVERY steps past the first step it was
    seen at (so that it holds a checkpoint of its own before the next fault)."""
    seen: list[int] = []

    def done(job: RunView) -> bool:
        if job["attempt"] <= attempt or job["state"] != "running":
            return False
        if not seen:
            seen.append(job["step"])
        return job["step"] >= seen[0] + SAVE_EVERY

    return done


def _stopped(follow: _Follow) -> RunView | None:
    """The job once it stopped, after a drill that failed: None if it would not (the forget then says why)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        job = follow.job()
        if job["state"] in TERMINAL:
            return job
        time.sleep(0.2)
    return None


def cmd_drill(args: argparse.Namespace) -> int:
    from coordinator.observe.drill_report import table

    def say(line: str) -> None:
        if not args.json:
            print(line, flush=True)

    report = run_drill(args, say)
    if args.json:
        print_json(report)
    else:
        print()
        for line in table(report):
            print(line)
        if report["status"] != "ok":
            print(f"drill failed: {report.get('detail', '')}", file=sys.stderr)
        else:
            print(f"{report['restarts']} restarts; nothing of the drill is left on the head or the nodes")
    return EXIT_OK if report["status"] == "ok" else EXIT_FAILED
