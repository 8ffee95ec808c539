"""Seeing, queueing and hearing about runs on the multi-host cluster: two jobs submitted
together run one after the other on the same three nodes; the dashboard, as headless Chromium
draws it, names the nodes and the running job and draws its curve; /metrics answers. (A job
that fails posting to a webhook: test_alerts_multihost.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.jobs import TOTAL_STEPS, TRAIN, events, finish, job_of, submit, tiny_project_and_daemon
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


def _in_head(netns_cluster, argv: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", netns_cluster.head_ns, *argv], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(900)
def test_the_dashboard_draws_the_running_job_and_metrics_answer(netns_cluster, running, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.fail("chromium is missing (.ci/setup installs it)")
    daemon, project = running["daemon"], running["project"]
    long_run = [w if w != str(TOTAL_STEPS) else "2000" for w in TRAIN]
    submit(daemon, project, "watched", command=long_run)
    doc = daemon.wait_for(lambda d: job_of(d, "watched")["step"] >= 15 or job_of(d, "watched")["state"] == "failed",
                          600, "watched at step 15")
    assert job_of(doc, "watched")["state"] == "running", job_of(doc, "watched")
    url = doc["dashboard"]["url"]
    assert url.startswith("http://127.0.0.1:"), doc["dashboard"]
    try:
        metrics = _in_head(netns_cluster, [sys.executable, "-c",
                                           f"import urllib.request; print(urllib.request.urlopen({url + 'metrics'!r}, "
                                           "timeout=30).read().decode())"])
        assert metrics.returncode == 0, metrics.stderr
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(metrics.stdout) for s in family.samples}
        assert all(samples[("coord_node_up", (("node", n),))] == 1 for n in ("n1", "n2", "n3")), samples
        assert samples[("coord_job_step", (("job", "watched"),))] >= 15
        argv = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1400,1100",
                f"--user-data-dir={tmp_path / 'chromium-profile'}", "--timeout=8000"]
        dom = _in_head(netns_cluster, [*argv, "--dump-dom", url]).stdout
        assert 'data-rendered="' in dom, dom[:3000]
        for text in ("n1", "n2", "n3", "watched", "running"):
            assert text in dom, text
        assert 'class="uplot' in dom and '<p id="curves-empty" class="muted" hidden="">' in dom, "no curve drawn"
        shot = Path(os.environ.get("COORD_SCREENSHOT_DIR") or tmp_path) / "dashboard-multihost.png"
        _in_head(netns_cluster, [*argv, f"--screenshot={shot}", url])
        assert shot.stat().st_size > 20_000
    finally:
        stopped = coord("stop", "--config", str(daemon.config), "watched", env=daemon.env, timeout=120)
        assert stopped.returncode == 0, stopped.stderr
