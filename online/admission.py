"""Admission decisions as pure functions: state and time in, decision out.

- ``take_token``: a tenant's token bucket (rate and burst); how long to wait when empty.
- ``admits``: whether a model's queue takes one more request of a priority class; the
  lower the class, the sooner it is shed (low at half the capacity, normal at 80%,
  high only when the queue is full), so overload sheds the lowest priority first.
- ``retry_after``: the whole seconds a client is told to wait (``Retry-After``).
- ``should_unload``: whether an idle model is scaled to zero.
- ``runs_inline``: whether a batch is scored on the event loop rather than a thread.
- ``worker_share``: one server process's share of a tenant's quota.

Nothing here reads a clock, a socket or a setting: the caller passes them in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from shardline.online.tenants import Priority

# Share of a model's queue capacity that a request of each class may fill.
SHED_SHARE: Mapping[Priority, float] = {"high": 1.0, "normal": 0.8, "low": 0.5}


@dataclass(frozen=True)
class TokenBucket:
    """Tokens left and when they were counted (seconds on the caller's monotonic clock)."""

    tokens: float
    updated: float


def take_token(
    bucket: TokenBucket | None, now: float, rate: float, burst: int
) -> tuple[TokenBucket, float]:
    """Take one token from a bucket refilled at ``rate`` per second up to ``burst``.

    A tenant's first request finds a full bucket (``bucket`` None).

    Returns:
        The bucket after the attempt, and 0.0 when a token was taken, else the
        seconds until one will be there (nothing is taken then).
    """
    if rate <= 0 or burst < 1:
        raise ValueError(f"a token bucket needs rate > 0 and burst >= 1, got rate={rate}, burst={burst}")
    if bucket is None:
        tokens = float(burst)
    else:
        tokens = min(float(burst), bucket.tokens + max(0.0, now - bucket.updated) * rate)
    if tokens >= 1.0:
        return TokenBucket(tokens - 1.0, now), 0.0
    return TokenBucket(tokens, now), (1.0 - tokens) / rate


def queue_limit(capacity: int, priority: Priority) -> int:
    """How many queued requests a model may hold when one of ``priority`` arrives (at least 1)."""
    return max(1, math.floor(capacity * SHED_SHARE[priority]))


def admits(queued: int, capacity: int, priority: Priority) -> bool:
    """Whether a request of ``priority`` may join a queue that holds ``queued`` requests."""
    return queued < queue_limit(capacity, priority)


def drain_seconds(queued_rows: int, rows_per_second: float | None) -> float:
    """How long the rows queued now take to score at the measured rate (unknown rate: 1 s)."""
    if not rows_per_second or rows_per_second <= 0:
        return 1.0
    return queued_rows / rows_per_second


def retry_after(seconds: float) -> int:
    """Whole seconds for a ``Retry-After`` header: at least 1, rounded up."""
    if not math.isfinite(seconds):
        return 60
    return max(1, math.ceil(seconds))


def should_unload(idle_seconds: float, idle_timeout: float, busy: bool, loaded: bool) -> bool:
    """Whether a model is scaled to zero: loaded, nothing queued or running, idle past its time-out.

    A time-out of 0 keeps the model loaded.
    """
    return loaded and not busy and idle_timeout > 0 and idle_seconds >= idle_timeout


def runs_inline(rows: int, seconds_per_row: float | None, budget_s: float) -> bool:
    """Whether ``rows`` go to the model on the event loop: its measured time for them fits the budget.

    A model not measured yet (``seconds_per_row`` None) goes to a thread, so a slow model never
    blocks the loop, not even once; a budget of 0 sends everything to threads. The per-row time is
    measured on small batches, so it over-estimates large ones (on the safe side).
    """
    return seconds_per_row is not None and budget_s > 0 and rows * seconds_per_row <= budget_s


def worker_share(quota: int, workers: int) -> int:
    """One of ``workers`` server processes' share of a whole-number quota (burst, max_concurrent).

    Rounded up, so a quota never becomes 0 (a tenant allowed 1 request in flight may have one
    in each process: the total may exceed the quota by at most ``workers - 1``).
    """
    return max(1, math.ceil(quota / max(1, workers)))
