"""Logging set-up of the daemon and the CLI (the agent uses shared.log, stdlib only).

Logs are structlog events written as JSON lines (or a readable console form) to
stderr or a file. Never to stdout: the agent's stdout carries the protocol.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

from shared.log import JsonLineFormatter


def configure_logging(*, json: bool = True, level: str = "info", stream: TextIO | None = None) -> None:
    """Route structlog (and stdlib logging, e.g. asyncssh's) to one stream."""
    stream = stream or sys.stderr
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream)
    plain = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler.setFormatter(JsonLineFormatter() if json else plain)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # asyncssh logs every channel at INFO; keep its warnings only.
    logging.getLogger("asyncssh").setLevel(max(numeric, logging.WARNING))
