"""The router as a running service: its background work and its ASGI adapter.

- ``RouterService``: the ``Router`` plus what keeps its view of the replicas true (and the data plane's, when
  nginx is in front: ``nginx_front``): an active health
  check of every replica (``GET /v2/health/ready``) every ``health_interval_s``, the DNS groups
  resolved every ``refresh_s``, the local replicas watched (``--local-replicas``), the replicas whose tries
  stalled probed every half ``stall_ms`` (one that does not answer is hung: ``Router.abandon``), and the aliases the
  tenants call read again every ``rollout_refresh_s`` to follow their rollouts (``rollouts``); with a
  scaler, the local replicas scaled to demand every half second (``scaling``), the ones starting
  checked every ``STARTING_CHECK_S`` (requests held by the activator go on once one is ready).
- ``router_app``: the plain ASGI app (no framework on this path): read the body (at most
  ``max_body_bytes``), ``Router.handle``, write the answer; lifespan starts and stops the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import shutil
import socket
import time
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

import orjson
from opentelemetry.trace import SpanKind

from shardline.errors import PayloadTooLarge
from shardline.observability import tracing
from shardline.online.background import stop_tasks
from shardline.online.bodies import ClientGone, receive_body
from shardline.online.protocols.forms import openai_error_body, openai_form
from shardline.online.router.config import LOCAL_GROUP, RouterConfig
from shardline.online.router.front import SYNC_S, Front
from shardline.online.router.health import OutlierPolicy, stalled
from shardline.online.router.local import LocalReplicas
from shardline.online.router.messages import Answer, Incoming, error_answer
from shardline.online.router.replicas import Replica
from shardline.online.router.router import Router
from shardline.online.router.scaling import Scaler
from shardline.online.router.upstream import UpstreamFailed, UpstreamPool

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
HEALTH_TIMEOUT_S = 1.0
SILENT = -1  # ``_health``: connected, and no answer in time
STARTING_CHECK_S = 0.1  # how often a replica being started is checked
_TRACEPARENT = tracing.TRACEPARENT.encode()


class RouterService:
    """The router and its background tasks."""

    def __init__(self, router: Router, config: RouterConfig, local: LocalReplicas | None = None,
                 scaler: Scaler | None = None) -> None:
        self.router = router
        self.config = config
        self.local = local
        self.scaler = scaler
        self._starting: dict[str, float] = {}  # replicas started and not yet ready: when they were started
        self.outliers = OutlierPolicy()
        self._tasks: list[asyncio.Task[None]] = []
        self._checks: dict[str, UpstreamPool] = {}  # a pool of its own per replica: checks never wait behind requests
        self.front: Front | None = None  # the proxy in front (nginx: ``nginx_front``), kept true every SYNC_S
        self._kept: set[str] = set()  # silent replicas kept in because no other was up (said once a silence)
        self._stopping = False

    async def start(self) -> None:
        """Open the pools, check every replica once, then keep checking in the background."""
        await self.router.start()
        loop = asyncio.get_running_loop()
        for group in self.config.groups:
            if group.dns is not None:
                await self._resolve(group.name)
                self._repeat(f"resolve {group.name}", group.dns.refresh_s, functools.partial(self._resolve, group.name))
        await self.check_all()
        self._repeat("health checks", self.router.settings.health_interval_s, self._check_round)
        stall_s = self.router.settings.stall_ms / 1000
        if stall_s > 0:
            self._repeat("stall watch", stall_s / 2, self._watch_stalls)
        book = self.router.rollouts
        if book is not None and self.front is not None:
            book.after_read = functools.partial(self.front.sync_pins, self.router)
        if book is not None:
            await book.refresh()  # the aliases' versions and rollouts known before the first request
            self._repeat("rollout refresh", self.router.settings.rollout_refresh_s, book.refresh)
        if self.front is not None:
            await loop.run_in_executor(None, self.front.start)
            await self.front.sync(self.router)
            self._repeat("front sync", SYNC_S, functools.partial(self.front.sync, self.router))
        if self.local is not None:
            self._repeat("local replicas", 0.5, self._watch_local)
            self._repeat("replicas starting", STARTING_CHECK_S, self._check_starting)
            now = time.monotonic()
            self._starting.update({url: now for url in self.local.urls if not self.router.replicas.replicas[url].healthy})

    async def stop(self) -> None:
        """Stop the background tasks, close the pools, stop nginx and the local replicas and remove their temporary
        folders (uvicorn ends the process by re-raising the signal that stopped it, so nothing after its run would)."""
        self._stopping = True
        await stop_tasks(self._tasks, "the router")
        self._tasks.clear()
        for pool in self._checks.values():
            pool.close()
        self._checks.clear()
        await self.router.stop()
        loop = asyncio.get_running_loop()
        if self.front is not None:
            await loop.run_in_executor(None, self.front.stop)
            shutil.rmtree(self.front.folder, ignore_errors=True)  # its configuration, sockets and log
        if self.local is not None:
            await loop.run_in_executor(None, self.local.stop)
            shutil.rmtree(self.local.log_dir, ignore_errors=True)

    def _repeat(self, name: str, seconds: float, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work`` every ``seconds`` in a background task called ``name`` until ``stop``."""
        self._tasks.append(asyncio.get_running_loop().create_task(self._every(seconds, work), name=name))

    async def _every(self, seconds: float, work: Callable[[], Awaitable[None]]) -> None:
        while not self._stopping:  # also ends a loop whose cancel was lost
            await asyncio.sleep(seconds)
            try:
                await work()
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("router background work failed")

    async def check_all(self, only: list[str] | None = None) -> None:
        """Check the readiness of every replica (or of ``only`` those) now; a silent one that is the only one up
        stays in (``_keep_the_last``)."""
        replicas = [r for r in self.router.replicas.replicas.values() if only is None or r.url in only]
        results = await asyncio.gather(*(self._health(r.url, HEALTH_TIMEOUT_S) for r in replicas))
        woke = False
        for replica, status in zip(replicas, results):
            if replica.url not in self.router.replicas.replicas:
                continue  # scaled away meanwhile
            ready = status == 200
            if status != SILENT:
                self._kept.discard(replica.url)
            elif self._keep_the_last(replica, "did not answer its health check in time"):
                continue
            if replica.healthy != ready:
                log.info("replica %s is %s", replica.url, "ready" if ready else "not ready")
                woke = woke or ready
            replica.healthy = ready
            started = self._starting.pop(replica.url, None) if ready else None
            if started is not None:
                self.router.metrics.cold_start(time.monotonic() - started)
        if woke and self.router.activator is not None:
            self.router.activator.notify()

    async def _check_round(self) -> None:
        """Every health interval: check every replica, and eject the ones far slower than the rest."""
        await self.check_all()
        replicas = self.router.replicas
        for url in replicas.eject_outliers(time.monotonic(), self.outliers):
            replica = replicas.replicas[url]
            self.router.metrics.ejections.labels(replica.group, url).inc()
            log.warning("replica %s ejected for latency for %.0f s (%s)", url, replica.ejected_until - time.monotonic(),
                        ", ".join(f"{m}: {e:.1f} ms" for m, (e, _) in sorted(replica.latency.items())[:4]))

    async def _check_starting(self) -> None:
        """Check the replicas being started often (a request may wait for the first), the rest each interval."""
        if self._starting:
            await self.check_all(list(self._starting))

    async def _watch_stalls(self) -> None:
        """Every half stall time: probe the health of each replica whose oldest waiting try has stalled
        (``health.stalled``); one that gives no answer within twice the stall time is hung (``Router.abandon``),
        unless it is the only one up (``_keep_the_last``). A try on a replica that has not answered its model yet
        (loading it) is not watched (``Router._send``)."""
        now = time.monotonic()
        stall_s = self.router.settings.stall_ms / 1000
        replicas = self.router.replicas.replicas
        suspects = [r for r in replicas.values()
                    if r.healthy and stalled(min(r.waiting.values(), default=None), r.heard, r.probed, now, stall_s)]
        if not suspects:
            return
        for replica in suspects:
            replica.probed = now
        answers = await asyncio.gather(*(self._health(r.url, 2 * stall_s) for r in suspects))
        for replica, status in zip(suspects, answers):
            if status not in (None, SILENT) or not replica.healthy or replica.url not in replicas:
                self._kept.discard(replica.url)
            elif status is None or not self._keep_the_last(replica, "stalled and gave no answer to a health probe"):
                self.router.abandon(replica, time.monotonic())

    def _keep_the_last(self, replica: Replica, what: str) -> bool:
        """Whether ``replica``, silent (connected, no answer in time), stays in: when no other replica is up, its
        requests would have nowhere to go, and a late answer beats a 503 (an overloaded machine's only replica is
        silent for a while as a stopped one is). Said once a silence; a replica that refuses connections or
        answers 503 is taken out as always."""
        if any(r.healthy for r in self.router.replicas.replicas.values() if r is not replica) or not replica.healthy:
            self._kept.discard(replica.url)
            return False
        if replica.url not in self._kept:
            self._kept.add(replica.url)
            log.warning("replica %s %s, but no other replica is up: kept, its %d waiting requests wait for it",
                        replica.url, what, len(replica.waiting))
        return True

    async def _health(self, url: str, timeout_s: float) -> int | None:
        """The status of the replica's ``GET /v2/health/ready``: None when it cannot be reached (refused, reset),
        ``SILENT`` when it took the connection but gave no answer within ``timeout_s``."""
        pool = self._checks.get(url)
        if pool is None:
            parts = urlsplit(url)
            pool = self._checks[url] = UpstreamPool(parts.hostname or "127.0.0.1", parts.port or 80)
        try:
            status, _, _ = await pool.request("GET", "/v2/health/ready", b"", b"", timeout_s)
        except UpstreamFailed as e:
            return SILENT if e.timed_out else None
        return status

    async def _resolve(self, group: str) -> None:
        spec = next(g for g in self.config.groups if g.name == group).dns
        assert spec is not None
        try:
            found = await asyncio.get_running_loop().getaddrinfo(spec.name, spec.port, type=socket.SOCK_STREAM)
        except OSError as e:
            log.warning("group %s: %s does not resolve (%s); its replicas stay as they were", group, spec.name, e)
            return
        hosts = sorted({str(info[4][0]) for info in found})
        urls = [f"http://[{h}]:{spec.port}" if ":" in h else f"http://{h}:{spec.port}" for h in hosts]
        self.router.replicas.set_members(group, urls)

    async def _watch_local(self) -> None:
        """Restart replicas that exited (following those that moved to a new port); with a scaler, run as many as
        demand wants."""
        assert self.local is not None
        moved = self.local.watch()
        now = time.monotonic()
        replicas = self.router.replicas
        if moved:  # started again on a new port: a new member, checked as one being started
            replicas.set_members(LOCAL_GROUP, self.local.urls)
            self._starting.update(dict.fromkeys(moved, now))
            self._starting = {u: t for u, t in self._starting.items() if u in replicas.replicas}
        if self.scaler is None:
            return
        activator = self.router.activator
        demand = (sum(r.in_flight for r in replicas.replicas.values()) + sum(self.router.metrics.front_replicas.values())
                  + (activator.total if activator else 0))
        self.router.metrics.wanted[LOCAL_GROUP] = self.scaler.observe(now, demand)
        target = self.scaler.decide(now, self.local.running)
        if target != self.local.running:
            log.info("scaling the local replicas from %d to %d (demand %d in flight or waiting)", self.local.running,
                     target, demand)
            for url in self.local.scale_to(target):
                self._starting[url] = now
            replicas.set_members(LOCAL_GROUP, self.local.urls)
            self._starting = {u: t for u, t in self._starting.items() if u in replicas.replicas}


