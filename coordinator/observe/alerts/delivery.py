"""Sending alerts: one queue and one worker per destination, retries with backoff.

``AlertDispatcher.on_event`` is called with every event the daemon records, on the event
loop's thread, from inside whatever recorded it (a job's supervisor among others), so it only
decides and puts the alert on a bounded queue: it never waits. A full queue drops the alert
and says so (``alert.dropped``). Each destination's worker sends one alert at a time, retrying
what may pass on a later try (a refused connection, a timeout, HTTP 5xx or 429, a command that
exits non-zero) with tenacity's exponential backoff; the outcome is an event, ``alert.sent``
or ``alert.failed``. A slow or dead destination delays only its own queue.

A webhook URL usually holds its secret (a Slack hook's path, an ntfy topic, a token), so events
and logs name a destination by its name and its URL's scheme and host only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import structlog
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from coordinator.config.cluster_file import DEFAULT_ALERT_EVENTS, AlertSettings, redact_url
from coordinator.observe.alerts import payloads, rules
from coordinator.observe.alerts.rules import Alert, NodeFacts, RunFacts

if TYPE_CHECKING:
    from coordinator.store.state import EventRecord

log = structlog.get_logger("alerts")

QUEUE_SIZE = 64  # alerts waiting per destination; beyond that they are dropped, with an event
HTTP_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 30.0
RETRY_BASE_S = 1.0  # 1 s, 2 s, 4 s ... between tries
RETRY_MAX_S = 60.0
TICK_S = 10.0  # how often the stalled and node-down timers are checked
DESKTOP = "desktop"

Facts = Callable[[], tuple[list[RunFacts], list[NodeFacts]]]


class RecordEvent(Protocol):
    """Cluster.record_event: how the outcome of a delivery is told."""

    def __call__(self, kind: str, message: str, *, node: str | None = None,
                 data: dict[str, Any] | None = None) -> None: ...


class DeliveryError(Exception):
    """A try that failed; ``permanent`` when another try cannot help (a 404, a missing program)."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


