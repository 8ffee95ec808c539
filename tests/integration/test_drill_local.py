"""`coord drill`'s refusals on a local cluster (the drill itself runs on the multi-host cluster:
tests/cluster/test_drill_multihost.py)."""

from __future__ import annotations

import shutil

import pytest

from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir

CLUSTER = """\
[cluster]
name = "drill-local"
state_dir = "{root}/state"

[ssh]
keepalive_s = 0.5

[[nodes]]
name = "a"
host = "local"
workdir = "{root}/a"

[[nodes]]
name = "b"
host = "local"
workdir = "{root}/b"
"""


@pytest.fixture(scope="module")
def cluster():
    root = short_tempdir()
    for node in ("a", "b"):
        (root / node).mkdir()
    config = root / "cluster.toml"
    config.write_text(CLUSTER.format(root=root))
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
