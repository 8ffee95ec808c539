"""`coord demo`: the whole story on one machine, in one command.

A local cluster of two nodes (agents over the local transport, no SSH), a tiny
llama-style model and data set made on the spot, a real `mlx_lm` full fine-tune
across both ranks under coord, one rank killed midway, the run resumed from its
newest checkpoint and finished. It prints the status and the recovery events.
Nothing is downloaded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.control.server import DaemonNotRunning, call_daemon
from coordinator.readiness.head_python import install_mlx_command, missing_training_modules

if TYPE_CHECKING:
    from coordinator.commands.status import StatusDocument

DEMO_CLUSTER = """\
# Written by `coord demo`: two local nodes on this machine.
[cluster]
name = "demo"
state_dir = "{state}"
socket = "{socket}"

[ssh]
keepalive_s = 1

[sync]
source = "{project}"
data = ["data/train.jsonl", "data/valid.jsonl"]
model = "model"

[[nodes]]
name = "local-a"
host = "local"
workdir = "{root}/node-a"

[[nodes]]
name = "local-b"
host = "local"
workdir = "{root}/node-b"
"""

ITERS, SAVE_EVERY, KILL_AT = 100, 10, 25  # room after the kill: a busy machine may read step 25 late
TRAIN = ["python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data",
         "--fine-tune-type", "full", "--batch-size", "4", "--iters", str(ITERS), "--learning-rate", "1e-4"]


def write_demo_cluster(root: Path) -> Path:
    from coordinator.cli.tinymodel import write_project

    root.mkdir(parents=True, exist_ok=True)
    project = root / "project"
    if not (project / "model" / "model.safetensors").exists():
        write_project(project)
    # The socket goes in a short private path: Unix socket paths are limited to ~104 bytes.
    socket = Path(f"/tmp/coord-demo-{os.getuid()}") / "coord.sock"
    config = root / "cluster.toml"
    config.write_text(DEMO_CLUSTER.format(state=root / "state", socket=socket, root=root, project=project))
    return config


def _ask(socket: Path, method: str, args: Mapping[str, object] | None = None) -> Any:
    """The daemon's answer, as the method declares it (the caller names its type)."""
    return asyncio.run(call_daemon(socket, method, args or {}, timeout=60))


def last_train_step(progress: Path) -> int:
    """The newest global step in a rank's progress file (0 before the first)."""
    try:
        lines = progress.read_bytes().splitlines()
    except FileNotFoundError:
        return 0
    for raw in reversed(lines):
        try:
            record = json.loads(raw)
        except ValueError:
            continue  # a line still being written
        if record.get("kind") == "train":
            return int(record["step"])
    return 0


