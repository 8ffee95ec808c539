"""Alerts from a real daemon: a job that fails at every start gives up, and a real local HTTP
receiver gets the job_failed alert with the job's name, run id and reason; a receiver that
answers 500 first gets it on the retry; a command gets it on stdin and in its environment."""

from __future__ import annotations

import json
import shutil
import stat
import time

import pytest

from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir
from tests.receiver import Receiver

SECRET = "T0AL3RT/B0/s3cr3t-token"

CLUSTER = """\
[cluster]
name = "alerts-local"
state_dir = "{root}/state"

[ssh]
keepalive_s = 0.5

[[nodes]]
name = "a"
host = "local"
workdir = "{root}/a"

[[alerts]]
name = "hook"
webhook = "{hook}/services/{secret}"

[[alerts]]
name = "team"
webhook = "{slack}/services/{secret}?token={secret}"
format = "slack"

[[alerts]]
name = "script"
command = ["{root}/notify", "--from-coord"]
on = ["job_failed", "job_restarted"]
"""

NOTIFY = """\
#!/bin/sh
# Appends each alert (stdin) and its environment to files, as a pager script would use them.
cat >> "{root}/alerts.jsonl"
echo "$COORD_ALERT_EVENT $COORD_ALERT_JOB $COORD_ALERT_RUN_ID $1" >> "{root}/alerts.env"
"""


@pytest.fixture
def receivers():
    with Receiver() as hook, Receiver(statuses=[500, 200]) as slack:
        yield hook, slack


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"not {what} within {timeout} s")


def test_a_job_that_gives_up_is_posted_to_webhooks_retried_after_a_500_and_run_as_a_command(receivers):
    hook, slack = receivers
    root = short_tempdir()
    notify = root / "notify"
    notify.write_text(NOTIFY.format(root=root))
    notify.chmod(notify.stat().st_mode | stat.S_IXUSR)
    config = root / "cluster.toml"
    config.write_text(CLUSTER.format(root=root, hook=hook.url, slack=slack.url, secret=SECRET))
    daemon = DaemonProcess(config, env=environment()).start()
    try:
        daemon.wait_for(all_up, 30, "the node up")
        submitted = coord("run", "--config", str(config), "--name", "doomed", "--max-restarts", "1", "--detach",
                          "--", "python", "-c", "import sys; sys.exit(1)", env=daemon.env)
        assert submitted.returncode == 0, submitted.stderr
        waited = coord("wait", "--quiet", "--json", "--config", str(config), "doomed", env=daemon.env, timeout=300)
        final = json.loads(waited.stdout)
        assert waited.returncode == 1 and final["state"] == "failed" and final["restarts"] == 1, final

        wait_until(lambda: hook.received and len(slack.received) >= 2 and (root / "alerts.env").exists()
                   and len((root / "alerts.env").read_text().splitlines()) >= 2, 60, "every alert delivered")
        # the generic webhook: one job_failed alert naming the job, its run and why it failed
        (posted,) = hook.received
        alert = json.loads(posted.body)
        assert posted.path == f"/services/{SECRET}"
        assert (alert["event"], alert["job"], alert["run_id"], alert["cluster"]) == (
            "job_failed", "doomed", final["run_id"], "alerts-local")
        assert alert["reason"] == final["error"] and "exited with status 1" in alert["reason"], alert
        # Slack: refused once with a 500, delivered on the retry
        assert [json.loads(r.body)["text"].split("\n")[0] for r in slack.received] == [
            ":rotating_light: *alerts-local: job doomed failed*"] * 2
        # the command: the restart and the failure, in order, each on stdin and in its environment
        lines = (root / "alerts.env").read_text().splitlines()
        assert lines == [f"job_restarted doomed {final['run_id']} --from-coord",
                         f"job_failed doomed {final['run_id']} --from-coord"]
        stdin = [json.loads(line) for line in (root / "alerts.jsonl").read_text().splitlines()]
        assert [a["event"] for a in stdin] == ["job_restarted", "job_failed"] and stdin[1]["reason"] == final["error"]

        doc = daemon.wait_for(lambda d: sum(e["kind"] == "alert.sent" for e in d["events"]) >= 4, 30,
                              "four alert.sent events")
        sent = {(e["data"]["destination"], e["data"]["alert"]): e for e in doc["events"] if e["kind"] == "alert.sent"}
        assert set(sent) == {("hook", "job_failed"), ("team", "job_failed"), ("script", "job_restarted"),
                             ("script", "job_failed")}
        assert sent[("team", "job_failed")]["data"]["tries"] == 2
        assert sent[("team", "job_failed")]["message"].endswith(f"(slack webhook {slack.url}/…) after 2 tries")
        assert not [e for e in doc["events"] if e["kind"] in ("alert.failed", "alert.dropped")]
    finally:
        daemon.stop()
    # a webhook's secret is in no event and no log line
    events = coord("status", "--json", "--events", "50", "--config", str(config), env=daemon.env)
    assert SECRET not in daemon.log_file.read_text() and SECRET not in events.stdout + events.stderr
    shutil.rmtree(root, ignore_errors=True)


STALL_CLUSTER = """\
[cluster]
name = "stall-local"
state_dir = "{root}/state"

[ssh]
keepalive_s = 0.5

[dashboard]
listen = "off"

[[nodes]]
name = "a"
host = "local"
workdir = "{root}/a"

[[alerts]]
name = "hook"
webhook = "{hook}/stalled"
on = ["job_stalled"]
stalled_minutes = 0.05
"""


def test_a_job_that_makes_no_progress_is_posted_as_stalled_once():
    with Receiver() as hook:
        root = short_tempdir()
        config = root / "cluster.toml"
        config.write_text(STALL_CLUSTER.format(root=root, hook=hook.url))
        daemon = DaemonProcess(config, env=environment()).start()
        try:
            daemon.wait_for(all_up, 30, "the node up")
            # A script that reports no step at all, for longer than the 3 s threshold and two timer ticks.
            submitted = coord("run", "--config", str(config), "--name", "quiet", "--hang-timeout", "300", "--detach",
                              "--", "python", "-c", "import time; time.sleep(120)", env=daemon.env)
            assert submitted.returncode == 0, submitted.stderr
            wait_until(lambda: hook.received, 60, "a job_stalled alert")
            time.sleep(12)  # another tick of the timers: the same stall is not posted again
            (posted,) = hook.received
            alert = json.loads(posted.body)
            assert (alert["event"], alert["job"]) == ("job_stalled", "quiet"), alert
            doc = json.loads(coord("status", "--json", "--config", str(config), env=daemon.env).stdout)
            job = next(j for j in doc["jobs"] if j["name"] == "quiet")
            assert job["state"] == "running" and alert["run_id"] == job["run_id"], job
        finally:
            coord("stop", "--config", str(config), "quiet", env=daemon.env, timeout=60)
            daemon.stop()
            shutil.rmtree(root, ignore_errors=True)
