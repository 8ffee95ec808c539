"""A scale cluster in the suite: 32 light nodes (a namespace, an OpenSSH server, a user and a workdir
each, one shared Python), every agent up on first contact, a ``--launcher command`` job on every node,
one node cut and the job shrunk to the other 31, and a stop that leaves no rank anywhere. The 128-node
measurements are bench/scale.py's; this keeps their path working within the suite's time."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator

import pytest

from coordinator.jobs.checkpoint_dirs import WHOLE_COPIES
from tests.cluster.jobs import events, job_of
from tests.cluster.netns import NetnsCluster, cluster_available, cluster_user_suffix, light_nodes
from tests.command_jobs import SOCKETS
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

NODES = 32


@pytest.fixture(scope="module")
def scale_cluster() -> Iterator[NetnsCluster]:
    ok, reason = cluster_available()
    if not ok:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"netns cluster unavailable under CI=true: {reason}")
        pytest.skip(reason)
    with NetnsCluster(light_nodes(NODES, cluster_user_suffix())) as cluster:
        yield cluster


def test_32_nodes_come_up_run_a_command_job_shrink_past_a_cut_node_and_stop_with_nothing_left(scale_cluster):
    cluster = scale_cluster
    root = short_tempdir()
    root.chmod(0o755)
    project = root / "project"
    project.mkdir(mode=0o755)
    (project / "sockets.py").write_text(SOCKETS)
    (project / "sockets.py").chmod(0o644)
    config = cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state")
    daemon = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", cluster.head_ns],
                           python=sys.executable)
    cut = cluster.nodes[-1].name
    try:
        started = time.monotonic()
        daemon.start()
        daemon.wait_for(all_up, 300, f"all {NODES} agents up")
        print(f"{NODES} agents up on first contact {time.monotonic() - started:.1f} s after the daemon started")
        submitted = time.monotonic()
        done = coord("run", "--config", str(daemon.config), "--name", "wide", "--source", str(project),
                     "--launcher", "command", "--save-every", "5", "--min-nodes", str(NODES - 1), "--node-timeout",
                     "5", "--total-steps", "100000", "--hang-timeout", "300", "--detach", "--", "python",
                     "sockets.py", "--steps", "100000", "--sleep", "0.2", env=daemon.env, timeout=120)
        assert done.returncode == 0, done.stderr
        daemon.wait_for(lambda d: job_of(d, "wide")["state"] == "running" and job_of(d, "wide")["step"] >= 1, 300,
                        "the job's first step on every node")
        print(f"submit to the first step on {NODES} nodes: {time.monotonic() - submitted:.1f} s")
        deadline = time.monotonic() + 300
        while not any(e["kind"] == "job.checkpoint" and e["data"]["step"] >= 10 for e in events(daemon, "wide")):
            assert time.monotonic() < deadline, "no checkpoint of step 10 validated"
            time.sleep(0.5)
        cluster.cut_link(cut)
        cut_at = time.monotonic()
        try:
            doc = daemon.wait_for(lambda d: job_of(d, "wide")["state"] == "running"
                                  and len(job_of(d, "wide")["nodes"]) == NODES - 1
                                  and job_of(d, "wide")["attempt"] >= 1, 300, f"the job shrunk to {NODES - 1}")
            first = job_of(doc, "wide")["step"]
            daemon.wait_for(lambda d: job_of(d, "wide")["step"] > first + 2, 300, "the shrunk job training")
            print(f"cut to training again on {NODES - 1}: {time.monotonic() - cut_at:.1f} s")
            story = "\n".join(f"{e['kind']}: {e['message']}" for e in events(daemon, "wide"))
            assert f"{NODES} → {NODES - 1} ranks; left out {cut}" in story, story
            # Each checkpoint was made whole on WHOLE_COPIES nodes, not on every node; the resume placed the
            # one it took on the nodes of the shrunk job that lacked it, and every rank read it.
            found = events(daemon, "wide")
            assert all(len(e["data"]["nodes"]) == WHOLE_COPIES for e in found if e["kind"] == "job.checkpoint"), story
            placed = [e["data"] for e in found if e["kind"] == "job.checkpoint_placed"]
            assert placed and len(placed[-1]["copied_to"]) >= NODES - 1 - WHOLE_COPIES, story
            stopped = time.monotonic()
            done = coord("stop", "--config", str(daemon.config), "wide", env=daemon.env, timeout=300)
            assert done.returncode == 0, done.stderr
            final = json.loads(coord("wait", "--quiet", "--json", "--config", str(daemon.config), "wide",
                                     env=daemon.env, timeout=300).stdout)
            assert final["state"] == "stopped", final
            print(f"stop to stopped on {NODES - 1} nodes: {time.monotonic() - stopped:.1f} s")
            left = {n.name: found for n in cluster.nodes if n.name != cut and (found := cluster.exec_in(
                n.name, ["pgrep", "-u", n.user, "-f", "sockets.py"]).stdout.strip())}
            assert not left, f"ranks left running: {left}"
        finally:
            cluster.restore_link(cut)
    finally:
        daemon.stop()
        for node in cluster.nodes:
            cluster.exec_in(node.name, ["pkill", "-KILL", "-u", node.user, "-f", "sockets.py"])
        shutil.rmtree(root, ignore_errors=True)
