"""Facts a launcher declares (``Capabilities.node_facts``), asked of every node at once."""

from __future__ import annotations

from types import SimpleNamespace

import anyio

from coordinator.nodes.session import UP
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


class _Session:
    """A node's session as the daemon's effects read it: up, with a generation, answering calls."""

    def __init__(self, name: str, asked: list):
        self.node = SimpleNamespace(name=name, python=f"/{name}/python")
        self.state, self.generation, self._asked = UP, 1, asked

    async def call(self, method, args, timeout):
        self._asked.append((self.node.name, method))
        return {"node": self.node.name, "generation": self.generation}


def test_facts_are_asked_once_per_session_of_a_node_and_pre_flights_answers_spare_the_first_plan(monkeypatch):
    from coordinator.jobs import daemon_effects
    from coordinator.readiness import preflight

    asked: list = []
    sessions = {n: _Session(n, asked) for n in ("a", "b")}
    cluster = SimpleNamespace(config=SimpleNamespace(), sessions=sessions)
    effects = daemon_effects.DaemonEffects(cluster, links=None, metrics=None,  # type: ignore[arg-type]
                                           spawn=lambda task, name: None)

    async def ran_preflight(cluster, emit, **kwargs):  # what the PyTorch checks found: both nodes' facts
        return {"checks": [], "node_facts": {"method": "torch_facts",
                                             "facts": {"a": {"node": "a", "fresh": True}}}}

    monkeypatch.setattr(preflight, "run_preflight", ran_preflight)

    async def scenario():
        await effects.preflight(backend=None, source=None, nodes=["a", "b"], launcher="torchrun")
        first, missing = await effects._node_facts("torch_facts", ["a", "b"])
        assert missing == {} and first["a"] == {"node": "a", "fresh": True}  # pre-flight's, not asked again
        assert asked == [("b", "torch_facts")]
        again, _ = await effects._node_facts("torch_facts", ["a", "b"])
        assert again == first and asked == [("b", "torch_facts")]  # the same sessions: asked no more
        sessions["b"].generation = 2  # b reconnected: its Python may have changed
        await effects._node_facts("torch_facts", ["a", "b"])
        assert asked == [("b", "torch_facts"), ("b", "torch_facts")]

    anyio.run(scenario)
