"""The catalog's policy for each node's own copy of a checkpoint: which copy a resume uses where
it lies, which nodes are sent it, which background copies are wanted, what retention removes."""

from __future__ import annotations

from coordinator.jobs import catalog


def copy(step, node, role="primary", *, sha=None, valid=True, attempt=0):
    return {"step": step, "attempt": attempt, "node": node, "role": role, "valid": valid,
            "path": f"/w/{node}/checkpoints/r/attempt-{attempt}/{step:07d}_adapters.safetensors",
            "sha256": sha or f"sha-{step}-{attempt}", "size": 850 << 20}


def up(*nodes):
    return lambda node: node == "head" or node in nodes


def different_machines(a, b):
    return a == b


def test_every_node_resumes_from_its_own_copy_and_nothing_is_copied():
    group = catalog.resume_candidates([copy(20, "n2", "local"), copy(20, "n1"), copy(20, "n3", "local")])[0]
    assert [c["node"] for c in group] == ["n1", "n2", "n3"]  # the primary first
    plan = catalog.plan_resume(group, ["n1", "n2", "n3"], up("n1", "n2", "n3"))
    assert plan.source["node"] == "n1"
    assert sorted(plan.in_place) == ["n1", "n2", "n3"] and plan.missing == []


def test_rank_0s_node_lost_resumes_from_another_nodes_own_copy_in_place():
    copies = [copy(20, "n1"), copy(20, "n2", "local"), copy(20, "n3", "local"), copy(10, "n1")]
    group = catalog.resume_candidates(copies)[0]
    plan = catalog.plan_resume(group, ["n2", "n3"], up("n2", "n3"))
    assert plan.source["node"] == "n2" and plan.source["role"] == "local"
    assert sorted(plan.in_place) == ["n2", "n3"] and plan.missing == []


def test_only_a_node_that_lacks_it_is_sent_the_checkpoint():
    # n3 was down while step 20 was written; n4 is new.
    group = catalog.resume_candidates([copy(20, "n1"), copy(20, "n2", "local")])[0]
    plan = catalog.plan_resume(group, ["n1", "n2", "n3", "n4"], up("n1", "n2", "n3", "n4"))
    assert sorted(plan.in_place) == ["n1", "n2"] and plan.missing == ["n3", "n4"]


def test_a_copy_with_another_sha256_or_invalid_is_not_used_in_place():
    group = catalog.resume_candidates([copy(20, "n1"), copy(20, "n2", "local", sha="other"),
                                       copy(20, "n3", "local", valid=False)])[0]
    plan = catalog.plan_resume(group, ["n1", "n2", "n3"], up("n1", "n2", "n3"))
    assert list(plan.in_place) == ["n1"] and plan.missing == ["n2", "n3"]


def test_a_nodes_own_copy_is_preferred_to_coords_replica_on_the_same_node():
    group = catalog.resume_candidates([copy(20, "n1"), {**copy(20, "n2", "replica"), "path": "/r"},
                                       copy(20, "n2", "local")])[0]
    plan = catalog.plan_resume(group, ["n1", "n2"], up("n1", "n2"))
    assert plan.in_place["n2"]["role"] == "local"


def test_no_reachable_copy_gives_no_plan_and_the_head_is_always_reachable():
    group = catalog.resume_candidates([copy(20, "n1")])[0]
    assert catalog.plan_resume(group, ["n2"], up("n2")) is None
    group = catalog.resume_candidates([copy(20, "n1"), copy(20, "head", "replica")])[0]
    plan = catalog.plan_resume(group, ["n2"], up("n2"))
    assert plan.source["node"] == "head" and plan.missing == ["n2"]


def test_retention_removes_every_nodes_copy_of_a_removed_checkpoint():
    copies = [copy(s, n, "primary" if n == "n1" else "local") for s in (10, 20, 30) for n in ("n1", "n2", "n3")]
    copies.append(copy(10, "head", "replica"))
    removed = catalog.to_remove(copies, keep=2)
    assert sorted((c["step"], c["node"]) for c in removed) == [(10, "head"), (10, "n1"), (10, "n2"), (10, "n3")]


