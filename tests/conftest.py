"""Shared pytest fixtures."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

# The tests run as under an activated environment of the Python running them: its scripts
# (uv for the test cluster's venvs, mlx.launch, coord, coordd) come first on PATH, so
# `.venv/bin/python -m pytest` finds the .venv's own, as `. .venv/bin/activate` would.
_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = os.pathsep.join(filter(None, [_BIN, os.environ.get("PATH")]))

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
    from tests.cluster.netns import DEFAULT_NODES, NetnsCluster

    nodes = DEFAULT_NODES
    suffix = os.environ.get("COORD_NETNS_USER_SUFFIX", "")
    if suffix:  # a second cluster beside one that holds the default users (another checkout's tests)
        if not suffix.isalnum() or len(suffix) > 6:
            pytest.fail(f"COORD_NETNS_USER_SUFFIX must be up to 6 letters or digits, got {suffix!r}")
        nodes = tuple(dataclasses.replace(n, user=n.user + suffix, home=n.home + suffix,
                                          venv=n.venv.replace(n.home, n.home + suffix)) for n in DEFAULT_NODES)
    with NetnsCluster(nodes) as cluster:
        yield cluster


# --- end netns cluster ---------------------------------------------------------------


# --- the fault schedules in the background -------------------------------------------

_SCHEDULES_TEST = "test_thousands_of_fault_schedules_keep_every_invariant"


def pytest_collection_modifyitems(session, config, items):
    """When the schedules test is among many, its batch starts now at the lowest priority and
    runs beside the real-process tests, on the cycles they leave idle; the test reads the result."""
    if os.environ.get("COORD_SIM_BACKGROUND", "1") == "0" or len(items) < 50:
        return
    if not any(item.name == _SCHEDULES_TEST for item in items):
        return
    import subprocess
    import tempfile

    from tests.simulation.test_fault_schedules import FIRST_SEED, SCHEDULES

    out = os.path.join(tempfile.mkdtemp(prefix="coord-schedules-"), "result.json")
    process = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "tests.simulation.batch", "--first",
                                str(FIRST_SEED), "--count", str(SCHEDULES), "--out", out],
                               cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    config._coord_schedules = (process, out)


def pytest_unconfigure(config):
    started = getattr(config, "_coord_schedules", None)
    if started is not None and started[0].poll() is None:
        started[0].kill()  # the run was cut short before the schedules test read it
        started[0].wait()


@pytest.fixture
def background_schedules(request):
    """A function that waits for the background batch and returns its result; None when the
    batch was not started in the background (the test then runs it itself)."""
    started = getattr(request.config, "_coord_schedules", None)
    if started is None:
        return None

    def result():
        import json

        process, out = started
        output, _ = process.communicate(timeout=1800)
        assert process.returncode == 0, f"the schedules batch failed:\n{output.decode(errors='replace')[-4000:]}"
        with open(out, encoding="utf-8") as handle:
            return json.load(handle)

    return result
