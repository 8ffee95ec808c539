"""Elastic shrink: which nodes an attempt runs on. Pure policy, tested without processes.

The batch that keeps the global batch on fewer ranks is coordinator/launch/batch.py's."""

from __future__ import annotations


def choose_nodes(configured: list[str], up: list[str], down_for: dict[str, float], *, min_nodes: int,
                 node_timeout: float) -> tuple[list[str] | None, str]:
    """The nodes the next attempt runs on, or None to keep waiting, with the reason.

    Every node that is up takes part (a node back from an outage rejoins here). A node that is
    down is waited for until it has been down ``node_timeout`` seconds; then it is left out if
    at least ``min_nodes`` remain.
    """
    missing = [n for n in configured if n not in up]
    if not missing:
        return list(configured), "every node is up"
    waiting = [n for n in missing if down_for.get(n, 0.0) < node_timeout]
    if waiting:
        return None, f"waiting for {', '.join(waiting)} (node timeout {node_timeout:g} s)"
    remaining = [n for n in configured if n in up]
    if len(remaining) < min_nodes:
        return None, (f"only {len(remaining)} of {len(configured)} nodes are up and --min-nodes is {min_nodes}: "
                      f"waiting for {', '.join(missing)}")
    return remaining, f"leaving out {', '.join(missing)} (down longer than {node_timeout:g} s)"
