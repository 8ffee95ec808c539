"""Checkpoint directories joined from every node's part and completed on each (coordinator/jobs/checkpoint_dirs.py),
driven through a small stand-in for the effects it uses: what is copied where, in which order, and what is
catalogued, including a copy cut short by a node's loss and the parts that show up after a step was judged."""

from __future__ import annotations

from types import SimpleNamespace

import anyio

from coordinator.jobs import catalog
from coordinator.jobs.checkpoint_dirs import EVERY_NODE_UP_TO, WHOLE_COPIES, DirKeeper, completed_on
from coordinator.jobs.effects import NodeView
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.spec import JobSpec
from shared.checkpoint_dirs import digest
from shared.rpc import RemoteError


class Effects:
    """Nodes a, b, c; copies recorded (and refused to ``unreachable`` once ``cut_after`` copies landed)."""

    def __init__(self, cut_after: int | None = None, unreachable: str = "c"):
        self.copies: list[tuple[str, str]] = []  # (node, target path)
        self.calls: list[list[str]] = []  # each copy's target nodes
        self.catalog: list[dict] = []
        self.events: list[tuple[str, str]] = []
        self.cut_after, self.unreachable = cut_after, unreachable

    def now(self) -> float:
        return 1.0

    def monotonic(self) -> float:
        return 1.0

    def node(self, name: str) -> NodeView:
        return NodeView(name, True, f"/w/{name}", "/p")

    def node_names(self) -> list[str]:
        return ["a", "b", "c"]

    async def copy_checkpoint(self, source, placements):
        self.calls.append([placement.node for placement in placements])
        for placement in placements:  # as the relay: the others are written when one fails
            if self.cut_after is not None and placement.node == self.unreachable and \
                    len([c for c in self.copies if c[0] == self.unreachable]) >= self.cut_after:
                raise RemoteError("connection_lost", f"{placement.node} is gone")
            self.copies.append((placement.node, placement.path))
        return [f"/w/{placement.node}/{placement.path}" for placement in placements]

    def add_checkpoint(self, run_id, entry):
        self.catalog = [c for c in self.catalog if (c["node"], c["path"]) != (entry["node"], entry["path"])]
        self.catalog.append(entry)

    def checkpoints(self, run_id):
        return [{"sha256": None, "size": None, "detail": None, "created": 0.0, "role": "primary", **c}
                for c in self.catalog]

    def save_run(self, *args) -> None:
        pass

    def event(self, kind, message, data) -> None:
        self.events.append((kind, message))


def _keeper(fx: Effects) -> DirKeeper:
    ctx = RunContext(fx, JobSpec(name="j", command=["python", "t.py"], launcher="torchrun"), run_id="r",  # type: ignore[arg-type]
                     record=None, state="running")
    health = SimpleNamespace(usable=lambda node: True, reachable=lambda node: True)
    return DirKeeper(ctx, health)  # type: ignore[arg-type]


def _part(node: str, *paths: str) -> dict:
    files = [{"path": p, "size": 10, "sha256": f"h-{p}"} for p in paths]
    return {"name": "0000010", "iteration": 10, "path": f"/w/{node}/checkpoints/r/attempt-0/0000010", "valid": True,
            "detail": "", "size": 10 * len(files), "sha256": digest(files), "kind": "dir", "files": files,
            "notes": {}, "references": {}}


def _settle(keeper: DirKeeper, listings: dict, known: dict, *, over: bool = False) -> bool:
    return anyio.run(lambda: keeper.settle(0, 0, ["a", "b", "c"], listings, known, {}, attempt_over=over,
                                           world_size=3, current=True))


def test_rank_0s_directory_is_sent_to_every_node_its_last_file_last_and_catalogued_whole_on_each():
    fx = Effects()
    known: dict[str, set[str]] = {}
    assert _settle(_keeper(fx), {"a": [_part("a", "state.pt", "COMPLETE", "extra.bin")], "b": [], "c": []}, known)
    # Each file to both nodes in one copy (the relay passes it on), the last file last.
    assert fx.copies == [(node, f"checkpoints/r/attempt-0/0000010/{name}")
                         for name in ("extra.bin", "state.pt", "COMPLETE") for node in ("b", "c")]
    assert fx.calls == [["b", "c"]] * 3
    whole = digest(_part("a", "state.pt", "COMPLETE", "extra.bin")["files"])
    assert sorted((c["node"], c["valid"], c["sha256"] == whole) for c in fx.catalog) == [
        ("a", True, True), ("b", True, True), ("c", True, True)]
    assert known == {"a": {"0000010"}, "b": {"0000010"}, "c": {"0000010"}}


