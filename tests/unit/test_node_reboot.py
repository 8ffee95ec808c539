"""Nodes that need a reboot: why (coordinator/jobs/reboot.py), the marks the cluster keeps
(coordinator/nodes/reboot_marks.py, the store), and how status, the dashboard and the wait for
nodes show them."""

from __future__ import annotations

import io

import anyio
from rich.console import Console

from coordinator.commands.status import render_status
from coordinator.jobs import reboot
from coordinator.jobs.attempt import Attempt
from coordinator.jobs.effects import NodeView
from coordinator.jobs.reboot_watch import RebootWatch
from coordinator.nodes.reboot_marks import new_mark, rebooted
from coordinator.observe.dashboard.document import node_entry
from coordinator.store.state import StateStore


def test_processes_that_outlive_sigkill_are_named_with_their_states():
    assert reboot.survivors(1, [41, 42], ["D", "U"]) == ("rank 1's processes outlived SIGKILL: 41 (state D), "
                                                         "42 (state U)")
    assert reboot.survivors(0, [7], []) == "rank 0's processes outlived SIGKILL: 7 (state ?)"


def test_a_mark_clears_with_a_new_boot_id_and_is_kept_by_the_store(tmp_path):
    mark = new_mark("n2", "rank 1's processes outlived SIGKILL: 41 (state D)", "boot-a", 10.0)
    assert "reboot n2" in mark["fix"] and "takes part again by itself" in mark["fix"]
    assert not rebooted(mark, "boot-a") and rebooted(mark, "boot-b")
    assert rebooted(new_mark("n2", "x", None, 1.0), "boot-a")  # nothing to compare: back is back
    store = StateStore(tmp_path / "state.db")
    store.set_reboot_mark("n2", mark)
    assert StateStore(tmp_path / "state.db").reboot_marks() == {"n2": mark}
    store.set_reboot_mark("n2", None)
    assert store.reboot_marks() == {}


def test_status_and_the_dashboard_say_a_node_needs_a_reboot_with_the_fix():
    mark = new_mark("n2", "rank 1's processes outlived SIGKILL: 41 (state D)", "boot-a", 10.0)
    view = {"name": "n2", "state": "up", "reason": None, "user": None, "host": "h", "workdir": "/w", "python": "p",
            "last_seen": 5.0, "facts": {}, "needs_reboot": mark}
    entry = node_entry(view)  # type: ignore[arg-type]
    assert entry["needs_reboot"] is not None and "41 (state D)" in entry["needs_reboot"]
    assert "sudo shutdown -r now" in entry["needs_reboot"]
    assert node_entry({**view, "needs_reboot": None})["needs_reboot"] is None  # type: ignore[arg-type]
    out = io.StringIO()
    doc = {"time": 20.0, "cluster": {"name": "c"}, "summary": {"up": 1, "nodes": 1},
           "daemon": {"pid": 1, "started": 0.0}, "nodes": [view], "jobs": [], "events": []}
    render_status(doc, Console(file=out, width=200))  # type: ignore[arg-type]
    text = out.getvalue()
    assert "up, needs reboot" in text and "n2 needs a reboot (no job runs on it until then)" in text
    assert "fix: reboot n2 (on it: sudo shutdown -r now)" in text


class _Effects:
    """A Mac node whose rank outlives SIGKILL and whose wired memory stays up, as its agent says."""

    def __init__(self, *, stops: list[dict], wired: list[int]) -> None:
        self.stops, self.wired = stops, wired
        self.marked: list[tuple[str, str]] = []
        self.events: list[str] = []

    def node(self, name: str) -> NodeView:
        return NodeView(name, True, "/w", "p", facts={"os": "macOS"})

    async def call(self, node: str, method: str, params: dict, *, timeout: float) -> dict:
        if method == "usage":
            return {"wired_bytes": self.wired.pop(0), "memory_total_bytes": 64 << 30}
        return self.stops.pop(0)

    def mark_needs_reboot(self, node: str, reason: str) -> None:
        self.marked.append((node, reason))

    def now(self) -> float:
        return 0.0

    def event(self, kind: str, message: str, data: object) -> None:
        self.events.append(kind)


