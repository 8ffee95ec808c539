"""The dashboard's document: which runs it lists, how a run's checkpoints are summed up, and how far
they are in its checkpoint store."""

from __future__ import annotations

from types import SimpleNamespace

from coordinator.jobs.record import Durability, JobRecord
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.spec import JobSpec
from coordinator.jobs.view import run_view
from coordinator.observe.dashboard.document import (
    FINISHED_SHOWN,
    checkpoint_rows,
    dashboard_document,
    node_entry,
    shown_runs,
)


def _runner(run_id: str, state: str, started: float, position: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(run_id=run_id, state=state, record=JobRecord(run_id=run_id, started=started),
                           queue_position=position)


def test_running_first_then_the_queue_in_order_then_the_newest_finished():
    runners = [_runner("old", "succeeded", 1), _runner("q2", "queued", 5, 2), _runner("run", "running", 3),
               _runner("q1", "queued", 6, 1), _runner("new", "failed", 4)]
    assert [r.run_id for r in shown_runs(runners)] == ["run", "q1", "q2", "new", "old"]
    many = [_runner(f"f{i}", "succeeded", i) for i in range(FINISHED_SHOWN + 5)]
    shown = shown_runs(many)
    assert len(shown) == FINISHED_SHOWN and shown[0].run_id == f"f{FINISHED_SHOWN + 4}"


def test_checkpoints_newest_first_with_every_copy_and_validity():
    rows = [{"step": 10, "attempt": 0, "node": "n1", "path": "/w/a", "sha256": "x", "size": 5, "valid": True,
             "detail": None, "created": 100.0, "role": "primary"},
            {"step": 10, "attempt": 0, "node": "head", "path": "/s/a", "sha256": "x", "size": 5, "valid": True,
             "detail": None, "created": 103.0, "role": "replica"},
            {"step": 20, "attempt": 0, "node": "n1", "path": "/w/b", "sha256": None, "size": 5, "valid": False,
             "detail": "truncated", "created": 110.0, "role": "primary"}]
    out = checkpoint_rows(rows, now=130.0)
    assert [c["step"] for c in out] == [20, 10]
    assert out[0]["valid"] is False and out[0]["copies"][0]["detail"] == "truncated"
    assert out[1]["valid"] is True and out[1]["age_s"] == 30.0
    assert [(c["node"], c["role"]) for c in out[1]["copies"]] == [("n1", "primary"), ("head", "replica")]


def test_a_node_entry_carries_no_paths():
    view = {"name": "n1", "state": "up", "reason": None, "user": "alice", "host": "10.0.0.2", "workdir": "/w",
            "python": "/venv/bin/python", "last_seen": 5.0,
            "facts": {"chip": "Apple M2 Ultra", "memory_bytes": 1 << 36, "os": "macOS", "os_version": "15.1",
                      "python_version": "3.12.4", "mlx_version": "0.29.1", "mlx_lm_version": "0.28.0"}}
    entry = node_entry(view, {"memory_used_bytes": 1 << 35, "gpu_utilization": 87.0, "power_watts": None})
    assert entry["chip"] == "Apple M2 Ultra" and entry["os"] == "macOS 15.1" and entry["mlx"] == "0.29.1"
    assert entry["memory_used_bytes"] == 1 << 35 and entry["gpu_utilization"] == 87.0 and entry["power_watts"] is None
    assert node_entry(view)["memory_used_bytes"] is None  # no sample yet
    assert "workdir" not in entry and "python" in entry and entry["python"] == "3.12.4"


def test_each_links_last_doctor_figure_is_drawn_beside_its_baseline(tmp_path) -> None:
    from coordinator.observe.dashboard.document import link_entries
    from coordinator.store.state import StateStore

    store = StateStore(tmp_path / "state.db")
    store.save_link("n1", "n2", "last", {"interface": "en2", "bits_per_second": 9e9, "reverse_bits_per_second": 8e9,
                                         "baseline_bits_per_second": 30e9, "verdict": "slow", "measured_at": 5.0})
    store.save_link("n2", "n3", "baseline", {"interface": "en3", "bits_per_second": 30e9})
    store.save_link("n3", "n2", "last", {"verdict": "ok"})
    store.forget_link("n3", "n2", "last")
    assert link_entries(store.links("last")) == [
        {"a": "n1", "b": "n2", "interface": "en2", "bits_per_second": 9e9, "reverse_bits_per_second": 8e9,
         "baseline_bits_per_second": 30e9, "verdict": "slow", "measured_at": 5.0}]
    assert list(store.links("baseline")) == [("n2", "n3")]
    import pytest
    with pytest.raises(ValueError, match="baseline or the last"):
        store.save_link("n1", "n2", "other", {})


class _Effects:
    def now(self) -> float:
        return 1700000000.0

    def node_names(self) -> list[str]:
        return ["n1", "n2"]


def _viewed_runner(name: str, durability: Durability | None) -> SimpleNamespace:
    """A running run whose view is the real one (coordinator/jobs/view.py), from a record holding ``durability``."""
    record = JobRecord(run_id=f"{name}-1", step=57, started=1.0, order=["n1", "n2"], durability=durability)
    ctx = RunContext(_Effects(), JobSpec(name=name, command=["python", "train.py"]), run_id=f"{name}-1",
                     record=record, state="running")
    return SimpleNamespace(run_id=ctx.run_id, state="running", record=record, queue_position=None,
                           view=lambda: run_view(ctx, queue_position=None))


def test_a_run_with_a_checkpoint_store_says_how_far_its_checkpoints_are_there():
    durable = Durability(store="s3://bucket/coord/big-1", durable_step=40, lag_steps=10, lag_seconds=73.5,
                         bytes_per_s=12.5e6, error="upload of part 3 timed out")
    cluster = SimpleNamespace(config=SimpleNamespace(name="lab"), node_views=list, events=[],
                              state=SimpleNamespace(checkpoints=lambda run_id: [], links=lambda role: {}))
    doc = dashboard_document(cluster, [_viewed_runner("big", durable), _viewed_runner("small", None)], now=5.0)
    by_name = {job["name"]: job for job in doc["jobs"]}
    assert by_name["big"]["durability"] == durable
    assert by_name["big"]["durability"] is not durable  # a copy: the page never holds the record's own dict
    assert by_name["small"]["durability"] is None  # its checkpoints stay on the cluster: nothing to draw
