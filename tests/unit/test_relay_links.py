"""The relay's link book: each node's topology asked once a session, and the pairs of the nodes made
only for a node whose answer is new (pure but for the sessions, which are plain stand-ins here)."""

from __future__ import annotations

import anyio

from coordinator.config.cluster_file import NodeConfig
from coordinator.launch import topology
from coordinator.nodes.session import UP
from coordinator.relay.links import LinkBook


class Session:
    """What the link book reads of a node's session: its state, generation and address, and its
    ``topology`` call (counted)."""

    def __init__(self, index: int) -> None:
        self.state, self.generation, self.peer_address = UP, 1, f"10.0.0.{index}"
        self.index, self.asked = index, 0

    async def call(self, method: str, timeout: float | None = None) -> dict:
        assert method == "topology"
        self.asked += 1
        return {"platform": "Linux", "interfaces": [
            {"name": "eth0", "kind": "ethernet", "up": True, "addresses": [f"10.0.0.{self.index}/24"]}]}


def test_nodes_reached_one_after_another_make_their_own_pairs_not_a_matrix_each(monkeypatch):
    """A checkpoint's copies reach the nodes one at a time: each new answer makes that node's pairs with
    the nodes known (a hundred nodes: a hundred rows, not a hundred matrices of ten thousand pairs)."""
    names = [f"n{i}" for i in range(1, 9)]
    book = LinkBook([NodeConfig(name=n, host=f"h{n}", python="python3", workdir="/w") for n in names])
    sessions = {n: Session(i) for i, n in enumerate(names, start=11)}
    made: list[tuple[str, str]] = []
    real = topology._pair
    monkeypatch.setattr(topology, "_pair", lambda a, b, *rest: made.append((a, b)) or real(a, b, *rest))

    for i in range(1, len(names)):
        anyio.run(book.refresh, sessions, [names[0], names[i]])
    assert len(made) == len(names) * (len(names) - 1) // 2  # every pair once
    assert all(session.asked == 1 for session in sessions.values())
    assert book.address("n1", "n8") == "10.0.0.18" and book.address("n8", "n1") == "10.0.0.11"

    made.clear()
    anyio.run(book.refresh, sessions, names)  # nothing new: nothing made, nobody asked again
    assert made == [] and all(session.asked == 1 for session in sessions.values())

    sessions["n3"].generation = 2  # n3 reconnected: asked again, its pairs made again, only those
    anyio.run(book.refresh, sessions, ["n3"])
    assert sessions["n3"].asked == 2 and len(made) == len(names) - 1
    assert all("n3" in pair for pair in made)
