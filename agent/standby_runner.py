"""``python -m agent.standby_runner --dir DIR --module MODULE --watch PID``: the next attempt's rank, warm.

A rank whose launcher is a Python module (torchrun, Accelerate, DeepSpeed) spends its first seconds
importing torch, and on a relaunch that import is on the recovery's critical path. While a job's
rank runs, its node's agent starts one of these beside it (``agent.standby``): a rank runner whose
child (``agent.preload``) has imported the launcher's module at the lowest priority and waits.

The agent claims it for the job's next rank by renaming ``DIR/open`` to ``DIR/claimed`` and writing
``DIR/go.json`` (the rank's directory, working directory, environment and arguments); this runner
hands the go to its child and, once the child says ``ok``, becomes that rank's runner exactly as
``agent.rank_runner`` is for a rank started cold (``pid``, ``runner.pid``, ``output.log``, ``exit`` in
the rank's directory). When the child cannot run it (its import failed, or the module's files
changed since), it removes ``DIR`` and goes, and the agent starts the rank cold.

It goes away by itself: retired by the agent (``DIR/retired``, or SIGTERM), when its directory is
removed, or when the rank it was started beside (``--watch``) has been gone ``LINGER_S`` with no
claim (a job that ended while its daemon was away). Stdlib only: it runs with the node's Python.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from types import FrameType

from agent import proc_state
from agent.rank_runner import become_subreaper, stop_group, watch_rank, write_atomically

TICK_S = 0.5  # how often it looks for a go without being woken (the agent wakes it with SIGUSR1)
WATCH_EVERY_S = 2.0  # how often it asks whether the rank it stands beside still runs
LINGER_S = 300.0  # how long it waits for a claim once that rank is gone (a relaunch may back off, up to 30 s)
GO_WAIT_S = 10.0  # a claim is followed by its go at once; without one this long, the claim was abandoned
AFTER_AT_MOST_S = 60.0  # the import starts once the rank reported progress, or after this long without
EARLY_OUTPUT_MAX = 64 << 10  # what the child prints before its go (an import's warnings), kept for the rank's log


def idle_cores() -> float:
    """Cores the node leaves idle, by its load over the last minute (runnable processes)."""
    try:
        return (os.cpu_count() or 1) - os.getloadavg()[0]
    except OSError:
        return 0.0


class Standby:
    def __init__(self, directory: str, module: str, watch: int, linger: float = LINGER_S,
                 after: str | None = None, *, idle: float):
        self.directory = directory
        self.module = module
        self.watch = watch
        self.linger = linger
        self.after = after
        self.idle_cores = idle
        self.started = time.monotonic()
        self.early = bytearray()
        self.child: subprocess.Popen[bytes] | None = None
        self.ack_r = -1
        self.wake_r = -1
        self.watched_gone_at: float | None = None
        self.next_watch = 0.0

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def start(self) -> None:
        # SIGUSR1 (the agent, once it wrote the go) ends the wait for the next tick at once.
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGUSR1, lambda _signum, _frame: None)
        write_atomically(self.path("standby.pid"), f"{os.getpid()} 0\n")
        write_atomically(self.path("open"), "")

    def spawn(self) -> None:
        """The child that imports the launcher's module, once its rank is past its launch (or this one is
        claimed): a launch's own imports come first."""
        ack_r, ack_w = os.pipe()
        self.child = subprocess.Popen(
            [sys.executable, "-m", "agent.preload", "--module", self.module, "--ack-fd", str(ack_w)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(ack_w,),
            preexec_fn=os.setpgrp)  # a group of its own, as a rank's child is (agent.rank_runner)
        os.close(ack_w)
        self.ack_r = ack_r
        write_atomically(self.path("standby.pid"), f"{os.getpid()} {self.child.pid}\n")

    def _spawn_due(self, now: float, claimed: bool) -> bool:
        """Whether to start importing: this standby was claimed; or its rank trains (it reported
        progress, or said nothing for a minute) and the node has a core to spare. Nodes whose ranks
        train on every core (CPU training) import only when the relaunch needs it: an import beside
        such ranks, even at the lowest priority, slowed them by 3-5% while it ran (bench/README.md)."""
        if self.child is not None:
            return False
        if claimed:
            return True  # the import is on a relaunch's critical path now: at once, whatever the load
        trains = now - self.started >= AFTER_AT_MOST_S or \
            (self.after is not None and os.path.exists(self.after) and os.path.getsize(self.after) > 0)
        return trains and idle_cores() >= self.idle_cores

    def wait_for_go(self) -> dict[str, object] | None:
        """The go once claimed; None when it is to go away instead."""
        claimed_at: float | None = None
        self.started = time.monotonic()
        while True:
            waits = [self.wake_r] + ([self.ack_r, self._out()] if self.child is not None else [])
            self._take_reads(select.select(waits, [], [], TICK_S)[0])
            if not os.path.isdir(self.directory) or os.path.exists(self.path("retired")):
                return None
            if os.path.exists(self.path("go.json")):
                with open(self.path("go.json"), encoding="utf-8") as handle:
                    return json.load(handle)
            now = time.monotonic()
            if claimed_at is None and not os.path.exists(self.path("open")):
                claimed_at = now
            if self._spawn_due(now, claimed_at is not None):
                self.spawn()
            if claimed_at is not None:
                if now - claimed_at > GO_WAIT_S:
                    return None  # the claim was abandoned
            elif self._unwanted(now) and self._retire():
                return None

    def _out(self) -> int:
        assert self.child is not None and self.child.stdout is not None
        return self.child.stdout.fileno()

    def _take_reads(self, ready: list[int]) -> None:
        if self.wake_r in ready:
            with contextlib.suppress(OSError):
                os.read(self.wake_r, 512)
        if self.child is not None and self._out() in ready:
            self._read_early(self._out())
        if self.ack_r in ready and "ready" in self._read_acks():
            write_atomically(self.path("ready"), "")

    def _unwanted(self, now: float) -> bool:
        """Whether no rank can want this standby any more: its child is gone, or the rank it stands
        beside has been gone LINGER_S."""
        if self.child is not None and self.child.poll() is not None:
            return True
        if now >= self.next_watch:
            self.next_watch = now + WATCH_EVERY_S
            if proc_state.alive(self.watch):
                self.watched_gone_at = None
            elif self.watched_gone_at is None:
                self.watched_gone_at = now
        return self.watched_gone_at is not None and now - self.watched_gone_at > self.linger

    def _retire(self) -> bool:
        """Take this standby off the table; False when the agent claimed it first (then its go follows)."""
        try:
            os.rename(self.path("open"), self.path("retired"))
        except FileNotFoundError:
            return False
        return True

    def _read_early(self, fd: int) -> None:
        with contextlib.suppress(OSError):
            chunk = os.read(fd, 65536)
            if len(self.early) < EARLY_OUTPUT_MAX:
                self.early += chunk[:EARLY_OUTPUT_MAX - len(self.early)]

    def _read_acks(self) -> list[str]:
        try:
            data = os.read(self.ack_r, 4096)
        except OSError:
            return []
        return data.decode(errors="replace").split()

    def ack_after_go(self, go: dict[str, object]) -> bool:
        """The go to the child; True once it says it runs it."""
        if self.child is None:
            self.spawn()
        assert self.child is not None and self.child.stdin is not None and self.child.stdout is not None
        try:
            self.child.stdin.write(json.dumps({key: go[key] for key in ("cwd", "env", "args")}).encode() + b"\n")
            self.child.stdin.close()
        except OSError:
            return False
        out = self.child.stdout.fileno()
        while True:
            ready, _, _ = select.select([self.ack_r, out], [], [], 1.0)
            if out in ready:
                self._read_early(out)
            if self.ack_r in ready:
                words = self._read_acks()
                if "ok" in words:
                    return True
                if "stale" in words or not words:  # no words: the child closed it, or died
                    return False
            elif self.child.poll() is not None:
                return False

    def stop(self) -> None:
        if self.child is not None and self.child.poll() is None:
            stop_group(self.child.pid, grace=2.0)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.child.wait(3.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agent.standby_runner")
    parser.add_argument("--dir", required=True, help="the standby's directory (claimed there by the agent)")
    parser.add_argument("--module", required=True, help="the launcher's module, run as python -m MODULE")
    parser.add_argument("--watch", type=int, required=True, help="the runner of the rank this one stands beside")
    parser.add_argument("--linger", type=float, default=LINGER_S,
                        help="seconds it waits for a claim once that rank is gone")
    parser.add_argument("--after", help="a file the rank writes once it trains (its progress): the import waits for "
                        "it, so that it never slows the launch")
    parser.add_argument("--idle-cores", type=float, default=1.0,
                        help="cores the node must leave idle for the import to run beside its training (the agent "
                        "passes agent.standby.IDLE_CORES)")
    args = parser.parse_args(argv)
    adopting = become_subreaper()
    standby = Standby(args.dir, args.module, args.watch, linger=args.linger, after=args.after,
                      idle=args.idle_cores)

    def leave(_signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(0)

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, leave)
    go: dict[str, object] | None = None
    try:
        standby.start()
        go = standby.wait_for_go()
        taken = go is not None and standby.ack_after_go(go)
    except SystemExit:
        taken = False
    if not taken or go is None:
        # Gone without a rank: the agent, if it claimed this one, sees the directory go and starts it cold.
        standby.stop()
        shutil.rmtree(args.dir, ignore_errors=True)
        return 0
    child = standby.child
    assert child is not None

    def stop_rank(_signum: int, _frame: FrameType | None) -> None:
        stop_group(child.pid)

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, stop_rank)  # until watch_rank sets its own, to the same effect
    # The rank's runner from here on, as agent.rank_runner is for a rank started cold.
    rank_dir = str(go["rank_dir"])
    os.chdir(str(go["cwd"]))
    with open(os.path.join(rank_dir, "output.log"), "ab", buffering=0) as log:
        code = watch_rank(child, rank_dir, log, pass_output=False, adopting=adopting, earlier=bytes(standby.early))
    shutil.rmtree(args.dir, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
