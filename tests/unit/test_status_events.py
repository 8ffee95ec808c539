"""`coord status --events N` returns the newest N events even when the daemon's memory holds fewer."""

from __future__ import annotations

import collections
from types import SimpleNamespace

from coordinator.nodes.cluster import RECENT_EVENTS
from coordinator.commands.status import recent_events
from coordinator.store.state import StateStore


def _daemon(store: StateStore) -> SimpleNamespace:
    """The part of a Cluster that recent_events reads: its events in memory and its store."""
    held = collections.deque(store.recent_events(RECENT_EVENTS), maxlen=RECENT_EVENTS)
    return SimpleNamespace(state=store, events=held)


def test_more_events_than_memory_holds_come_from_the_store(tmp_path):
    store = StateStore(tmp_path / "state.db")
    for i in range(RECENT_EVENTS * 3):
        store.add_event("job.step", f"event {i}")
    daemon = _daemon(store)
    assert [e["message"] for e in recent_events(daemon, 5)] == [f"event {i}" for i in range(145, 150)]
    wanted = RECENT_EVENTS * 2
    got = recent_events(daemon, wanted)
    assert len(got) == wanted
    assert [e["message"] for e in got] == [f"event {i}" for i in range(RECENT_EVENTS * 3 - wanted, RECENT_EVENTS * 3)]
    assert len(recent_events(daemon, 10**9)) == RECENT_EVENTS * 3
    assert recent_events(daemon, 0) == [] and recent_events(daemon, -3) == []


def test_a_daemon_restarted_a_moment_ago_still_gives_its_predecessors_events(tmp_path):
    # Its memory holds only its own few events; the earlier daemon's are in the store (coord status
    # had answered from memory alone, and a reattach's event went missing from a job's story).
    store = StateStore(tmp_path / "state.db")
    for i in range(RECENT_EVENTS * 2):
        store.add_event("job.step", f"earlier {i}")
    daemon = SimpleNamespace(state=store, events=collections.deque(maxlen=RECENT_EVENTS))
    for i in range(3):
        daemon.events.append(store.add_event("node.up", f"now {i}"))
    got = [e["message"] for e in recent_events(daemon, 10)]
    assert got == [f"earlier {i}" for i in range(RECENT_EVENTS * 2 - 7, RECENT_EVENTS * 2)] + ["now 0", "now 1", "now 2"]
