"""Shared pytest fixtures."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
from pathlib import Path

import pytest

# The tests run as under an activated environment of the Python running them: its scripts
# (uv for the test cluster's venvs, mlx.launch, coord, coordd) come first on PATH, so
# `.venv/bin/python -m pytest` finds the .venv's own, as `. .venv/bin/activate` would.
_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = os.pathsep.join(filter(None, [_BIN, os.environ.get("PATH")]))


def _waiting_ranks_sleep() -> None:
    """The processes the tests start (daemons, local agents, their MLX ranks) wait for a peer without
    spinning one of the two cores they all share (tests/socket_wait.py)."""
    from tests import socket_wait

    shim = socket_wait.preload()
    if shim and shim not in os.environ.get("LD_PRELOAD", "").split():
        os.environ["LD_PRELOAD"] = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), shim]))


_waiting_ranks_sleep()

# --- multi-host network-namespace test cluster (tests/cluster/netns.py) -------------


def cluster_available() -> tuple[bool, str]:
    """(True, "") where the netns test cluster can run: Linux, root, ip, sshd, uv."""
    from tests.cluster.netns import cluster_available as _available

    return _available()


@pytest.fixture(scope="session")
def netns_cluster():
    """A started 3-node NetnsCluster (n1, n2, n3 as coordalice, coordbob, coordcarol).

    Skipped with the reason where it cannot run, except under CI=true, where it fails.
    """
    ok, reason = cluster_available()
    if not ok:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"netns cluster unavailable under CI=true: {reason}")
        pytest.skip(reason)
    from tests.cluster.netns import DEFAULT_NODES, NetnsCluster, cluster_user_suffix

    nodes = DEFAULT_NODES
    suffix = cluster_user_suffix()
    if suffix:  # a second cluster beside one that holds the default users (another checkout's tests)
        if not suffix.isalnum() or len(suffix) > 6:
            pytest.fail(f"COORD_NETNS_USER_SUFFIX must be up to 6 letters or digits, got {suffix!r}")
        nodes = tuple(dataclasses.replace(n, user=n.user + suffix, home=n.home + suffix,
                                          venv=n.venv.replace(n.home, n.home + suffix)) for n in DEFAULT_NODES)
    with NetnsCluster(nodes) as cluster:
        yield cluster


# --- end netns cluster ---------------------------------------------------------------


# --- three workers, the multi-host tests in two halves ----------------------------------


# The multi-host modules' time in a run of the suite (seconds, measured on 2 cores): the two halves
# they are split into are balanced by it. A module not listed counts as 20 s.
CLUSTER_MODULE_SECONDS = {
    "test_checkpoint_store_multihost": 326, "test_training_health_multihost": 240, "test_torch_multihost": 193,
    "test_stragglers_multihost": 120, "test_recovery_multihost": 142, "test_run_identity_multihost": 120,
    "test_elastic_multihost": 94, "test_drill_multihost": 86, "test_scale_multihost": 59,
    "test_command_multihost": 54, "test_service_stop_multihost": 43, "test_doctor_multihost": 39,
    "test_run_multihost": 38, "test_busy_first_step_multihost": 33, "test_alerts_multihost": 30,
    "test_observe_multihost": 30, "test_own_copies_multihost": 29, "test_daemon_multihost": 22,
    "test_exact_resume_multihost": 18, "test_relay_multihost": 16, "test_ready_multihost": 11,
    "test_onboarding_multihost": 11, "test_hostfile_multihost": 10, "test_host_keys_multihost": 9,
}
CLUSTER = "tests/cluster/"


def cluster_halves(modules: list[str]) -> dict[str, str]:
    """Each multi-host module (its path) to one of two halves, ``a`` or ``b``, of about equal time:
    the longest first, each to the half with less so far."""
    halves = {"a": 0.0, "b": 0.0}
    chosen = {}
    for module in sorted(set(modules), key=lambda m: (-CLUSTER_MODULE_SECONDS.get(Path(m).stem, 20), m)):
        half = min(halves, key=lambda h: (halves[h], h))
        halves[half] += CLUSTER_MODULE_SECONDS.get(Path(module).stem, 20)
        chosen[module] = half
    return chosen


def pytest_xdist_make_scheduler(config, log):
    """With pytest-xdist: on two workers (pyproject.toml) the multi-host tests run on one of them, on one
    cluster; on three or more they go in two halves of about equal time to two workers, each with a
    cluster of its own (one set of Unix users and namespaces, made once: ``cluster_user_suffix``); those
    workers start them at once, and take other work only as they go. An integration module runs on one
    worker (its daemon and cluster are made once, and its tests may follow each other), and so does a
    fuzz module; every other test is scheduled on its own."""
    from xdist.scheduler import LoadScopeScheduling

    class ClusterHalves(LoadScopeScheduling):
        halves: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(CLUSTER):
                if self.numnodes < 3:
                    return CLUSTER  # one cluster, on one worker: the others' tests beside it
                if self.halves is None:
                    modules = [i.split("::", 1)[0] for i in self.collection or [] if i.startswith(CLUSTER)]
                    self.halves = cluster_halves(modules) if modules else None
                module = nodeid.split("::", 1)[0]
                return CLUSTER + ((self.halves or {}).get(module) or cluster_halves([module])[module])
            if nodeid.startswith(("tests/integration/", "tests/unit/test_bad_input_")):
                # the fuzz modules too: their last test counts the inputs all of the module's tests tried
                return nodeid.split("::", 1)[0]
            return nodeid

        def _assign_work_unit(self, node) -> None:
            # A worker without a half takes one first, if one is left; one with a half takes other work
            # first, so the two halves go to two workers (a worker that takes both, with one worker or
            # once nothing else is left, runs both on its one cluster).
            holds = any(scope.startswith(CLUSTER) for scope in self.assigned_work.get(node, {}))
            # The schedules test waits for the batch that runs beside the suite at the lowest priority:
            # taken last, it waits least, and holds no worker while other tests are left.
            waiting = next((scope for scope in self.workqueue if scope.endswith("::" + _SCHEDULES_TEST)), None)
            if waiting is not None and len(self.workqueue) > 1:
                self.workqueue.move_to_end(waiting)
            for scope in self.workqueue:
                if scope.startswith(CLUSTER) != holds and scope != waiting:
                    self.workqueue.move_to_end(scope, last=False)
                    break
            super()._assign_work_unit(node)

    return ClusterHalves(config, log)


# --- the fault schedules in the background -------------------------------------------

_SCHEDULES_TEST = "test_thousands_of_fault_schedules_keep_every_invariant"
_RESULT_ENV = "COORD_SCHEDULES_RESULT"  # where the background batch writes its result, for every worker


def _start_batch(config, out: str) -> None:
    """Start the schedules batch at the lowest priority; its result goes to ``out``."""
    import subprocess

    from tests.simulation.test_fault_schedules import FIRST_SEED, SCHEDULES

    process = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "tests.simulation.batch", "--first",
                                str(FIRST_SEED), "--count", str(SCHEDULES), "--out", out],
                               cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)  # its pool's workers are stopped with it
    config._coord_schedules = (process, out)
    with open(out + ".started", "w", encoding="utf-8"):
        pass


def _wanted(ids: list[str]) -> bool:
    """Whether a run of these tests starts the batch in the background: many tests, the schedules one among them."""
    return (os.environ.get("COORD_SIM_BACKGROUND", "1") != "0" and len(ids) >= 50
            and any(i.endswith("::" + _SCHEDULES_TEST) for i in ids))


def pytest_configure(config):
    """Under pytest-xdist, the controller names the batch's result file for every worker it starts (it
    starts the batch itself once the workers have collected)."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        import tempfile

        os.environ[_RESULT_ENV] = os.path.join(tempfile.mkdtemp(prefix="coord-schedules-"), "result.json")


