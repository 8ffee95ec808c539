"""What the job tests on the multi-host cluster share: the tiny project, a daemon in the
head namespace, and small helpers to submit, follow and finish a job."""

from __future__ import annotations

import json
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from coordinator.cli.demo import last_train_step
from coordinator.cli.tinymodel import write_project
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir

TOTAL_STEPS = 60
TRAIN = ["python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data", "--fine-tune-type",
         "full", "--batch-size", "3", "--iters", str(TOTAL_STEPS), "--learning-rate", "1e-4"]


def readable_project(root: Path) -> Path:
    """The demo's tiny model project under ``root``, readable by every node's user (each reads its sync
    source as itself)."""
    root.chmod(0o755)
    project = write_project(root / "project")
    for path in [project, *project.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return project


@contextmanager
def daemon_on_first(netns_cluster, root: Path, count: int) -> Iterator[tuple[Path, DaemonProcess]]:
    """A daemon in the head's namespace over the cluster's first ``count`` nodes (its cluster file and
    state directory under ``root``, one of each per size), once it sees them all up; stopped after."""
    names = [n.name for n in netns_cluster.nodes][:count]
    config = netns_cluster.write_cluster_toml(root / f"cluster{count}.toml", state_dir=root / f"state{count}",
                                              nodes=names)
    daemon = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", netns_cluster.head_ns]).start()
    try:
        daemon.wait_for(all_up, 60, "all nodes up")
        yield config, daemon
    finally:
        daemon.stop()


@contextmanager
def tiny_project_and_daemon(netns_cluster, nodes: list[str] | None = None) -> Iterator[dict]:
    """The demo's tiny model project (readable by every node user) and a daemon that sees every node up.

    Yields a holder dict (daemon, project, root) so a test may replace the daemon it restarted.
    """
    root = short_tempdir()
    project = readable_project(root)
    config = netns_cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state", nodes=nodes)
    holder = {"daemon": DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", netns_cluster.head_ns]),
              "project": project, "root": root}
    holder["daemon"].start()
    try:
        holder["daemon"].wait_for(all_up, 30, "all nodes up")
        yield holder
    finally:
        holder["daemon"].stop()
        shutil.rmtree(root, ignore_errors=True)


def job_of(doc: dict, name: str) -> dict:
    return next(j for j in doc["jobs"] if j["name"] == name)


def submit(daemon: DaemonProcess, project: Path, name: str, *extra: str, command: list[str] = TRAIN) -> None:
    result = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(project),
                   "--save-every", "10", "--detach", *extra, "--", *command, env=daemon.env)
    assert result.returncode == 0, result.stderr


def rank_step(netns_cluster, job: dict, rank: int = 0) -> int:
    """The newest global step in a rank's own progress file (0 before the first)."""
    node = netns_cluster.node(job["nodes"][rank])
    return last_train_step(Path(node.workdir) / ".coord" / "jobs" / job["run_id"] / f"attempt-{job['attempt']}"
                           / f"rank-{rank}" / "progress.jsonl")


def at_step(netns_cluster, daemon: DaemonProcess, name: str, step: int, act, timeout: float = 600) -> tuple[dict, int]:
    """Run ``act(job)`` as soon as rank 0 of the job's attempt reports ``step``; returns the job and the step seen.

    The daemon's view of the step is a poll (or, on two busy cores, several seconds) behind the
    ranks, and this tiny run takes tens of milliseconds a step: waiting on the daemon alone let a
    run reach its end before the test acted. So rank 0's own progress file is read every 10 ms and
    the act happens in the same breath as the read.
    """
    doc = daemon.wait_for(lambda d: job_of(d, name)["state"] in ("failed", "stopped", "succeeded")
                          or (job_of(d, name)["state"] == "running" and bool(job_of(d, name)["nodes"])),
                          timeout, f"{name} running")
    job = job_of(doc, name)
    assert job["state"] == "running", job
    deadline = time.monotonic() + timeout
    asked = time.monotonic()
    while time.monotonic() < deadline:
        if time.monotonic() - asked >= 1.0:
            # An attempt that ended (on a loaded machine, a hang or a slow start) was followed by another:
            # its rank 0's file keeps the steps it reached, and its ranks are gone. Act on the newest.
            asked = time.monotonic()
            newest = job_of(daemon.status(), name)
            if newest["state"] == "running" and newest["nodes"] and newest["attempt"] != job["attempt"]:
                job = newest
        seen = rank_step(netns_cluster, job)
        if seen >= step:
            assert seen < (job["total_steps"] or seen + 1), f"{name} had reached its last step before the test acted"
            act(job)
            return job, seen
        time.sleep(0.01)
    story = "\n".join(f"{e['kind']}: {e['message']}" for e in events(daemon, name))
    raise AssertionError(f"{name} did not reach step {step} within {timeout} s (rank 0's file: step "
                         f"{rank_step(netns_cluster, job)});\n{story}")


def events(daemon: DaemonProcess, name: str | None = None) -> list[dict]:
    doc = daemon.status(events=5000)  # asked from this process: it is polled
    return [e for e in doc["events"] if name is None or e["message"].startswith(name + ":")]


def wait_event(daemon: DaemonProcess, name: str, kind: str, timeout: float, what: str, count: int = 1,
               where=lambda event: True) -> list[dict]:
    """Wait until the job has ``count`` events of ``kind`` (that satisfy ``where``); returns them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in events(daemon, name) if e["kind"] == kind and where(e)]
        if len(found) >= count:
            return found
        time.sleep(0.5)
    story = "\n".join(f"{e['kind']}: {e['message']}" for e in events(daemon, name))
    raise AssertionError(f"{name}: timed out after {timeout:g} s waiting for {what}; the job's events:\n{story}")


def finish(daemon: DaemonProcess, name: str, steps: int = TOTAL_STEPS) -> dict:
    """Wait for the job; it must have succeeded at its last step. Returns its final view and story."""
    result = coord("wait", "--quiet", "--json", "--config", str(daemon.config), name, env=daemon.env, timeout=900)
    final = json.loads(result.stdout)
    story = "\n".join(e["message"] for e in events(daemon, name))
    assert result.returncode == 0 and final["state"] == "succeeded" and final["step"] == steps, story
    final["story"] = story
    return final


def rank_pid(netns_cluster, job: dict, rank: int) -> int:
    node = netns_cluster.node(job["nodes"][rank])
    path = Path(node.workdir) / ".coord" / "jobs" / job["run_id"] / f"attempt-{job['attempt']}" / f"rank-{rank}" / "pid"
    return int(path.read_text())


def ranks_left(netns_cluster, pattern: str = "agent.mlx_lm_train|agent.train") -> dict[str, str]:
    """Training processes still running, per node (empty when none is left anywhere): each one's pid,
    state, kernel wait channel, seconds alive and command line, so that a failure says what they were
    doing (a process that outlived SIGKILL is in state D)."""
    left = {}
    for spec in netns_cluster.nodes:
        found = netns_cluster.exec_in(spec.name, ["pgrep", "-u", spec.user, "-f", pattern]).stdout.split()
        if found:
            described = netns_cluster.exec_in(spec.name, ["ps", "-o", "pid=,stat=,wchan:24=,etimes=,args=",
                                                          "-p", ",".join(found)]).stdout.strip()
            left[spec.name] = described or " ".join(found)
    return left
