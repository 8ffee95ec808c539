"""The pages the daemon serves over HTTP, each read from its memory or its metrics history.

- ``/``: the dashboard page (``coordinator/observe/dashboard/static``), its files under ``/static/``;
  the page's code, no data: these need no token.
- ``/api/dashboard``: what the page draws (``coordinator.observe.dashboard.document``), and
  ``/api/stream`` the same as server-sent events, once a second while the page is open.
- ``/metrics``: Prometheus text exposition (``coordinator.observe.metrics.prometheus``).
- ``/api/status``: the ``coord status --json`` document.
- ``/api/history?run=RUN&since=TIME``: ``MetricsHistory.document`` (``coord status --json --history``).
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio

from coordinator.observe.dashboard.assets import static_files
from coordinator.observe.metrics.prometheus import metrics_text
from coordinator.observe.web.server import Handler, Request, Response
from shared.json_values import strict

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from coordinator.observe.metrics.history import MetricsHistory

JSON = "application/json"
STREAM_EVERY_S = 1.0


def api_routes(*, status_document: Callable[[], Awaitable[Mapping[str, Any]]], history: MetricsHistory,
               dashboard_document: Callable[[], Mapping[str, Any]], registry: CollectorRegistry) -> dict[str, Handler]:
    """The pages read from the daemon's memory: what each is made from is handed over by the daemon (the
    status and dashboard documents, sent here as JSON whatever their shape)."""

    async def metrics(_request: Request) -> Response:
        body, content_type = metrics_text(registry)
        return Response(body=body, content_type=content_type)

    async def status(_request: Request) -> Response:
        return _json(await status_document())

    async def history_page(request: Request) -> Response:
        run = request.query.get("run", [None])[0]
        since_text = request.query.get("since", [None])[0]
        try:
            since = float(since_text) if since_text is not None else None
        except ValueError:
            return Response(400, f"since must be a Unix time in seconds, got {since_text!r}\n".encode())
        if since is not None and not math.isfinite(since):
            return Response(400, b"since must be a finite number\n")
        return _json(history.document(run_id=run, since=since))

    async def dashboard(_request: Request) -> Response:
        return _json(dashboard_document())

    async def stream(_request: Request) -> Response:
        async def documents() -> AsyncIterator[bytes]:
            while True:
                # One line: an event's data field ends at a newline.
                yield b"data: " + json.dumps(strict(dashboard_document()), separators=(",", ":"), allow_nan=False,
                                             default=str).encode() \
                    + b"\n\n"
                await anyio.sleep(STREAM_EVERY_S)
        return Response(content_type="text/event-stream", stream=documents())

    routes: dict[str, Handler] = {"/metrics": metrics, "/api/status": status, "/api/history": history_page,
                                  "/api/dashboard": dashboard, "/api/stream": stream}
    routes.update(page_routes())
    return routes


def page_routes() -> dict[str, Handler]:
    """The page and its files, answered from memory."""
    def answer(body: bytes, content_type: str) -> Handler:
        async def handler(_request: Request) -> Response:
            return Response(body=body, content_type=content_type, headers={"Cache-Control": "no-cache"})
        return handler

    routes = {path: answer(body, ctype) for path, (body, ctype) in static_files().items()}
    routes["/"] = routes["/index.html"] = routes["/static/index.html"]
    return routes


def _json(document: Mapping[str, Any]) -> Response:
    # A diverged run's loss is NaN: sent as "nan", since JSON has no NaN (shared/json_values.py).
    return Response(body=json.dumps(strict(document), allow_nan=False, default=str).encode(), content_type=JSON)
