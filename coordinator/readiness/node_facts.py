"""Facts a launcher plans from, asked of every node at once by the agent call it declares
(``Capabilities.node_facts``): the PyTorch launchers' ``torch_facts``, say. Nothing here knows
which call it is; what the answers mean is the launcher's business and its checks'."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio

from coordinator.nodes.session import UP
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.nodes.session import NodeSession

FACTS_TIMEOUT_S = 300.0  # a facts call may import a framework (and initialise a GPU) on a cold disk

#: One agent call: (node, method, arguments, timeout) -> its answer; RemoteError when it fails.
AgentCall = Callable[[str, str, dict[str, Any], float], Awaitable[Any]]


def session_call(sessions: Mapping[str, NodeSession]) -> AgentCall:
    """An ``AgentCall`` through the daemon's sessions: a node that is not up, or a call that times out,
    is a RemoteError that says so (what ``gather_facts`` keeps as why that node gave none)."""

    async def call(node: str, method: str, args: dict[str, Any], timeout: float) -> Any:
        session = sessions[node]
        if session.state != UP:
            raise RemoteError("unavailable", f"the node is {session.state}")
        try:
            return await session.call(method, args, timeout=timeout)
        except TimeoutError as exc:
            raise RemoteError("timeout", str(exc)) from None

    return call


async def gather_facts(call: AgentCall, method: str, pythons: Mapping[str, str]) -> tuple[dict[str, Any],
                                                                                         dict[str, str]]:
    """Each node's answer to ``method`` for its ranks' Python, all at once: (facts, why the others gave none)."""
    facts: dict[str, Any] = {}
    missing: dict[str, str] = {}

    async def one(name: str, python: str) -> None:
        try:
            facts[name] = await call(name, method, {"python": python}, FACTS_TIMEOUT_S)
        except RemoteError as exc:
            missing[name] = exc.message

    async with anyio.create_task_group() as tasks:
        for name, python in pythons.items():
            tasks.start_soon(one, name, python)
    return facts, missing


def facts_named(method: str) -> str:
    """How a message names the answers to ``method``: ``torch_facts`` -> "torch facts"."""
    return method.replace("_", " ")
