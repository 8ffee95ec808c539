"""Per-rank launch scripts, so one mlx.launch command fits nodes that differ.

mlx.launch runs the same command on every host. Nodes differ in Python, workdir
and user, so that command is ``sh -c 'exec "$HOME/.coord/jobs/JOB/rank-$MLX_RANK.sh"'``
and each node's agent writes its own rank's script: it enters the node's
workdir, gives the rank a private TMPDIR (MLX's CPU backend compiles kernels
under $TMPDIR, where two users of one machine collide), sets the environment and
execs the command with the node's Python.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from typing import TYPE_CHECKING

from shared import protocol as p
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from shared.agent_api.ranks import PrepareRankReply, StartRankReply

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


def render_rank_script(*, workdir: str, python: str, argv: list[str], env: dict[str, str], tmpdir: str,
                       rank_dir: str, pass_output: bool = True) -> str:
    # A leading "python" means this node's Python.
    command = [python, *argv[1:]] if argv and argv[0] in ("python", "python3") else list(argv)
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


def prepare_rank(job: str, rank: int, workdir: str, python: str, argv: list[str], env: dict[str, str],
                 attempt: int = 0, pass_output: bool = True, files: dict[str, str] | None = None) -> PrepareRankReply:
    """Write the rank's script. ``pass_output``: the rank's output also goes to mlx.launch (a
    launch the user runs and watches); coord's own launches read it from the node instead.
    ``files``: {name: text} the rank's launcher reads (a per-node config), written in the rank's
    directory. ``{rank_dir}`` in a word of ``argv`` or ``env`` is that directory."""
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
    directory = os.path.join(jobs_dir(), job)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    # One TMPDIR per node, shared by its jobs: MLX's compiled CPU kernels are kept there, so a
    # new job does not compile them again (that costs tens of seconds on a small CPU).
    tmpdir = os.path.join(workdir, ".coord", "tmp")
    rank_dir = os.path.join(workdir, ".coord", "jobs", job, f"attempt-{attempt}", f"rank-{rank}")
    # A rank directory that already exists here is not this attempt's (it is prepared once, before
    # its rank starts): whatever it holds (progress, an exit status, a pid) must never be read as
    # this attempt's, so it goes.
    shutil.rmtree(rank_dir, ignore_errors=True)
    os.makedirs(rank_dir, exist_ok=True)
    env = {key: value.replace("{rank_dir}", rank_dir) for key, value in env.items()}
    argv = [word.replace("{rank_dir}", rank_dir) for word in argv]
    for name, text in (files or {}).items():
        with open(os.path.join(rank_dir, name), "w", encoding="utf-8") as handle:
            handle.write(text)
    script = render_rank_script(workdir=workdir, python=python, argv=list(argv), env=dict(env), tmpdir=tmpdir,
                                rank_dir=rank_dir, pass_output=pass_output)
    path = os.path.join(directory, f"rank-{rank}.sh")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(script)
    os.chmod(tmp, 0o700)
    os.replace(tmp, path)
    return {"script": path, "tmpdir": tmpdir, "rank_dir": rank_dir}


def start_rank(workdir: str, job: str, attempt: int, rank: int) -> StartRankReply:
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
    with open(os.path.join(directory, "start.log"), "ab") as errors:
        proc = subprocess.Popen(["/bin/sh", script], stdin=subprocess.DEVNULL, stdout=errors, stderr=errors,
                                cwd=workdir, start_new_session=True, close_fds=True)
    # Reaped here while this agent lives (its end is read from the rank's own files, not from here).
    threading.Thread(target=proc.wait, name=f"rank-{job}-{rank}", daemon=True).start()
    return {"pid": proc.pid}
