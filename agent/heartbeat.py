"""A rank's heartbeat: what it is doing, appended to ``$COORD_PROGRESS_FILE`` by a thread of its own.

Every ``HEARTBEAT_S`` (and at once when the phase changes) the rank appends one ``heartbeat``
record: its phase (loading, compiling, training, saving, evaluating), the last step it finished,
how long it has gone without progress (``idle_s``: since that step, or since the phase began) and
whether it waits inside a collective now, and the mean compute time of the steps it finished
since the beat before (``compute_s``: a step's time outside its collectives, for coord's watch of
stragglers, ``coordinator/jobs/straggler.py``; a step finished while the rank still compiled is
not counted). coord's watch of hangs (``coordinator/jobs/hang.py``)
counts only the time in a phase that should make progress, so a long save or evaluation is not
taken for a hang, and a rank that stops moving is caught in seconds, not minutes.

The thread keeps beating while the training thread waits inside MLX (``mx.eval`` lets go of the
GIL), so the record says "waiting in a collective, idle 40 s", which names the rank the others
wait for. Used by coord's trainers on every rank; a script of one's own may use it too (the
agent's bundle is on the rank's PYTHONPATH)::

    from agent.heartbeat import Heartbeat
    beat = Heartbeat.from_environment().start()
    ...  # load the model
    beat.phase("training")
    for step in ...:
        with beat.collective():
            ...  # the step, with its all_sum
        beat.step(step, compute_s=...)  # the step's time outside the all_sum

Stdlib only: it runs with the node's Python.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.agent_api.progress import HeartbeatRecord

HEARTBEAT_S = 2.0


class Heartbeat:
    def __init__(self, path: str | None, *, step: int | None = None, every: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.every = every
        self._clock = clock
        self._lock = threading.Lock()
        self._phase = "loading"
        self._step = step
        self._progress_at = clock()
        self._collective = False
        self._compute_sum = 0.0  # compute seconds of the steps finished since the last beat written
        self._compute_steps = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_environment(cls) -> Heartbeat:
        """For this rank: its progress file and the step its attempt starts from ($COORD_STEP_OFFSET)."""
        offset = os.environ.get("COORD_STEP_OFFSET", "")
        return cls(os.environ.get("COORD_PROGRESS_FILE") or None, step=int(offset) if offset.isdigit() else None)

    def start(self) -> Heartbeat:
        if self.path and self._thread is None:
            self.beat()
            self._thread = threading.Thread(target=self._run, name="coord-heartbeat", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def phase(self, name: str) -> None:
        """A new phase is progress: it is written at once."""
        with self._lock:
            if name == self._phase:
                return
            self._phase = name
            self._progress_at = self._clock()
        self.beat()

    def step(self, step: int, *, compute_s: float | None = None) -> None:
        """A step finished (the global step); the next beat says so, with the mean of the steps'
        ``compute_s`` since the beat before. A step finished while compiling (the first) is not a
        compute time: its compile would look like a straggler."""
        with self._lock:
            self._step = step
            self._progress_at = self._clock()
            if compute_s is not None and compute_s >= 0 and self._phase == "training":
                self._compute_sum += compute_s
                self._compute_steps += 1

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """``phase`` for the block (saving, evaluating), then the phase it was in before."""
        with self._lock:
            before = self._phase
        self.phase(phase)
        try:
            yield
        finally:
            self.phase(before)

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """The block waits on the other ranks (an all_sum): its heartbeats say so."""
        with self._lock:
            self._collective = True
        try:
            yield
        finally:
            with self._lock:
                self._collective = False

    def record(self) -> HeartbeatRecord:
        with self._lock:
            beat: HeartbeatRecord = {"kind": "heartbeat", "time": time.time(), "phase": self._phase,
                                     "idle_s": round(max(0.0, self._clock() - self._progress_at), 3)}
            if self._step is not None:
                beat["step"] = self._step
            if self._collective:
                beat["collective"] = True
            if self._compute_steps:
                beat["compute_s"] = round(self._compute_sum / self._compute_steps, 6)
                beat["compute_steps"] = self._compute_steps
        return beat

    def beat(self) -> None:
        """One record, appended whole (one write to a file opened for appending); a failure to
        write (a full disk) costs the beat, never the training."""
        if not self.path:
            return
        record = self.record()
        if "compute_s" in record:
            with self._lock:  # said once: the next beat holds the steps after these
                self._compute_sum, self._compute_steps = 0.0, 0
        line = (json.dumps(record) + "\n").encode("utf-8")
        with contextlib.suppress(OSError):
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.beat()


def silent() -> Heartbeat:
    """A heartbeat without a file: every method works and nothing is written."""
    return Heartbeat(None)