def _wait(what: str, predicate, timeout: float, daemon: subprocess.Popen, log_file: Path, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise RuntimeError(f"coordd exited with status {daemon.returncode}; see {log_file}")
        try:
            value = predicate()
        except DaemonNotRunning:
            value = None
        if value:
            return value
        time.sleep(every)
    raise RuntimeError(f"{what}: not within {timeout:g} s; see {log_file}")


# Every checkpoint is validated and copied: true, but it would drown the recovery in the story.
_ROUTINE = {"job.checkpoint", "job.checkpoint_saved", "job.replicated"}


def missing_training_message() -> str | None:
    """What to install when this Python cannot train (the demo's nodes and launcher use it), or None."""
    missing = missing_training_modules()
    if not missing:
        return None
    return (f"coord demo trains with this Python, {sys.executable}, which cannot import "
            f"{' and '.join(missing)}. Install them into it with:\n  {install_mlx_command()}")


def run_demo(root: Path, *, keep: bool, timeout: float = 600.0) -> int:
    from coordinator.cli.console import make_console
    from coordinator.commands.jobs import render_job
    from coordinator.commands.status import render_status
    from coordinator.config.cluster_file import load_config

    problem = missing_training_message()
    if problem:
        print(problem, file=sys.stderr)
        return 1
    console = make_console()
    root = root.resolve()
    console.print(f"making a tiny llama model and data set in {root / 'project'}")
    config_path = write_demo_cluster(root)
    config = load_config(config_path)
    log_file = root / "coordd.log"
    console.print(f"starting coordd with {len(config.nodes)} local nodes (cluster file {config_path})")
    with open(root / "coordd.stderr", "ab") as stderr:  # the daemon keeps its own copy of the file
        daemon = subprocess.Popen([sys.executable, "-m", "coordinator.cli.main", "daemon", "--config",
                                   str(config_path), "--log-file", str(log_file)], stdin=subprocess.DEVNULL,
                                  stderr=stderr, start_new_session=True)
    job_name = f"demo-{time.strftime('%H%M%S')}"
    try:
        _wait("nodes up", lambda: (doc := _ask(config.socket, "status"))["summary"]["up"] == doc["summary"]["nodes"],
              60, daemon, log_file)
        console.print("both nodes are up; submitting a full fine-tune of "
                      f"{ITERS} steps, a checkpoint every {SAVE_EVERY}")
        _ask(config.socket, "run", {"spec": {"name": job_name, "command": TRAIN, "source": str(root / "project"),
                                             "save_every": SAVE_EVERY, "hang_timeout": 120}})
        job = _wait("the ranks to start", lambda: (j := _ask(config.socket, "job", {"name": job_name}))["state"]
                    in ("running", "failed", "stopped", "succeeded") and j, timeout, daemon, log_file)
        if job["state"] != "running":
            console.print(render_job(job), markup=False)
            return 1
        # Rank 0's own progress file, read often: a step takes tens of milliseconds here, far
        # less than the daemon's poll. The kill happens in the same breath as the read, so the
        # run cannot finish between "step 25 seen" and the signal.
        attempt_dir = Path(".coord", "jobs", job["run_id"], f"attempt-{job['attempt']}")
        first = next(n for n in config.nodes if n.name == job["nodes"][0])
        progress = Path(first.workdir, attempt_dir, "rank-0", "progress.jsonl")
        victim_rank = len(job["nodes"]) - 1
        victim_node = next(n for n in config.nodes if n.name == job["nodes"][victim_rank])
        pid_file = Path(victim_node.workdir, attempt_dir, f"rank-{victim_rank}", "pid")
        killed: list[tuple[int, int]] = []
        asked = [0.0]

        def kill_at_step_or_ended() -> bool:
            step = last_train_step(progress)
            if step >= KILL_AT:
                pid = int(pid_file.read_text())
                os.kill(pid, signal.SIGKILL)
                killed.append((step, pid))
                return True
            if time.monotonic() - asked[0] < 0.5:
                return False
            asked[0] = time.monotonic()  # a job that ended early is told at once, not after the timeout
            return _ask(config.socket, "job", {"name": job_name})["state"] != "running"

        _wait(f"step {KILL_AT}", kill_at_step_or_ended, timeout, daemon, log_file, every=0.01)
        if not killed:
            console.print(render_job(_ask(config.socket, "job", {"name": job_name})), markup=False)
            return 1
        step, pid = killed[0]
        console.print(f"at step {step}: killing rank {victim_rank} on {victim_node.name} (pid {pid}) with SIGKILL")
        final = _wait("the job to end", lambda: (j := _ask(config.socket, "job", {"name": job_name}))["state"]
                      in ("succeeded", "failed", "stopped") and j, timeout, daemon, log_file)
        console.print()
        doc: StatusDocument = _ask(config.socket, "status", {"events": 1000})
        render_status({**doc, "events": []}, console)
        console.print("\n[bold]the job's story[/] (checkpoint validations and copies left out)")
        for event in doc["events"]:
            if event["message"].startswith(job_name + ":") and event["kind"] not in _ROUTINE:
                stamp = time.strftime("%H:%M:%S", time.localtime(event["ts"]))
                console.print(f"  {stamp}  {event['message']}", soft_wrap=True, markup=False, highlight=False)
        console.print(f"\nlogs: coord logs --config {config_path} --rank 0 {job_name}")
        if keep:
            console.print(f"coordd keeps running (pid {daemon.pid}); stop it with: kill {daemon.pid}")
        return 0 if final["state"] == "succeeded" and final["restarts"] == 1 else 1
    except RuntimeError as exc:
        console.print(f"[red]demo failed: {exc}[/]")
        return 1
    finally:
        if not keep and daemon.poll() is None:
            daemon.terminate()
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
