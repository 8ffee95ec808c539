"""Which alerts events and facts call for, and how each destination receives them: pure, under a
clock moved by hand."""

from __future__ import annotations

import json

from coordinator.observe.alerts import payloads, rules
from coordinator.observe.alerts.rules import Alert, NodeFacts, RunFacts
from coordinator.config.cluster_file import AlertSettings

T0 = 1_700_000_000.0
RUN = RunFacts(run_id="tiny-3f9a0c1e", name="tiny", state="failed", step=12, total_steps=100, restarts=2,
               max_restarts=2, error="rank 1 on n2 exited 1; no restarts left (2 of 2 used)")


def event(kind: str, message: str, run: str | None = "tiny-3f9a0c1e", ts: float = T0) -> dict:
    return {"id": 1, "ts": ts, "kind": kind, "node": None, "message": message, "data": {"run": run} if run else None}


# --- events ------------------------------------------------------------------------------

def test_a_job_that_gives_up_is_a_job_failed_alert_with_its_name_run_and_reason():
    alert = rules.alert_for_event(event("job.failed", "tiny: rank 1 on n2 exited 1; no restarts left (2 of 2 used)"),
                                  RUN, "lab")
    assert (alert.kind, alert.job, alert.run_id) == ("job_failed", "tiny", "tiny-3f9a0c1e")
    assert alert.reason == RUN.error and alert.title == "lab: job tiny failed"
    assert alert.message == ("run tiny-3f9a0c1e failed at step 12 of 100 after 2 restarts: "
                             "rank 1 on n2 exited 1; no restarts left (2 of 2 used)")
    assert alert.time == T0 and alert.details["max_restarts"] == 2


def test_a_failure_whose_run_is_unknown_still_alerts_from_the_event_alone():
    alert = rules.alert_for_event(event("job.failed", "x: sync failed: disk full", run="x-00000000"), None, "lab")
    assert (alert.kind, alert.run_id, alert.reason) == ("job_failed", "x-00000000", "x: sync failed: disk full")


def test_succeeded_and_restart_events_are_their_own_alerts_with_the_job_prefix_dropped():
    done = rules.alert_for_event(event("job.succeeded", "tiny: finished at step 100 with 1 restarts"),
                                 RunFacts("tiny-3f9a0c1e", "tiny", "succeeded", 100, 100, 1, 3), "lab")
    assert done.kind == "job_succeeded" and done.message == "run tiny-3f9a0c1e finished at step 100 with 1 restarts"
    again = rules.alert_for_event(event("job.restart", "tiny: restart 1 of 3 in 1 s: rank 0 on a exited 1"),
                                  RunFacts("tiny-3f9a0c1e", "tiny", "recovering", 40, 100, 1, 3), "lab")
    assert again.kind == "job_restarted" and again.reason == "restart 1 of 3 in 1 s: rank 0 on a exited 1"


def test_other_events_are_no_alerts():
    for kind in ("job.stopped", "job.launched", "node.down", "alert.failed", "daemon.started", "job.restarted"):
        assert rules.alert_for_event(event(kind, "tiny: whatever"), RUN, "lab") is None


def test_a_destination_wants_only_its_events_and_failures_by_default():
    default = AlertSettings(name="a", webhook="https://x.example/h")
    assert rules.wants(default, "job_failed")
    assert not any(rules.wants(default, k) for k in ("job_succeeded", "job_restarted", "job_stalled", "node_down"))
    chosen = AlertSettings(name="b", webhook="https://x.example/h", on=("job_succeeded", "node_down"))
    assert rules.wants(chosen, "node_down") and not rules.wants(chosen, "job_failed")


def test_a_straggler_and_its_resolve_are_alerts_that_go_together_where_straggler_is_asked_for():
    running = RunFacts("tiny-3f9a0c1e", "tiny", "running", 40, 100, 0, 3)
    said = ("tiny: rank 2 on n3 is a straggler: its compute time is 4.0x the ranks' median; likely cause: CPU "
            "throttled by a quota")
    named = rules.alert_for_event(event("job.straggler", said), running, "lab")
    assert named.kind == "straggler" and named.title == "lab: job tiny has a straggler"
    assert named.reason.startswith("rank 2 on n3 is a straggler") and "CPU throttled by a quota" in named.message
    cleared = rules.alert_for_event(event("job.straggler_cleared", "tiny: rank 2 on n3 is no longer a straggler"),
                                    running, "lab")
    assert cleared.kind == "straggler_resolved" and cleared.title == "lab: job tiny straggler resolved"
    asked = AlertSettings(name="s", webhook="https://x.example/h", on=("straggler",))
    assert rules.wants(asked, "straggler") and rules.wants(asked, "straggler_resolved")
    default = AlertSettings(name="a", webhook="https://x.example/h")
    assert not rules.wants(default, "straggler") and not rules.wants(default, "straggler_resolved")
    for alert in (named, cleared):  # every destination's format knows both kinds
        assert all(payloads.webhook_request(alert, fmt) for fmt in ("generic", "slack", "ntfy"))


