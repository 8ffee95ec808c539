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


def test_a_young_daemon_answers_from_memory_alone(tmp_path):
    store = StateStore(tmp_path / "state.db")
    for i in range(7):
        store.add_event("node.up", f"event {i}")
    daemon = _daemon(store)
    daemon.state = None  # memory holds everything there is: the store is not asked
    assert [e["message"] for e in recent_events(daemon, 200)] == [f"event {i}" for i in range(7)]
