"""Whether a node may be trusted with the next call, as one run's supervisor sees it."""

from __future__ import annotations

from coordinator.jobs.effects import HEAD, NodePorts

UNREACHABLE_HOLD_S = 15.0  # longer than a session takes to notice its node is gone (keepalives)


class NodeHealth:
    def __init__(self, fx: NodePorts):
        self.fx = fx
        # node -> (session generation, time) of a call to it that failed: not trusted again until it
        # reconnects, or its session stays up for UNREACHABLE_HOLD_S (the call was merely slow)
        self._unreachable: dict[str, tuple[int, float]] = {}
        self.dropped: list[str] = []  # the run's nodes shrunk out as stragglers (its record's list)

    def up(self, name: str) -> bool:
        """Up, and not the same session that just failed a call (it may not have noticed yet)."""
        view = self.fx.node(name)
        failed = self._unreachable.get(name)
        if failed is not None and (view.generation > failed[0]
                                   or self.fx.monotonic() - failed[1] > UNREACHABLE_HOLD_S):
            self._unreachable.pop(name, None)
            failed = None
        return view.up and failed is None

    def usable(self, name: str) -> bool:
        """Up, not waiting for a reboot, and not shrunk out of this run as a straggler: a node a job's
        next attempt may run on."""
        return self.up(name) and self.fx.node(name).needs_reboot is None and name not in self.dropped

    def mark_unreachable(self, name: str) -> None:
        self._unreachable[name] = (self.fx.node(name).generation, self.fx.monotonic())

    def reachable(self, node: str) -> bool:
        """A place a checkpoint copy can be read from: the head, or a node of the cluster that is up."""
        return node == HEAD or (node in self.fx.node_names() and self.up(node))

    def same_machine(self, a: str, b: str) -> bool:
        """Two catalog places on one machine: the same node, or the head and nodes on the head's machine."""
        if a == b:
            return True
        on_head = [n == HEAD or (n in self.fx.node_names() and self.fx.on_head_machine(n)) for n in (a, b)]
        return all(on_head)