def post_webhook(url: str, request: payloads.WebhookRequest, *, timeout: float = HTTP_TIMEOUT_S) -> int:
    """POST (blocking; run it in a thread). The HTTP status on success; DeliveryError otherwise,
    whose message never holds the URL."""
    http_request = urllib.request.Request(url, data=request.body, method="POST",
                                          headers={"User-Agent": "coord-alerts", **request.headers})
    try:
        with urllib.request.urlopen(http_request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        retry = exc.code >= 500 or exc.code in (408, 429)
        raise DeliveryError(f"the receiver answered HTTP {exc.code} {exc.reason}", permanent=not retry) from None
    except urllib.error.URLError as exc:
        raise DeliveryError(_scrub(f"cannot reach the receiver: {exc.reason}", url)) from None
    except (OSError, ValueError) as exc:  # timeouts, resets, a malformed answer
        raise DeliveryError(_scrub(f"the request failed: {exc.__class__.__name__}: {exc}", url)) from None


async def run_command(argv: Sequence[str], stdin: bytes, env: dict[str, str], *,
                      timeout: float = COMMAND_TIMEOUT_S) -> None:
    """Run ``argv`` without a shell, the alert on stdin; DeliveryError unless it exits 0 in time
    (a program past its time is killed)."""
    said = b""
    try:
        with anyio.fail_after(timeout):
            async with await anyio.open_process(list(argv), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.PIPE, env={**os.environ, **env}) as proc:
                assert proc.stdin is not None and proc.stderr is not None  # both are pipes
                try:
                    if stdin:
                        await proc.stdin.send(stdin)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass  # a program that does not read its stdin needs none
                await proc.stdin.aclose()
                async for chunk in proc.stderr:
                    said = (said + chunk)[-4096:]
                status = await proc.wait()
    except TimeoutError:
        raise DeliveryError(f"{argv[0]} did not finish within {timeout:g} s") from None
    except FileNotFoundError:
        raise DeliveryError(f"no program {argv[0]!r} (give its absolute path in the [[alerts]] command)",
                            permanent=True) from None
    except PermissionError:
        raise DeliveryError(f"{argv[0]} is not executable (chmod +x it)", permanent=True) from None
    if status != 0:
        last = said.decode(errors="replace").strip().splitlines()
        raise DeliveryError(f"{argv[0]} exited {status}" + (f": {last[-1][:200]}" if last else ""))


@dataclass(frozen=True)
class Destination:
    settings: AlertSettings
    desktop: bool = False

    @property
    def label(self) -> str:
        """The name events and logs use: never the whole URL."""
        if self.desktop:
            return "desktop notification"
        if self.settings.webhook:
            return f"{self.settings.name} ({self.settings.format} webhook {redact_url(self.settings.webhook)})"
        return f"{self.settings.name} (command {os.path.basename(self.settings.command[0])})"

    async def send(self, alert: Alert) -> None:
        settings = self.settings
        if self.desktop:
            await run_command(payloads.desktop_argv(alert), b"", {}, timeout=COMMAND_TIMEOUT_S)
        elif settings.webhook:
            url = settings.webhook
            request = payloads.webhook_request(alert, settings.format)
            await anyio.to_thread.run_sync(lambda: post_webhook(url, request))
        else:
            await run_command(settings.command, payloads.command_input(alert), payloads.command_environment(alert))


def desktop_settings(entries: Sequence[AlertSettings], platform: str = sys.platform) -> AlertSettings | None:
    """On a Mac head, a notification as well, for every event some [[alerts]] entry wants (the
    defaults when there is none), with the shortest of their timers."""
    if platform != "darwin":
        return None
    on = sorted({kind for entry in entries for kind in entry.on}) or list(DEFAULT_ALERT_EVENTS)
    stalled = [e.stalled_minutes for e in entries if rules.JOB_STALLED in e.on]
    down = [e.node_down_minutes for e in entries if rules.NODE_DOWN in e.on]
    return AlertSettings(name=DESKTOP, on=tuple(on), stalled_minutes=min(stalled, default=30.0),
                         node_down_minutes=min(down, default=5.0), retries=0)


class AlertDispatcher:
    def __init__(self, cluster: str, entries: Sequence[AlertSettings], *, record_event: RecordEvent,
                 run_facts: Callable[[str], RunFacts | None], facts: Facts, clock: Callable[[], float] = time.time,
                 platform: str = sys.platform, queue_size: int = QUEUE_SIZE,
                 retry_base_s: float = RETRY_BASE_S) -> None:
        self.cluster = cluster
        self.destinations = [Destination(entry) for entry in entries]
        desktop = desktop_settings(entries, platform)
        if desktop is not None:
            self.destinations.append(Destination(desktop, desktop=True))
        self._record_event = record_event
        self._run_facts = run_facts
        self._facts = facts
        self._clock = clock
        self._retry_base_s = retry_base_s
        self._queues = [anyio.create_memory_object_stream[Alert](max_buffer_size=queue_size)
                        for _ in self.destinations]
        # the timers' memory: since when each node is down; per destination, what was alerted
        self._down_since: dict[str, float] = {}
        self._nodes_alerted: list[dict[str, float]] = [{} for _ in self.destinations]
        self._stalls_alerted: list[dict[str, float]] = [{} for _ in self.destinations]

    # --- deciding (never waits) -------------------------------------------------------

    def on_event(self, event: EventRecord) -> None:
        """Called with every recorded event; queues the alerts it calls for."""
        kind = event.get("kind", "")
        if kind.startswith("alert.") or not self.destinations:
            return
        node = event.get("node")
        if kind.startswith("node.") and node:
            self._down_since = rules.note_node_state(self._down_since, node, kind == "node.up", event["ts"])
            return
        run_id = (event.get("data") or {}).get("run")
        run = self._run_facts(run_id) if run_id else None
        alert = rules.alert_for_event(event, run, self.cluster)
        if alert is not None:
            for index, destination in enumerate(self.destinations):
                if rules.wants(destination.settings, alert.kind):
                    self._enqueue(index, alert)

    def check_timers(self) -> None:
        """The stalled and node-down timers against the facts now; queues what became due."""
        if not any(rules.wants(d.settings, kind) for d in self.destinations
                   for kind in (rules.JOB_STALLED, rules.NODE_DOWN)):
            return
        runs, nodes = self._facts()
        now = self._clock()
        self._down_since = rules.track_down_since(self._down_since, nodes, now)
        for index, destination in enumerate(self.destinations):
            settings = destination.settings
            due: list[Alert] = []
            if rules.wants(settings, rules.NODE_DOWN):
                found, self._nodes_alerted[index] = rules.node_down_alerts(
                    nodes, self._down_since, now, threshold_s=settings.node_down_minutes * 60,
                    alerted=self._nodes_alerted[index], cluster=self.cluster)
                due += found
            if rules.wants(settings, rules.JOB_STALLED):
                found, self._stalls_alerted[index] = rules.stalled_alerts(
                    runs, now, threshold_s=settings.stalled_minutes * 60, alerted=self._stalls_alerted[index],
                    cluster=self.cluster)
                due += found
            for alert in due:
                self._enqueue(index, alert)

    def _enqueue(self, index: int, alert: Alert) -> None:
        destination = self.destinations[index]
        try:
            self._queues[index][0].send_nowait(alert)
        except anyio.WouldBlock:
            self._event("alert.dropped", destination, alert,
                        f"{alert.kind} alert for {destination.label} dropped: "
                        f"{self._queues[index][0].statistics().current_buffer_used} alerts already wait for it")

    # --- sending ----------------------------------------------------------------------

    async def run(self, *, tick_s: float = TICK_S) -> None:
        """Deliver until cancelled: one worker per destination, and the timers."""
        if not self.destinations:
            return
        log.info("alerts on", destinations=[d.label for d in self.destinations])
        async with anyio.create_task_group() as tasks:
            for index in range(len(self.destinations)):
                tasks.start_soon(self._deliver_queue, index, name=f"alerts:{self.destinations[index].settings.name}")
            while True:
                try:
                    self.check_timers()
                except Exception:  # the edge: a bug in a timer must not end the deliveries
                    log.exception("alert timers failed")
                await anyio.sleep(tick_s)

    async def _deliver_queue(self, index: int) -> None:
        destination = self.destinations[index]
        async with self._queues[index][1] as alerts:
            async for alert in alerts:
                await self.deliver(destination, alert)

    async def deliver(self, destination: Destination, alert: Alert) -> bool:
        """Send one alert with retries; the outcome is an event either way."""
        tries = 0
        retrying = AsyncRetrying(
            stop=stop_after_attempt(destination.settings.retries + 1),
            wait=wait_exponential(multiplier=self._retry_base_s, max=RETRY_MAX_S),
            retry=retry_if_exception(lambda exc: isinstance(exc, DeliveryError) and not exc.permanent),
            sleep=anyio.sleep, reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    tries += 1
                    await destination.send(alert)
        except DeliveryError as exc:
            self._event("alert.failed", destination, alert, f"{alert.kind} alert not delivered to {destination.label}"
                        f" after {_tries(tries)}: {exc}", tries=tries, error=str(exc))
            return False
        except Exception as exc:  # the edge: whatever else went wrong is said, and the worker goes on
            log.exception("alert delivery failed", destination=destination.label)
            self._event("alert.failed", destination, alert, f"{alert.kind} alert not delivered to {destination.label}"
                        f": {exc.__class__.__name__}", tries=tries, error=exc.__class__.__name__)
            return False
        self._event("alert.sent", destination, alert, f"{alert.kind} alert sent to {destination.label}"
                    + (f" after {_tries(tries)}" if tries > 1 else ""), tries=tries)
        return True

    def _event(self, kind: str, destination: Destination, alert: Alert, message: str, **data: Any) -> None:
        subject = {"run": alert.run_id} if alert.run_id else {}
        log.info(kind, destination=destination.label, alert=alert.kind, **subject, **data)
        self._record_event(kind, message, node=alert.node, data={
            "destination": destination.settings.name, "alert": alert.kind, **subject, **data})


def _tries(count: int) -> str:
    return f"{count} tr{'y' if count == 1 else 'ies'}"


def _scrub(text: str, url: str) -> str:
    """Some errors repeat the URL; it holds the secret."""
    return text.replace(url, redact_url(url)) if url else text