def router_app(service: RouterService, max_body_bytes: int) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The router's ASGI app."""
    router = service.router

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(service, receive, send)
            return
        if scope["type"] != "http":
            return
        headers = scope["headers"]
        declared = next((v.decode("latin-1") for k, v in headers if k == b"content-length"), None)
        try:
            body = await receive_body(receive, declared, max_body_bytes)
        except PayloadTooLarge as e:
            answer = error_answer(e, openai_form(scope["path"]), "-")
        except ClientGone:
            return
        else:
            if tracing.ENABLED:
                await _traced(router, scope, receive, send, headers, body)
                return
            answer = await router.handle(Incoming(scope["method"], scope["path"], scope["query_string"], headers, body))
        if answer.stream is not None:
            await _write_stream(send, receive, answer)
        else:
            await _write(send, answer)

    return app


async def _traced(router: Router, scope: Scope, receive: Receive, send: Send, headers: list[tuple[bytes, bytes]],
                  body: bytes) -> None:
    """A request under the router's server span (the caller's ``traceparent`` its parent; the replica's span
    its child), ended when the answer's last byte is written: a stream's last token."""
    span = tracing.start(f"{scope['method']} {scope['path']}", kind=SpanKind.SERVER,
                         parent=tracing.parent_from(next((v for k, v in headers if k == _TRACEPARENT), None)),
                         attributes={"http.request.method": scope["method"], "url.path": scope["path"]})
    headers = [(k, v) for k, v in headers if k != _TRACEPARENT] + [(_TRACEPARENT, tracing.traceparent_of(span).encode())]
    status = 500
    try:
        answer = await router.handle(Incoming(scope["method"], scope["path"], scope["query_string"], headers, body))
        status = answer.status
        if answer.stream is not None:
            await _write_stream(send, receive, answer)
        else:
            await _write(send, answer)
    except BaseException as e:
        tracing.end(span, error=e)
        raise
    tracing.end(span, status)