# --- node_down: down longer than N minutes, once per down period -------------------------

def test_a_node_is_alerted_once_after_it_has_been_down_longer_than_the_threshold_and_again_after_coming_back():
    down, alerted, sent = {}, {}, []

    def tick(now: float, n2_up: bool) -> None:
        nonlocal down, alerted
        nodes = [NodeFacts("n1", True), NodeFacts("n2", n2_up, None if n2_up else "ssh keepalive lost")]
        down = rules.track_down_since(down, nodes, now)
        found, alerted = rules.node_down_alerts(nodes, down, now, threshold_s=300, alerted=alerted, cluster="lab")
        sent.extend((now, a) for a in found)

    tick(T0, False)            # n2 is seen down
    tick(T0 + 299, False)      # not yet five minutes
    assert sent == []
    tick(T0 + 301, False)
    tick(T0 + 900, False)      # still the same outage: no second alert
    assert [(now - T0, a.kind, a.node) for now, a in sent] == [(301, "node_down", "n2")]
    assert sent[0][1].message == "n2 has been down for 5 minutes: ssh keepalive lost"
    assert sent[0][1].details["down_since"] == T0
    tick(T0 + 1000, True)      # back: the outage ends
    tick(T0 + 1010, False)     # a new outage starts its own clock
    tick(T0 + 1200, False)
    assert len(sent) == 1
    tick(T0 + 1311, False)
    assert [now - T0 for now, _ in sent] == [301, 1311]


def test_a_node_never_up_since_the_daemon_started_counts_from_when_it_was_first_seen():
    nodes = [NodeFacts("n1", False, "connecting")]
    down = rules.track_down_since({}, nodes, T0)
    assert rules.node_down_alerts(nodes, down, T0 + 60, threshold_s=300, alerted={}, cluster="c")[0] == []
    found, _ = rules.node_down_alerts(nodes, down, T0 + 360, threshold_s=300, alerted={}, cluster="c")
    assert [a.node for a in found] == ["n1"] and found[0].message == "n1 has been down for 6 minutes: connecting"


def test_state_changes_between_two_looks_time_the_outage_from_its_real_start_and_alert_it_again():
    # n2 was down when the facts were first read (the daemon just started), came up, then was cut
    nodes_down = [NodeFacts("n2", False, "link cut")]
    down = rules.track_down_since({}, nodes_down, T0)
    down = rules.note_node_state(down, "n2", True, T0 + 3)       # node.up
    down = rules.note_node_state(down, "n2", False, T0 + 9)      # node.down
    down = rules.note_node_state(down, "n2", False, T0 + 9.5)    # node.connecting: the same outage
    down = rules.track_down_since(down, nodes_down, T0 + 10)
    assert down == {"n2": T0 + 9}
    found, alerted = rules.node_down_alerts(nodes_down, down, T0 + 15, threshold_s=5, alerted={}, cluster="c")
    assert [a.details["down_since"] for a in found] == [T0 + 9]
    # back up and down again before the next look: a new outage, alerted again once it lasts
    down = rules.note_node_state(rules.note_node_state(down, "n2", True, T0 + 16), "n2", False, T0 + 17)
    assert rules.node_down_alerts(nodes_down, down, T0 + 20, threshold_s=5, alerted=alerted, cluster="c")[0] == []
    found, _ = rules.node_down_alerts(nodes_down, down, T0 + 23, threshold_s=5, alerted=alerted, cluster="c")
    assert [a.details["down_since"] for a in found] == [T0 + 17]


# --- job_stalled: no progress for N minutes, once per stall ------------------------------

def test_a_running_job_without_progress_is_alerted_once_per_stall():
    alerted, sent = {}, []

    def tick(now: float, last_progress: float, state: str = "running", step: int = 40) -> None:
        nonlocal alerted
        run = RunFacts("tiny-1", "tiny", state, step, 600, 0, 3, last_progress=last_progress, launched_at=T0)
        found, alerted = rules.stalled_alerts([run], now, threshold_s=1800, alerted=alerted, cluster="lab")
        sent.extend(found)

    tick(T0 + 1800, T0)           # exactly 30 minutes: not yet
    assert sent == []
    tick(T0 + 1801, T0)
    tick(T0 + 3600, T0)           # the same stall
    assert len(sent) == 1 and sent[0].kind == "job_stalled" and sent[0].job == "tiny"
    assert sent[0].message == "run tiny-1 has made no progress for 30 minutes (at step 40 of 600), state running"
    tick(T0 + 3700, T0 + 3650, step=41)   # it moved
    tick(T0 + 3650 + 1801, T0 + 3650, step=41)   # and stalled again
    assert len(sent) == 2


