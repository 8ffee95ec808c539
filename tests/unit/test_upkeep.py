"""The agent's checkpoint upkeep runs at a lower priority than the ranks, and only there."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest

from agent import server, upkeep
from shared import protocol as p

LINUX = sys.platform.startswith("linux")


def _nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.fixture(autouse=True)
def fresh_pool():
    upkeep.shutdown()
    yield
    upkeep.shutdown()


@pytest.mark.skipif(not LINUX, reason="per-thread nice values are Linux's")
def test_upkeep_threads_run_at_nice_10_and_the_agents_own_threads_keep_theirs():
    own = _nice_of_this_thread()

    async def main() -> tuple[int, int]:
        in_upkeep = await upkeep.run(_nice_of_this_thread)
        beside = await asyncio.to_thread(_nice_of_this_thread)  # where the agent starts ranks
        return in_upkeep, beside

    in_upkeep, beside = asyncio.run(main())
    assert in_upkeep == max(own, upkeep.NICE)
    assert beside == own and _nice_of_this_thread() == own


@pytest.mark.skipif(not LINUX, reason="per-thread nice values are Linux's")
def test_a_process_started_beside_the_upkeep_keeps_the_agents_priority():
    """A child takes the nice value of the thread that forks it: a rank must never come from an upkeep thread."""

    def child_nice() -> int:
        out = subprocess.run([sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
                             capture_output=True, text=True, check=True)
        return int(out.stdout)

    async def main() -> tuple[int, int]:
        return await upkeep.run(child_nice), await asyncio.to_thread(child_nice)

    from_upkeep, from_agent_thread = asyncio.run(main())
    assert from_upkeep == max(_nice_of_this_thread(), upkeep.NICE)  # why no process may start there
    assert from_agent_thread == _nice_of_this_thread()


def test_checkpoint_rpcs_run_in_upkeep_threads_and_rank_starts_do_not(tmp_path):
    names: dict[str, str] = {}
    original = (server.node_ranks.list_checkpoints, server.node_launch.start_rank)

    def list_checkpoints(**_: object) -> dict[str, object]:
        names["list_checkpoints"] = threading.current_thread().name
        return {"dir": str(tmp_path), "checkpoints": []}

    def start_rank(**_: object) -> dict[str, object]:
        names["start_rank"] = threading.current_thread().name
        return {"pid": 1}

    server.node_ranks.list_checkpoints, server.node_launch.start_rank = list_checkpoints, start_rank
    try:
        table = server.build_dispatcher()

        async def main() -> None:
            args = {"workdir": str(tmp_path), "job": "j", "attempt": 0}
            await table.dispatch(p.Request(1, "list_checkpoints", args), emit=None)  # type: ignore[arg-type]
            await table.dispatch(p.Request(2, "start_rank", {**args, "rank": 0}), emit=None)  # type: ignore[arg-type]

        asyncio.run(main())
    finally:
        server.node_ranks.list_checkpoints, server.node_launch.start_rank = original
    assert names["list_checkpoints"].startswith("coord-upkeep")
    assert not names["start_rank"].startswith("coord-upkeep")
