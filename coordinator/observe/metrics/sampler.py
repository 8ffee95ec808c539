"""Every node's use, sampled into the metrics history: each node's agent asked for ``usage``
(``agent/usage.py``) every ``NODE_SAMPLE_S``, all nodes at once; the samples thinned now and then."""

from __future__ import annotations

import sqlite3
import time
from typing import TYPE_CHECKING

import anyio
import structlog

from coordinator.nodes.session import UP
from coordinator.observe.metrics.thinning import NODE_SAMPLE_S
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.nodes.session import NodeSession
    from coordinator.observe.metrics.history import MetricsHistory

log = structlog.get_logger("metrics")
THIN_EVERY_S = 600.0
USAGE_TIMEOUT_S = 15.0


async def sample_nodes(sessions: dict[str, NodeSession], history: MetricsHistory, *,
                       interval: float = NODE_SAMPLE_S) -> None:
    """Sample until cancelled, each node every ``interval`` and at once when it comes up; a node
    that is down or does not answer is skipped this time."""
    sampled: dict[str, tuple[int, float]] = {}  # node -> (session generation, time) of its last sample
    last_thinned = time.monotonic()
    while True:
        now = time.monotonic()
        due = [s for s in sessions.values() if s.state == UP and (
            sampled.get(s.node.name, (-1, 0.0))[0] != s.generation or now - sampled[s.node.name][1] >= interval)]
        for session in due:
            sampled[session.node.name] = (session.generation, now)
        async with anyio.create_task_group() as tasks:
            for session in due:
                tasks.start_soon(_sample_one, session, history)
        if now - last_thinned >= THIN_EVERY_S:
            last_thinned = now
            try:
                history.thin_nodes()
            except sqlite3.Error as exc:
                log.warning("node samples not thinned", error=str(exc))
        await anyio.sleep(min(1.0, interval))


async def _sample_one(session: NodeSession, history: MetricsHistory) -> None:
    try:
        sample = await session.call("usage", {}, timeout=USAGE_TIMEOUT_S)
    except (RemoteError, TimeoutError) as exc:
        log.debug("no usage sample", node=session.node.name, error=str(exc))
        return
    try:
        history.add_node_sample(session.node.name, sample)
    except (sqlite3.Error, KeyError, TypeError, ValueError) as exc:  # a full disk, an odd sample: skip it
        log.warning("usage sample not kept", node=session.node.name, error=str(exc))
