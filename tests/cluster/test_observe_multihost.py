"""Seeing, queueing and hearing about runs on the multi-host cluster: two jobs submitted
together run one after the other on the same three nodes."""

from __future__ import annotations

import json

import pytest

from tests.cluster.jobs import events, finish, job_of, submit, tiny_project_and_daemon
from tests.integration.daemon_harness import coord

pytestmark = pytest.mark.cluster


@pytest.fixture
def running(netns_cluster):
    with tiny_project_and_daemon(netns_cluster) as holder:
        yield holder


@pytest.mark.timeout(900)
def test_two_jobs_submitted_together_run_one_after_the_other(running):
    daemon, project = running["daemon"], running["project"]
    submit(daemon, project, "first")
    submit(daemon, project, "second")
    doc = json.loads(coord("status", "--json", "--config", str(daemon.config), env=daemon.env).stdout)
    second = job_of(doc, "second")
    assert second["state"] == "queued" and second["queue_position"] == 1, second
    finish(daemon, "first")
    finish(daemon, "second")
    found = events(daemon)
    first_done = next(e["ts"] for e in found if e["kind"] == "job.succeeded" and e["message"].startswith("first:"))
    second_launched = [e["ts"] for e in found if e["kind"] == "job.launched" and e["message"].startswith("second:")]
    dequeued = [e for e in found if e["kind"] == "job.dequeued" and e["message"].startswith("second:")]
    assert dequeued and second_launched and min(second_launched) >= first_done, found
