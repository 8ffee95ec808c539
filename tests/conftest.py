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
