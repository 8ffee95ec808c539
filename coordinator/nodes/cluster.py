"""All node sessions of one cluster, and what they report into durable state."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
import structlog

from coordinator.config.cluster_file import ClusterConfig
from coordinator.nodes.agent_bundle import AgentBundle
from coordinator.nodes.reboot_marks import new_mark, rebooted
from coordinator.nodes.session import UP, Backoff, Connect, NodeSession, NodeViewDict, open_transport
from coordinator.store.state import EventRecord, RebootMark, StateStore

if TYPE_CHECKING:
    from shared.agent_api.common import JsonObject

log = structlog.get_logger("cluster")
RECENT_EVENTS = 50


class ClusterNodeView(NodeViewDict):
    """A node's view with where it is and what runs it there (``Cluster.node_views``)."""

    user: str | None
    host: str
    workdir: str
    python: str
    needs_reboot: RebootMark | None  # kept out of jobs until it comes back from a reboot


class Cluster:
    def __init__(self, config: ClusterConfig, state: StateStore, bundle: AgentBundle, *,
                 connect: Connect = open_transport) -> None:
        self.config = config
        self.state = state
        self.bundle = bundle
        self.backoff = Backoff()  # a node back wakes the others' reconnect tries
        self.sessions = {
            node.name: NodeSession(node, config.ssh, bundle, on_change=self._node_changed, connect=connect,
                                   backoff=self.backoff)
            for node in config.nodes
        }
        # Status is answered from memory so it never waits on SQLite or a node.
        self.events: collections.deque[EventRecord] = collections.deque(
            state.recent_events(RECENT_EVENTS), maxlen=RECENT_EVENTS)
        # Called with every event once it is stored (the alerts); each must return at once.
        self.listeners: list[Callable[[EventRecord], None]] = []
        self.reboot_marks: dict[str, RebootMark] = state.reboot_marks()
        self._forget_removed_nodes()

    def _forget_removed_nodes(self) -> None:
        for name, row in self.state.nodes().items():
            if name not in self.sessions and row["state"] != "removed":
                self.state.save_node(name, row["address"], "removed", "no longer in the cluster file", None, None)

    async def run(self) -> None:
        """Connect to every node at once and keep them connected until cancelled."""
        async with anyio.create_task_group() as tasks:
            for session in self.sessions.values():
                tasks.start_soon(session.run, name=f"node:{session.node.name}")

    def record_event(self, kind: str, message: str, *, node: str | None = None,
                     data: JsonObject | None = None) -> None:
        event = self.state.add_event(kind, message, node=node, data=data)
        self.events.append(event)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # the edge: whoever recorded the event (a job's supervisor) goes on
                log.exception("event listener failed", kind=kind)

    async def _node_changed(self, session: NodeSession, state: str, reason: str | None) -> None:
        view = session.view
        self.state.save_node(view.name, view.address, state, reason, view.facts if state == UP else None,
                             view.last_seen)
        message = f"{view.name} is {state}" + (f": {reason}" if reason else "")
        self.record_event(f"node.{state}", message, node=view.name)
        if state == UP:
            self.backoff.node_back()
        mark = self.reboot_marks.get(view.name)
        if state == UP and mark is not None and rebooted(mark, (view.facts or {}).get("boot_id")):
            self.reboot_marks.pop(view.name)
            self.state.set_reboot_mark(view.name, None)
            self.record_event("node.rebooted", f"{view.name} is back after a reboot and takes part in jobs again",
                              node=view.name)

    def mark_needs_reboot(self, name: str, reason: str) -> None:
        """``name`` leaves every job's placement until its agent comes back from a reboot."""
        if name in self.reboot_marks:
            return
        boot_id = (self.sessions[name].view.facts or {}).get("boot_id")
        mark = new_mark(name, reason, boot_id if isinstance(boot_id, str) else None, time.time())
        self.reboot_marks[name] = mark
        self.state.set_reboot_mark(name, mark)
        self.record_event("node.needs_reboot", f"{name} needs a reboot: {reason}; fix: {mark['fix']}", node=name)

    def node_views(self) -> list[ClusterNodeView]:
        stored = self.state.nodes()
        views: list[ClusterNodeView] = []
        for name, session in self.sessions.items():
            view = session.view.as_dict()
            if view["facts"] is None and name in stored:  # last known facts while the node is away
                view["facts"] = stored[name]["facts"]
                view["last_seen"] = view["last_seen"] or stored[name]["last_seen"]
            node = session.node
            views.append({**view, "user": node.user, "host": node.host, "workdir": node.workdir,
                          "python": node.python, "needs_reboot": self.reboot_marks.get(name)})
        return views

    def all_up(self) -> bool:
        return all(s.state == UP for s in self.sessions.values())
