"""The sessions' reconnect tries are cut short when another node comes back: a head whose own network
was down reaches every node again within a try of the first, not after each one's backoff."""

from __future__ import annotations

import anyio
import pytest

from coordinator.nodes.session import Backoff


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_node_back_wakes_every_session_sleeping_out_its_backoff(anyio_backend):
    backoff = Backoff()
    woke: list[float] = []

    async def session() -> None:
        started = anyio.current_time()
        await backoff.sleep(30.0)
        woke.append(anyio.current_time() - started)

    async with anyio.create_task_group() as tasks:
        for _ in range(3):
            tasks.start_soon(session)
        await anyio.sleep(0.1)
        backoff.node_back()
    assert len(woke) == 3 and max(woke) < 5.0
    started = anyio.current_time()
    await backoff.sleep(0.2)  # with no node back, a sleep is its own length
    assert anyio.current_time() - started >= 0.19