class _Context:
    def __init__(self, fx: _Effects) -> None:
        self.fx, self.run_id = fx, "j-00000000"

    def event(self, kind: str, message: str, **data: object) -> None:
        self.fx.event(kind, message, data)


def test_a_rank_still_there_after_a_second_stop_marks_its_node_and_one_that_went_does_not(monkeypatch):
    monkeypatch.setattr(reboot, "SURVIVOR_RECHECK_S", 0.0)
    monkeypatch.setattr(reboot, "WIRED_SETTLE_S", 0.0)
    left = {"stopped": False, "left": [41], "states": ["D"], "detail": "still running"}
    fx = _Effects(stops=[{"stopped": True, "left": [], "detail": "stopped"}, left], wired=[])
    watch = RebootWatch(_Context(fx))  # type: ignore[arg-type]
    assert anyio.run(watch.survived, "n2", 1, 0, left) is True and fx.marked == []
    assert anyio.run(watch.survived, "n2", 1, 0, left) is False
    assert fx.marked[0][0] == "n2" and "41 (state D)" in fx.marked[0][1] and "attempt 0" in fx.marked[0][1]


def test_a_mac_whose_wired_memory_stays_up_after_its_ranks_is_marked(monkeypatch):
    monkeypatch.setattr(reboot, "WIRED_SETTLE_S", 0.0)
    gib = 1 << 30
    fx = _Effects(stops=[], wired=[2 * gib, 30 * gib, 29 * gib, 30 * gib])
    watch = RebootWatch(_Context(fx))  # type: ignore[arg-type]
    attempt = Attempt(3, ["n1"])
    anyio.run(watch.baseline, attempt)
    assert attempt.wired_baseline == {"n1": 2 * gib}
    anyio.run(watch.stranded, attempt, {"n1"})
    assert fx.marked and "wired memory stayed at 30.0 GiB" in fx.marked[0][1] and attempt.wired_baseline == {}
    settles = _Effects(stops=[], wired=[30 * gib, 2 * gib])  # the kernel let go on the second look
    attempt = Attempt(4, ["n1"], wired_baseline={"n1": 2 * gib})
    anyio.run(RebootWatch(_Context(settles)).stranded, attempt, {"n1"})  # type: ignore[arg-type]
    assert settles.marked == []


def test_the_cluster_keeps_a_node_out_until_its_agent_comes_back_with_another_boot_id(tmp_path):
    from coordinator.config.cluster_file import load_config
    from coordinator.nodes.agent_bundle import AgentBundle
    from coordinator.nodes.cluster import Cluster
    from coordinator.nodes.session import UP

    config = tmp_path / "cluster.toml"
    config.write_text(f'[cluster]\nname = "c"\nstate_dir = "{tmp_path}/state"\n\n[[nodes]]\nname = "a"\n'
                      f'host = "local"\nworkdir = "{tmp_path}/a"\n')
    store = StateStore(tmp_path / "state.db")
    cluster = Cluster(load_config(config), store, AgentBundle("0" * 64, b""))
    session = cluster.sessions["a"]
    session.view.facts = {"boot_id": "boot-1"}
    cluster.mark_needs_reboot("a", "rank 0's processes outlived SIGKILL: 41 (state D)")
    cluster.mark_needs_reboot("a", "again")  # marked once
    (view,) = cluster.node_views()
    assert view["needs_reboot"] is not None and view["needs_reboot"]["boot_id"] == "boot-1"
    assert [e["kind"] for e in cluster.events if e["kind"].startswith("node.needs")] == ["node.needs_reboot"]
    anyio.run(cluster._node_changed, session, UP, None)  # the agent reconnected: the same boot
    assert "a" in Cluster(load_config(config), store, AgentBundle("0" * 64, b"")).reboot_marks  # kept in the store
    session.view.facts = {"boot_id": "boot-2"}
    anyio.run(cluster._node_changed, session, UP, None)
    assert cluster.node_views()[0]["needs_reboot"] is None and store.reboot_marks() == {}
    assert cluster.events[-1]["kind"] == "node.rebooted"
