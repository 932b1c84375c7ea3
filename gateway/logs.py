"""structlog set-up: one JSON object per line, one event per decision.

Event names are stable (``claim.granted``, ``commit.rejected``...) and each carries the task,
attempt, generation and epoch it concerns. The JSON renderer escapes every value, so request
content cannot forge a log line.

Everything else that would write to stderr goes through the same renderer: the standard
library's loggers (aiohttp's ``aiohttp.*``, ``asyncio``, warnings) are forwarded as
``python.log`` events, and the access log is ``http.access`` (debug level). So every line a
running ``fencegate serve`` writes is one JSON object.

Every line has ``event``, ``level`` and ``ts`` (added here); each event's own fields are the
keywords of its call. The list of events, levels and fields an operator can rely on is the
"## Audit log" table of docs/operations.md; tests/test_log_events.py fails when an event or
field the code emits is missing from it, so a new event is documented with its code.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import structlog
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse

from fencegate.gateway import tracing

__all__ = ["AccessLog", "configure_logging"]

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def _fallback(value: object) -> Any:
    """What structlog's own renderer does with a value JSON cannot hold: ``__structlog__``,
    else ``repr``."""
    try:
        return value.__structlog__()  # type: ignore[attr-defined]
    except AttributeError:
        return repr(value)


#: Built once: ``json.dumps`` with a ``default`` builds a new encoder for every line. The
#: same settings as ``json.dumps``, so a line reads exactly as it did.
_ENCODER = json.JSONEncoder(default=_fallback)


def _render(event: Any, **_: Any) -> str:
    return _ENCODER.encode(event)


class _ToStructlog(logging.Handler):
    """A standard-library record as one structlog event (``python.log``), traceback included
    as a JSON string, never as raw lines."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a library's bad format string must not lose the record
            message = str(record.msg)
        fields: dict[str, object] = {"logger": record.name, "message": message}
        if record.exc_info and record.exc_info[0] is not None:
            fields["exc_info"] = record.exc_info
        structlog.get_logger("python").log(record.levelno, "python.log", **fields)


class AccessLog(AbstractAccessLogger):
    """aiohttp's access log as ``http.access`` events (debug level: off unless asked)."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        structlog.get_logger("fencegate.http").debug(
            "http.access",
            method=request.method,
            path=request.path,
            status=response.status,
            ms=round(time * 1000, 1),
            peer=request.remote,
        )

    @property
    def enabled(self) -> bool:
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def configure_logging(level: str = "info") -> None:
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            tracing.log_ids,  # trace_id / span_id while a span is active ([tracing])
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(_render),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _ToStructlog):  # configured again: one forwarder
            root.removeHandler(handler)
    root.addHandler(_ToStructlog())
    root.setLevel(_LEVELS[level])
    logging.captureWarnings(True)
