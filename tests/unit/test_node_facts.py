"""Facts a launcher declares (``Capabilities.node_facts``), asked of every node at once."""

from __future__ import annotations

import anyio

from coordinator.readiness.node_facts import facts_named, gather_facts
from shared.rpc import RemoteError


def test_every_node_is_asked_the_declared_call_with_its_python_and_a_failure_is_named_not_raised():
    asked = []

    async def call(node, method, args, timeout):
        asked.append((node, method, args["python"]))
        await anyio.sleep(0.01 if node == "a" else 0)
        if node == "c":
            raise RemoteError("timeout", "c: no answer in 300 s")
        return {"node": node}

    facts, missing = anyio.run(gather_facts, call, "jax_facts", {"a": "/pa", "b": "/pb", "c": "/pc"})
    assert facts == {"a": {"node": "a"}, "b": {"node": "b"}}
    assert missing == {"c": "c: no answer in 300 s"}
    assert sorted(asked) == [("a", "jax_facts", "/pa"), ("b", "jax_facts", "/pb"), ("c", "jax_facts", "/pc")]
    assert facts_named("torch_facts") == "torch facts"