def test_mlx_lm_checkpoints_are_spread_to_every_node_of_the_attempt_and_the_head_in_one_copy():
    copies = [copy(10, "n1"), copy(20, "n1")]
    wanted = catalog.copies_wanted(copies, 3, target="head", spread_to=["n1", "n2", "n3"],
                                   same_machine=different_machines)
    # Only the newest is spread; each kept one gets its head replica.
    assert [(w.source["step"], w.targets) for w in wanted] == [(20, ["head", "n2", "n3"]), (10, ["head"])]
    done = copies + [copy(20, "head", "replica"), copy(20, "n2", "replica"), copy(20, "n3", "replica")]
    wanted = catalog.copies_wanted(done, 3, target="head", spread_to=["n1", "n2", "n3"],
                                   same_machine=different_machines)
    assert [(w.source["step"], w.targets) for w in wanted] == [(10, ["head"])]


def test_a_head_on_rank_0s_machine_is_not_sent_a_copy_another_machine_already_holds():
    def head_is_n1(a, b):
        return a == b or {a, b} == {"head", "n1"}

    own = [copy(20, "n1"), copy(20, "n2", "local"), copy(20, "n3", "local")]
    assert catalog.copies_wanted(own, 3, target="head", spread_to=[], same_machine=head_is_n1,
                                 head_is_a_node=True) == []
    # n1 lost before its copy was catalogued: n2's and n3's still protect it, the head copies nothing.
    assert catalog.copies_wanted(own[1:], 3, target="head", spread_to=[], same_machine=head_is_n1,
                                 head_is_a_node=True) == []
    # mlx-lm: the copies to every node stand in for the head's.
    wanted = catalog.copies_wanted([copy(20, "n1")], 3, target="head", spread_to=["n1", "n2"],
                                   same_machine=head_is_n1, head_is_a_node=True)
    assert [w.targets for w in wanted] == [["n2"]]
    # The head elsewhere: its replica stays the default.
    wanted = catalog.copies_wanted(own, 3, target="head", spread_to=[], same_machine=different_machines)
    assert [(w.source["step"], w.targets) for w in wanted] == [(20, ["head"])]
    # Nothing elsewhere yet (one node): the head copy is still made, as before.
    wanted = catalog.copies_wanted([copy(20, "n1")], 3, target="head", spread_to=[], same_machine=head_is_n1,
                                   head_is_a_node=True)
    assert [w.targets for w in wanted] == [["head"]]


def test_what_survives_the_loss_of_the_primarys_machine():
    def head_is_n1(a, b):
        return a == b or {a, b} == {"head", "n1"}

    group = [copy(20, "n1"), copy(20, "n2", "local")]
    assert [c["node"] for c in catalog.off_machine(group, head_is_n1)] == ["n2"]
    assert catalog.off_machine([copy(20, "n1")], head_is_n1) == []
    assert [c["node"] for c in catalog.off_machine([copy(20, "n1"), copy(20, "head", "replica")], head_is_n1)] \
        == ["head"]


def test_retention_keeps_the_newest_copied_off_checkpoint_while_newer_ones_are_on_rank_0s_node_alone():
    copies = [copy(s, "n1") for s in (10, 20, 30, 40)] + [copy(10, "head", "replica"), copy(20, "head", "replica")]
    # The newest two (30, 40) have no copy off n1 yet: 20 (copied to the head) stays, with what is newer.
    removed = catalog.to_remove(copies, keep=2, same_machine=different_machines)
    assert sorted((c["step"], c["node"]) for c in removed) == [(10, "head"), (10, "n1")]
    # Once 30 is copied off too, 20 goes like any checkpoint older than the newest two.
    copies.append(copy(30, "head", "replica"))
    removed = catalog.to_remove(copies, keep=2, same_machine=different_machines)
    assert sorted({c["step"] for c in removed}) == [10, 20]
    # Without a rule for machines (no replicas at all), retention is the newest --keep as before.
    assert sorted({c["step"] for c in catalog.to_remove([copy(s, "n1") for s in (10, 20, 30)], keep=2)}) == [10]