def test_queued_and_finished_runs_never_stall_and_a_run_without_steps_counts_from_its_launch():
    old = T0 - 10_000
    quiet = [RunFacts("q-1", "q", "queued", started=old), RunFacts("f-1", "f", "failed", started=old),
             RunFacts("s-1", "s", "stopped", last_progress=old)]
    assert rules.stalled_alerts(quiet, T0, threshold_s=60, alerted={}, cluster="c") == ([], {})
    starting = RunFacts("w-1", "w", "starting", launched_at=T0 - 120, started=old)
    found, alerted = rules.stalled_alerts([starting], T0, threshold_s=60, alerted={}, cluster="c")
    assert [a.run_id for a in found] == ["w-1"] and alerted == {"w-1": T0 - 120}
    assert rules.stalled_alerts([starting], T0, threshold_s=300, alerted={}, cluster="c")[0] == []


# --- how each destination receives an alert ----------------------------------------------

ALERT = Alert("job_failed", "lab: job tiny failed", "run tiny-1 failed at step 3: <rank 1> & \"out\"", "lab", T0,
              "tiny", "tiny-1", reason="rank 1 exited 1", details={"restarts": 2})


def test_the_generic_webhook_is_one_json_document_with_every_field():
    request = payloads.webhook_request(ALERT, "generic")
    assert request.headers == {"Content-Type": "application/json"}
    document = json.loads(request.body)
    assert document == {"source": "coord", "event": "job_failed", "cluster": "lab", "title": "lab: job tiny failed",
                        "message": ALERT.message, "time": "2023-11-14T22:13:20+00:00", "timestamp": T0,
                        "job": "tiny", "run_id": "tiny-1", "node": None, "reason": "rank 1 exited 1",
                        "details": {"restarts": 2}}


def test_slack_gets_text_in_mrkdwn_with_its_control_characters_escaped():
    document = json.loads(payloads.webhook_request(ALERT, "slack").body)
    assert list(document) == ["text"]
    assert document["text"] == (":rotating_light: *lab: job tiny failed*\n"
                                "run tiny-1 failed at step 3: &lt;rank 1&gt; &amp; \"out\"")


def test_ntfy_gets_the_message_as_body_and_title_priority_tags_as_headers():
    request = payloads.webhook_request(ALERT, "ntfy")
    assert request.body == ALERT.message.encode()
    assert request.headers == {"Content-Type": "text/plain; charset=utf-8", "Title": "lab: job tiny failed",
                               "Priority": "high", "Tags": "rotating_light"}
    done = payloads.webhook_request(Alert("job_succeeded", "labé ☃: job\ttiny", "ok", "labé ☃", T0), "ntfy")
    assert done.headers["Priority"] == "default" and done.headers["Tags"] == "white_check_mark"
    assert done.headers["Title"] == "labé ?: job tiny"  # a header is one Latin-1 line


def test_a_command_gets_the_json_on_stdin_and_the_fields_as_environment_variables():
    assert json.loads(payloads.command_input(ALERT)) == payloads.alert_document(ALERT)
    env = payloads.command_environment(ALERT)
    assert env["COORD_ALERT_EVENT"] == "job_failed" and env["COORD_ALERT_JOB"] == "tiny"
    assert env["COORD_ALERT_RUN_ID"] == "tiny-1" and env["COORD_ALERT_NODE"] == ""
    assert env["COORD_ALERT_REASON"] == "rank 1 exited 1" and env["COORD_ALERT_TIME"] == "2023-11-14T22:13:20+00:00"
    assert all(isinstance(v, str) for v in env.values())


def test_the_macos_notification_passes_its_text_as_arguments_never_as_applescript():
    argv = payloads.desktop_argv(ALERT)
    assert argv == ["/usr/bin/osascript", "-e", "on run argv",
                    "-e", "display notification (item 1 of argv) with title (item 2 of argv)",
                    "-e", "end run", "--", ALERT.message, "lab: job tiny failed"]
    long = payloads.desktop_argv(Alert("node_down", "t", "x" * 1000, "c", T0))
    assert len(long[-2]) == 400 and long[-2].endswith("…")
