"""The TypedDicts of the jobs layer hold the keys their builders write, in order, so the types and
the stored JSON (and what coord status sends) cannot drift apart."""

from __future__ import annotations

import dataclasses

from coordinator.launch.mlx_backend import launch_links
from coordinator.launch.seam import LaunchLinks, NeighbourLink
from coordinator.jobs.fingerprints import ReplicaCheck, ReplicaState, ReplicaSummary, comparison_summary
from coordinator.jobs.policy import Outcome, OutcomeEntry, outcome_entry, outcome_of
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.spec import JobSpec, JobSpecFields
from coordinator.jobs.view import RunView, run_view


class _Effects:
    def now(self) -> float:
        return 1700000000.0

    def node_names(self) -> list[str]:
        return ["n1", "n2"]


def test_the_spec_fields_are_the_job_specs_own_in_order():
    spec = JobSpec(name="j", command=["python", "train.py"])
    assert list(JobSpecFields.__annotations__) == [f.name for f in dataclasses.fields(JobSpec)]
    assert list(spec.as_dict()) == list(JobSpecFields.__annotations__)
    assert JobSpec.from_dict(spec.as_dict()) == spec


def test_a_runs_view_lists_the_keys_of_its_type_in_order():
    ctx = RunContext(_Effects(), JobSpec(name="j", command=["python", "train.py"]), run_id="j-00000000",
                     record=None, state="queued")
    assert list(run_view(ctx, queue_position=2)) == list(RunView.__annotations__)
    assert run_view(ctx, queue_position=2)["queue_position"] == 2


def test_an_outcome_entry_keeps_the_outcome_and_reads_back():
    outcome = Outcome("rank_failed", "rank 1 exited", True, "exit:1:boom")
    entry = outcome_entry(outcome, attempt=3, counted=True)
    assert list(entry) == list(OutcomeEntry.__annotations__)
    assert entry == {**outcome.__dict__, "attempt": 3, "counted": True}  # as records have always held it
    assert outcome_of(entry) == outcome
    older = {"kind": "hung", "detail": "no progress", "reached_first_step": False, "attempt": 0, "counted": True}
    assert outcome_of(older).signature == ""  # written before outcomes had a signature


def test_the_replica_comparison_and_its_summary_list_their_keys_in_order():
    check = ReplicaCheck(2)
    check.add(4, 0, "a")
    assert list(check.state()) == list(ReplicaState.__annotations__)
    found = check.add(4, 1, "b")
    summary = comparison_summary(None, check, 0, ["n1", "n2"], found)
    assert list(summary) == list(ReplicaSummary.__annotations__)
    assert list(comparison_summary(summary, check, 1, ["n1", "n2"], None)) == list(ReplicaSummary.__annotations__)


def test_launch_links_list_their_keys_in_order():
    choice = {"ok": True, "backend": "ring", "transport": "tcp", "order": ["a", "b"], "ring": ["a", "b"],
              "hosts": [{"node": "a", "toward": {"b": {"kind": "thunderbolt", "speed_gbps": 40.0}}},
                        {"node": "b", "toward": {"a": {"kind": "thunderbolt", "speed_gbps": 40.0}}}]}
    links = launch_links(choice)
    assert list(links) == list(LaunchLinks.__annotations__)
    assert [list(link) for link in links["links"]] == [list(NeighbourLink.__annotations__)]
