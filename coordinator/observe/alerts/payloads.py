"""An alert as each destination takes it. Pure: no I/O.

- generic: one JSON object with every field (``alert_document``), for your own receiver;
- slack: an incoming webhook's ``{"text": ...}`` in Slack's mrkdwn;
- ntfy: a POST to the topic URL with the message as the body and the title, priority and tags
  as headers (ntfy's plain publishing form, which works with any topic URL);
- a command: the same JSON on stdin and the main fields as ``COORD_ALERT_*`` variables;
- macOS: ``osascript`` with the text passed as arguments, never spliced into AppleScript.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypedDict

from coordinator.observe.alerts.rules import (
    DIVERGED,
    JOB_FAILED,
    JOB_RESTARTED,
    JOB_STALLED,
    JOB_SUCCEEDED,
    LOSS_SPIKE,
    NODE_DOWN,
    STRAGGLER,
    STRAGGLER_RESOLVED,
    Alert,
    AlertDetails,
)

# ntfy's priorities and emoji tags (https://docs.ntfy.sh/publish/)
_NTFY_PRIORITY = {JOB_FAILED: "high", NODE_DOWN: "high", JOB_STALLED: "high", JOB_RESTARTED: "default",
                  JOB_SUCCEEDED: "default", DIVERGED: "high", LOSS_SPIKE: "default",
                  STRAGGLER: "default", STRAGGLER_RESOLVED: "low"}
_NTFY_TAGS = {JOB_FAILED: "rotating_light", NODE_DOWN: "warning", JOB_STALLED: "hourglass",
              JOB_RESTARTED: "arrows_counterclockwise", JOB_SUCCEEDED: "white_check_mark",
              DIVERGED: "chart_with_downwards_trend", LOSS_SPIKE: "chart_with_upwards_trend",
              STRAGGLER: "turtle", STRAGGLER_RESOLVED: "white_check_mark"}
_SLACK_EMOJI = {JOB_FAILED: ":rotating_light:", NODE_DOWN: ":warning:", JOB_STALLED: ":hourglass:",
                JOB_RESTARTED: ":arrows_counterclockwise:", JOB_SUCCEEDED: ":white_check_mark:",
                DIVERGED: ":chart_with_downwards_trend:", LOSS_SPIKE: ":chart_with_upwards_trend:",
                STRAGGLER: ":turtle:", STRAGGLER_RESOLVED: ":white_check_mark:"}


class AlertDocument(TypedDict):
    """The generic form of an alert: a webhook's JSON body, a command's stdin."""

    source: str  # "coord"
    event: str  # the alert's kind: one of coordinator.config.cluster_file.ALERT_EVENTS
    cluster: str
    title: str
    message: str
    time: str  # ISO 8601, UTC
    timestamp: float  # the same, in Unix seconds
    job: str | None
    run_id: str | None
    node: str | None
    reason: str | None
    details: AlertDetails


class SlackMessage(TypedDict):
    text: str  # mrkdwn


@dataclass(frozen=True)
class WebhookRequest:
    body: bytes
    headers: dict[str, str]


def alert_document(alert: Alert) -> AlertDocument:
    """The generic form: what a webhook receives by default and a command reads on stdin."""
    return {"source": "coord", "event": alert.kind, "cluster": alert.cluster, "title": alert.title,
            "message": alert.message, "time": _iso(alert.time), "timestamp": alert.time, "job": alert.job,
            "run_id": alert.run_id, "node": alert.node, "reason": alert.reason, "details": {**alert.details}}


def webhook_request(alert: Alert, fmt: str) -> WebhookRequest:
    if fmt == "slack":
        text = f"{_SLACK_EMOJI[alert.kind]} *{_slack_escape(alert.title)}*\n{_slack_escape(alert.message)}"
        message: SlackMessage = {"text": text}
        return _json_request(message)
    if fmt == "ntfy":
        return WebhookRequest(alert.message.encode(), {
            "Content-Type": "text/plain; charset=utf-8", "Title": _header_safe(alert.title),
            "Priority": _NTFY_PRIORITY[alert.kind], "Tags": _NTFY_TAGS[alert.kind]})
    return _json_request(alert_document(alert))


def command_input(alert: Alert) -> bytes:
    return json.dumps(alert_document(alert)).encode() + b"\n"


def command_environment(alert: Alert) -> dict[str, str]:
    """What a command gets on top of the daemon's environment (absent fields are empty)."""
    fields = {"EVENT": alert.kind, "CLUSTER": alert.cluster, "TITLE": alert.title, "MESSAGE": alert.message,
              "JOB": alert.job, "RUN_ID": alert.run_id, "NODE": alert.node, "REASON": alert.reason,
              "TIME": _iso(alert.time)}
    return {f"COORD_ALERT_{key}": value or "" for key, value in fields.items()}


# `on run argv` takes the texts as arguments: a quote or a backslash in a reason cannot break out.
_NOTIFY_SCRIPT = ("on run argv", "display notification (item 1 of argv) with title (item 2 of argv)", "end run")


def desktop_argv(alert: Alert) -> list[str]:
    """osascript's argv (no shell) for a macOS notification of ``alert``."""
    script = [word for line in _NOTIFY_SCRIPT for word in ("-e", line)]
    return ["/usr/bin/osascript", *script, "--", _clip(alert.message, 400), _clip(alert.title, 120)]


def _json_request(document: Mapping[str, object]) -> WebhookRequest:
    return WebhookRequest(json.dumps(document).encode(), {"Content-Type": "application/json"})


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat(timespec="seconds")


def _slack_escape(text: str) -> str:
    # Slack's mrkdwn takes &, < and > as control characters (https://api.slack.com/reference/surfaces/formatting)
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _header_safe(text: str) -> str:
    """HTTP header values are Latin-1 and one line."""
    return " ".join(text.split()).encode("latin-1", "replace").decode("latin-1")


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"