async def _write(send: Send, answer: Answer) -> None:
    headers = [(k, v) for k, v in answer.headers if k != b"content-length"]
    headers.append((b"content-length", str(len(answer.body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


async def _write_stream(send: Send, receive: Receive, answer: Answer) -> None:
    """Pass a streamed answer on piece by piece (chunked), until it ends or the client goes away; either way
    the stream is closed, so that a replica still generating is told (its connection closes)."""
    assert answer.stream is not None
    pieces = answer.stream
    headers = [(k, v) for k, v in answer.headers if k != b"content-length"]

    events = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)

    async def relay() -> None:
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        try:
            async for piece in pieces:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
        except Exception as e:  # noqa: BLE001 - the replica failed once the stream ran: said as serve says it
            if not events:
                raise  # (a body that is not events cannot say it: cut, so the client sees it incomplete)
            log.warning("a stream from its replica failed midway (%s: %s); ended with an error event",
                        type(e).__name__, e)
            failed = openai_error_body(f"the replica generating this stream failed midway ({type(e).__name__}); send "
                                       "the request again", 502)
            ending = b"data: " + orjson.dumps(failed) + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": ending, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def client_gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    relaying = asyncio.ensure_future(relay())
    watching = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({relaying, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (relaying, watching):
            task.cancel()
        await asyncio.gather(relaying, watching, return_exceptions=True)
        close = getattr(pieces, "aclose", None)
        if close is not None:
            await close()


async def _lifespan(service: RouterService, receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                await service.start()
            except Exception as e:  # noqa: BLE001 - reported to uvicorn, which stops
                await send({"type": "lifespan.startup.failed", "message": f"{type(e).__name__}: {e}"})
                return
            gc.collect()
            gc.freeze()  # what is loaded by now lives as long as the router: keep it out of every collection
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            with contextlib.suppress(Exception):
                await service.stop()
            tracing.shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return

