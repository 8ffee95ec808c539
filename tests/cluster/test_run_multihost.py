"""Run and keep running, on the multi-host cluster: a real mlx_lm fine-tune over three nodes
(different users, homes and venvs), one rank SIGKILLed midway."""

from __future__ import annotations

import os
import signal

import pytest

from tests.cluster.jobs import events, finish, rank_pid, ranks_left, submit, tiny_project_and_daemon, wait_step
from tests.integration.daemon_harness import coord

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def running(netns_cluster):
    with tiny_project_and_daemon(netns_cluster) as holder:
        yield holder["daemon"], holder["project"]


def test_a_killed_rank_resumes_from_the_newest_checkpoint_on_three_nodes(netns_cluster, running):
    daemon, project = running
    submit(daemon, project, "tiny3", "--hang-timeout", "120")
    current = wait_step(daemon, "tiny3", 25)
    killed_at = current["step"]
    os.kill(rank_pid(netns_cluster, current, 1), signal.SIGKILL)
    final = finish(daemon, "tiny3")
    assert final["restarts"] == 1, final["story"]
    found = events(daemon, "tiny3")
    resumed = [e for e in found if e["kind"] == "job.resume_from"]
    assert resumed, found
    resume_step = resumed[-1]["data"]["step"]
    assert killed_at - resume_step <= 10 + 2  # at most one checkpoint interval redone (+ polling slack)
    assert any("exited with status 137 (SIGKILL)" in e["message"] for e in found)
    assert ranks_left(netns_cluster) == {}  # no rank is left running anywhere
    # each rank's output is kept on the head, per attempt and per rank
    logs = coord("logs", "--config", str(daemon.config), "--rank", "0", "--attempt", "1", "tiny3", env=daemon.env)
    assert logs.returncode == 0 and logs.stdout
