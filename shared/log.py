"""Logging for code that also runs on nodes: stdlib only, JSON lines on stderr.

The agent runs with the node's own Python, which has mlx and mlx-lm but not
coord's dependencies, so ``shared`` and ``agent`` log through this small
adapter. It has structlog's calling convention (``log.bind(node=...)``,
``log.info("event", key=value)``), so the daemon can pass a structlog logger
wherever a ``Logger`` is accepted.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Protocol, TextIO


class Logger(Protocol):
    def bind(self, **context: Any) -> Logger: ...
    def debug(self, event: str, **kw: Any) -> Any: ...
    def info(self, event: str, **kw: Any) -> Any: ...
    def warning(self, event: str, **kw: Any) -> Any: ...
    def error(self, event: str, **kw: Any) -> Any: ...
    def exception(self, event: str, **kw: Any) -> Any: ...


class KeyValueLogger:
    """A bound logger over stdlib logging; each record carries its key-values."""

    def __init__(self, name: str, context: dict[str, Any] | None = None) -> None:
        # context: key-values bound to every record (structlog's convention), free-form by design
        self._logger = logging.getLogger(name)
        self._context = context or {}

    def bind(self, **context: Any) -> KeyValueLogger:
        return KeyValueLogger(self._logger.name, {**self._context, **context})

    def _log(self, level: int, event: str, exc_info: bool = False, **kw: Any) -> None:
        if self._logger.isEnabledFor(level):
            self._logger.log(level, event, exc_info=exc_info, extra={"kv": {**self._context, **kw}})

    def debug(self, event: str, **kw: Any) -> None:
        self._log(logging.DEBUG, event, **kw)

    def info(self, event: str, **kw: Any) -> None:
        self._log(logging.INFO, event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._log(logging.WARNING, event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._log(logging.ERROR, event, **kw)

    def exception(self, event: str, **kw: Any) -> None:
        self._log(logging.ERROR, event, exc_info=True, **kw)


def get_logger(name: str) -> KeyValueLogger:
    return KeyValueLogger(f"coord.{name}")


class JsonLineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                + f".{int(record.msecs):03d}Z", "level": record.levelname.lower(),
                "logger": record.name, "event": record.getMessage()}
        line.update(getattr(record, "kv", {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_json_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """JSON lines to stderr (never stdout: the agent's stdout carries frames)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonLineFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
