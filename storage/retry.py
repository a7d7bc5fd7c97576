"""Retry storage work that failed for a passing reason; never retry what will fail again.

Pure decisions (:func:`is_transient`, :func:`backoff_delay`) and one small loop
(:func:`call_with_retries`) whose clock and randomness the caller can set, so tests
run them without sleeping. Transient: the network or the store is briefly unwell
(connection reset, time-out, throttling, 5xx). Permanent: the data or the request is
wrong (a corrupt file, a missing object, no permission): retrying only delays the
quarantine or the error the user has to act on.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from shardline.errors import ShardlineError

T = TypeVar("T")
logger = logging.getLogger("shardline.retry")

# errno values a store uses for "busy, try again" (s3fs maps SlowDown/503 to EBUSY,
# 500 InternalError to EREMOTEIO) and the network's own transient failures.
TRANSIENT_ERRNOS = frozenset(
    {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
     errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, getattr(errno, "EREMOTEIO", 121)}
)
# Names of exception classes (botocore, aiohttp, s3fs, fsspec) that mean the same, matched
# by name so this module imports none of those packages.
TRANSIENT_NAMES = frozenset(
    {"ThrottlingException", "Throttling", "SlowDown", "RequestLimitExceeded", "ServiceUnavailable",
     "RequestTimeout", "RequestTimeoutException", "InternalError", "EndpointConnectionError",
     "ConnectTimeoutError", "ReadTimeoutError", "ClientConnectionError", "ServerDisconnectedError",
     "ClientPayloadError", "ClientOSError", "IncompleteRead", "ResponseParserError", "FSTimeoutError"}
)
TRANSIENT_WORDS = ("slowdown", "slow down", "throttl", "rate exceeded", "try again", "temporarily unavailable")


def is_transient(error: BaseException) -> bool:
    """True when ``error`` is a passing fault of the network or the store, worth a retry.

    Shardline's own errors (a corrupt shard, a schema mismatch, a missing model) are
    never transient, nor are ``FileNotFoundError`` and ``PermissionError``.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (ShardlineError, FileNotFoundError, PermissionError, IsADirectoryError)):
            return False
        if isinstance(current, (ConnectionError, TimeoutError)):
            return True
        names = {cls.__name__ for cls in type(current).__mro__}
        if names & TRANSIENT_NAMES:
            return True
        if isinstance(current, OSError) and current.errno in TRANSIENT_ERRNOS:
            return True
        code = _error_code(current)
        if code in TRANSIENT_NAMES or code in {"500", "502", "503", "504"}:
            return True
        if isinstance(current, OSError) and any(w in str(current).lower() for w in TRANSIENT_WORDS):
            return True
        current = current.__cause__ or current.__context__
    return False


def _error_code(error: BaseException) -> str | None:
    """The service's error code of a botocore ClientError-like exception, if any."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return str(code) if code is not None else None
    return None


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry transient errors."""

    attempts: int = 4
    base_s: float = 0.5
    cap_s: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 0 or self.base_s <= 0 or self.cap_s < self.base_s:
            raise ValueError(
                f"retry policy {self} is inconsistent: attempts >= 0, base_s > 0 and cap_s >= base_s are needed"
            )


def backoff_delay(retry: int, policy: RetryPolicy, uniform: Callable[[], float] = random.random) -> float:
    """Seconds to wait before retry number ``retry`` (0 for the first): full jitter.

    The ceiling doubles each retry from ``base_s`` up to ``cap_s``; the delay is drawn
    uniformly below it, so workers that failed together do not retry together.
    ``uniform`` returns a float in [0, 1).
    """
    if retry < 0:
        raise ValueError(f"retry numbers start at 0, got {retry}")
    ceiling = min(policy.cap_s, policy.base_s * (2 ** min(retry, 60)))
    return ceiling * uniform()


def call_with_retries(
    fn: Callable[[], T],
    policy: RetryPolicy,
    *,
    what: str = "storage call",
    sleep: Callable[[float], None] = time.sleep,
    uniform: Callable[[], float] = random.random,
) -> T:
    """Call ``fn``; on a transient error wait (backoff with jitter) and call again.

    A permanent error, or a transient one after ``policy.attempts`` retries, is raised
    as it is.
    """
    retry = 0
    while True:
        try:
            return fn()
        except Exception as e:
            if retry >= policy.attempts or not is_transient(e):
                raise
            delay = backoff_delay(retry, policy, uniform)
            logger.warning("%s failed (%s: %s); retry %d of %d in %.2f s", what, type(e).__name__, e,
                           retry + 1, policy.attempts, delay)
            sleep(delay)
            retry += 1
