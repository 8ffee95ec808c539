"""Warm launchers: a job's next rank on this node, its launcher already imported.

A rank started by its node's agent (torchrun, Accelerate, DeepSpeed: ``python -m MODULE ...``)
imports its launcher's module, torch with it, before it starts a worker, which imports torch again.
On a relaunch those imports are most of the recovery. So when such a rank starts, the agent starts
a standby beside it (``agent.standby_runner``): it imports the module at the lowest priority and
waits. The job's next rank on this node (the relaunch) claims it and runs at once; a standby that
does not fit the rank (another Python, module, workdir or ``PYTHON*`` environment) is retired and
the rank starts cold, as it does when there is none or the claim fails. Each standby lives under
``~/.coord/jobs/<job>/standby-<attempt>-<rank>`` (the agent's own, mode 0700, like the rank scripts).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping

from agent import proc_state

HANDOVER_READY_S = 15.0  # a standby whose import is done takes its go within a tick
HANDOVER_IMPORTING_S = 120.0  # one still importing finishes it first (faster than a cold start would)
STANDBY_PREFIX = "standby-"
IDLE_CORES = 1.0  # the standby imports beside a training rank only where it has a core to itself


def launcher_module(command: list[str], python: str) -> tuple[str, list[str]] | None:
    """(module, its arguments) when ``command`` is ``PYTHON -m MODULE ARGS...`` with the node's Python."""
    if len(command) >= 3 and command[0] == python and command[1] == "-m" and command[2]:
        return command[2], command[3:]
    return None


def launcher_env(base: Mapping[str, str], *, tmpdir: str, root: str, env: Mapping[str, str]) -> dict[str, str]:
    """The environment the rank script (``agent.launch.render_rank_script``) gives its launcher."""
    out = dict(base)
    out["TMPDIR"] = tmpdir
    out["PYTHONPATH"] = root + (f":{base['PYTHONPATH']}" if base.get("PYTHONPATH") else "")
    out.update(env)
    return out


def import_key(python: str, module: str, workdir: str, env: Mapping[str, str]) -> dict[str, object]:
    """What a standby must share with a rank to run it: what its import saw."""
    return {"python": python, "module": module, "workdir": workdir,
            "python_env": {k: v for k, v in sorted(env.items()) if k.startswith("PYTHON")}}


def standby_dirs(job_dir: str) -> list[str]:
    try:
        names = sorted(os.listdir(job_dir))
    except OSError:
        return []
    return [os.path.join(job_dir, n) for n in names if n.startswith(STANDBY_PREFIX)]


def _read_json(path: str) -> dict[str, object] | None:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _pids(directory: str) -> tuple[int, int] | None:
    try:
        with open(os.path.join(directory, "standby.pid"), encoding="utf-8") as handle:
            runner, child = (int(word) for word in handle.read().split())
    except (OSError, ValueError):
        return None
    return runner, child


def start(job_dir: str, name: str, *, python: str, module: str, workdir: str, env: Mapping[str, str],
          watch: int, after: str | None = None) -> None:
    """A standby beside the rank whose runner is ``watch``, for the job's next rank on this node."""
    directory = os.path.join(job_dir, STANDBY_PREFIX + name)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, mode=0o700)
    with open(os.path.join(directory, "standby.json"), "w", encoding="utf-8") as handle:
        json.dump(import_key(python, module, workdir, env), handle)
    with open(os.path.join(directory, "runner.log"), "ab") as log:
        proc = subprocess.Popen([python, "-m", "agent.standby_runner", "--dir", directory, "--module", module,
                                 "--watch", str(watch), *(["--after", after] if after else []),
                                 "--idle-cores", str(IDLE_CORES)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                cwd=workdir, env=dict(env),
                                start_new_session=True, close_fds=True)
    # Reaped by a thread of its own while this agent lives; it outlives the agent otherwise.
    threading.Thread(target=proc.wait, name=f"standby-{name}", daemon=True).start()


def claim(job_dir: str, key: Mapping[str, object], go: Mapping[str, object]) -> int | None:
    """Run the rank described by ``go`` in a standby of this job that fits ``key``; the pid of its
    runner once it took the rank, or None (the caller starts the rank cold). Standbys for the same
    workdir that do not fit are retired."""
    for directory in standby_dirs(job_dir):
        info = _read_json(os.path.join(directory, "standby.json"))
        if info is None or info.get("workdir") != key["workdir"]:
            continue  # another node's (local nodes share this home), or not written yet
        if info != dict(key):
            retire(directory)
            continue
        ready = os.path.exists(os.path.join(directory, "ready"))
        try:
            os.rename(os.path.join(directory, "open"), os.path.join(directory, "claimed"))
        except FileNotFoundError:
            continue  # retired, or claimed by another rank
        pid = _hand_over(directory, go, HANDOVER_READY_S if ready else HANDOVER_IMPORTING_S)
        if pid is not None:
            return pid
    return None


def _hand_over(directory: str, go: Mapping[str, object], limit: float) -> int | None:
    tmp = os.path.join(directory, f"go.json.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(dict(go), handle)
    os.replace(tmp, os.path.join(directory, "go.json"))
    rank_dir = str(go["rank_dir"])
    runner_file = os.path.join(rank_dir, "runner.pid")
    pids = _pids(directory)
    if pids is not None:
        with contextlib.suppress(OSError):
            os.kill(pids[0], signal.SIGUSR1)  # wakes it at once rather than at its next tick
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if os.path.exists(runner_file):
            return pids[0] if pids else None
        if not os.path.isdir(directory) or pids is None or not proc_state.alive(pids[0]):
            break
        time.sleep(0.02)
    # Not taken in time (or it went): it must never run the rank beside the cold start that follows.
    _end(directory, pids)
    shutil.rmtree(directory, ignore_errors=True)
    for name in ("pid", "runner.pid", "exit"):  # taken just as it was ended: not this rank's now
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(rank_dir, name))
    return None


def _end(directory: str, pids: tuple[int, int] | None) -> None:
    """The standby's runner, then its child's group and whatever that child started, killed (the child
    read after the runner is gone: a runner may start it late)."""
    if pids is None:
        return
    with contextlib.suppress(OSError):
        os.kill(pids[0], signal.SIGKILL)
    child = (_pids(directory) or pids)[1]
    if not child:
        return
    table = proc_state.process_table()
    for pid in (child, *proc_state.descendants_in(table, child)):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.killpg(child, signal.SIGKILL)


def retire(directory: str) -> bool:
    """Take a standby off the table (its runner sees it within a tick and goes); False when it was
    claimed or gone already."""
    try:
        os.rename(os.path.join(directory, "open"), os.path.join(directory, "retired"))
    except FileNotFoundError:
        return False
    return True


def retire_all(job_dir: str, workdir: str) -> int:
    """Every standby of a job that ended, for the node whose workdir is ``workdir`` (local nodes
    share a home); how many were retired."""
    return sum(retire(directory) for directory in standby_dirs(job_dir)
               if (_read_json(os.path.join(directory, "standby.json")) or {}).get("workdir") == workdir)
