"""Structured logs: one JSON object per line, each with the id of the request it belongs to.

The HTTP edge opens a ``RequestInfo`` per request (``X-Request-ID`` from the client, or
a new one) and keeps it in a context variable, so every log line written while the
request is handled carries its id, whichever module writes it. Extra fields go in
``extra={"fields": {...}}``.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import os
import threading
import time
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


class _RequestIds:
    """New request ids: 32 hex digits, a random 64-bit prefix for this process and a 64-bit
    counter scrambled by a random odd multiplier (a bijection: never the same id twice in a
    process, and the ids do not show how many requests came before). A uuid4 would read the
    OS's randomness for every request, ~4 µs; this is a multiplication."""

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)  # a forked worker must not repeat its parent's ids

    def reseed(self) -> None:
        self.prefix = os.urandom(8).hex()
        self.multiplier = int.from_bytes(os.urandom(8), "big") | 1
        self.counter = itertools.count(1)

    def new(self) -> str:
        return f"{self.prefix}{next(self.counter) * self.multiplier & 0xFFFF_FFFF_FFFF_FFFF:016x}"


_IDS = _RequestIds()


def request_id_from(header: str | None) -> str:
    """The client's request id if it is sensible (printable, at most 128 characters), else a new one."""
    if header and len(header) <= _MAX_ID and header.isprintable() and header.strip() == header:
        return header
    return _IDS.new()


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


class BufferedLineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler that writes its lines in batches: at most ``interval_s`` late, or when
    ``max_bytes`` are pending, and on ``flush()``/``close()`` (the server's shutdown calls them).

    For the access log: a ``write`` to stderr per request (it is line-buffered) costs a system
    call, ~20-30 us of server CPU per request under load, more than the line itself. A line is
    never lost while the process ends normally; a killed process loses at most ``interval_s`` of them.
    """

    def __init__(self, stream: Any = None, interval_s: float = 0.25, max_bytes: int = 64 * 1024) -> None:
        super().__init__(stream)
        self._pending: list[str] = []
        self._size = 0
        self._max_bytes = max_bytes
        self._interval_s = interval_s
        self._second, self._stamp = -1, ""
        self._stopped = threading.Event()
        self._flusher = threading.Thread(target=self._flush_forever, name="shardline-log-flush", daemon=True)
        self._flusher.start()

    def takes_fields(self) -> bool:
        """Whether ``emit_fields`` writes what a record would: JSON lines, no filters, INFO let through."""
        return type(self.formatter) is JsonFormatter and not self.filters and self.level <= logging.INFO

    def emit_fields(self, logger: str, message: str, fields: dict[str, Any]) -> None:
        """The line ``JsonFormatter`` makes of an INFO record with these fields, made without a LogRecord.

        For the access log (a line per request): a record, the handler chain and the
        formatter cost several times the line itself. Callers check ``takes_fields()``.
        """
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        line: dict[str, Any] = {"ts": f"{self._stamp}.{int((now - second) * 1000):03d}Z", "level": "info",
                                "logger": logger, "msg": message}
        info = CURRENT.get()
        if info is not None:
            line["request_id"] = info.request_id
        line.update(fields)
        text = orjson.dumps(line, default=str).decode() + self.terminator
        with self.lock:  # type: ignore[union-attr]
            self._pending.append(text)
            self._size += len(text)
            if self._size >= self._max_bytes:
                self._write()

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the formatted line; write the batch when it is large."""
        try:
            line = self.format(record) + self.terminator
        except Exception:  # noqa: BLE001 - as StreamHandler: a bad record must not fail the request
            self.handleError(record)
            return
        self._pending.append(line)  # (emit runs under the handler's lock)
        self._size += len(line)
        if self._size >= self._max_bytes:
            self._write()

    def _write(self) -> None:
        if self._pending:
            batch, self._pending, self._size = "".join(self._pending), [], 0
            self.stream.write(batch)
            self.stream.flush()

    def flush(self) -> None:
        """Write every pending line now."""
        self.acquire()
        try:
            if self.stream is not None and not getattr(self.stream, "closed", False):
                self._write()
        finally:
            self.release()

    def _flush_forever(self) -> None:
        while not self._stopped.wait(self._interval_s):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - e.g. the stream went away at exit: nothing to write to
                return

    def close(self) -> None:
        """Write what is pending and stop the flushing thread."""
        self._stopped.set()
        self.flush()
        super().close()


def flush_access_log() -> None:
    """Write the access log's pending lines (a worker process's end does not run ``logging.shutdown``)."""
    for handler in logging.getLogger(ACCESS_LOGGER).handlers:
        handler.flush()


ACCESS_LOGGER = "shardline.online.access"


def log_config(level: str = "info") -> dict[str, Any]:
    """A ``logging.config.dictConfig`` that writes Shardline's and uvicorn's logs as JSON lines to stderr.

    The access log (a line per request) is written in batches, at most 0.25 s late (``BufferedLineHandler``).
    """
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    access = {"()": BufferedLineHandler, "formatter": "json", "stream": "ext://sys.stderr"}
    loggers = {
        name: {"handlers": ["json"], "level": level.upper(), "propagate": False}
        for name in ("shardline", "uvicorn", "uvicorn.error")
    }
    loggers[ACCESS_LOGGER] = {"handlers": ["access"], "level": level.upper(), "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"json": handler, "access": access},
        "loggers": loggers,
    }