def pytest_xdist_node_collection_finished(node, ids):
    config = node.config
    if getattr(config, "_coord_schedules", None) is None and os.environ.get(_RESULT_ENV) and _wanted(ids):
        _start_batch(config, os.environ[_RESULT_ENV])


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected: a batch for a test that will not run is waste
def pytest_collection_modifyitems(session, config, items):
    """Without pytest-xdist: when the schedules test is among many, its batch starts now at the lowest
    priority and runs beside the real-process tests, on the cycles they leave idle; the test reads the result."""
    if hasattr(config, "workerinput") or os.environ.get(_RESULT_ENV) or not _wanted([i.nodeid for i in items]):
        return
    import tempfile

    _start_batch(config, os.path.join(tempfile.mkdtemp(prefix="coord-schedules-"), "result.json"))


def pytest_unconfigure(config):
    started = getattr(config, "_coord_schedules", None)
    if started is not None and started[0].poll() is None:
        with contextlib.suppress(ProcessLookupError):  # the run was cut short before the schedules test read it
            os.killpg(started[0].pid, signal.SIGKILL)  # the batch and its pool's workers
        started[0].wait()


@pytest.fixture
def background_schedules(request):
    """A function that waits for the background batch and returns its result; None when no batch was
    started in the background (the test then runs it itself)."""
    import json
    import time

    started = getattr(request.config, "_coord_schedules", None)
    out = started[1] if started is not None else os.environ.get(_RESULT_ENV)
    if out is None or not os.path.exists(out + ".started"):
        return None

    def result():
        if started is not None:  # started by this process: its output says why it failed
            process = started[0]
            output, _ = process.communicate(timeout=1800)
            assert process.returncode == 0, f"the schedules batch failed:\n{output.decode(errors='replace')[-4000:]}"
        deadline = time.monotonic() + 1800
        while not os.path.exists(out):  # started by pytest-xdist's controller: its file is the news
            assert time.monotonic() < deadline, "the background schedules batch wrote no result in 30 minutes"
            time.sleep(1.0)
        with open(out, encoding="utf-8") as handle:
            return json.load(handle)

    return result
