"""K processes of one command on one node, as one rank of a ``--launcher command`` job.

    python -m agent.local_ranks --ranks RANKS_JSON -- COMMAND...

``RANKS_JSON`` is a list of environments, one per process (``COORD_RANK``, ``COORD_LOCAL_RANK``, ...:
coordinator/launch/command_env.py), written by the daemon in the rank's directory. Every process runs
``COMMAND`` (a leading ``python`` is this Python) with its own environment laid over this one's, in
this process group, so that coord's signals to the rank (a stop, a SIGSTOP for a hang's stacks) reach
them all. Like torchrun's agent, the first process to fail ends the others: the rank's exit status is
that process's (128 + N for signal N), and 0 only when every process exited 0. SIGTERM, SIGINT and
SIGHUP are passed on to every process. Standard library only: it runs with whatever Python the node's
ranks use.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from types import FrameType

GRACE_S = 10.0  # how long the others have to end after one failed, before they are killed


def read_envs(path: str) -> list[dict[str, str]]:
    with open(path, encoding="utf-8") as handle:
        envs = json.load(handle)
    if not isinstance(envs, list) or not envs or not all(
            isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
            for env in envs):
        raise ValueError(f"{path}: expected a list of environments of NAME: value strings")
    return envs


def status_of(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def run(command: list[str], envs: list[dict[str, str]], grace: float = GRACE_S) -> int:
    if command and command[0] in ("python", "python3"):
        command = [sys.executable, *command[1:]]
    children = [subprocess.Popen(command, env={**os.environ, **env}) for env in envs]

    def forward(signum: int, _frame: FrameType | None) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    failed: int | None = None
    while True:
        running = [child for child in children if child.poll() is None]
        if failed is None:
            failed = next((status_of(c.returncode) for c in children if c.returncode not in (None, 0)), None)
            if failed is not None:
                ended_at = time.monotonic()
                for child in running:
                    child.terminate()
        elif running and time.monotonic() - ended_at > grace:
            for child in running:
                child.kill()
        if not running:
            return failed or 0
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.local_ranks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", required=True, help="the JSON list of each process's environment")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command each process runs")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    try:
        envs = read_envs(args.ranks)
    except (OSError, ValueError) as exc:
        print(f"agent.local_ranks: {exc}", file=sys.stderr)
        return 2
    return run(command, envs)


if __name__ == "__main__":
    sys.exit(main())
