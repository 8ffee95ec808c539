"""Which node sends a broadcast's bytes to which: pure functions over names and links.

A broadcast is a tree whose root is the source (the head, or the node holding the file).
Sending from the root to every node directly costs the root's uplink once per node; a
chain costs every link once, and pipelined by chunks it takes about as long as one copy.
So the default is a chain. The order prefers Thunderbolt cables (a node's next hop is one
it is cabled to, when there is one), then the order given. When the source has its own
cable to every receiver (a full Thunderbolt mesh), each cable is a separate link and the
source sends to every receiver directly: as fast, with no relay in the way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

Linked = Callable[[str, str], bool]


def plan_route(source: str, receivers: Iterable[str], thunderbolt: Linked = lambda a, b: False) -> dict[str, str]:
    """{receiver: the node (or source) that sends to it}."""
    order = [name for name in dict.fromkeys(receivers) if name != source]
    if not order:
        return {}
    if len(order) > 1 and all(thunderbolt(source, name) for name in order):
        return {name: source for name in order}
    parents: dict[str, str] = {}
    end = source
    left = list(order)
    while left:
        following = next((name for name in left if thunderbolt(end, name)), left[0])
        parents[following] = end
        left.remove(following)
        end = following
    return parents


def ancestors(parents: Mapping[str, str], node: str) -> list[str]:
    """The senders above ``node``, nearest first, ending with the source."""
    found: list[str] = []
    current = node
    while current in parents:
        current = parents[current]
        if current in found:
            raise ValueError(f"the route has a cycle through {current}")
        found.append(current)
    return found


def reroute(parents: Mapping[str, str], node: str, avoid: set[str]) -> str | None:
    """The nearest sender above ``node`` that is not in ``avoid`` (lost nodes, or ones that sent it
    bad bytes), or None when none is left."""
    return next((above for above in ancestors(parents, node) if above not in avoid), None)
