"""Which rank holds the others back: the rule that names a straggler, and clears it. Pure.

In data-parallel training every step waits for the slowest rank, so the wait shows on the fast
ranks (in their collectives) and the cause on the slow one: its **compute time**, a step's time
outside its collectives. Every rank reports it (coord's trainer with its heartbeat, a script with
``coord_script.report(step, compute_seconds=...)``), and the rule compares the ranks by it:

- A rank's **value** is the median of its compute times over the last ``window_s`` seconds (at
  least its last ``min_samples``, when its steps are slower than the window). A median, so that
  one slow step (a save or an evaluation inside a script's step, a collection of garbage) does not
  move it.
- The **score** of a rank is its value over the median of the ranks' values (the lower median:
  with two ranks, the faster one's), so a healthy job scores about 1 everywhere.
- A rank is **named** a straggler once its score has stayed at ``factor`` or more, and its value
  ``min_excess_s`` or more above the median, for ``hold_s`` seconds without a break. It is
  **cleared** once its score has stayed under ``clear_factor`` (or its excess under
  ``min_excess_s``) for ``hold_s``.
- Not counted: a rank's first ``warmup_samples`` reports of an attempt (the first steps fill a
  data loader's caches and warm its allocators; the compile of the first step is never a compute
  time at all), and a job of fewer than two reporting ranks (there is nothing to compare).
  Checkpoints and evaluations happen between steps on every rank at once: no compute time is
  reported while they run, and the values stay as they were.

With a heartbeat every 2 s and the defaults, a rank that turns slow is named about
``window_s / 2 + hold_s`` (about 10 s) after it does, well within the bound of 30 s or 20 steps,
whichever is longer; a rank whose steps take longer than the window is named after two of its slow
steps and ``hold_s``. The clock is the head's: when a report was read, so ranks on machines whose
clocks differ compare fairly."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import TypedDict


class StragglerEntry(TypedDict):
    """A rank named a straggler, as ``coord status --json`` shows it (``jobs[].stragglers``)."""

    rank: int
    node: str
    score: float  # its compute time over the ranks' median
    cause: str  # the likely cause, in words (coordinator/jobs/straggler_cause.py)
    cause_kind: str  # quota, thermal, memory, process, link or unknown
    since: float  # when it was named (the head's wall clock)


@dataclass(frozen=True)
class StragglerRule:
    factor: float = 1.5  # k: a rank this many times the median's compute time is slow
    clear_factor: float = 1.25  # under this, it has recovered (below factor: no flapping at the edge)
    window_s: float = 10.0
    min_samples: int = 3
    hold_s: float = 4.0
    min_excess_s: float = 0.002  # tiny steps' noise (a millisecond here or there) is never a straggler
    warmup_samples: int = 3

    def __post_init__(self) -> None:
        if not 1.0 < self.clear_factor <= self.factor:
            raise ValueError(f"a straggler's rule needs 1 < clear_factor <= factor, got {self.clear_factor} "
                             f"and {self.factor}")


@dataclass(frozen=True)
class Change:
    """A rank named (``named``) or cleared (``cleared``), with its score then."""

    kind: str
    rank: int
    score: float


@dataclass
class _Rank:
    samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=512))
    seen: int = 0  # reports of this attempt, warm-up ones included
    above_since: float | None = None  # slow without a break since
    below_since: float | None = None  # (while named) recovered without a break since
    named_at: float | None = None


class StragglerDetector:
    """The ranks of one attempt: ``add`` each compute time as it is read, ``evaluate`` after each
    poll for the ranks named or cleared since."""

    def __init__(self, rule: StragglerRule | None = None) -> None:
        self.rule = rule or StragglerRule()
        self._ranks: dict[int, _Rank] = {}
        self.scores: dict[int, float] = {}

    def add(self, rank: int, at: float, compute_s: float) -> None:
        state = self._ranks.setdefault(rank, _Rank())
        state.seen += 1
        if state.seen > self.rule.warmup_samples and compute_s >= 0:
            state.samples.append((at, compute_s))

    def value(self, rank: int, now: float) -> float | None:
        """The rank's compute time over the window (None before it has ``min_samples``)."""
        state = self._ranks.get(rank)
        if state is None or len(state.samples) < self.rule.min_samples:
            return None
        recent = [s for at, s in state.samples if at >= now - self.rule.window_s]
        if len(recent) < self.rule.min_samples:
            recent = [s for _, s in list(state.samples)[-self.rule.min_samples:]]
        return statistics.median(recent)

    @property
    def named(self) -> dict[int, float]:
        """The ranks named now, with their scores."""
        return {rank: self.scores.get(rank, 0.0) for rank, state in self._ranks.items() if state.named_at is not None}

    def named_for(self, rank: int, now: float) -> float:
        """How long ``rank`` has been named (0 when it is not)."""
        state = self._ranks.get(rank)
        return 0.0 if state is None or state.named_at is None else max(0.0, now - state.named_at)

    def evaluate(self, now: float) -> list[Change]:
        values = {rank: v for rank in self._ranks if (v := self.value(rank, now)) is not None}
        if len(values) < 2:
            self.scores = {}
            return []
        median = statistics.median_low(values.values())
        self.scores = {rank: (v / median if median > 0 else 1.0) for rank, v in values.items()}
        changes: list[Change] = []
        for rank, v in values.items():
            change = self._judge(rank, self._ranks[rank], self.scores[rank], v - median, now)
            if change is not None:
                changes.append(change)
        return changes

    def _judge(self, rank: int, state: _Rank, score: float, excess: float, now: float) -> Change | None:
        rule = self.rule
        slow = score >= rule.factor and excess >= rule.min_excess_s
        recovered = score < rule.clear_factor or excess < rule.min_excess_s
        if state.named_at is None:
            state.above_since = (state.above_since if state.above_since is not None else now) if slow else None
            if state.above_since is not None and now - state.above_since >= rule.hold_s:
                state.named_at, state.below_since = now, None
                return Change("named", rank, score)
            return None
        state.below_since = (state.below_since if state.below_since is not None else now) if recovered else None
        if state.below_since is not None and now - state.below_since >= rule.hold_s:
            state.named_at = state.above_since = state.below_since = None
            return Change("cleared", rank, score)
        return None