def test_a_copy_cut_short_is_no_copy_and_what_it_left_is_never_taken_for_the_whole():
    fx = Effects(cut_after=1)  # c takes one file, then is gone
    keeper = _keeper(fx)
    known: dict[str, set[str]] = {}
    _settle(keeper, {"a": [_part("a", "state.pt", "COMPLETE")], "b": [], "c": []}, known)
    assert ("c", "checkpoints/r/attempt-0/0000010/COMPLETE") not in fx.copies  # the marker never went alone
    assert {c["node"] for c in fx.catalog if c["valid"]} == {"a", "b"} and "c" not in known
    # The attempt ends with a away: c shows what the cut copy left, b knows its whole already. Judged
    # once, the step is not judged again from what c holds: c's leftovers are a part, not a whole.
    _settle(keeper, {"b": [], "c": [_part("c", "state.pt")]}, known, over=True)
    c_copy = next(c for c in fx.catalog if c["node"] == "c")
    assert not c_copy["valid"] and "cut short" in c_copy["detail"]
    b_copy = next(c for c in fx.catalog if c["node"] == "b")
    assert b_copy["valid"] and b_copy["sha256"] == digest(_part("a", "state.pt", "COMPLETE")["files"])


def test_a_node_back_with_the_very_bytes_of_the_whole_keeps_its_copy():
    fx = Effects()
    keeper = _keeper(fx)
    known: dict[str, set[str]] = {}
    _settle(keeper, {"b": [_part("b", "state.pt", "COMPLETE")], "c": []}, known)
    _settle(keeper, {"a": [_part("a", "state.pt", "COMPLETE")]}, known, over=True)  # a was away, is back
    a_copy = next(c for c in fx.catalog if c["node"] == "a")
    assert a_copy["valid"] and a_copy["detail"] == "the whole, as catalogued"


def test_a_whole_whose_only_holder_went_away_after_listing_stays_whole_there_and_a_part_elsewhere():
    # Found on the multi-host cluster: rank 0's node listed the step's files, then was cut before they
    # could be sent on; the supervisor must not stop on it (it did, with a StopIteration).
    fx = Effects()
    ctx_keeper = _keeper(fx)
    ctx_keeper.health = SimpleNamespace(usable=lambda node: node != "a", reachable=lambda node: node != "a")  # type: ignore[assignment]
    known: dict[str, set[str]] = {}
    assert _settle(ctx_keeper, {"a": [_part("a", "state.pt", "COMPLETE")], "b": [], "c": []}, known)
    assert fx.copies == []
    assert [(c["node"], c["valid"]) for c in sorted(fx.catalog, key=lambda c: c["node"])] == [("a", True)]


def test_a_node_is_completed_from_another_holder_when_the_writer_went_away_after_listing():
    # The torchrun shrink case on the multi-host cluster: rank 0's node listed the step and was cut; b
    # holds the files too (sent them earlier), c is sent them from b, and the step is whole on b and c.
    class Sources(Effects):
        async def copy_checkpoint(self, source, placements):
            self.copies.extend((placement.node, source["node"], source["path"]) for placement in placements)
            return [f"/w/{placement.node}/{placement.path}" for placement in placements]

    fx = Sources()
    keeper = _keeper(fx)
    keeper.health = SimpleNamespace(usable=lambda node: node != "a", reachable=lambda node: node != "a")  # type: ignore[assignment]
    known: dict[str, set[str]] = {}
    listings = {"a": [_part("a", "state.pt", "COMPLETE")], "b": [_part("b", "state.pt", "COMPLETE")], "c": []}
    assert _settle(keeper, listings, known)
    assert [(node, source) for node, source, _ in fx.copies] == [("c", "b"), ("c", "b")]
    assert all(path.startswith("/w/b/checkpoints/r/attempt-0/0000010/") for _, _, path in fx.copies)
    assert {c["node"] for c in fx.catalog if c["valid"]} == {"a", "b", "c"}


