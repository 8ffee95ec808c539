"""The suite's own scheduling under pytest-xdist (tests/conftest.py): the multi-host modules in two
halves of about equal time, each half on a worker of its own (each such worker holds one test
cluster), and every other scope around them. The workers here are stand-ins that record what they
are sent; the scheduler is pytest-xdist's, with the suite's rules."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import CLUSTER_MODULE_SECONDS, cluster_halves, pytest_xdist_make_scheduler

CLUSTER_TESTS = [f"tests/cluster/{module}.py::test_{i}" for module in CLUSTER_MODULE_SECONDS for i in range(2)]
# A fuzz module of many more tests than a half (pytest-xdist would start with the largest scopes).
OTHER_TESTS = ([f"tests/unit/test_bad_input_cli.py::test_x[{i}]" for i in range(200)]
               + [f"tests/integration/test_mod{m}.py::test_{i}" for m in range(6) for i in range(60)]
               + [f"tests/unit/test_u{u}.py::test_x" for u in range(40)])


class Worker:
    def __init__(self, name: str):
        self.name, self.sent, self.shutting_down = name, [], False
        self.gateway = SimpleNamespace(id=name)

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent += indexes

    def shutdown(self) -> None:
        self.shutting_down = True


def _scheduled(workers: int, collection: list[str]):
    config = SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"], option=SimpleNamespace(loadscopereorder=True))
    log = SimpleNamespace(loadscopesched=lambda *args: None)
    scheduler = pytest_xdist_make_scheduler(config, log)
    nodes = [Worker(f"gw{i}") for i in range(workers)]
    for node in nodes:
        scheduler.add_node(node)
    for node in nodes:
        scheduler.add_node_collection(node, collection)
    scheduler.schedule()
    # Every worker runs what it was sent, one test at a time, and is given more as it goes.
    done = {node: 0 for node in nodes}
    while any(done[node] < len(node.sent) for node in nodes):
        for node in nodes:
            if done[node] < len(node.sent):
                scheduler.mark_test_complete(node, node.sent[done[node]])
                done[node] += 1
    return {node.name: [collection[i] for i in node.sent] for node in nodes}


def test_the_halves_are_of_about_equal_time_and_hold_every_module_once():
    modules = [f"tests/cluster/{m}.py" for m in CLUSTER_MODULE_SECONDS] + ["tests/cluster/test_new_multihost.py"]
    halves = cluster_halves(modules)
    assert sorted(halves) == sorted(modules) and set(halves.values()) == {"a", "b"}
    seconds = {h: sum(CLUSTER_MODULE_SECONDS.get(m.split("/")[-1][:-3], 20) for m in modules if halves[m] == h)
               for h in "ab"}
    assert abs(seconds["a"] - seconds["b"]) <= max(CLUSTER_MODULE_SECONDS.values()) / 10, seconds
    assert cluster_halves(list(reversed(modules))) == halves  # the same whatever the order


def test_three_workers_each_half_on_a_worker_of_its_own_and_every_test_run_once():
    collection = CLUSTER_TESTS + OTHER_TESTS
    ran = _scheduled(3, collection)
    assert sorted(t for tests in ran.values() for t in tests) == sorted(collection)
    holding = {name: {t.split("::")[0] for t in tests if t.startswith("tests/cluster/")} for name, tests in ran.items()}
    with_cluster = [name for name, modules in holding.items() if modules]
    assert len(with_cluster) == 2, holding
    halves = cluster_halves([t.split("::")[0] for t in CLUSTER_TESTS])
    for name in with_cluster:
        assert len({halves[m] for m in holding[name]}) == 1, holding  # one half each, whole
        first = ran[name][0]
        assert first.startswith("tests/cluster/"), ran[name][:3]  # started at once
    # An integration module stays on one worker.
    for m in range(6):
        module = f"tests/integration/test_mod{m}.py"
        owners = {name for name, tests in ran.items() if any(t.startswith(module) for t in tests)}
        assert len(owners) == 1, owners


def test_one_worker_runs_both_halves():
    collection = CLUSTER_TESTS + OTHER_TESTS
    ran = _scheduled(1, collection)
    assert sorted(ran["gw0"]) == sorted(collection)


def test_the_schedules_test_waiting_on_its_background_batch_is_sent_last():
    waiting = "tests/simulation/test_fault_schedules.py::test_thousands_of_fault_schedules_keep_every_invariant"
    for workers in (1, 3):
        collection = OTHER_TESTS[:50] + [waiting] + CLUSTER_TESTS + OTHER_TESTS[50:]
        ran = _scheduled(workers, collection)
        owner = next(tests for tests in ran.values() if waiting in tests)
        assert owner[-1] == waiting, owner[-3:]
        assert sorted(t for tests in ran.values() for t in tests) == sorted(collection)


def test_two_workers_keep_one_cluster_on_one_worker():
    collection = CLUSTER_TESTS + OTHER_TESTS
    ran = _scheduled(2, collection)
    holding = [name for name, tests in ran.items() if any(t.startswith("tests/cluster/") for t in tests)]
    assert len(holding) == 1, holding
    assert sorted(t for tests in ran.values() for t in tests) == sorted(collection)
