"""Per-rank launch scripts, so one mlx.launch command fits nodes that differ.

mlx.launch runs the same command on every host. Nodes differ in Python, workdir
and user, so that command is ``sh -c 'exec "$HOME/.coord/jobs/JOB/rank-$MLX_RANK.sh"'``
and each node's agent writes its own rank's script: it enters the node's
workdir, gives the rank a private TMPDIR (MLX's CPU backend compiles kernels
under $TMPDIR, where two users of one machine collide), sets the environment and
execs the command with the node's Python.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent import mlx_kernels
from agent import standby as node_standby
from agent.torch_locks import clear_stale_locks
from shared import protocol as p
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from shared.agent_api.ranks import PrepareRankReply, RetireStandbysReply, StartRankReply

# A run id: the job's name (at most 64) and a suffix of its own. Letters, digits, '.', '_', '-' only:
# it becomes a directory name on every node.
JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def jobs_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".coord", "jobs")


def rank_command(job: str) -> list[str]:
    """The command mlx.launch runs on every host (expanded there, with that host's $HOME)."""
    return ["/bin/sh", "-c", f'exec "$HOME/.coord/jobs/{job}/rank-$MLX_RANK.sh"']


def bundle_root() -> str:
    """The directory holding this agent's packages (the installed bundle, or a checkout)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def node_command(python: str, argv: list[str]) -> list[str]:
    """A leading "python" means this node's Python."""
    return [python, *argv[1:]] if argv and argv[0] in ("python", "python3") else list(argv)


def render_rank_script(*, workdir: str, python: str, argv: list[str], env: dict[str, str], tmpdir: str,
                       rank_dir: str, pass_output: bool = True) -> str:
    command = node_command(python, argv)
    root = shlex.quote(bundle_root())
    lines = ["#!/bin/sh", "# Written by the coord agent: one rank of a job on this node.",
             f"cd {shlex.quote(workdir)} || exit 97",
             f"TMPDIR={shlex.quote(tmpdir)}; export TMPDIR",
             'mkdir -p "$TMPDIR"',
             # mlx.launch gives a one-host ring an empty hostfile, which MLX cannot parse; without
             # one, MLX runs the rank as a world of one, which is what a one-node job is.
             'if [ -n "${MLX_HOSTFILE:-}" ] && [ -z "$(tr -d \'[:space:]\' < "$MLX_HOSTFILE" 2>/dev/null)" ]; then '
             'unset MLX_HOSTFILE; fi',
             # coord's rank runner and trainers come from the agent's bundle.
             f'PYTHONPATH={root}${{PYTHONPATH:+:$PYTHONPATH}}; export PYTHONPATH']
    for key, value in sorted(env.items()):
        lines.append(f"{key}={shlex.quote(value)}; export {key}")
    runner = [python, "-m", "agent.rank_runner", "--dir", rank_dir, *([] if pass_output else ["--keep-output"]), "--"]
    lines.append("exec " + " ".join(shlex.quote(word) for word in runner + command))
    return "\n".join(lines) + "\n"


def _check_port_free(port: int) -> None:
    """RemoteError unless a TCP socket can listen on ``port`` on every address here."""
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise RemoteError(p.BAD_ARGS, f"port {port!r} is not a TCP port")
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a listener's own bind would
        probe.bind(("", port))
    except OSError as exc:
        raise RemoteError(p.BAD_ARGS, f"port {port} is in use on this node ({exc.strerror or exc}): the rank "
                          "could not listen there") from None
    finally:
        probe.close()


def prepare_rank(job: str, rank: int, workdir: str, python: str, argv: list[str], env: dict[str, str],
                 attempt: int = 0, pass_output: bool = True, files: dict[str, str] | None = None,
                 free_ports: list[int] | None = None) -> PrepareRankReply:
    """Write the rank's script. ``pass_output``: the rank's output also goes to mlx.launch (a
    launch the user runs and watches); coord's own launches read it from the node instead.
    ``files``: {name: text} the rank's launcher reads (a per-node config), written in the rank's
    directory. ``{rank_dir}`` in a word of ``argv`` or ``env`` is that directory. ``free_ports``: the
    TCP ports the rank will listen on (a coordinator's), each checked free here first: one in use
    fails the preparation with its number, rather than the rank with its program's own words."""
    if not JOB_NAME.match(job):
        raise RemoteError(p.BAD_ARGS, f"job name {job!r} must be letters, digits, '.', '_' or '-'")
    if rank < 0 or rank > 4096:
        raise RemoteError(p.BAD_ARGS, f"rank {rank} is out of range")
    for path, what in ((workdir, "workdir"), (python, "python")):
        if not isinstance(path, str) or not os.path.isabs(path):
            raise RemoteError(p.BAD_ARGS, f"{what} must be an absolute path, got {path!r}")
    if not argv or not all(isinstance(word, str) for word in argv):
        raise RemoteError(p.BAD_ARGS, "argv must be a non-empty list of strings")
    for key, value in env.items():
        if not ENV_NAME.match(key) or not isinstance(value, str):
            raise RemoteError(p.BAD_ARGS, f"environment entry {key!r} is not NAME=string")
    for name, text in (files or {}).items():
        if not isinstance(name, str) or not FILE_NAME.match(name) or not isinstance(text, str):
            raise RemoteError(p.BAD_ARGS, f"rank file {name!r} must be a plain file name with text")
    for port in free_ports or []:
        _check_port_free(port)
    directory = os.path.join(jobs_dir(), job)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    # One TMPDIR per node, shared by its jobs: MLX's compiled CPU kernels are kept there, so a
    # new job does not compile them again (that costs tens of seconds on a small CPU).
    tmpdir = os.path.join(workdir, ".coord", "tmp")
    with contextlib.suppress(OSError):
        mlx_kernels.remove_cut_kernels(tmpdir)  # a kernel an earlier rank's kill cut short breaks every job
    rank_dir = os.path.join(workdir, ".coord", "jobs", job, f"attempt-{attempt}", f"rank-{rank}")
    # A rank directory that already exists here is not this attempt's (it is prepared once, before
    # its rank starts): whatever it holds (progress, an exit status, a pid) must never be read as
    # this attempt's, so it goes.
    shutil.rmtree(rank_dir, ignore_errors=True)
    os.makedirs(rank_dir, exist_ok=True)
    env = {key: value.replace("{rank_dir}", rank_dir) for key, value in env.items()}
    _make_checkpoint_dir(workdir, env.get("COORD_CHECKPOINT_DIR"))
    argv = [word.replace("{rank_dir}", rank_dir) for word in argv]
    for name, text in (files or {}).items():
        with open(os.path.join(rank_dir, name), "w", encoding="utf-8") as handle:
            handle.write(text)
    script = render_rank_script(workdir=workdir, python=python, argv=list(argv), env=dict(env), tmpdir=tmpdir,
                                rank_dir=rank_dir, pass_output=pass_output)
    # What the script runs, for a warm launcher to run it the same way (agent.standby); beside the
    # script, in the agent's own directory (the environment may hold a user's secrets).
    launch = os.path.join(directory, f"rank-{rank}.json")
    with open(f"{launch}.{os.getpid()}.tmp", "w", encoding="utf-8") as handle:
        json.dump({"rank_dir": rank_dir, "python": python, "command": node_command(python, argv), "env": env,
                   "workdir": workdir, "tmpdir": tmpdir}, handle)
    os.replace(f"{launch}.{os.getpid()}.tmp", launch)
    path = os.path.join(directory, f"rank-{rank}.sh")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(script)
    os.chmod(tmp, 0o700)
    os.replace(tmp, path)
    return {"script": path, "tmpdir": tmpdir, "rank_dir": rank_dir}


def _make_checkpoint_dir(workdir: str, path: str | None) -> None:
    """The attempt's checkpoint directory, there when the rank starts: a script may write a file in it
    before any checkpoint (or without one, as a run resumed at its last step does)."""
    if not path:
        return
    from shared.paths import UnsafePath, resolve_under

    try:
        full = resolve_under(workdir, os.path.relpath(path, workdir) if os.path.isabs(path) else path)
    except (UnsafePath, ValueError) as exc:
        raise RemoteError(p.BAD_ARGS, f"COORD_CHECKPOINT_DIR {path!r} is not under the workdir: {exc}") from None
    os.makedirs(full, exist_ok=True)


def start_rank(workdir: str, job: str, attempt: int, rank: int, standby: bool = False) -> StartRankReply:
    """Start the rank's script, prepared for this attempt, on this node: for a launcher that runs on every
    node (torchrun, Accelerate, DeepSpeed) rather than from the head over SSH (mlx.launch).

    The rank runs in a session of its own, the child of no one that matters: it outlives this agent,
    the daemon's SSH session and the daemon (a restarted daemon re-attaches to it), and is stopped by
    ``stop_rank`` like a rank mlx.launch started. A rank already started is not started twice."""
    if not JOB_NAME.match(job) or not 0 <= attempt < 100000 or not 0 <= rank <= 4096:
        raise RemoteError(p.BAD_ARGS, f"bad job {job!r}, attempt {attempt} or rank {rank}")
    if not os.path.isabs(workdir):
        raise RemoteError(p.BAD_ARGS, f"workdir must be an absolute path, got {workdir!r}")
    script = os.path.join(jobs_dir(), job, f"rank-{rank}.sh")
    directory = os.path.join(workdir, ".coord", "jobs", job, f"attempt-{attempt}", f"rank-{rank}")
    try:
        with open(script, encoding="utf-8") as handle:
            prepared_for = f"--dir {shlex.quote(directory)} " in handle.read()
    except OSError:
        prepared_for = False
    if not prepared_for or not os.path.isdir(directory):
        raise RemoteError(p.REFUSED, f"rank {rank} of attempt {attempt} of {job} was not prepared on this node")
    if any(os.path.exists(os.path.join(directory, name)) for name in ("pid", "exit", "started")):
        raise RemoteError(p.REFUSED, f"rank {rank} of attempt {attempt} of {job} was started already")
    with open(os.path.join(directory, "started"), "w", encoding="utf-8") as marker:
        marker.write(f"{time.time()}\n")
    cleared = clear_stale_locks()  # a rank killed mid-build would leave this one waiting on it for good
    launch = _launch_of(os.path.join(jobs_dir(), job, f"rank-{rank}.json"), directory) if standby else None
    pid = _start_warm(job, directory, launch) if launch else None
    warm = pid is not None
    if pid is None:
        with open(os.path.join(directory, "start.log"), "ab") as errors:
            proc = subprocess.Popen(["/bin/sh", script], stdin=subprocess.DEVNULL, stdout=errors, stderr=errors,
                                    cwd=workdir, start_new_session=True, close_fds=True)
        # Reaped here while this agent lives (its end is read from the rank's own files, not from here).
        threading.Thread(target=proc.wait, name=f"rank-{job}-{rank}", daemon=True).start()
        pid = proc.pid
    if launch:
        # The next attempt's rank on this node, warm, started after this reply (it is not this
        # launch's business). The shell of a cold start execs the runner: ``pid`` is the rank's runner.
        threading.Thread(target=_start_standby, args=(job, f"{attempt}-{rank}", launch, pid, directory),
                         name=f"standby-{job}-{rank}", daemon=True).start()
    reply: StartRankReply = {"pid": pid, "warm": warm}
    if cleared:
        reply["cleared_locks"] = cleared
    return reply


def _start_standby(job: str, name: str, launch: _Launch, watch: int, directory: str) -> None:
    with contextlib.suppress(OSError):
        node_standby.start(os.path.join(jobs_dir(), job), name, python=launch.python, module=launch.module,
                           workdir=launch.workdir, env=launch.env, watch=watch,
                           after=os.path.join(directory, "progress.jsonl"))


@dataclass(frozen=True)
class _Launch:
    python: str
    module: str
    args: list[str]
    workdir: str
    env: dict[str, str]  # the launcher's whole environment, as the rank script gives it


def _launch_of(path: str, directory: str) -> _Launch | None:
    """The rank prepared in ``directory`` as a warm launcher would run it; None when it is not
    ``python -m MODULE``."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        if data["rank_dir"] != directory:
            return None  # prepared for another attempt
        python, workdir, command = data["python"], data["workdir"], list(data["command"])
        env = node_standby.launcher_env(os.environ, tmpdir=data["tmpdir"], root=bundle_root(), env=data["env"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    found = node_standby.launcher_module(command, python)
    if found is None or "MLX_HOSTFILE" in env or bundle_root() not in env["PYTHONPATH"].split(":"):
        return None  # not a module; an MLX rank; a PYTHONPATH of the job's own that leaves out coord's runner
    return _Launch(python, found[0], found[1], workdir, env)


def _start_warm(job: str, directory: str, launch: _Launch) -> int | None:
    """The rank run by a standby of this job, when one fits: its runner's pid, or None."""
    os.makedirs(launch.env["TMPDIR"], exist_ok=True)
    key = node_standby.import_key(launch.python, launch.module, launch.workdir, launch.env)
    go = {"rank_dir": directory, "cwd": launch.workdir, "env": launch.env, "args": launch.args}
    return node_standby.claim(os.path.join(jobs_dir(), job), key, go)


def retire_standbys(workdir: str, job: str) -> RetireStandbysReply:
    """The job ended: its standbys for this node's workdir go."""
    if not JOB_NAME.match(job):
        raise RemoteError(p.BAD_ARGS, f"job name {job!r} must be letters, digits, '.', '_' or '-'")
    return {"retired": node_standby.retire_all(os.path.join(jobs_dir(), job), workdir)}
