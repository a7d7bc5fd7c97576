"""The router's HTTP/1.1 client to its replicas: keep-alive connections per replica, answers parsed
with httptools (the parser uvicorn uses).

Why not aiohttp's client: a proxy makes one upstream call per request, and aiohttp's took three times the
CPU of the rest of the router's work for one (its request and response objects, timers, payload writers)
(figures: bench/README.md, "Figures behind the code"); this client writes the request in one ``write`` and parses the answer
as it arrives. It does only what the router needs: a request with a body of known length, the whole
answer read (Content-Length or chunked) or streamed as it comes (``stream``: server-sent events of a
generation), keep-alive, a time-out.

- ``UpstreamPool.request`` takes the request's header lines already joined (``header_lines``): the
  router builds them once per request, not once per try. It raises ``UpstreamFailed`` when the
  replica gave no answer: it refused the connection, reset it, closed it before answering, or the
  time-out passed. A connection reused from the pool that the replica had already closed (its
  keep-alive ran out as the request went) is retried once on a new connection: that is not the
  replica's fault.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, Iterable, cast

import httptools

MAX_IDLE = 64  # idle keep-alive connections kept per replica


def header_lines(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """``name: value`` lines, each ended by CRLF, as ``UpstreamPool.request`` takes them."""
    return b"".join([b"%s: %s\r\n" % pair for pair in headers])


class UpstreamFailed(ConnectionError):
    """The replica gave no answer (refused, reset, closed early, timed out: ``timed_out``, connected and silent)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class _Stale(Exception):
    """A reused connection was closed by the replica before any byte of the answer."""


class _Connection(asyncio.Protocol):
    __slots__ = ("transport", "parser", "answer", "status", "headers", "body", "keep", "closed", "got_bytes", "chunks")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future[None] | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.status = 0
        self.keep = False
        self.closed = False
        self.got_bytes = False
        self.chunks: asyncio.Queue[bytes | None | Exception] | None = None  # a streamed answer's body, as it comes

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's transports are not asyncio.Transport subclasses)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamFailed(f"the replica's answer is not HTTP ({e})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.chunks is not None and self.answer is not None and self.answer.done():
            self.chunks.put_nowait(UpstreamFailed("the replica closed the connection in the middle of its answer"))
            return
        if self.answer is not None and not self.answer.done():
            if not self.got_bytes:
                self.answer.set_exception(_Stale())
            else:
                self.answer.set_exception(UpstreamFailed("the replica closed the connection in the middle of its answer"))

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self.chunks is not None:  # streamed: the answer is there once its head is
            self.status = self.parser.get_status_code()
            if self.answer is not None and not self.answer.done():
                self.answer.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.chunks is not None:
            self.chunks.put_nowait(body)
        else:
            self.body.append(body)

    def on_message_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep = self.parser.should_keep_alive()
        if self.chunks is not None:
            self.chunks.put_nowait(None)
        if self.answer is not None and not self.answer.done():
            self.answer.set_result(None)

    def _fail(self, error: Exception) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(error)
        if self.transport is not None:
            self.transport.close()

    def start(self, loop: asyncio.AbstractEventLoop, stream: bool = False) -> asyncio.Future[None]:
        self.answer = loop.create_future()
        self.headers, self.body, self.got_bytes = [], [], False
        self.chunks = asyncio.Queue() if stream else None
        return self.answer


def _time_out(answer: asyncio.Future[None]) -> None:
    if not answer.done():
        answer.set_exception(TimeoutError())


class Relay:
    """An async iterator over a streamed answer whose clean-up runs once, however it ends: read to its end
    (``cleanup(True)``), failed, or closed by ``aclose()`` before its end (``cleanup(False)``), also when it
    was never read at all (an async generator closed before its first step skips its ``finally``: a client
    gone before the first byte would leave the replica generating and its slots taken). The router's stream
    layers (the replica's connection, its in-flight count, the tenant's quotas) are each one of these."""

    def __init__(self, pieces: AsyncIterator[bytes], cleanup: Callable[[bool], Awaitable[None]]) -> None:
        self._pieces = pieces
        self._cleanup = cleanup
        self._done = False

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._pieces.__anext__()
        except StopAsyncIteration:
            await self._finish(True)
            raise
        except BaseException:
            await self._finish(False)
            raise

    async def aclose(self) -> None:
        """Stop it before its end (harmless after it)."""
        await self._finish(False)

    async def _finish(self, ended: bool) -> None:
        if self._done:
            return
        self._done = True
        try:
            close = getattr(self._pieces, "aclose", None)
            if close is not None:
                await close()
        finally:
            await self._cleanup(ended)


