"""`coord demo`: a local cluster on this machine, started and shown in one command.

Two local nodes (agents over the local transport, no SSH), each with its own
workdir, under a daemon started for the demo. It shows the same status a real
cluster shows, then stops the daemon unless asked to keep it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from coordinator.control import DaemonNotRunning, call_daemon

DEMO_CLUSTER = """\
# Written by `coord demo`: two local nodes on this machine.
[cluster]
name = "demo"
state_dir = "{state}"
socket = "{socket}"

[[nodes]]
name = "local-a"
host = "local"
workdir = "{root}/node-a"

[[nodes]]
name = "local-b"
host = "local"
workdir = "{root}/node-b"
"""


def write_demo_cluster(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    # The socket goes in a short private path: Unix socket paths are limited to ~104 bytes.
    socket = Path(f"/tmp/coord-demo-{os.getuid()}") / "coord.sock"
    config = root / "cluster.toml"
    config.write_text(DEMO_CLUSTER.format(state=root / "state", socket=socket, root=root))
    return config


def run_demo(root: Path, *, keep: bool, timeout: float = 60.0) -> int:
    from coordinator.cli import make_console
    from coordinator.commands.status import render_status
    from coordinator.config import load_config

    console = make_console()
    config_path = write_demo_cluster(root.resolve())
    config = load_config(config_path)
    log_file = root / "coordd.log"
    console.print(f"starting coordd for a local cluster of {len(config.nodes)} nodes "
                  f"(cluster file {config_path}, log {log_file})")
    daemon = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "daemon", "--config", str(config_path),
                               "--log-file", str(log_file)], stdin=subprocess.DEVNULL, start_new_session=True)
    doc = None
    try:
        deadline = time.monotonic() + timeout
        shown = None
        while time.monotonic() < deadline:
            if daemon.poll() is not None:
                console.print(f"[red]coordd exited with status {daemon.returncode}; see {log_file}[/]")
                return 1
            try:
                doc = asyncio.run(call_daemon(config.socket, "status", {"events": 10}, timeout=10))
            except DaemonNotRunning:
                doc = None
            if doc is not None:
                progress = f"{doc['summary']['up']}/{doc['summary']['nodes']} nodes up"
                if progress != shown:
                    console.print(f"  {progress}")
                    shown = progress
                if doc["summary"]["up"] == doc["summary"]["nodes"]:
                    break
            time.sleep(0.2)
        else:
            console.print(f"[red]not every node came up within {timeout:g} s; see {log_file}[/]")
        if doc is not None:
            console.print()
            render_status(doc, console)
        up = doc is not None and doc["summary"]["up"] == doc["summary"]["nodes"]
        if keep:
            console.print(f"\ncoordd keeps running (pid {daemon.pid}). Ask it: coord status --config {config_path}"
                          f"\nStop it with: kill {daemon.pid}")
        return 0 if up else 1
    finally:
        if not keep and daemon.poll() is None:
            daemon.terminate()
            try:
                daemon.wait(20)
            except subprocess.TimeoutExpired:
                daemon.kill()
