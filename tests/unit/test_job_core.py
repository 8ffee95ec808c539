"""The supervisor's pure decisions (coordinator/jobs/core.py), with plain data."""

from __future__ import annotations

from coordinator.jobs import core
from coordinator.launch.mlx_backend import launch_links
from coordinator.jobs.policy import LAUNCH_FAILED, NODE_LOST, RANK_FAILED, SUCCEEDED, Outcome, decide

R = core.RankReport


def classify(reports, *, step=10, total=10, launcher_exit=None, since=1.0):
    return core.classify_ranks(reports, ranks=len(reports), step=step, total_steps=total,
                               launcher_exit=launcher_exit, since_launch=since)


def test_ranks_still_running_are_no_verdict():
    assert classify([R(0, "a", "running"), R(1, "b", "starting")], step=3) is None


def test_every_rank_at_the_total_is_success_and_short_of_it_an_early_exit():
    done = [R(0, "a", "exited", 0), R(1, "b", "exited", 0)]
    assert classify(done).kind == SUCCEEDED
    early = classify(done, step=7)
    assert early.kind == RANK_FAILED and early.signature == "early-exit" and "step 7 of 10" in early.detail


def test_failed_ranks_are_reported_with_the_slowest_detection():
    verdict = classify([R(0, "a", "exited", 1, 0.2), R(1, "b", "exited", 143, 0.7), R(2, "c", "running")])
    assert verdict.kind == RANK_FAILED and [r.rank for r in verdict.failures] == [0, 1]
    assert verdict.detected_after == 0.7


def test_a_vanished_rank_is_a_failure_and_a_launcher_gone_without_its_ranks_a_launch_failure():
    assert classify([R(0, "a", "vanished"), R(1, "b", "running")]).signature == "vanished"
    starting = [R(0, "a", "starting"), R(1, "b", "running")]
    assert classify(starting, launcher_exit=1, since=5) is None  # still within the grace
    verdict = classify(starting, launcher_exit=1, since=core.LAUNCH_GRACE_S + 1)
    assert verdict.kind == LAUNCH_FAILED and "rank 0 on a never started" in verdict.detail


def test_resize_waits_for_a_newer_checkpoint_and_is_dropped_when_nothing_would_change():
    assert core.resize_due(None, ["a", "b"], ["a"], 10) == core.ResizeVerdict(False, None)
    assert core.resize_due(10, ["a", "b"], ["a"], 10).pending
    assert "relaunching on a, b" in core.resize_due(10, ["a", "b"], ["a"], 20).reason
    assert core.resize_due(10, ["a", "b"], ["b", "a"], 20).skipped


def test_run_ids_are_unique_and_safe_as_directory_names():
    tokens = iter(["aaaaaaaa", "aaaaaaaa", "bbbbbbbb"])
    assert core.new_run_id("tiny", {"tiny-aaaaaaaa"}, token=lambda n: next(tokens)) == "tiny-bbbbbbbb"
    assert core.RUN_ID.match(core.new_run_id("x" * 64))


def test_an_unexpected_error_is_said_in_words_never_as_a_group():
    try:
        raise ExceptionGroup("unhandled errors in a TaskGroup", [FileNotFoundError(2, "No such file", "mlx.launch")])
    except ExceptionGroup as exc:
        text = core.describe_exception(exc, "the launcher")
    assert "ExceptionGroup" not in text and "mlx.launch" in text and text.startswith("the launcher:")


def test_a_node_that_fails_launches_twice_is_waited_for_not_failed():
    node = Outcome(LAUNCH_FAILED, "no link information from n1", False, "node:n1")
    assert decide(node, [node], max_restarts=3, restarts_used=1).action == "restart"
    broken = Outcome(LAUNCH_FAILED, "mlx.launch could not be started", False, "launch:mlx.launch could not be started")
    assert decide(broken, [broken], max_restarts=3, restarts_used=1).action == "fail"
    lost = Outcome(NODE_LOST, "node n1 lost", False, "node:n1")
    assert decide(lost, [lost], max_restarts=3, restarts_used=1).action == "restart"


def test_launch_links_keep_each_pair_of_neighbours_once_with_kind_and_speed():
    choice = {"backend": "jaccl-ring", "transport": "rdma", "ring": ["n1", "n2", "n3"], "hosts": [
        {"node": "n1", "toward": {"n2": {"kind": "thunderbolt", "speed_gbps": 40}, "n3": None}},
        {"node": "n2", "toward": {"n1": {"kind": "thunderbolt", "speed_gbps": 40},
                                  "n3": {"kind": "ethernet", "speed_gbps": 10}}},
        {"node": "n3", "toward": {"n2": {"kind": "ethernet", "speed_gbps": 10}}}]}
    assert launch_links(choice) == {
        "backend": "jaccl-ring", "transport": "rdma", "ring": ["n1", "n2", "n3"],
        "links": [{"a": "n1", "b": "n2", "kind": "thunderbolt", "speed_gbps": 40},
                  {"a": "n2", "b": "n3", "kind": "ethernet", "speed_gbps": 10}]}
    assert launch_links({"backend": "ring", "transport": "tcp", "hosts": []})["links"] == []


def test_each_attempt_has_ring_ports_of_its_own():
    from coordinator.launch.mlx_launch import RING_PORTS, RING_PORTS_WIDTH, ring_starting_port

    ports = {ring_starting_port(f"job-{i:08x}", attempt) for i in range(200) for attempt in range(3)}
    assert all(RING_PORTS[0] <= p and p + RING_PORTS_WIDTH <= RING_PORTS[1] for p in ports)
    # Never where the kernel hands out ports to outgoing connections (Linux's lowest, macOS's above it).
    assert max(ports) + RING_PORTS_WIDTH <= 32768
    assert len(ports) > 590  # 600 attempts: the default 32323 for all of them was how jobs cross-talked
    assert ring_starting_port("job-1", 0) == ring_starting_port("job-1", 0) != ring_starting_port("job-1", 1)
