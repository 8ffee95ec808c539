"""Replica consistency during training: data-parallel ranks must hold identical weights.

coord's trainer reports, every N steps, a SHA256 of each rank's trainable parameters. Once
every rank has reported a step, the majority fingerprint is the replicas' state and a rank
that differs is named. Pure, tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from coordinator.jobs.robust import majority_fingerprint


class ReplicaState(TypedDict):
    """An attempt's comparison so far, saved with the run's record (``JobRecord.replica_state``)."""

    last_agreed: int | None
    compared: int
    last_compared: int | None
    pending: dict[str, dict[str, str]]  # step -> rank -> fingerprint, for steps not every rank reported yet


class DivergenceEntry(TypedDict):
    attempt: int
    step: int
    nodes: list[str]  # the divergent ranks' nodes
    detail: str


class ReplicaSummary(TypedDict):
    """A run's replica checks across its attempts (``JobRecord.replica_check``; the plan shows them)."""

    steps_compared: int
    divergences: list[DivergenceEntry]  # the newest 10
    ranks: int
    attempt: int
    last_step: int | None
    last_agreed: int | None


@dataclass(frozen=True)
class Divergence:
    step: int
    ranks: list[int]  # every rank when there is no majority to tell which one is wrong
    majority: str | None
    last_agreed: int | None  # the last step at which every rank agreed, in this attempt

    def describe(self) -> str:
        who = ", ".join(str(r) for r in self.ranks)
        if self.majority is None:
            return f"replicas disagree at step {self.step} with no majority (ranks {who})"
        return (f"rank{'s' if len(self.ranks) > 1 else ''} {who} diverged from the majority's weights at step "
                f"{self.step}")


class ReplicaCheck:
    def __init__(self, ranks: int):
        self.ranks = ranks
        self.last_agreed: int | None = None
        self.compared = 0  # steps every rank reported
        self.last_compared: int | None = None
        self._pending: dict[int, dict[int, str]] = {}

    def add(self, step: int, rank: int, sha256: str) -> Divergence | None:
        """One rank's fingerprint; the divergence once every rank reported a step that differs."""
        seen = self._pending.setdefault(step, {})
        seen[rank] = sha256
        if len(seen) < self.ranks:
            return None
        del self._pending[step]
        self.compared += 1
        self.last_compared = max(step, self.last_compared or step)
        majority, divergent = majority_fingerprint(seen)
        if not divergent:
            self.last_agreed = max(step, self.last_agreed or step)
            return None
        return Divergence(step, divergent, majority, self.last_agreed)

    def state(self) -> ReplicaState:
        """What a daemon restarted later needs to go on comparing (saved with the job's record, beside
        the progress offsets: the fingerprints already read are not read again)."""
        return {"last_agreed": self.last_agreed, "compared": self.compared, "last_compared": self.last_compared,
                "pending": {str(step): {str(rank): sha for rank, sha in seen.items()}
                            for step, seen in self._pending.items()}}

    @classmethod
    def from_state(cls, ranks: int, state: ReplicaState | None) -> ReplicaCheck:
        check = cls(ranks)
        if state:
            check.last_agreed, check.compared = state.get("last_agreed"), state.get("compared", 0)
            check.last_compared = state.get("last_compared")
            check._pending = {int(step): {int(rank): sha for rank, sha in seen.items()}
                              for step, seen in (state.get("pending") or {}).items()}
        return check


def comparison_summary(summary: ReplicaSummary | None, check: ReplicaCheck, attempt: int, order: list[str],
                       found: Divergence | None) -> ReplicaSummary:
    """A job's replica checks so far, across attempts, after ``check`` compared one more step:
    how many steps were compared, the last one and the last that agreed, and the newest
    divergences (at most 10) with the nodes named."""
    previous: ReplicaSummary = summary or {"steps_compared": 0, "divergences": [], "ranks": check.ranks,
                                           "attempt": attempt, "last_step": None, "last_agreed": None}
    divergences = previous["divergences"]
    if found is not None:
        divergences = [*divergences[-9:], {
            "attempt": attempt, "step": found.step, "nodes": [order[r] for r in found.ranks if r < len(order)],
            "detail": found.describe()}]
    return {**previous, "steps_compared": previous["steps_compared"] + 1, "divergences": divergences,
            "ranks": check.ranks, "attempt": attempt, "last_step": check.last_compared,
            "last_agreed": check.last_agreed}
