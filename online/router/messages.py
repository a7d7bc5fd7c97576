"""What the router reads and writes: a request as it came (``Incoming``), the answer the client is sent
(``Answer``), how a request went (``Tries``), an OpenAI body pinned to a version (``Pinned``), request ids,
and the router's own answers (its errors in the protocol's form, and plain JSON).
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import orjson

from shardline.errors import ShardlineError
from shardline.online.errors import error_status
from shardline.online.headers import REQUEST_ID_HEADER
from shardline.online.protocols.forms import openai_error_body, v2_error_body
from shardline.online.router.rollouts import Route

REQUEST_ID = REQUEST_ID_HEADER.encode()
# new_request_id: a random half per process, then a count from a random start
_ID_PREFIX = secrets.token_hex(8)
_ID_COUNT = itertools.count(int.from_bytes(secrets.token_bytes(4), "big"))


@dataclass
class Incoming:
    """A request as the router got it."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    budget: str = ""  # the tenant's budget state when past a threshold (warn, soft), as the router read it
    measured: bool = False  # counted in the router's metrics as an answer for a model (``Router._measured``)

    def header(self, name: bytes) -> str | None:
        """The first value of a header (``name`` lower-case)."""
        for key, value in self.headers:
            if key == name:
                return value.decode("latin-1")
        return None


@dataclass
class Answer:
    """What the client is sent."""

    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None  # a streamed answer's body (server-sent events), instead of ``body``


@dataclass
class Tries:
    """How a request went: replicas tried, and whether the answering replica answered that model version
    for the first time (it likely loaded the model for it: a rollout leaves that time out of its p99)."""

    count: int = 0
    first: bool = False


@dataclass
class Pinned:
    """An OpenAI body as the router sends it on (see ``Router._pin_body_model``)."""

    body: bytes
    key: str
    route: Route | None
    mirror: bytes | None
    stream: bool
    include_usage: bool = False  # a stream that asked for its usage chunk (stream_options.include_usage)


def new_request_id() -> str:
    """An id for a request that came without ``X-Request-Id``: 32 hex digits, unique in this process (a count)
    and across processes (a random half), as a uuid4's hex is but cheaper (a count, not the OS's randomness)."""
    return f"{_ID_PREFIX}{next(_ID_COUNT) & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def error_answer(error: ShardlineError, openai: bool, request_id: str) -> Answer:
    """The router's own error, in the protocol's form (V2 ``{"error": ...}``, OpenAI's ``{"error": {...}}``)."""
    status, extra = error_status(error)
    body = (openai_error_body if openai else v2_error_body)(str(error), status, error.code, error.param)
    headers = [(b"content-type", b"application/json"), (REQUEST_ID, request_id.encode("latin-1"))]
    headers += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
    return Answer(status, headers, orjson.dumps(body))


def json_answer(status: int, content: Any) -> Answer:
    return Answer(status, [(b"content-type", b"application/json")], orjson.dumps(content))
