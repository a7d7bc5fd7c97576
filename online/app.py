"""The ASGI application: the protocol adapters' routes, request ids, access logs.

``create_app(plane)`` wires a data plane to the routes of both protocols and the request
middleware; the app's lifespan starts and stops the data plane. It has no ``/metrics``: the
metrics name every tenant, so ``shardline.online.metrics.metrics_app`` serves them on a listener of their own (loopback
by default, ``shardline.online.server``).
``RequestMiddleware`` (plain ASGI, no per-request task) gives every request an id
(``X-Request-ID`` from the client, or a new one) that is echoed in the response and
carried by every log line, notes its deadline (``X-Shardline-Timeout-Ms``, which the router
sends: the data plane does not score a request past it) and the precision variant it names
(``X-Shardline-Variant``, a router's fallback: every protocol's model look-up honours it), writes one JSON access-log line per
request and counts it in the metrics by protocol, model, version, tenant and status.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, set_span_in_context
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shardline.observability import tracing
from shardline.online.admission import asked_timeout_s
from shardline.online.bodies import CLIENT_GONE
from shardline.online.dataplane import DataPlane
from shardline.online.edge import json_response
from shardline.online.headers import BUDGET_HEADER, FALLBACK_HEADER, TIMEOUT_HEADER, VARIANT_HEADER
from shardline.online.logs import (
    ACCESS_LOGGER,
    CURRENT,
    BufferedLineHandler,
    RequestInfo,
    flush_access_log,
    request_id_from,
)
from shardline.online.metrics import Metrics
from shardline.online.protocols import kserve_v1, kserve_v2, openai
from shardline.online.protocols.forms import openai_error_body, openai_form, v2_error_body

access_log = logging.getLogger(ACCESS_LOGGER)
_REQUEST_ID = b"x-request-id"
_BUDGET = BUDGET_HEADER.encode()
_FALLBACK = FALLBACK_HEADER.encode()
_TIMEOUT = TIMEOUT_HEADER.encode()
_VARIANT = VARIANT_HEADER.encode()
_TRACEPARENT = tracing.TRACEPARENT.encode()


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
        header = timeout = traceparent = variant = None
        for key, value in scope["headers"]:
            if key == _REQUEST_ID:
                header = value
            elif key == _TIMEOUT:
                timeout = asked_timeout_s(value.decode("latin-1"))
            elif key == _TRACEPARENT:
                traceparent = value
            elif key == _VARIANT:
                variant = value
        info = RequestInfo(request_id_from(header.decode("latin-1") if header is not None else None),
                           deadline=None if timeout is None else time.monotonic() + timeout,
                           variant=variant.decode("latin-1") if variant is not None else "")
        if tracing.ENABLED:
            await self._traced(scope, receive, send, info, traceparent)
            return
        if traceparent is not None:
            info.trace_id = tracing.trace_id_of(traceparent)
        await self._handled(scope, receive, send, info)

    async def _traced(self, scope: Scope, receive: Receive, send: Send, info: RequestInfo,
                      traceparent: bytes | None) -> None:
        """The request under a server span (the caller's ``traceparent`` its parent) that ends when the last
        byte of the answer is sent: for a stream, its last token."""
        span = tracing.start(f"{scope['method']} {scope['path']}", kind=SpanKind.SERVER,
                             parent=tracing.parent_from(traceparent),
                             attributes={"http.request.method": scope["method"], "url.path": scope["path"],
                                         "shardline.request_id": info.request_id})
        info.trace_id = tracing.hex_trace_id(span)
        if not span.is_recording():  # sampled out: nothing below it records either
            await self._handled(scope, receive, send, info)
            span.end()
            return
        token = otel_context.attach(set_span_in_context(span))
        try:
            status = await self._handled(scope, receive, send, info)
        except BaseException as e:
            tracing.end(span, error=e)
            raise
        finally:
            otel_context.detach(token)
        for name, value in (("shardline.model", info.model), ("shardline.version", info.version),
                            ("shardline.tenant", info.tenant)):
            if value:
                span.set_attribute(name, value)
        tracing.end(span, status)

    async def _handled(self, scope: Scope, receive: Receive, send: Send, info: RequestInfo) -> int:
        token = CURRENT.set(info)
        started = time.perf_counter()
        status = 500
        encoded_id = info.request_id.encode("latin-1")

        answered = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status, answered = message["status"], True
                message["headers"] = [*message.get("headers", []), (_REQUEST_ID, encoded_id)]
                if info.budget:
                    message["headers"].append((_BUDGET, info.budget.encode()))
                if info.fallback:
                    message["headers"].append((_FALLBACK, info.fallback.encode("latin-1")))
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
            if status == 500 and not answered:
                status = CLIENT_GONE  # no answer, and no error: the client went away first (a body that never came)
        finally:
            seconds = time.perf_counter() - started
            self.metrics.observe_request(info.protocol or "http", info.model, info.version, info.tenant, status, seconds)
            if self.log_requests and access_log.isEnabledFor(logging.INFO):
                fields = {"method": scope["method"], "path": scope["path"], "status": status,
                          "ms": round(seconds * 1000, 3), "protocol": info.protocol, "tenant": info.tenant,
                          "model": info.model, "version": info.version}
                handler = access_log.handlers[0] if len(access_log.handlers) == 1 else None
                if (isinstance(handler, BufferedLineHandler) and type(handler) is BufferedLineHandler
                        and not access_log.filters and handler.takes_fields()):
                    handler.emit_fields(access_log.name, "request", fields)  # the same line, no LogRecord
                else:
                    # makeRecord + handle is what .info() does, less finding the caller's frame (a stack
                    # walk per request): the record goes through the same handlers, filters and formatter.
                    access_log.handle(access_log.makeRecord(
                        access_log.name, logging.INFO, __file__, 0, "request", (), None, extra={"fields": fields}))
            CURRENT.reset(token)
        return status


class InferFirst:
    """Sends ``POST .../infer`` straight to the V2 inference endpoint (and ``POST .../{name}:predict`` to V1's),
    everything else to ``app``.

    The inference path is the hot one: past Starlette's router and middleware (error and
    exception middleware, gzip, a Request and a Response per request) it costs a fraction of
    the CPU. The endpoint answers errors and gzips large answers itself; the router still
    has the same routes, for the other methods (405) and for anything this misses.
    """

    def __init__(self, app: ASGIApp, infer: ASGIApp, predict: ASGIApp) -> None:
        self.app = app
        self.infer = infer
        self.predict = predict  # KServe V1's POST .../{name}:predict, the same plain-ASGI endpoint with V1's codec

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if len(path) > 1 and path[-1] == "/":  # one trailing slash is the same path (no redirect, see create_app)
            scope["path"] = path[:-1]
        if scope["type"] == "http" and scope["method"] == "POST":
            params = kserve_v2.infer_path_params(scope["path"])
            if params is not None:
                scope["path_params"] = params
                await self.infer(scope, receive, send)
                return
            params = kserve_v1.predict_path_params(scope["path"])
            if params is not None:
                scope["path_params"] = params
                await self.predict(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unknown paths and methods, in the V2 error form (OpenAI's under /v1)."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    if status == 404:
        message = (f"no endpoint {request.method} {request.url.path}; this server speaks the Open Inference "
                   "Protocol under /v2, KServe's V1 (/v1/models/{name}:predict) and OpenAI's under /v1 (models, "
                   "embeddings, completions, chat/completions)")
    elif status == 405:
        message = f"{request.url.path} does not take {request.method}"
    else:
        message = str(getattr(exc, "detail", exc))
    body = (openai_error_body if openai_form(request.url.path) else v2_error_body)(message, status)
    if status in (404, 405) and "error" in body and isinstance(body["error"], dict):
        body["error"]["code"] = None  # no model is at fault (OpenAI's code for a 404): as OpenAI answers a wrong URL
    return json_response(body, status)


def create_app(plane: DataPlane, *, log_requests: bool = True) -> ASGIApp:
    """The ASGI app serving ``plane`` over both protocols; its lifespan starts and stops the plane.

    From the outside in: ``RequestMiddleware`` (request id, access log, metrics), ``InferFirst``
    (V2 inference, the hot path), then the Starlette app with every route.
    """

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await plane.start()
        try:
            yield
        finally:
            await plane.stop()
            flush_access_log()
            tracing.shutdown()

    v2_routes, v1_routes = kserve_v2.routes(plane), kserve_v1.routes(plane)
    routes: list[Any] = [
        *v2_routes,
        *v1_routes,  # before OpenAI's GET /v1/models/{model}, which its paths also match
        *openai.routes(plane),
    ]
    starlette = Starlette(
        routes=routes, middleware=[Middleware(GZipMiddleware, minimum_size=kserve_v2.GZIP_MIN_BYTES,
                                                  compresslevel=kserve_v2.GZIP_LEVEL)],
        lifespan=lifespan, exception_handlers={HTTPException: _http_error},
    )
    # Starlette would answer a trailing slash with a redirect to the path without it, built from the Host
    # header: behind the router, the replica's own address, which takes no requests but the router's; and a
    # POST's client seldom follows it. InferFirst reads the path without it instead, as the router does.
    starlette.router.redirect_slashes = False
    infer = next(r.app for r in v2_routes if isinstance(r, Route) and r.path.endswith("/infer"))
    predict = next(r.app for r in v1_routes if isinstance(r, Route) and r.path.endswith(":predict"))
    return RequestMiddleware(InferFirst(starlette, infer, predict), plane.metrics, log_requests)