def test_a_copy_to_many_that_fails_for_one_node_is_made_again_without_it_and_the_others_are_whole():
    # c goes away in the middle of the second file's copy to b, c and d: b and d are sent it again
    # together, and only c is left a part (its marker never sent).
    fx = Effects(cut_after=1)
    fx.node_names = lambda: ["a", "b", "c", "d"]  # type: ignore[method-assign]
    gone: set[str] = set()
    keeper = _keeper(fx)
    keeper.health = SimpleNamespace(usable=lambda node: node not in gone,  # type: ignore[assignment]
                                    reachable=lambda node: node not in gone)
    copy = fx.copy_checkpoint

    async def cut_c(source, placements):
        try:
            return await copy(source, placements)
        except RemoteError:
            gone.add("c")  # the session saw it go
            raise

    fx.copy_checkpoint = cut_c  # type: ignore[method-assign]
    known: dict[str, set[str]] = {}
    assert anyio.run(lambda: keeper.settle(0, 0, ["a", "b", "c", "d"], {"a": [_part("a", "state.pt", "COMPLETE")],
                                                                       "b": [], "c": [], "d": []},
                                           known, {}, attempt_over=False, world_size=4, current=True))
    assert fx.calls == [["b", "c", "d"], ["b", "c", "d"], ["b", "d"]], fx.calls
    assert ("c", "checkpoints/r/attempt-0/0000010/COMPLETE") not in fx.copies
    assert {c["node"] for c in fx.catalog if c["valid"]} == {"a", "b", "d"}
    assert "c" not in known


def test_every_node_of_a_small_attempt_holds_the_whole_and_three_of_a_large_one_rank_0s_first():
    small = ["a", "b", "c", "d"]
    assert completed_on(small, set(), set(small)) == small
    assert completed_on(small, {"c"}, {"a", "b"}) == ["a", "b", "c"]  # d is away; c is whole already
    large = [f"n{i:02}" for i in range(EVERY_NODE_UP_TO + 4)]
    assert completed_on(large, set(), set(large)) == large[:WHOLE_COPIES]
    assert completed_on(large, {"n05"}, set(large) - {"n00"}) == ["n01", "n02", "n05"]
    assert completed_on(large, set(large[3:8]), set(large)) == large[3:8]  # whole already: none unmade


def test_a_large_attempts_directory_is_made_whole_on_three_nodes_and_a_resume_places_it_on_the_rest():
    # Each node wrote its own part (a rank's random states), rank 0's node the model besides.
    order = [f"n{i:02}" for i in range(12)]
    fx = Effects()
    keeper = _keeper(fx)
    listings = {node: [_part(node, f"random_states_{i}.pkl", *(("model.pt", "COMPLETE") if i == 0 else ()))]
                for i, node in enumerate(order)}
    known: dict[str, set[str]] = {}
    assert anyio.run(lambda: keeper.settle(0, 0, order, listings, known, {}, attempt_over=False, world_size=12,
                                           current=True))
    # The three first nodes are sent what they lack (each file in one copy to them), the other nine nothing.
    assert {node for node, _ in fx.copies} == {"n00", "n01", "n02"} and all(len(call) <= 3 for call in fx.calls)
    valid = sorted(c["node"] for c in fx.catalog if c["valid"])
    assert valid == ["n00", "n01", "n02"]
    parts = [c for c in fx.catalog if not c["valid"]]
    assert len(parts) == 9 and all("whole on n00, n01, n02" in c["detail"] for c in parts)
    assert known == {node: {"0000010"} for node in order}  # each node's part is catalogued: not listed again
    # The resume: the three whole copies are used in place, the nine other nodes are sent it.
    group = catalog.resume_candidates(fx.checkpoints("r"))[0]
    plan = catalog.plan_resume(group, order, lambda node: True)
    assert plan is not None and sorted(plan.in_place) == valid and plan.missing == order[3:]
