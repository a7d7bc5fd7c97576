"""Structured logs: one JSON object per line, each with the id of the request it belongs to.

The HTTP edge opens a ``RequestInfo`` per request (``X-Request-ID`` from the client, or
a new one) and keeps it in a context variable, so every log line written while the
request is handled carries its id, whichever module writes it. Extra fields go in
``extra={"fields": {...}}``.
"""

from __future__ import annotations

import contextvars
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

_MAX_ID = 128


@dataclass
class RequestInfo:
    """What the edge knows about the request being handled; the adapters fill in model and tenant."""

    request_id: str
    protocol: str = ""
    tenant: str = ""
    model: str = ""
    version: str = ""


CURRENT: contextvars.ContextVar[RequestInfo | None] = contextvars.ContextVar("shardline_request", default=None)


def request_id_from(header: str | None) -> str:
    """The client's request id if it is sensible (printable, at most 128 characters), else a new one."""
    if header and len(header) <= _MAX_ID and header.isprintable() and header.strip() == header:
        return header
    return uuid.uuid4().hex


def current() -> RequestInfo | None:
    """The request being handled on this task, if any."""
    return CURRENT.get()


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line: time, level, logger, message, request id, fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        info = CURRENT.get()
        if info is not None:
            line["request_id"] = info.request_id
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


def log_config(level: str = "info") -> dict[str, Any]:
    """A ``logging.config.dictConfig`` that writes Shardline's and uvicorn's logs as JSON lines to stderr."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"json": handler},
        "loggers": {
            name: {"handlers": ["json"], "level": level.upper(), "propagate": False}
            for name in ("shardline", "uvicorn", "uvicorn.error")
        },
    }
