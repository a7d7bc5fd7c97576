"""Structured logs: one JSON object per line, each with the id of the request (and trace) it belongs to.

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
    deadline: float | None = None  # time.monotonic() by which it must be answered (X-Shardline-Timeout-Ms)
    trace_id: str = ""  # the W3C trace it belongs to (its traceparent's, or the server span's), "" when none
    budget: str = ""  # the tenant's budget state when past a threshold (warn, soft): the answer's X-Shardline-Budget
    fallback: str = ""  # name:version#variant when the server chose a cheaper variant (soft): X-Shardline-Fallback
    variant: str = ""  # the precision variant the request names (X-Shardline-Variant: a router's fallback), "" none


CURRENT: contextvars.ContextVar[RequestInfo | None] = contextvars.ContextVar("shardline_request", default=None)


class _RequestIds:
    """New request ids: 32 hex digits, a random 64-bit prefix for this process and a 64-bit
    counter scrambled by a random odd multiplier (a bijection: never the same id twice in a
    process, and the ids do not show how many requests came before). A uuid4 would read the
    OS's randomness for every request; this is a multiplication."""

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


def deadline_left() -> float | None:
    """Seconds left of the current request's deadline (``X-Shardline-Timeout-Ms``; negative once it has passed),
    or None when it has none."""
    info = CURRENT.get()
    return None if info is None or info.deadline is None else info.deadline - time.monotonic()


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
            if info.trace_id:
                line["trace_id"] = info.trace_id
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


class BufferedLineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler whose lines are written in batches by a thread of its own: at most
    ``interval_s`` late, sooner when ``max_bytes`` are pending, and on ``flush()``/``close()``
    (the server's shutdown calls them).

    For the access log: a ``write`` to stderr per request (it is line-buffered) costs a system
    call per request, more than the line itself (figures: bench/README.md, "Figures behind the code"). And the
    thread that logs (the event loop) never writes: a write can block for tens of milliseconds
    when the kernel holds back a file's dirty pages, and every request would wait with it.
    A line is never lost while the process ends normally (a killed process loses at most
    ``interval_s`` of them), unless the stream takes nothing for so long that
    ``max_pending_bytes`` pile up: then new lines are dropped and a line says how many.
    """

    def __init__(self, stream: Any = None, interval_s: float = 0.25, max_bytes: int = 64 * 1024,
                 max_pending_bytes: int = 64 * 1024 * 1024) -> None:
        super().__init__(stream)
        self._pending: list[str] = []
        self._size = 0
        self._dropped = 0
        self._max_bytes = max_bytes
        self._max_pending = max_pending_bytes
        self._interval_s = interval_s
        self._second, self._stamp = -1, ""
        self._pending_lock = threading.Lock()  # held only to append or to take the batch: never while writing
        self._write_lock = threading.Lock()  # one batch written at a time, in order
        self._wake = threading.Event()
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
            if info.trace_id:
                line["trace_id"] = info.trace_id
        line.update(fields)
        self._append(orjson.dumps(line, default=str).decode() + self.terminator)

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the formatted line for the writing thread."""
        try:
            line = self.format(record) + self.terminator
        except Exception:  # noqa: BLE001 - as StreamHandler: a bad record must not fail the request
            self.handleError(record)
            return
        self._append(line)

    def _append(self, line: str) -> None:
        with self._pending_lock:
            if self._size >= self._max_pending:
                self._dropped += 1
                return
            self._pending.append(line)
            self._size += len(line)
            full = self._size >= self._max_bytes
        if full and not self._wake.is_set():  # set once: until the writer runs, every later line is past the mark
            self._wake.set()

    def _take(self) -> str:
        with self._pending_lock:
            batch, self._pending, self._size = self._pending, [], 0
            dropped, self._dropped = self._dropped, 0
        if dropped:
            batch.append(orjson.dumps({
                "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "level": "warning",
                "logger": "shardline.online.logs", "msg": "log lines dropped: the stream took nothing for too long",
                "dropped": dropped}).decode() + self.terminator)
        return "".join(batch)

    def flush(self) -> None:
        """Write every pending line now."""
        with self._write_lock:
            batch = self._take()
            if batch and self.stream is not None and not getattr(self.stream, "closed", False):
                self.stream.write(batch)
                self.stream.flush()

    def _flush_forever(self) -> None:
        while not self._stopped.is_set():
            self._wake.wait(self._interval_s)
            self._wake.clear()
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - e.g. the stream went away at exit: nothing to write to
                return

    def close(self) -> None:
        """Write what is pending and stop the writing thread."""
        self._stopped.set()
        self._wake.set()
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
