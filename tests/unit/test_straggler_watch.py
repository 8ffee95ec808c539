"""One run's watch of stragglers (coordinator/jobs/straggler_watch.py) over a fake of the effects it
uses (the clock, the node views, the agent's rank_signals, the event log): a rank named with its
cause, shown in the record and cleared; --straggler-policy drop shrinks its node out after the
grace, never below --min-nodes; and the job spec's checks of the two options."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from coordinator.jobs.attempt import Attempt
from coordinator.jobs.record import JobRecord
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.spec import JobSpec, JobSpecError, validate
from coordinator.jobs.straggler_watch import StragglerWatch
from coordinator.launch.batch import Undividable

QUOTA = {"seconds": 1.0, "rank_pids": [7], "cores": 2, "rank_cpu": 0.05, "others": [], "speed_limit": None,
         "quota": {"source": "cgroup v2", "cores": 0.05, "group": "/sys/fs/cgroup/slow", "throttled_share": 0.9},
         "memory_pressure": None, "swapins_per_s": None, "gpu_utilization": None}


class Effects:
    def __init__(self) -> None:
        self.clock = 0.0
        self.events: list[tuple[str, str, dict]] = []
        self.asked: list[tuple[str, str, dict]] = []

    def now(self) -> float:
        return 1_700_000_000.0 + self.clock

    def monotonic(self) -> float:
        return self.clock

    def node(self, name: str):
        return SimpleNamespace(up=True, workdir="/w")

    def slow_links(self, node: str) -> list[str]:
        return []

    async def call(self, node: str, method: str, params, *, timeout: float):
        self.asked.append((node, method, dict(params)))
        return QUOTA

    def event(self, kind: str, message: str, data: dict) -> None:
        self.events.append((kind, message, data))

    def save_run(self, *args) -> None:
        pass


def watched(**spec_fields):
    fx = Effects()
    spec = JobSpec(name="tiny", command=["python", "train.py"], **spec_fields)
    ctx = RunContext(fx, spec, run_id="tiny-1", record=JobRecord(run_id="tiny-1"), state="running")
    attempt = Attempt.fresh(0, ["n1", "n2", "n3"], ctx.record)
    return fx, ctx, attempt, StragglerWatch(ctx)


def beat(fx, watch, attempt, slow_rank: int | None, until: float):
    """Every rank reports every 2 s, ``slow_rank`` 5x slower; the watch runs after each round."""
    results = []
    while fx.clock < until:
        fx.clock += 2.0
        for rank in range(3):
            watch.compute(attempt, rank, 0.5 if rank == slow_rank else 0.1)
        results.append(anyio.run(watch.after_poll, attempt))
    return results


def test_a_rank_named_is_asked_of_its_node_said_with_its_cause_shown_and_cleared():
    fx, ctx, attempt, watch = watched()
    assert not any(beat(fx, watch, attempt, 2, 40.0))  # tell: the attempt goes on
    named = [e for e in fx.events if e[0] == "job.straggler"]
    assert len(named) == 1 and named[0][2]["rank"] == 2 and named[0][2]["node"] == "n3", fx.events
    assert named[0][2]["cause"].startswith("CPU throttled by a quota") and named[0][2]["cause_kind"] == "quota"
    assert fx.asked == [("n3", "rank_signals", {"job": "tiny-1", "attempt": 0, "rank": 2, "seconds": 1.0})]
    shown = ctx.record.stragglers
    assert [(s["rank"], s["node"], s["cause_kind"]) for s in shown] == [(2, "n3", "quota")]
    assert shown[0]["score"] == pytest.approx(5.0)
    assert ctx.record.rank_compute == {"0": 0.1, "1": 0.1, "2": 0.5}
    assert ctx.record.rank_scores["2"] == pytest.approx(5.0)
    assert ctx.record.compute_heat and ctx.record.compute_heat[-1][1] == [0.1, 0.1, 0.5]
    beat(fx, watch, attempt, None, 80.0)
    assert [e[2]["rank"] for e in fx.events if e[0] == "job.straggler_cleared"] == [2]
    assert ctx.record.stragglers == []


def test_drop_shrinks_the_stragglers_node_out_after_the_grace_and_never_below_min_nodes():
    fx, ctx, attempt, watch = watched(straggler_policy="drop", straggler_grace=20.0, min_nodes=2)
    results = beat(fx, watch, attempt, 1, 60.0)
    reasons = [r for r in results if r]
    assert len(reasons) == 1 and "rank 1 on n2 has been a straggler for" in reasons[0], results
    named_at = next(e for e in fx.events if e[0] == "job.straggler")
    assert ctx.record.dropped == ["n2"]
    assert any(e[0] == "job.straggler_dropped" for e in fx.events)
    assert results.index(reasons[0]) * 2.0 + 2.0 >= 20.0, (named_at, results)
    fx, ctx, attempt, watch = watched(straggler_policy="drop", straggler_grace=10.0, min_nodes=3)
    assert not any(beat(fx, watch, attempt, 1, 60.0))
    kept = [e for e in fx.events if e[0] == "job.straggler_kept"]
    assert len(kept) == 1 and "--min-nodes 3" in kept[0][1] and ctx.record.dropped == []
    # Nor when the job's global batch cannot be kept on the others.
    fx, ctx, attempt, watch = watched(straggler_policy="drop", straggler_grace=10.0, min_nodes=2)

    def undividable(nodes):
        raise Undividable("the global batch of 3 cannot be split evenly over 2 ranks")

    watch.batch_for = undividable
    assert not any(beat(fx, watch, attempt, 1, 60.0))
    kept = [e for e in fx.events if e[0] == "job.straggler_kept"]
    assert len(kept) == 1 and "cannot be split evenly over 2 ranks" in kept[0][1] and ctx.record.dropped == []


def test_the_options_are_checked():
    with pytest.raises(JobSpecError, match="needs --min-nodes"):
        validate(JobSpec(name="tiny", command=["python", "train.py"], straggler_policy="drop"))
    with pytest.raises(JobSpecError, match="straggler_policy|straggler-policy"):
        validate(JobSpec(name="tiny", command=["python", "train.py"], straggler_policy="kill"))
    with pytest.raises(JobSpecError, match="straggler_grace|straggler-grace"):
        validate(JobSpec(name="tiny", command=["python", "train.py"], straggler_grace=-1.0))
    validate(JobSpec(name="tiny", command=["python", "train.py"], straggler_policy="drop", min_nodes=2))


def test_a_straggler_whose_node_shows_no_cause_is_put_down_to_the_link_coord_doctor_found_slow():
    fx, ctx, attempt, watch = watched()
    quiet = {**QUOTA, "quota": None, "rank_cpu": 0.98}
    slow = "its link n2 - n3 was slow when coord doctor last measured it (0.9 Gbit/s against 9.4)"

    async def call(node, method, params, *, timeout):
        return quiet

    fx.call = call
    fx.slow_links = lambda node: [slow] if node == "n3" else []
    beat(fx, watch, attempt, 2, 40.0)
    named = [e for e in fx.events if e[0] == "job.straggler"]
    assert named and named[0][2]["cause"].startswith(slow) and named[0][2]["cause_kind"] == "link", named
