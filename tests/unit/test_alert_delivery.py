"""Delivering alerts: a real local HTTP receiver and real commands; retries with backoff, a
failed delivery is an event, a full queue drops with an event, secrets stay out of both."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import anyio
import pytest

from coordinator.observe.alerts.delivery import AlertDispatcher, Destination, desktop_settings
from coordinator.observe.alerts.rules import Alert, NodeFacts, RunFacts
from coordinator.config.cluster_file import AlertSettings
from tests.receiver import Receiver

T0 = 1_700_000_000.0
ALERT = Alert("job_failed", "lab: job tiny failed", "run tiny-1 failed: rank 1 exited 1", "lab", T0, "tiny",
              "tiny-1", reason="rank 1 exited 1")
SECRET = "T000/B000/s3cr3t"


class Events(list):
    def __call__(self, kind: str, message: str, *, node=None, data=None) -> None:
        self.append({"kind": kind, "message": message, "node": node, "data": data})


def dispatcher(entries, events, *, facts=lambda: ([], []), clock=lambda: T0, **kwargs) -> AlertDispatcher:
    return AlertDispatcher("lab", entries, record_event=events, run_facts=lambda run_id: None, facts=facts,
                           clock=clock, platform="linux", retry_base_s=0.05, **kwargs)


def deliver(alerts: AlertDispatcher, index: int = 0, alert: Alert = ALERT) -> bool:
    return anyio.run(alerts.deliver, alerts.destinations[index], alert)


def test_a_receiver_that_fails_first_gets_the_alert_on_the_retry():
    events = Events()
    with Receiver(statuses=[500, 200]) as receiver:
        alerts = dispatcher([AlertSettings("hook", webhook=f"{receiver.url}/services/{SECRET}")], events)
        assert deliver(alerts)
    assert [r.path for r in receiver.received] == [f"/services/{SECRET}"] * 2
    assert json.loads(receiver.received[1].body)["run_id"] == "tiny-1"
    assert receiver.received[1].headers["Content-Type"] == "application/json"
    assert [e["kind"] for e in events] == ["alert.sent"]
    assert events[0]["data"] == {"destination": "hook", "alert": "job_failed", "run": "tiny-1", "tries": 2}
    assert events[0]["message"] == f"job_failed alert sent to hook (generic webhook {receiver.url}/…) after 2 tries"


def test_a_receiver_that_refuses_the_request_is_not_asked_again_and_the_failure_is_an_event():
    events = Events()
    with Receiver(statuses=[404]) as receiver:
        alerts = dispatcher([AlertSettings("hook", webhook=f"{receiver.url}/{SECRET}", format="slack")], events)
        assert not deliver(alerts)
    assert len(receiver.received) == 1 and list(json.loads(receiver.received[0].body)) == ["text"]
    assert [e["kind"] for e in events] == ["alert.failed"]
    assert "after 1 try: the receiver answered HTTP 404 Not Found" in events[0]["message"]
    assert SECRET not in json.dumps(events)


def test_an_unreachable_receiver_is_tried_retries_plus_one_times_and_its_url_stays_secret():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    events = Events()
    alerts = dispatcher([AlertSettings("hook", webhook=f"http://127.0.0.1:{port}/x?token={SECRET}", retries=2)],
                        events)
    assert not deliver(alerts)
    assert events[0]["kind"] == "alert.failed" and events[0]["data"]["tries"] == 3
    assert "cannot reach the receiver" in events[0]["message"] and "Connection refused" in events[0]["message"]
    assert SECRET not in json.dumps(events)


def script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "notify"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_command_gets_the_alert_on_stdin_and_in_its_environment_without_a_shell(tmp_path):
    out = tmp_path / "out"
    program = script(tmp_path, f'cat > "{out}.json"\nprintf "%s|%s|%s" "$COORD_ALERT_EVENT" "$COORD_ALERT_JOB" '
                               f'"$1" > "{out}.env"\n')
    events = Events()
    alerts = dispatcher([AlertSettings("cmd", command=(program, "two words; $(rm -rf /)"))], events)
    assert deliver(alerts)
    assert json.loads(Path(f"{out}.json").read_text())["reason"] == "rank 1 exited 1"
    assert Path(f"{out}.env").read_text() == "job_failed|tiny|two words; $(rm -rf /)"  # one argument, as given
    assert events[0]["kind"] == "alert.sent" and events[0]["message"] == "job_failed alert sent to cmd (command notify)"


def test_a_command_that_fails_is_retried_and_one_that_does_not_exist_is_not(tmp_path):
    counter = tmp_path / "count"
    program = script(tmp_path, f'echo x >> "{counter}"\necho "quota exceeded" >&2\nexit 3\n')
    events = Events()
    alerts = dispatcher([AlertSettings("cmd", command=(program,), retries=1),
                         AlertSettings("gone", command=(str(tmp_path / "missing"),))], events)
    assert not deliver(alerts, 0) and not deliver(alerts, 1)
    assert counter.read_text() == "x\nx\n"
    assert events[0]["message"].endswith("after 2 tries: " + program + " exited 3: quota exceeded")
    assert events[1]["data"]["tries"] == 1 and "no program" in events[1]["message"]


def test_the_event_listener_never_waits_and_a_full_queue_drops_with_an_event():
    events = Events()
    alerts = dispatcher([AlertSettings("hook", webhook="http://127.0.0.1:9/x")], events, queue_size=2)
    failed = {"ts": T0, "kind": "job.failed", "message": "tiny: boom", "data": {"run": "tiny-1"}}
    for _ in range(4):
        alerts.on_event(failed)  # nothing delivers yet: the queue fills
    alerts.on_event({"ts": T0, "kind": "job.succeeded", "message": "tiny: done", "data": {"run": "tiny-1"}})
    assert [e["kind"] for e in events] == ["alert.dropped", "alert.dropped"]
    assert events[0]["message"] == ("job_failed alert for hook (generic webhook http://127.0.0.1:9/…) dropped: "
                                    "2 alerts already wait for it")


def test_the_timers_queue_node_down_only_for_the_destinations_that_want_it(tmp_path):
    now = [T0]
    events = Events()
    alerts = dispatcher([AlertSettings("fail-only", webhook="http://127.0.0.1:9/x"),
                         AlertSettings("ops", webhook="http://127.0.0.1:9/y", on=("node_down", "job_stalled"),
                                       node_down_minutes=1, stalled_minutes=2)], events,
                        facts=lambda: ([RunFacts("r-1", "r", "running", last_progress=T0)], [NodeFacts("n2", False)]),
                        clock=lambda: now[0], queue_size=1)
    alerts.check_timers()
    now[0] = T0 + 61
    alerts.check_timers()   # node_down due for "ops": its queue (size 1) is full now
    now[0] = T0 + 121
    alerts.check_timers()   # job_stalled due for "ops": dropped, which shows it was decided
    assert [(e["kind"], e["data"]["destination"], e["data"]["alert"]) for e in events] == [
        ("alert.dropped", "ops", "job_stalled")]
    assert alerts._queues[0][0].statistics().current_buffer_used == 0  # fail-only got nothing


def test_a_mac_head_notifies_on_the_desktop_as_well_for_every_event_an_entry_wants():
    assert desktop_settings([AlertSettings("a", webhook="http://x/y")], platform="linux") is None
    alone = desktop_settings([], platform="darwin")
    assert alone.on == ("job_failed", "diverged", "loss_spike", "durability_lag") and alone.retries == 0
    both = desktop_settings([AlertSettings("a", webhook="http://x/y", on=("job_stalled",), stalled_minutes=40),
                             AlertSettings("b", command=("x",), on=("job_stalled", "node_down"), stalled_minutes=20)],
                            platform="darwin")
    assert both.on == ("job_stalled", "node_down") and both.stalled_minutes == 20
    events = Events()
    mac = AlertDispatcher("lab", [], record_event=events, run_facts=lambda r: None, facts=lambda: ([], []),
                          platform="darwin")
    assert [d.label for d in mac.destinations] == ["desktop notification"]
    assert Destination(AlertSettings("x", command=("/opt/bin/page", f"--token={SECRET}"))).label == "x (command page)"


@pytest.mark.skipif(not os.path.exists("/usr/bin/osascript"), reason="macOS only: osascript shows the notification")
def test_a_desktop_notification_is_shown_on_a_mac():
    events = Events()
    mac = AlertDispatcher("lab", [], record_event=events, run_facts=lambda r: None, facts=lambda: ([], []))
    assert deliver(mac), events


def test_a_command_past_its_time_is_killed_and_that_is_a_failed_try(tmp_path):
    from coordinator.observe.alerts.delivery import DeliveryError, run_command

    pid_file = tmp_path / "pid"
    program = script(tmp_path, f'echo $$ > "{pid_file}"\nexec sleep 30\n')
    with pytest.raises(DeliveryError, match="did not finish within 0.5 s") as caught:
        anyio.run(lambda: run_command([program], b"{}", {}, timeout=0.5))
    assert not caught.value.permanent
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_node_events_between_two_looks_reach_the_node_down_timer():
    now = [T0]
    events = Events()
    alerts = dispatcher([AlertSettings("ops", webhook="http://127.0.0.1:9/y", on=("node_down",),
                                       node_down_minutes=1)], events,
                        facts=lambda: ([], [NodeFacts("n2", False, "link cut")]), clock=lambda: now[0],
                        queue_size=0)  # nothing waits: every alert decided shows as dropped
    alerts.check_timers()  # n2 not up when the daemon starts
    alerts.on_event({"ts": T0 + 3, "kind": "node.up", "node": "n2", "message": "n2 is up", "data": None})
    alerts.on_event({"ts": T0 + 50, "kind": "node.down", "node": "n2", "message": "n2 is down", "data": None})
    now[0] = T0 + 61
    alerts.check_timers()  # down for 11 s only, not since T0
    assert events == []
    now[0] = T0 + 111
    alerts.check_timers()
    assert [(e["kind"], e["node"], e["data"]["alert"]) for e in events] == [("alert.dropped", "n2", "node_down")]
