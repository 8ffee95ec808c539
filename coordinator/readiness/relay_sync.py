"""The large files of a sync go through the relay: a model or data file that several nodes lack
crosses the head's uplink once, and the nodes pass it on to each other.

Small files stay in each node's own plan (batched over its SSH session): for them the cost is
per file, not per byte. A large file the relay could not bring to a node (no route to it, a
data port a firewall blocks) is put back in that node's plan and sent over its SSH session;
one the node itself could not hold (a full disk) is not: it would fail the same way.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, TypedDict

import anyio

from coordinator.relay.broadcast import HEAD, Outcome, RelayProgress, Source, Target, broadcast

if TYPE_CHECKING:
    from coordinator.nodes.cluster import Cluster
    from coordinator.readiness.consistency import Manifest
    from coordinator.readiness.push import Progress, SyncPlan
    from coordinator.relay.links import LinkBook

#: Files at least this large are relayed: below it a file is a few chunks and the batches win.
RELAY_MIN_BYTES = 8 << 20
#: Files relayed at once: each already fills the links of its chain.
PARALLEL_FILES = 2


class RelayResult(TypedDict):
    """What the relay brought one node."""

    files: int
    bytes: int
    failed: list[list[str]]  # [path, why] of each file that did not arrive
    own_failures: list[str]  # of those, the paths the node itself could not hold (its disk): not sent again
    seconds: float  # the slowest file's
    reroutes: int


def take_large_files(source: Manifest, plans: dict[str, SyncPlan]) -> dict[str, list[str]]:
    """{path: the nodes lacking it} for every large file of the plans, taken out of them."""
    wanted: dict[str, list[str]] = {}
    for name, plan in plans.items():
        keep = []
        for rel in plan.send:
            if source[rel][0] >= RELAY_MIN_BYTES:
                wanted.setdefault(rel, []).append(name)
                plan.bytes_to_send -= source[rel][0]
            else:
                keep.append(rel)
        plan.send = keep
    return wanted


async def relay_files(cluster: Cluster, links: LinkBook, source_dir: str, source: Manifest,
                      wanted: dict[str, list[str]], progress: Progress | None = None) -> dict[str, RelayResult]:
    """Send each wanted file to the nodes lacking it; per node: files and bytes relayed, and the
    files that did not arrive with why."""
    results: dict[str, RelayResult] = {}
    for nodes in wanted.values():
        for name in nodes:
            results.setdefault(name, {"files": 0, "bytes": 0, "failed": [], "own_failures": [], "seconds": 0.0,
                                      "reroutes": 0})
    if not wanted:
        return results
    sessions = cluster.sessions
    await links.refresh(sessions, sorted(results))
    limiter = anyio.Semaphore(PARALLEL_FILES)

    async def one(rel: str, nodes: list[str]) -> None:
        size, mode, sha = source[rel]
        async with limiter:
            async def report(update: RelayProgress) -> None:
                if progress is not None:
                    outcome = progress({**update, "file": rel})
                    if outcome is not None:
                        await outcome

            outcomes: dict[str, Outcome] = await broadcast(
                sessions, Source(HEAD, os.path.join(source_dir, rel), size, sha),
                [Target(name, rel, mode) for name in nodes], address=links.address,
                thunderbolt=links.thunderbolt, progress=report,
                events=lambda kind, text: cluster.record_event(kind, f"sync {rel}: {text}"))
        for name, outcome in outcomes.items():
            entry = results[name]
            entry["reroutes"] += outcome.reroutes
            if outcome.ok:
                entry["files"] += 1
                entry["bytes"] += size
                entry["seconds"] = max(entry["seconds"], outcome.seconds)
            else:
                entry["failed"].append([rel, outcome.detail])
                if outcome.node_failed:
                    entry["own_failures"].append(rel)

    order = {node.name: index for index, node in enumerate(cluster.config.nodes)}
    async with anyio.create_task_group() as tasks:
        for rel, nodes in wanted.items():
            # The chain follows the cluster file's order (then the cables): the same every time.
            tasks.start_soon(one, rel, sorted(nodes, key=lambda name: order.get(name, len(order))))
    return results
