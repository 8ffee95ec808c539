"""The job queue: a job holds its nodes while it runs; one whose nodes are busy waits.

Pure policy, tested without processes. First in, first out within a priority (higher first).
A later job may start before an earlier one that is still waiting only when it needs none of
the nodes the earlier one waits for, so it can never delay it; jobs on disjoint nodes run
side by side.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Waiting:
    run_id: str
    nodes: frozenset[str]
    priority: int
    submitted: float


def queue_order(waiting: list[Waiting]) -> list[Waiting]:
    return sorted(waiting, key=lambda w: (-w.priority, w.submitted, w.run_id))


def startable(waiting: list[Waiting], busy: set[str]) -> list[str]:
    """The waiting runs that may start now, given the nodes running jobs hold."""
    claimed = set(busy)
    start = []
    for job in queue_order(waiting):
        if not job.nodes & claimed:
            start.append(job.run_id)
        claimed |= job.nodes  # started, or reserved for it: no later job may take them
    return start


def positions(waiting: list[Waiting]) -> dict[str, int]:
    """1 for the job that starts next, and so on."""
    return {job.run_id: number for number, job in enumerate(queue_order(waiting), start=1)}
