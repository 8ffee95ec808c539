"""``python -m agent.rank_runner --dir RANKDIR -- COMMAND...``: one rank, watched.

mlx.launch starts this on each node (through the rank script). It starts the
training command in a process group of its own, so the whole rank can be killed
as one, and it leaves facts the agent reads without being the
rank's parent: ``pid`` (the rank's process group), ``exit`` (its exit status,
written when it ends), ``output.log`` (everything it printed, also passed on to mlx.launch).
With ``--keep-output`` the output stays on the node: coord's own launches read it through the
agent, so passing it on too would only cost every line an ssh round and a relay on the head
(about half a percent of a core per node at 50 steps/s); mlx.launch gets one line saying where
the output is. A SIGTERM or SIGHUP (mlx.launch
stopping, ssh hanging up) stops the rank's whole group. On macOS it holds a power assertion while the rank runs
(``agent.keep_awake``). Stdlib only: it runs with the node's Python.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import FrameType
from typing import BinaryIO

from agent import keep_awake

KILL_GRACE_S = 5.0
KEPT_OUTPUT_READ_S = 0.2  # how often the runner gathers a rank's output it keeps (and at most how late it sees its end)
KEPT_OUTPUT_BURST = 16 << 10  # a read this large is followed by the next at once
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
ORPHAN_GRACE_S = 5.0  # the longest the runner spends ending what its rank left behind
OUTPUT_DRAIN_S = 2.0  # the longest it waits for the last of the rank's output once the rank is over


def write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def stop_group(pgid: int, grace: float = KILL_GRACE_S) -> None:
    """SIGTERM the group, then SIGKILL whatever is left after the grace period."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    timer = threading.Timer(grace, _kill_group, args=(pgid,))
    timer.daemon = True
    timer.start()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agent.rank_runner")
    parser.add_argument("--dir", required=True, help="where pid, exit and output.log go")
    parser.add_argument("--keep-output", action="store_true",
                        help="keep the rank's output in output.log only, instead of also passing it on")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command")
    os.makedirs(args.dir, exist_ok=True)
    for stale in ("exit", "pid"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(args.dir, stale))
    with open(os.path.join(args.dir, "output.log"), "ab", buffering=0) as log:
        return run_rank(command, args.dir, log, pass_output=not args.keep_output)


def become_subreaper() -> bool:
    """On Linux, adopt whatever this rank leaves when its process dies: torchrun starts each worker in
    a session of its own, and a torchrun that is killed leaves them running, out of the rank's group,
    forever (they hold the training's memory and its ports). As the subreaper, the runner becomes
    their parent and ends them. Elsewhere (macOS) nothing happens."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def end_orphans(own: int, grace: float = ORPHAN_GRACE_S) -> None:
    """Kill (with their process groups) the processes this runner adopted once its child had died,
    and reap them, until none is left or ``grace`` seconds have passed."""
    from agent import proc_state

    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        table = proc_state.process_table()
        left = [pid for pid in proc_state.descendants_in(table, os.getpid())
                if table[pid][2] != own and table[pid][0] not in ("Z", "X")]
        if not left:
            return
        for pid in left:
            with contextlib.suppress(OSError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def copy_output(stream: BinaryIO, log: BinaryIO, out: BinaryIO, pass_output: bool) -> None:
    """Everything the rank prints, into ``log`` (and ``out`` with ``pass_output``), until the pipe closes."""
    while True:
        chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(4096)
        if not chunk:
            return
        log.write(chunk)
        if not pass_output:
            # Nobody waits on these lines (the agent reads the log every few seconds): a pause
            # between reads gathers a busy rank's lines into one write, not one per line. Not after
            # a large read: a rank printing that much must not wait on a full pipe.
            if len(chunk) < KEPT_OUTPUT_BURST:
                time.sleep(KEPT_OUTPUT_READ_S)
            continue
        try:
            out.write(chunk)
            out.flush()
        except OSError:
            pass_output = False  # mlx.launch went away; the log on the node still has everything


def run_rank(command: list[str], directory: str, log: BinaryIO, pass_output: bool = True) -> int:
    """Start the rank, copy its output to ``log`` (and to our stdout with ``pass_output``), and
    record its pid and exit status in ``directory``; returns that status."""
    adopting = become_subreaper()
    try:
        # A process group of its own, so that the whole rank can be killed as one, but not a
        # session of its own: Linux's autogroup scheduler gives every session its own share of
        # the CPU, which made local ranks 30-40% slower than the same ranks under mlx.launch.
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 preexec_fn=os.setpgrp)  # process_group=0 needs Python 3.11; nodes may have 3.10
    except OSError as exc:
        log.write(f"coord: cannot start {command[0]}: {exc}\n".encode())
        write_atomically(os.path.join(directory, "exit"), "127\n")
        return 127
    return watch_rank(child, directory, log, pass_output=pass_output, adopting=adopting)


def watch_rank(child: subprocess.Popen[bytes], directory: str, log: BinaryIO, *, pass_output: bool,
               adopting: bool, earlier: bytes = b"") -> int:
    """The rank's process ``child`` (in a process group of its own, its output on a pipe) from here
    to its end: its pid and exit status in ``directory``, its output (``earlier`` first) in ``log``."""
    if earlier:
        log.write(earlier)
    write_atomically(os.path.join(directory, "pid"), f"{child.pid}\n")
    write_atomically(os.path.join(directory, "runner.pid"), f"{os.getpid()}\n")
    awake = keep_awake.hold_awake(child.pid, log)

    def forward(signum: int, _frame: FrameType | None) -> None:
        stop_group(child.pid)

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, forward)
    out = sys.stdout.buffer
    if not pass_output:
        with contextlib.suppress(OSError):  # mlx.launch went away: the rank and its log carry on
            out.write(f"coord: the output of this rank is in {os.path.join(directory, 'output.log')} "
                      f"on {socket.gethostname()}\n".encode())
            out.flush()
    stream = child.stdout
    assert stream is not None  # stdout=PIPE
    # The output is copied by a thread of its own: the rank has ended when its process has, even
    # while processes it left behind (a killed launcher's workers) still hold the pipe open.
    copier = threading.Thread(target=copy_output, args=(stream, log, out, pass_output), daemon=True)
    copier.start()
    code = exit_status(child.wait())
    if adopting:
        end_orphans(os.getpgid(0))
    copier.join(OUTPUT_DRAIN_S)
    write_atomically(os.path.join(directory, "exit"), f"{code}\n")
    keep_awake.release(awake)
    return code


if __name__ == "__main__":
    sys.exit(main())
