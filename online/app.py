"""The ASGI application: the protocol adapters' routes, request ids, access logs, metrics.

``create_app(plane)`` wires a data plane to the routes of both protocols, ``/metrics``
and the request middleware; the app's lifespan starts and stops the data plane.
``RequestMiddleware`` (plain ASGI, no per-request task) gives every request an id
(``X-Request-ID`` from the client, or a new one) that is echoed in the response and
carried by every log line, writes one JSON access-log line per request and counts it
in the metrics by protocol, model, version, tenant and status.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shardline.online.dataplane import DataPlane
from shardline.online.edge import json_response
from shardline.online.logs import CURRENT, RequestInfo, request_id_from
from shardline.online.metrics import Metrics
from shardline.online.protocols import kserve_v2, openai

access_log = logging.getLogger("shardline.online.access")
_REQUEST_ID = b"x-request-id"


class RequestMiddleware:
    """Request id in and out, one access-log line and the request metrics per request."""

    def __init__(self, app: ASGIApp, metrics: Metrics, log_requests: bool = True) -> None:
        self.app = app
        self.metrics = metrics
        self.log_requests = log_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == _REQUEST_ID), None)
        info = RequestInfo(request_id_from(header.decode("latin-1") if header is not None else None))
        token = CURRENT.set(info)
        started = time.perf_counter()
        status = 500
        encoded_id = info.request_id.encode("latin-1")

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (_REQUEST_ID, encoded_id)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            self.metrics.observe_request(info.protocol or "http", info.model, info.version, info.tenant, status, seconds)
            if self.log_requests:
                access_log.info("request", extra={"fields": {
                    "method": scope["method"], "path": scope["path"], "status": status,
                    "ms": round(seconds * 1000, 3), "protocol": info.protocol, "tenant": info.tenant,
                    "model": info.model, "version": info.version}})
            CURRENT.reset(token)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unknown paths and methods, in the V2 error form (OpenAI's under /v1)."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    if status == 404:
        message = (f"no endpoint {request.method} {request.url.path}; this server speaks the Open Inference "
                   "Protocol under /v2 and OpenAI-style /v1/embeddings")
    elif status == 405:
        message = f"{request.url.path} does not take {request.method}"
    else:
        message = str(getattr(exc, "detail", exc))
    body = openai.error_body(message, status) if request.url.path.startswith("/v1/") else kserve_v2.error_body(message, status)
    return json_response(body, status)


def create_app(plane: DataPlane, *, log_requests: bool = True) -> Starlette:
    """The ASGI app serving ``plane`` over both protocols; its lifespan starts and stops the plane."""

    async def metrics_endpoint(request: Request) -> Response:
        payload, content_type = plane.metrics.exposition()
        return Response(payload, media_type=content_type)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await plane.start()
        try:
            yield
        finally:
            await plane.stop()

    routes: list[Any] = [
        *kserve_v2.routes(plane),
        *openai.routes(plane),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    middleware = [
        Middleware(RequestMiddleware, metrics=plane.metrics, log_requests=log_requests),
        Middleware(GZipMiddleware, minimum_size=1024),
    ]
    return Starlette(
        routes=routes, middleware=middleware, lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
    )
