"""What every protocol adapter shares at the HTTP edge: reading bodies, the tenant, error answers.

``endpoint(protocol, error_body)`` wraps a handler so that a domain error becomes the
status from the one table (``online/errors.py``) with a body in the protocol's own
form, and nothing unexpected escapes as a crash (``error_answer`` is that table's use, for
plain ASGI endpoints too). ``read_body``, the one body reader (from an ASGI ``receive``, which
a Starlette request has too), enforces the size limit before and after decompression (gzip,
every member of it, and deflate).

A large body is decompressed on the data plane's codec threads, not the event loop
(``runs_off_loop``: ``offload_min_bytes``, or a 32nd of it for a compressed body), so that
health checks and small requests are answered meanwhile; a small one takes no detour.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

from shardline.errors import ShardlineError
from shardline.online.bodies import CLIENT_GONE, ClientGone, decode_body, receive_body
from shardline.online.dataplane import DataPlane
from shardline.online.errors import error_status
from shardline.online.headers import TENANT_HEADER
from shardline.online.logs import current
from shardline.online.models import ServedModel
from shardline.online.tenants import Tenant

log = logging.getLogger("shardline.online")
Handler = Callable[[Request], Awaitable[Response]]
ErrorBody = Callable[[str, int, str | None, str | None], dict[str, Any]]  # message, status, the error's code, param
JSON = "application/json"
COMPRESSION_RATIO = 32  # a compressed body this much smaller than offload_min_bytes may inflate past it


def runs_off_loop(size: int, compressed: bool, threshold: int) -> bool:
    """Whether work on a body of ``size`` bytes goes to the codec threads (else it is done on the loop).

    A compressed body counts ``COMPRESSION_RATIO`` times its size (what it may inflate to).
    """
    return size * COMPRESSION_RATIO >= threshold if compressed else size >= threshold


def json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response, serialised with orjson (numpy arrays too)."""
    return Response(orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY), status, headers, media_type=JSON)


def endpoint(protocol: str, error_body: ErrorBody) -> Callable[[Handler], Handler]:
    """Wrap a handler: note the protocol, answer domain errors by the table, log and contain the rest."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def run(request: Request) -> Response:
            info = current()
            if info is not None:
                info.protocol = protocol
            try:
                return await handler(request)
            except ClientGone:  # nobody is left to read an answer; not a fault of the server (nor a bad request)
                return Response(status_code=CLIENT_GONE)
            except Exception as e:  # noqa: BLE001 - a domain error by the table; a bug answers 500, logged
                status, body, headers = error_answer(e, error_body)
                return json_response(body, status, headers)

        return run

    return wrap


def error_answer(error: Exception, error_body: ErrorBody) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Status, body (in the protocol's form) and headers that answer an error raised by a handler.

    A domain error gets its status from the one table; anything else is a bug: it answers
    500, is logged with its traceback, and the server goes on.
    """
    if isinstance(error, ShardlineError):
        status, headers = error_status(error)
        if status == 500:  # a fault of the model or the server; 501 and 503 are answers, not faults
            log.error("request failed", exc_info=error, extra={"fields": {"status": status}})
        return status, error_body(str(error), status, error.code, error.param), headers
    log.error("unexpected error while handling a request", exc_info=error)
    info = current()
    request_id = info.request_id if info is not None else "?"
    message = f"internal error ({type(error).__name__}); the server logged it with request id {request_id}"
    return 500, error_body(message, 500, None, None), {}


def authenticate(request: Request, plane: DataPlane) -> Tenant:
    """The tenant of the request's ``Authorization: Bearer`` key (Unauthenticated otherwise)."""
    tenant = plane.authenticate(request.headers.get("authorization"), request.headers.get(TENANT_HEADER))
    info = current()
    if info is not None:
        info.tenant = tenant.name
    return tenant


def note_model(served: ServedModel) -> None:
    """Label the request's metrics and logs with the version it uses."""
    info = current()
    if info is not None:
        info.model = served.name
        info.version = str(served.version)


async def read_body(receive: Receive, content_length: str | None, encoding: str | None, plane: DataPlane) -> bytes:
    """The request's body from ``receive``, decompressed (Content-Encoding gzip or deflate), at most ``max_body_bytes``.

    The one body reader of every protocol: a plain ASGI app passes its ``receive`` and the two
    headers; a Starlette handler passes ``request.receive`` and ``request.headers``' values.

    Raises:
        PayloadTooLarge: the body (as declared, as sent, or what it inflates to) is over the limit.
        UnsupportedEncoding: another Content-Encoding.
        InvalidInput: a compressed body that does not decompress.
        ClientGone: the client disconnected before the body was read.
    """
    body = await receive_body(receive, content_length, plane.settings.max_body_bytes)
    return await _decoded(body, encoding, plane)


async def _decoded(body: bytes, encoding: str | None, plane: DataPlane) -> bytes:
    if not encoding or encoding.strip().lower() == "identity":  # the commonest request: nothing to do
        return body
    limit = plane.settings.max_body_bytes
    if runs_off_loop(len(body), True, plane.settings.offload_min_bytes):
        return await plane.off_loop(lambda: decode_body(body, encoding, limit))
    return decode_body(body, encoding, limit)
