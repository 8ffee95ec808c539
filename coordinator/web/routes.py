"""The pages the daemon serves over HTTP, each read from its memory or its metrics history.

- ``/metrics``: Prometheus text exposition (``coordinator.metrics.prometheus``).
- ``/api/status``: the ``coord status --json`` document.
- ``/api/history?run=RUN&since=TIME``: ``MetricsHistory.document`` (``coord status --json --history``).
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

from coordinator.metrics.prometheus import daemon_registry, metrics_text
from coordinator.web.server import Handler, Request, Response

if TYPE_CHECKING:
    from coordinator.daemon import Daemon

JSON = "application/json"


def daemon_routes(daemon: Daemon) -> dict[str, Handler]:
    registry = daemon_registry(daemon)

    async def metrics(_request: Request) -> Response:
        body, content_type = metrics_text(registry)
        return Response(body=body, content_type=content_type)

    async def status(_request: Request) -> Response:
        from coordinator.commands.status import serve_status

        return _json(serve_status(daemon))

    async def history(request: Request) -> Response:
        run = request.query.get("run", [None])[0]
        since_text = request.query.get("since", [None])[0]
        try:
            since = float(since_text) if since_text is not None else None
        except ValueError:
            return Response(400, f"since must be a Unix time in seconds, got {since_text!r}\n".encode())
        if since is not None and not math.isfinite(since):
            return Response(400, b"since must be a finite number\n")
        return _json(daemon.history.document(run_id=run, since=since))

    return {"/metrics": metrics, "/api/status": status, "/api/history": history}


def _json(document) -> Response:
    return Response(body=json.dumps(document, allow_nan=False, default=str).encode(), content_type=JSON)
