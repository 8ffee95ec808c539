"""`coord drill`'s refusals on a local cluster (the drill itself runs on the multi-host cluster:
tests/cluster/test_drill_multihost.py)."""

from __future__ import annotations

import shutil

import pytest

from tests.integration.daemon_harness import (
    DaemonProcess,
    all_up,
    coord,
    environment,
    short_tempdir,
    write_local_cluster,
)


@pytest.fixture(scope="module")
def cluster():
    root = short_tempdir()
    config = write_local_cluster(root, ("a", "b"), name="drill-local", keepalive_s=0.5)
    daemon = DaemonProcess(config, env=environment()).start()
    daemon.wait_for(all_up, 30, "all nodes up")
    yield daemon, root
    daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_a_drill_is_refused_on_one_node_and_on_a_node_it_does_not_know(cluster):
    daemon, _ = cluster
    one = coord("drill", "--config", str(daemon.config), "--nodes", "a", env=daemon.env)
    assert one.returncode == 2 and "a drill needs 2 nodes" in one.stderr, one.stderr
    unknown = coord("drill", "--config", str(daemon.config), "--nodes", "a,zz", env=daemon.env)
    assert unknown.returncode == 2 and "no node named zz" in unknown.stderr, unknown.stderr
    # Before any fault, not after two: a local node has no link of its own to take down.
    cut = coord("drill", "--config", str(daemon.config), "--cut-node", env=daemon.env)
    assert cut.returncode == 2 and "b runs on the head's own machine" in cut.stderr, cut.stderr