async def _pieces(connection: _Connection) -> AsyncIterator[bytes]:
    """The pieces of a streamed answer as they come (the clean-up is its ``Relay``'s)."""
    assert connection.chunks is not None
    while True:
        piece = await connection.chunks.get()
        if piece is None:
            return
        if isinstance(piece, Exception):
            raise piece
        yield piece


class UpstreamPool:
    """Keep-alive connections to one replica (``host``:``port``)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._host_header = f"{host}:{port}".encode()
        self._idle: list[_Connection] = []

    async def request(self, method: str, target: str, headers: bytes, body: bytes,
                      timeout: float) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """Send one request (``headers``: ``header_lines``; Host and Content-Length are added) and read the
        whole answer: (status, headers with lower-case names, body).

        Raises:
            UpstreamFailed: no answer from the replica (see the module docstring).
        """
        connection = await self._send(method, target, headers, body, timeout, False)
        self._release(connection)
        return connection.status, connection.headers, b"".join(connection.body)

    async def stream(self, method: str, target: str, headers: bytes, body: bytes,
                     timeout: float) -> tuple[int, list[tuple[bytes, bytes]], Relay]:
        """Like ``request``, but the answer is handed over once its head is there: (status, headers, the
        body's pieces as they come). ``timeout`` bounds the wait for the head only (a generation streams for
        as long as it runs). Closing the pieces' iterator before its end closes the connection, which
        tells the replica the client is gone.

        Raises:
            UpstreamFailed: no answer from the replica; from the iterator, the replica closed the connection
                in the middle of its answer.
        """
        connection = await self._send(method, target, headers, body, timeout, True)

        async def closed(ended: bool) -> None:
            if ended:  # the whole answer was read: the connection may serve the next request
                connection.chunks = None
                self._release(connection)
            elif connection.transport is not None:
                connection.transport.close()

        return connection.status, connection.headers, Relay(_pieces(connection), closed)

    async def _send(self, method: str, target: str, headers: bytes, body: bytes, timeout: float,
                    stream: bool) -> _Connection:
        if method == "HEAD":
            # An answer to HEAD has no body, which httptools' parser cannot be told: it would wait for the
            # body its Content-Length promises until the replica closed the connection (a failed try, a
            # breaker fed). The replica is asked with GET; the router's server sends HEAD's answer bodiless.
            method = "GET"
        data = b"%s %s HTTP/1.1\r\nhost: %s\r\n%scontent-length: %d\r\n\r\n%s" % (
            method.encode("latin-1"), target.encode("latin-1"), self._host_header, headers, len(body), body)
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        for attempt in (0, 1):
            connection, reused = await self._connection(loop, until)
            answer = connection.start(loop, stream)
            assert connection.transport is not None
            connection.transport.write(data)
            timer = loop.call_at(until, _time_out, answer)  # cheaper than asyncio.timeout on this path
            try:
                await answer
            except _Stale:
                if reused and attempt == 0:
                    continue  # its keep-alive ran out as we sent: a new connection, once
                raise UpstreamFailed("the replica closed the connection without answering") from None
            except TimeoutError:
                connection.transport.close()
                raise UpstreamFailed(f"no answer within {timeout * 1000:.0f} ms", timed_out=True) from None
            except BaseException:
                connection.transport.close()
                raise
            finally:
                timer.cancel()
            return connection
        raise AssertionError("unreachable")

    async def _connection(self, loop: asyncio.AbstractEventLoop, until: float) -> tuple[_Connection, bool]:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection, True
        try:
            async with asyncio.timeout_at(until):
                _, protocol = await loop.create_connection(_Connection, self.host, self.port)
        except TimeoutError:
            raise UpstreamFailed("no connection within the time-out") from None
        except OSError as e:
            raise UpstreamFailed(f"cannot connect ({e.strerror or e})") from e
        return protocol, False

    def _release(self, connection: _Connection) -> None:
        if connection.keep and not connection.closed and len(self._idle) < MAX_IDLE:
            connection.answer = None
            self._idle.append(connection)
        elif connection.transport is not None:
            connection.transport.close()

    def close(self) -> None:
        """Close every idle connection."""
        for connection in self._idle:
            if connection.transport is not None:
                connection.transport.close()
        self._idle.clear()
