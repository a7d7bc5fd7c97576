"""The router as a running service: its background work and its ASGI adapter.

- ``RouterService``: the ``Router`` plus what keeps its view of the replicas true: an active health
  check of every replica (``GET /v2/health/ready``) every ``health_interval_s``, the DNS groups
  resolved every ``refresh_s``, the local replicas watched (``--local-replicas``), and the aliases the
  tenants call read again every ``rollout_refresh_s`` to follow their rollouts (``rollouts``).
- ``router_app``: the plain ASGI app (no framework on this path): read the body (at most
  ``max_body_bytes``), ``Router.handle``, write the answer; lifespan starts and stops the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

from shardline.errors import PayloadTooLarge
from shardline.online.bodies import ClientGone, receive_body
from shardline.online.router.config import RouterConfig
from shardline.online.router.local import LocalReplicas
from shardline.online.router.router import Answer, Incoming, Router, error_answer
from shardline.online.router.upstream import UpstreamFailed, UpstreamPool

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
HEALTH_TIMEOUT_S = 1.0


class RouterService:
    """The router and its background tasks."""

    def __init__(self, router: Router, config: RouterConfig, local: LocalReplicas | None = None) -> None:
        self.router = router
        self.config = config
        self.local = local
        self._tasks: list[asyncio.Task[None]] = []
        self._checks: dict[str, UpstreamPool] = {}  # a pool of its own per replica: checks never wait behind requests

    async def start(self) -> None:
        """Open the pools, check every replica once, then keep checking in the background."""
        await self.router.start()
        loop = asyncio.get_running_loop()
        for group in self.config.groups:
            if group.dns is not None:
                await self._resolve(group.name)
                self._tasks.append(loop.create_task(self._every(group.dns.refresh_s, functools.partial(self._resolve, group.name))))
        await self.check_all()
        self._tasks.append(loop.create_task(self._every(self.router.settings.health_interval_s, self.check_all)))
        book = self.router.rollouts
        if book is not None:
            await book.refresh()  # the aliases' versions and rollouts known before the first request
            self._tasks.append(loop.create_task(self._every(self.router.settings.rollout_refresh_s, book.refresh)))
        if self.local is not None:
            self._tasks.append(loop.create_task(self._every(0.5, self._watch_local)))

    async def stop(self) -> None:
        """Stop the background tasks, close the pools, and stop the local replicas (uvicorn ends the process
        by re-raising the signal that stopped it, so nothing after its run would)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for pool in self._checks.values():
            pool.close()
        self._checks.clear()
        await self.router.stop()
        if self.local is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.local.stop)

    async def _every(self, seconds: float, work: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await work()
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("router background work failed")

    async def check_all(self) -> None:
        """Check every replica's readiness now."""
        replicas = list(self.router.replicas.replicas.values())
        results = await asyncio.gather(*(self._ready(r.url) for r in replicas))
        for replica, ready in zip(replicas, results):
            if replica.healthy != ready:
                log.info("replica %s is %s", replica.url, "ready" if ready else "not ready")
            replica.healthy = ready

    async def _ready(self, url: str) -> bool:
        pool = self._checks.get(url)
        if pool is None:
            parts = urlsplit(url)
            pool = self._checks[url] = UpstreamPool(parts.hostname or "127.0.0.1", parts.port or 80)
        try:
            status, _, _ = await pool.request("GET", "/v2/health/ready", [], b"", HEALTH_TIMEOUT_S)
        except UpstreamFailed:
            return False
        return status == 200

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
        assert self.local is not None
        self.local.watch()


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
            answer = error_answer(e, scope["path"].startswith("/v1/"), "-")
        except ClientGone:
            return
        else:
            answer = await router.handle(Incoming(scope["method"], scope["path"], scope["query_string"], headers, body))
        await _write(send, answer)

    return app


async def _write(send: Send, answer: Answer) -> None:
    headers = [(k, v) for k, v in answer.headers if k != b"content-length"]
    headers.append((b"content-length", str(len(answer.body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


async def _lifespan(service: RouterService, receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                await service.start()
            except Exception as e:  # noqa: BLE001 - reported to uvicorn, which stops
                await send({"type": "lifespan.startup.failed", "message": f"{type(e).__name__}: {e}"})
                return
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            with contextlib.suppress(Exception):
                await service.stop()
            await send({"type": "lifespan.shutdown.complete"})
            return

