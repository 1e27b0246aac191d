"""structlog set-up shared by the services: JSON lines in containers, readable lines on a console."""

from __future__ import annotations

import logging
import math
import sys
import time

import structlog

__all__ = ["OncePer", "configure_logging", "get_logger"]


def configure_logging(service: str, json_logs: bool, level: int = logging.INFO) -> None:
    """Routes structlog to stderr, tagging every event with the service name (by a processor, not a
    context variable: threads do not inherit those, and a rank watchdog's events went out without it)."""
    renderer = structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer(colors=False)
    # The console renderer prints a logged exception's traceback; the JSON one wrote only
    # "exc_info": true (a draft's failed verifier reply, turned into UNAVAILABLE, kept no trace).
    # Without the frames' locals: a step's prompt text or a reply of inline features (32 MB
    # rendered: 4.7 s on the event loop) has no business in a log line.
    exceptions = [structlog.processors.ExceptionRenderer(
        structlog.tracebacks.ExceptionDictTransformer(show_locals=False))] if json_logs else []

    def add_service(logger, method: str, event: dict) -> dict:
        event.setdefault("service", service)
        return event

    # The console renderer quotes a text only where it holds a space, '=', a quote or a line feed:
    # a NUL, an escape sequence or another line break (in a value a client chose) went out raw,
    # making the log a binary file to grep, or rewriting lines on a terminal. JSON escapes them.
    escapes = [] if json_logs else [_escape_unprintable]

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_service,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *exceptions,
            *escapes,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


class _Escaped:
    """A text the console renderer shows as its repr (escaped, once; a str it might quote again)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return repr(self.text)


_RENDERED_APART = ("event", "exception", "stack")   # the event's name (ours), and the renderer's tracebacks


def _escape_unprintable(logger: object, method: str, event: dict) -> dict:
    """Each text value that is not printable as its escaped repr (see `configure_logging`)."""
    for key, value in event.items():
        if isinstance(value, str) and not value.isprintable() and key not in _RENDERED_APART:
            event[key] = _Escaped(value)
    return event


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)


class OncePer:
    """Counts an event that anyone may cause many times a second (a token-guessing run, bytes sent
    to a public port) and says when a log line is due: at most once each ``every_s`` seconds, with
    the count since the last line. A line each would flood the log; none would leave no trace."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self._count = 0
        self._said = -math.inf

    def due(self) -> int | None:
        """Counts one; the count to log where a line is due now, else None."""
        self._count += 1
        now = time.monotonic()
        if now - self._said < self.every_s:
            return None
        count, self._count, self._said = self._count, 0, now
        return count
