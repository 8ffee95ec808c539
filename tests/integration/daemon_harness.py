"""Start a real coordd as a subprocess and talk to it with the real `coord` CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests import mlx_kernels
from tests.node_python import mlx_python

REPO = Path(__file__).resolve().parents[2]


def coord(*args: str, env: dict[str, str] | None = None, timeout: float = 60, prefix: list[str] | None = None,
          check: bool = False, python: str | None = None) -> subprocess.CompletedProcess:
    """Run the coord CLI as a user would (optionally through a prefix such as `ip netns exec`), with
    this Python or ``python`` (the demo's nodes run the Python that runs coord)."""
    argv = (prefix or []) + [python or sys.executable, "-m", "coordinator.cli.main", *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if check and result.returncode != 0:
        raise AssertionError(f"coord {' '.join(args)} exited {result.returncode}: {result.stderr}")
    return result


def write_local_cluster(root: Path, nodes: tuple[str, ...] | list[str], *, name: str = "local-test",
                        keepalive_s: float | None = None) -> Path:
    """A cluster file of local nodes (agents over the local transport, this environment's Python
    without PyTorch: tests/node_python.py), each with a workdir of its own under root; returns its path."""
    text = f'[cluster]\nname = "{name}"\nstate_dir = "{root}/state"\n'
    if keepalive_s is not None:
        text += f"\n[ssh]\nkeepalive_s = {keepalive_s}\n"
    for node in nodes:
        text += (f'\n[[nodes]]\nname = "{node}"\nhost = "local"\npython = "{mlx_python()}"\n'
                 f'workdir = "{root}/{node}"\n')
    config = root / "cluster.toml"
    config.write_text(text)
    return config


def short_tempdir(prefix: str = "coord-") -> Path:
    """Unix socket paths are short (104 bytes on macOS): keep test state dirs near /tmp."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


class DaemonProcess:
    def __init__(self, config: Path, *, env: dict[str, str] | None = None, prefix: list[str] | None = None,
                 log_file: Path | None = None, own_session: bool = False, python: str | None = None):
        self.config = config
        # The daemon's Python, which local nodes that name none run too: by default this environment
        # without PyTorch (tests/node_python.py); the PyTorch job tests pass their own.
        self.python = python or mlx_python()
        self.env = env
        self.prefix = prefix or []
        # As a service manager starts it: the leader of a session (and process group) of its own.
        self.own_session = own_session
        self.log_file = log_file or config.with_suffix(".log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> DaemonProcess:
        for workdir in mlx_kernels.local_workdirs(self.config):
            mlx_kernels.seed(workdir)  # as a node that ran a job before: MLX's kernels compiled already
        argv = self.prefix + [self.python, "-m", "coordinator.cli.main", "daemon", "--config", str(self.config),
                              "--log-file", str(self.log_file)]
        self.proc = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, start_new_session=self.own_session)
        return self

    def status(self, timeout: float = 30, events: int = 10) -> dict[str, Any]:
        """What `coord status --json` prints, asked from this process: the tests ask it hundreds of times
        while they wait, and a `coord` process each time (a tenth of a second of CPU) took that much from
        the ranks on a 2-core machine. The CLI itself is tested where it is the subject."""
        doc = self._ask_status(timeout, events)
        if doc is None:
            raise AssertionError(f"coordd did not answer status on {self._socket()}\n{self.log_tail()}")
        return doc

    def _socket(self) -> Path:
        """The daemon's socket, found as `coord` finds it under the daemon's own environment (its HOME and
        XDG_STATE_HOME place the default state directory)."""
        from coordinator.config.cluster_file import load_config
        from coordinator.control.address import socket_from_file

        saved = dict(os.environ)
        try:
            if self.env is not None:
                os.environ.clear()
                os.environ.update(self.env)
            return socket_from_file(str(self.config)) or load_config(self.config).socket
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def _ask_status(self, timeout: float, events: int = 10) -> dict[str, Any] | None:
        from coordinator.cli.client import CliError, ask_daemon

        try:
            doc = ask_daemon(self._socket(), "status", {"events": events, "all": False}, timeout=timeout)
        except CliError:
            return None  # not up yet, or going away: as a failed `coord status`
        return json.loads(json.dumps(doc))  # exactly what --json prints: lists, string keys

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        """Poll the status (as `coord status --json` gives it) until predicate holds; returns the last document."""
        deadline = time.monotonic() + timeout
        doc: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"coordd exited {self.proc.returncode}: {self.proc.stderr.read()}\n"
                                     f"{self.log_tail()}")
            found = self._ask_status(30)
            if found is not None:
                doc = found
                if predicate(doc):
                    return doc
            time.sleep(0.2)
        raise AssertionError(f"not {what} within {timeout} s; last status: {json.dumps(doc, indent=1)[:3000]}\n"
                             f"{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text().splitlines()[-lines:])
        except OSError:
            return "(no daemon log)"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int | None:
        for workdir in mlx_kernels.local_workdirs(self.config):
            mlx_kernels.harvest(workdir)
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)


def node_states(doc: dict[str, Any]) -> dict[str, str]:
    return {node["name"]: node["state"] for node in doc["nodes"]}


def all_up(doc: dict[str, Any]) -> bool:
    return bool(doc["nodes"]) and all(node["state"] == "up" for node in doc["nodes"])


def environment(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("COORD_SOCKET", None)
    env.pop("COORD_CONFIG", None)
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def installed_environment(**extra: str) -> dict[str, str]:
    """environment() for a benchmark: coord's modules compiled to bytecode, as an installed package's
    are, and kept (a shell with PYTHONDONTWRITEBYTECODE set would have every CLI run compile its sources,
    a cost no user pays)."""
    import compileall

    for package in ("agent", "coordinator", "shared"):
        compileall.compile_dir(str(REPO / package), quiet=1)
    env = environment(**extra)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env
