"""[[alerts]] entries: each names one destination and its events; every mistake is refused with
the entry, the line and the fix, and a webhook's secret never appears in a message."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config.cluster_file import ConfigError, parse_config, redact_url

BASE = """\
[cluster]
name = "lab"

[[nodes]]
name = "n1"
host = "local"
workdir = "/tmp/w"
"""


def alerts(text: str, path: Path | None = None):
    return parse_config(BASE + text, path).alerts


def refused(text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(BASE + text)
    return str(caught.value)


def test_no_alerts_is_no_destinations():
    assert alerts("") == ()


def test_an_entry_without_on_alerts_on_failures_and_divergences_with_default_timers_and_retries():
    (entry,) = alerts('[[alerts]]\nwebhook = "https://hooks.example.com/T0/B0/xyz"\n')
    assert (entry.name, entry.on, entry.webhook, entry.format) == (
        "alerts[0]", ("job_failed", "diverged", "loss_spike", "durability_lag"), "https://hooks.example.com/T0/B0/xyz", "generic")
    assert (entry.stalled_minutes, entry.node_down_minutes, entry.retries) == (30.0, 5.0, 4)


def test_webhook_and_command_entries_with_their_events_and_timers(tmp_path):
    text = """
[[alerts]]
name = "phone"
webhook = "https://ntfy.sh/secret-topic"
format = "ntfy"
on = ["job_failed", "job_stalled", "node_down"]
stalled_minutes = 45
node_down_minutes = 2.5

[[alerts]]
name = "script"
command = ["bin/page-me", "--urgent"]
on = ["job_succeeded", "job_restarted"]
retries = 0
"""
    phone, script = alerts(text, tmp_path / "lab.toml")
    assert phone.on == ("job_failed", "job_stalled", "node_down") and phone.format == "ntfy"
    assert (phone.stalled_minutes, phone.node_down_minutes) == (45.0, 2.5)
    # a program given as a path is relative to the cluster file, as every path there is
    assert script.command == (str(tmp_path / "bin" / "page-me"), "--urgent") and script.retries == 0
    (bare,) = alerts('[[alerts]]\ncommand = ["notify-send", "coord"]\n')
    assert bare.command == ("notify-send", "coord")  # a bare name is looked up on PATH when it runs


@pytest.mark.parametrize("entry, expected", [
    ('webhook = "https://x.example/h"\ncommand = ["true"]', "alerts[0]: give exactly one destination"),
    ('on = ["job_failed"]', "alerts[0]: give exactly one destination"),
    ('webhook = "ftp://x.example/h"', "webhook must be an http:// or https:// URL"),
    ('webhook = "https:///nohost"', "webhook must be an http:// or https:// URL"),
    ('webhook = "https://x.example/h"\nformat = "discord"', "format must be one of generic, slack, ntfy"),
    ('command = ["true"]\nformat = "slack"', "format applies to a webhook only"),
    ('command = []', "command must be a non-empty list of strings"),
    ('command = ["/bin/echo", 3]', "command must be a non-empty list of strings"),
    ('command = "/bin/echo hi"', "alerts[0].command must be a list"),
    ('webhook = "https://x.example/h"\non = ["job_died"]', "unknown event 'job_died' in on"),
    ('webhook = "https://x.example/h"\non = []', "on must be a non-empty list"),
    ('webhook = "https://x.example/h"\non = ["job_failed", "job_failed"]', "on names an event twice"),
    ('webhook = "https://x.example/h"\nstalled_minutes = 10',
     "stalled_minutes is set but 'job_stalled' is not in on; add 'job_stalled' to on"),
    ('webhook = "https://x.example/h"\non = ["node_down"]\nnode_down_minutes = 0',
     "node_down_minutes must be greater than 0"),
    ('webhook = "https://x.example/h"\non = ["job_stalled"]\nstalled_minutes = "30"',
     "alerts[0].stalled_minutes must be an integer or a number, got a string"),
    ('webhook = "https://x.example/h"\nretries = -1', "retries must be between 0 and 20"),
    ('webhook = "https://x.example/h"\nname = "my phone"', "name 'my phone' must be letters"),
    ('webhook = "https://x.example/h"\nchannel = "#ops"', "unknown key alerts[0].channel"),
])
def test_a_bad_entry_is_refused_naming_the_entry_the_line_and_the_fix(entry, expected):
    message = refused("\n[[alerts]]\n" + entry + "\n")
    assert expected in message, message
    assert message.startswith("<cluster file>:9: ") or message.startswith("<cluster file>:1"), message


def test_the_second_entry_is_named_with_its_own_line():
    message = refused('\n[[alerts]]\nwebhook = "https://a.example/h"\n\n[[alerts]]\nwebhook = "https://b.example/h"\n'
                      'on = ["node_up"]\n')
    assert message.startswith("<cluster file>:14: alerts[1]: unknown event 'node_up'"), message


def test_two_entries_with_one_name_are_refused():
    message = refused('[[alerts]]\nname = "ops"\ncommand = ["true"]\n[[alerts]]\nname = "ops"\ncommand = ["true"]\n')
    assert "duplicate alert name 'ops' (first used by alerts[0])" in message


def test_alerts_must_be_an_array_of_tables():
    assert "'alerts' must be an array of tables ([[alerts]])" in refused('[alerts]\nwebhook = "https://a.example/h"\n')


def test_a_refused_webhook_is_shown_without_its_secret():
    message = refused('[[alerts]]\nwebhook = "gopher://hooks.example.com/services/T0/B0/SECRET?token=SECRET"\n')
    assert "SECRET" not in message and "gopher://hooks.example.com/…" in message


@pytest.mark.parametrize("url, shown", [
    ("https://hooks.slack.com/services/T0/B0/SECRET", "https://hooks.slack.com/…"),
    ("https://ntfy.sh/secret-topic", "https://ntfy.sh/…"),
    ("http://127.0.0.1:8080/hook?token=SECRET", "http://127.0.0.1:8080/…"),
    ("https://user:SECRET@example.com", "https://example.com/…"),
    ("https://example.com/", "https://example.com"),
])
def test_a_webhook_url_is_redacted_to_its_scheme_and_host(url, shown):
    assert redact_url(url) == shown
