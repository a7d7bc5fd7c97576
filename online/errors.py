"""The one table that turns domain errors into HTTP status codes (and Retry-After headers).

The data plane, router and batcher raise ``shardline.errors``; the protocol adapters
encode the message in their protocol's error body; the status comes from here only.
The first row whose class matches wins, so subclasses come before their bases.

``shown`` (``shardline.errors``, where the batch tier's OpenAI wire finds it too) is how a
message quotes a value a client sent, cut short.
"""

from __future__ import annotations

import math

from shardline.errors import (
    AccessDenied,
    DeadlineExceeded,
    InferenceFailed,
    InvalidBundle,
    InvalidInput,
    ModelNotFound,
    NotServed,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    RegistryUnreadable,
    RuntimeUnavailable,
    ShardlineError,
    Unauthenticated,
    UnsupportedEncoding,
    shown,  # re-exported: the online tier's modules quote client values with it
)

STATUS_BY_ERROR: tuple[tuple[type[BaseException], int], ...] = (
    (Unauthenticated, 401),  # no key, or not a key of any tenant
    (ModelNotFound, 404),  # no such model/version/alias, or one the tenant may not call (same answer)
    (AccessDenied, 403),  # a model whose own Python code the tenant may not run (tenants file: custom_code)
    (PayloadTooLarge, 413),
    (UnsupportedEncoding, 415),
    (InvalidInput, 400),  # malformed body, wrong shape or datatype, missing input, nulls
    (RateLimited, 429),  # over the tenant's rate or concurrency quota; Retry-After
    (NotServed, 501),  # an endpoint not offered yet (the LLM endpoints)
    (Overloaded, 503),  # shed under overload, lowest priority first; the router's ReplicasUnavailable; Retry-After
    (DeadlineExceeded, 504),  # the request's deadline passed: before a replica answered, or in a replica's queue
    (RuntimeUnavailable, 503),  # the model cannot load on this server
    (RegistryUnreadable, 503),  # the storage refused to read the registry: the client may retry
    (InvalidBundle, 500),  # the registry's bundle is broken (bad manifest, sha256 mismatch)
    (InferenceFailed, 500),  # the model failed on rows that passed its signature check
    (ShardlineError, 500),
)
INTERNAL = 500


def error_status(error: BaseException) -> tuple[int, dict[str, str]]:
    """The HTTP status for an error, and the headers it brings (``Retry-After`` in whole seconds)."""
    status = next((code for kind, code in STATUS_BY_ERROR if isinstance(error, kind)), INTERNAL)
    headers = {}
    wait = getattr(error, "retry_after", None)
    if isinstance(wait, (int, float)) and status in (429, 503):
        headers["Retry-After"] = str(max(1, math.ceil(wait)))
    return status, headers
