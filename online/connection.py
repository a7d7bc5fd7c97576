"""uvicorn's httptools protocol with the bounds uvicorn lacks: head size, header count, head and
body time-outs, a connection cap and an in-flight cap. Written against uvicorn 0.54 (constraints.txt);
``tests/e2e/test_serve_limits.py`` drives every bound over real sockets.

What each connection is held to (``ConnectionLimits``, from ``OnlineSettings``):

- **Head size and count.** Bytes are counted while a request's head is incomplete; past
  ``max_header_bytes`` (or with more than ``max_headers`` fields) the answer is 431 and the
  connection is closed, so an unfinished head holds at most the limit plus one read (256 KiB).
- **Head time-out.** A new connection must send its first head within ``header_timeout_s``;
  later heads within ``keep_alive_s`` of the previous answer. The timer is uvicorn's own
  keep-alive handle, armed at connect and left running until the head is complete (uvicorn
  stops it at the first byte), so the hot path arms no extra timer. A partial head is answered
  408, a silent connection just closed.
- **Body time-out.** A body that does not arrive whole in the first read gets a timer: all of it
  within ``body_timeout_s``, else 408 (if no answer started) and close; the app reads a disconnect.
- **Connection cap.** Past ``max_connections`` the connection that has waited longest for a head
  (silent, half-sent, or idle keep-alive; never one with a request in progress) is closed to make
  room; when every connection has a request in progress the new one is answered 503 and closed.
  So half-open connections cannot keep a health check or a real request out.
- **In-flight cap.** With ``max_in_flight`` requests being answered, another is answered 503 with
  ``Retry-After`` (``/v2/health/*`` and ``/health`` always go through).
- **Not HTTP.** What the parser refuses (a ``Content-Length`` that is not digits, or given twice, a bad request
  line) is answered 400 with the parser's words and closed, in the JSON form below (uvicorn's own answer was plain
  text).
- **A client gone before its request began.** When a request's last byte is read, the socket is asked
  (``poll``, ``POLLRDHUP``: nothing is read) whether the client has closed its side behind it already;
  then the app reads a disconnect at once and answers nothing (``ClientGone``: 499 in the access log and the
  request counter, no inference, no latency observed, nothing metered), as nginx tests a client that closed
  before its request is passed on. It is what a router's given-up copy looks like to a replica that was
  stopped or blocked: the router moved the request to another replica and closed the connection, and the
  copy was still in this socket's buffer.

A refusal is answered, then the write side is shut (FIN) and whatever the client still sends is
read and dropped for ``LINGER_S`` at most (a "lingering close"): closing with unread data would
make the kernel send a reset that can destroy the answer before the client reads it.

These answers are written below the app (no middleware, no access-log line, no request metrics):
``{"error": "..."}`` JSON, the V2 error form. ``limited_protocol`` also serves other apps on
other listeners of the same server (the metrics port), chosen once per connection.

An answer's head and body leave in one send (``_HeadWithBody``): uvicorn writes the head as soon as the app
sends it, so each answer was two system calls and two packets, and a client that reads the head, then the
body (http.client, requests) woke twice; a stream's head still leaves at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import select
import socket
from typing import Any

import httptools
import orjson
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from shardline.errors import InvalidSetting
from shardline.online.limits import ConnectionLimits

HEALTH_PATHS = (b"/v2/health/", b"/health")  # never refused for the in-flight cap (probes)
LINGER_S = 2.0  # after an answer that closes, how long what the client still sends is read and dropped
# The peer closed its side (FIN), or reset the connection: what poll says of a socket whose client is gone.
# (POLLRDHUP is Linux's; elsewhere there is no such test, and a request whose client went is answered to no one.)
_GONE = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR

log = logging.getLogger(__name__)


def error_answer(status: int, message: str, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection: ``{"error": message}`` as JSON."""
    body = orjson.dumps({"error": message})
    head = [STATUS_LINE[status], b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n"]
    if retry_after_s is not None:
        head.append(b"retry-after: %d\r\n" % retry_after_s)
    return b"".join([*head, b"\r\n", body])


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a connection that was just answered and closed."""


class Listeners:
    """What the connections of one server share: the apps of its other listeners (by local port),
    and the connections waiting for a head, longest-waiting first. One per server (and so per
    worker process: it is pickled with the protocol factory, empty)."""

    def __init__(self, apps_by_port: dict[int, ASGIApp] | None = None) -> None:
        self.apps_by_port = apps_by_port or {}
        self.waiting: dict[LimitedHttpToolsProtocol, None] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"apps_by_port": {}, "waiting": {}}  # apps are of this process; workers serve the main app only


def limited_protocol(limits: ConnectionLimits, apps_by_port: dict[int, ASGIApp] | None = None) -> Any:
    """The ``http=`` protocol factory for uvicorn's ``Config``: ``LimitedHttpToolsProtocol`` bound to
    ``limits`` (it pickles, for worker processes) and, for listeners on other ports, their apps."""
    return functools.partial(LimitedHttpToolsProtocol, limits=limits, listeners=Listeners(apps_by_port))


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` holding each connection to ``limits`` (see the module docstring)."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, limits: ConnectionLimits,
                 listeners: Listeners) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.listeners = listeners
        self.timeout_keep_alive = limits.keep_alive_s  # type: ignore[assignment]  # uvicorn types it int
        self._in_head = True  # no request line and headers complete yet (for this request or the next)
        self._head_bytes = 0  # bytes received while in the head
        self._head_over = False  # the read that ended the head took it past max_header_bytes
        self._body_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._peer: Any = None  # a poll object on the connection's socket (``_client_gone``), None where there is none

    # -- connection ----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.listeners.apps_by_port and self.server is not None and self.server[1] is not None:
            self.app = self.listeners.apps_by_port.get(self.server[1], self.app)
        if len(self.connections) > self.limits.max_connections and not self._close_longest_waiting():
            self._refuse(503, "the server has all the connections it can hold, each with a request in "
                         "progress; retry later", self.limits.retry_after_s)
            return
        self.listeners.waiting[self] = None
        self.timeout_keep_alive_task = self.loop.call_later(self.limits.header_timeout_s,
                                                            self.timeout_keep_alive_handler)
        sock = transport.get_extra_info("socket")
        if hasattr(select, "POLLRDHUP") and sock is not None and sock.fileno() >= 0:
            self._peer = select.poll()
            self._peer.register(sock.fileno(), select.POLLRDHUP)

    def connection_lost(self, exc: Exception | None) -> None:
        self.listeners.waiting.pop(self, None)
        self._cancel_body_timer()
        self._peer = None
        super().connection_lost(exc)

    def _client_gone(self) -> bool:
        """Whether the client has closed its side of the connection (or reset it), from the socket, reading nothing."""
        peer = self._peer
        if peer is None:
            return False
        try:
            return any(events & _GONE for _, events in peer.poll(0))
        except OSError:
            return False

    def _close_longest_waiting(self) -> bool:
        for victim in self.listeners.waiting:
            if victim is not self:
                del self.listeners.waiting[victim]
                victim.transport.close()
                return True
        return False

    def _refuse(self, status: int, message: str, retry_after_s: int | None = None) -> None:
        """Answer and close; what the client still sends is read and dropped (for ``LINGER_S`` at most),
        so that its kernel gets the answer rather than a reset for data we left unread."""
        self._refused = True
        self.listeners.waiting.pop(self, None)
        self._cancel_body_timer()
        self._unset_keepalive_if_required()
        if self.cycle is not None:
            self.cycle.disconnected = True  # an app still reading this request reads a disconnect
            self.cycle.message_event.set()
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(error_answer(status, message, retry_after_s))
        if transport.can_write_eof():
            transport.write_eof()  # the answer, then FIN; the client's EOF (or the linger) closes the rest
            self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()

    # -- reading ---------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        """uvicorn's, except that the head timer runs on until the head is complete, and the bounds."""
        if self._refused:
            return
        if self._in_head:
            self._head_bytes += len(data)
            self._head_over = self._head_bytes > self.limits.max_header_bytes
        else:
            self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if not self._refused:
                self._not_http(e)
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._in_head:
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(431, f"the request's headers are over {self.limits.max_header_bytes} bytes")
        elif self._body_timer is None and not self.transport.is_closing():
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def _not_http(self, error: httptools.HttpParserError) -> None:
        """The parser refused what the client sent (a Content-Length that is not digits, a bad request line): 400 with
        the JSON body every other 400 has, where uvicorn answered plain text; closed. An answer already being written
        (a stream, a large body) can have nothing after it: the connection is just closed."""
        why = str(error) or type(error).__name__
        self.logger.warning("Invalid HTTP request received (%s).", why)
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self.transport.close()
            return
        todo = ("send Content-Length once, the body's size in ASCII digits" if "content-length" in why.lower()
                else "send a well-formed HTTP/1.1 request line and headers")
        self._refuse(400, f"the request is not valid HTTP/1.1 ({why}); {todo}")

    def on_headers_complete(self) -> None:
        self._on_head_complete()
        if self.cycle is not None and self.cycle.transport is self.transport:
            self.cycle.transport = _HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]

    def _on_head_complete(self) -> None:
        self._unset_keepalive_if_required()  # the head timer
        self._in_head = False
        self.listeners.waiting.pop(self, None)
        limits = self.limits
        if len(self.headers) > limits.max_headers or (self._head_over and self._head_size() > limits.max_header_bytes):
            self._refuse(431, f"the request has over {limits.max_headers} header fields or {limits.max_header_bytes} "
                         "bytes of headers")
            raise _Refused
        if len(self.tasks) >= limits.max_in_flight and not self.url.startswith(HEALTH_PATHS):
            app, self.app = self.app, self._busy
            try:
                super().on_headers_complete()
            finally:
                self.app = app
            return
        super().on_headers_complete()

    def _head_size(self) -> int:
        return len(self.url) + 12 + sum(len(name) + len(value) + 4 for name, value in self.headers)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes = True, 0
        self._cancel_body_timer()
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and not cycle.disconnected and self._client_gone():
            # The client closed the connection behind its request (a router gave this copy up and moved the
            # request elsewhere while this process was stopped): the app reads a disconnect before it starts on it.
            cycle.disconnected = True
            cycle.message_event.set()
        if (self.timeout_keep_alive_task is None and self.cycle is not None and self.cycle.response_complete
                and not self.transport.is_closing()):
            # answered before its body was read: the next head is timed from here
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
            self.listeners.waiting[self] = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None and self._in_head:  # idle now, waiting for a head
            self.listeners.waiting[self] = None

    # -- time-outs ---------------------------------------------------------------------------------
    def timeout_keep_alive_handler(self) -> None:
        """The head did not come in time: a partial one is answered 408, a silent connection just closed."""
        if self.transport.is_closing():
            return
        if self._in_head and self._head_bytes:
            self._refuse(408, "the request's headers did not all arrive in time")
        else:
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None:
            return
        if cycle.response_started:
            self.transport.close()
        else:  # the app reads a disconnect; nothing it sends goes out
            self._refuse(408, f"the request's body did not arrive within {self.limits.body_timeout_s:g} s")

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    async def _busy(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = orjson.dumps({"error": f"the server is answering {self.limits.max_in_flight} requests already; "
                                      f"retry after {self.limits.retry_after_s} s"})
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(self.limits.retry_after_s).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _HeadWithBody:
    """The transport one request's cycle writes its answer to. uvicorn writes a response's head as soon as the
    app sends it and the body after: two system calls and, with TCP_NODELAY, two packets the client reads one
    after the other. Here the head is held until the next write in the same turn of the loop (the body of an
    answer whose length is known: the app sends it right after) and goes out with it, in one send. A head
    whose body does not follow in that turn (a stream's) goes out at the end of the turn."""

    __slots__ = ("_transport", "_loop", "_held")
    _COALESCE_MAX = 64 * 1024  # a larger body is sent after the head: copying it would cost more than a call

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = b""  # b"": nothing written yet; None: the head has gone out

    def write(self, data: bytes) -> None:
        held = self._held
        if held is None:
            self._transport.write(data)
        elif not held:
            self._held = bytes(data)
            self._loop.call_soon(self._flush)
        else:
            self._held = None
            if len(data) <= self._COALESCE_MAX:
                self._transport.write(held + data)
            else:
                self._transport.write(held)
                self._transport.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, ...: the connection's own
        return getattr(self._transport, name)


def uvicorn_options(limits: ConnectionLimits, apps_by_port: dict[int, ASGIApp] | None = None) -> dict[str, Any]:
    """The uvicorn ``Config`` options every listener of ``shardline serve`` (and ``serve_in_thread``) uses:
    the bounded protocol (``shardline.online.connection``), no websockets, no server header."""
    # proxy_headers off: nothing here reads the client's address (uvicorn would rewrite it from
    # X-Forwarded-For on every request).
    return dict(http=limited_protocol(limits, apps_by_port), ws="none", timeout_keep_alive=limits.keep_alive_s,
                access_log=False, server_header=False, proxy_headers=False)


def bind_metrics_listener(host: str, port: int, main_port: int, setting: str) -> socket.socket:
    """A bound socket for a metrics listener on ``host``:``port`` (``serve``'s and the router's).

    Raises:
        InvalidSetting: the port is the main port, or it cannot be listened on (``setting`` names the variable).
    """
    if port == main_port:
        raise InvalidSetting(f"the metrics port and the main port are both {port}: set {setting} to another port, or 'off'")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise InvalidSetting(f"cannot listen for metrics on {host}:{port} ({e.strerror}); set {setting} to a free "
                             "port, or 'off'") from e
    log.info("metrics on http://%s:%d/metrics", host, sock.getsockname()[1])
    return sock
