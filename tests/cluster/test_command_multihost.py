"""``--launcher command`` on the multi-host cluster: a home-made socket program (its own all-reduce through
rank 0 at ``COORD_COORDINATOR_ADDR``) across three nodes, each a namespace with its own sshd, user, home
and Python, reached over real SSH. The first node (the coordinator's) cut for good: the job shrinks to
two, whose world and coordinator come from the environment of the next attempt, and finishes from the
newest checkpoint with the weight that world gives. A process stopped for good (a hang): recovered, and
the weight is the uninterrupted run's, exactly."""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.jobs import events, finish, job_of
from tests.command_jobs import SOCKETS, expected_weight
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def command_cluster(netns_cluster) -> Iterator[dict]:
    root = short_tempdir()
    root.chmod(0o755)
    project = root / "project"
    project.mkdir(mode=0o755)
    (project / "sockets.py").write_text(SOCKETS)
    (project / "sockets.py").chmod(0o644)
    config = netns_cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state")
    daemon = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", netns_cluster.head_ns],
                           python=sys.executable)
    daemon.start()
    try:
        daemon.wait_for(all_up, 60, "all nodes up")
        yield {"root": root, "project": project, "daemon": daemon}
    finally:
        daemon.stop()
        for spec in netns_cluster.nodes:
            netns_cluster.exec_in(spec.name, ["pkill", "-KILL", "-u", spec.user, "-f", "sockets.py"])
        shutil.rmtree(root, ignore_errors=True)


def _submit(holder: dict, name: str, *args: str) -> None:
    daemon = holder["daemon"]
    done = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(holder["project"]),
                 "--launcher", "command", "--save-every", "5", "--detach", *args, env=daemon.env)
    assert done.returncode == 0, done.stderr


def _final(netns_cluster, final: dict) -> dict:
    node = netns_cluster.node(final["nodes"][0])
    return json.loads((Path(node.workdir) / "checkpoints" / final["run_id"] / f"attempt-{final['attempt']}" /
                       "final.json").read_text())


def test_the_coordinators_node_cut_for_good_the_command_job_shrinks_and_finishes_from_its_checkpoint(
        netns_cluster, command_cluster):
    daemon = command_cluster["daemon"]
    _submit(command_cluster, "cmd-shrink", "--min-nodes", "2", "--node-timeout", "5", "--total-steps", "40", "--",
            "python", "sockets.py", "--steps", "40", "--sleep", "0.1")
    deadline = time.monotonic() + 120
    while not any(e["kind"] == "job.checkpoint" and e["data"]["step"] == 10 for e in events(daemon, "cmd-shrink")):
        assert time.monotonic() < deadline, "the checkpoint of step 10 was not validated"
        time.sleep(0.1)
    job = job_of(daemon.status(), "cmd-shrink")
    assert job["nodes"] == ["n1", "n2", "n3"], job
    netns_cluster.cut_link("n1")
    try:
        final = finish(daemon, "cmd-shrink", 40)
    finally:
        netns_cluster.restore_link("n1")
    story = final["story"]
    assert final["nodes"] == ["n2", "n3"] and "3 → 2 ranks; left out n1" in story, story
    resumed = [e for e in events(daemon, "cmd-shrink") if e["kind"] == "job.resume_from"][-1]["data"]["step"]
    assert resumed >= 10, story
    # The first steps on three processes, the rest on two, from the checkpoint it resumed from.
    assert _final(netns_cluster, final) == {"w": expected_weight(40 - resumed, 2, expected_weight(resumed, 3)),
                                            "world": 2}, story
    log = coord("logs", "--config", str(daemon.config), "--rank", "1", "cmd-shrink", env=daemon.env).stdout
    address = netns_cluster.node_ip("n2")
    assert f"rank 1 of 2, local 0, node 1 of 2, coordinator {address}:" in log, log[-2000:]


def test_a_process_held_for_good_on_one_node_is_a_hang_recovered_exactly(netns_cluster, command_cluster):
    daemon = command_cluster["daemon"]
    daemon.wait_for(all_up, 120, "every node up again (the test before cut one)")
    _submit(command_cluster, "cmd-hang", "--total-steps", "30", "--hang-timeout", "20", "--", "python", "sockets.py",
            "--steps", "30", "--sleep", "0.05", "--hold-at", "12")
    final = finish(daemon, "cmd-hang", 30)
    story = final["story"]
    assert final["attempt"] == 1 and any(e["kind"] == "job.hang" for e in events(daemon, "cmd-hang")), story
    assert _final(netns_cluster, final) == {"w": expected_weight(30, 3), "world": 3}, story
