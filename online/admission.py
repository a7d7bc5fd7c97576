"""Admission decisions: state and time in, decision out.

- ``TokenBucket``: a tenant's rate and burst; how long to wait when empty.
- ``TenantGate``: one tenant's quotas in a server process (concurrent requests and its
  bucket), entered around each request.
- ``admits``: whether a model's queue takes one more request of a priority class; the
  lower the class, the sooner it is shed (low at half the capacity, normal at 80%,
  high only when the queue is full), so overload sheds the lowest priority first.
- ``retry_after``: the whole seconds a client is told to wait (``Retry-After``).
- ``should_unload``: whether an idle model is scaled to zero.
- ``runs_inline``: whether a batch is scored on the event loop rather than a thread, and
  ``next_seconds_per_row``: the measured speed that decides it.
- ``worker_share``: one server process's share of a tenant's quota.
- ``asked_timeout_s``: the seconds a request's ``X-Shardline-Timeout-Ms`` asks for (the router's
  deadline, and each replica's: a request whose caller has given up is not scored).

Nothing here reads a clock, a socket or a setting: the caller passes them in (a gate is
given its clock).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

from shardline.errors import RateLimited
from shardline.online.tenants import Tenant
from shardline.tenants import Priority

# Share of a model's queue capacity that a request of each class may fill.
SHED_SHARE: Mapping[Priority, float] = {"high": 1.0, "normal": 0.8, "low": 0.5}


class TokenBucket:
    """Tokens refilled at ``rate`` a second up to ``burst``; full when made. Times are seconds on
    the caller's monotonic clock."""

    __slots__ = ("rate", "burst", "tokens", "updated")

    def __init__(self, rate: float, burst: int) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"a token bucket needs rate > 0 and burst >= 1, got rate={rate}, burst={burst}")
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.updated: float | None = None

    def take(self, now: float, count: float = 1.0) -> float:
        """Take ``count`` tokens: 0.0 when they were taken, else the seconds until they will be there
        (nothing is taken then; more than ``burst`` never will: infinity). A clock that steps back adds nothing."""
        tokens, updated = self.tokens, self.updated
        if updated is not None and now > updated:
            tokens = min(self.burst, tokens + (now - updated) * self.rate)
        if updated is None or now > updated:
            self.updated = now
        if tokens >= count:
            self.tokens = tokens - count
            return 0.0
        self.tokens = tokens
        return math.inf if count > self.burst else (count - tokens) / self.rate

    def wait(self, now: float, count: float = 1.0) -> float:
        """The seconds until ``count`` tokens are there (0.0: they are now), taking none."""
        waited = self.take(now, count)
        if waited == 0.0:
            self.tokens += count
        return waited

    def spend(self, now: float, count: float) -> bool:
        """Take ``count`` tokens that were used already (an LLM's tokens, generated or read), going below zero when
        fewer are there, down to ``-burst``, as the shared quota store's ``CHARGE`` does; whether all ``count`` were
        there. The debt is waited out before the next ``take``: a router, which charges an answer's tokens once it
        has them, let a tenant of 300 tokens a minute use 1,166 in 10 s when the bucket stopped at zero."""
        if self.take(now, count) == 0.0:
            return True
        self.tokens = max(self.tokens - count, -self.burst)
        return False


class TenantGate:
    """One tenant's quotas in this server process, entered around each of its requests.

    Entering takes one of its concurrent requests and a token of its rate, or raises
    ``RateLimited`` (and calls ``refused(tenant, quota)``, ``quota`` "concurrency" or "rate");
    leaving gives the request back. With ``workers`` server processes the gate holds this
    process's share of each quota (``worker_share``; the rate divided evenly).
    """

    __slots__ = ("tenant", "in_flight", "max_concurrent", "bucket", "clock", "refused")

    def __init__(self, tenant: Tenant, workers: int, clock: Callable[[], float],
                 refused: Callable[[str, str], None]) -> None:
        self.tenant = tenant
        self.in_flight = 0
        self.max_concurrent = None if tenant.max_concurrent is None else worker_share(tenant.max_concurrent, workers)
        rate = tenant.rate
        self.bucket = None if rate is None else TokenBucket(rate.requests_per_second / workers,
                                                            worker_share(rate.burst, workers))
        self.clock = clock
        self.refused = refused

    def __enter__(self) -> None:
        if self.max_concurrent is not None and self.in_flight >= self.max_concurrent:
            name = self.tenant.name
            self.refused(name, "concurrency")
            raise RateLimited(
                f"tenant {name!r} has {self.in_flight} requests in flight, its max_concurrent; wait for one to "
                "finish or ask for a larger quota", name, 1, "concurrency",
            )
        if self.bucket is not None:
            wait = self.bucket.take(self.clock())
            if wait > 0:
                name, rate = self.tenant.name, self.tenant.rate
                assert rate is not None
                self.refused(name, "rate")
                raise RateLimited(
                    f"tenant {name!r} is over its rate of {rate.requests_per_second:g} requests/s (burst "
                    f"{rate.burst}); retry after {retry_after(wait)} s", name, retry_after(wait),
                )
        self.in_flight += 1

    def __exit__(self, *exc: object) -> None:
        self.in_flight -= 1


def asked_timeout_s(value: str | None) -> float | None:
    """The seconds an ``X-Shardline-Timeout-Ms`` value asks for; None for no value, or one that is not a
    positive, finite number of milliseconds (such a value counts as absent, at the router and the replicas)."""
    if not value:
        return None
    try:
        asked = float(value) / 1000.0
    except ValueError:
        return None
    return asked if asked > 0 and math.isfinite(asked) else None


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


SPEED_SMOOTHING = 0.2  # weight of a new measurement in the smoothed seconds per row
SPEED_MAX_STEP = 2.0  # one measurement may at most double the estimate


def next_seconds_per_row(previous: float | None, measured: float) -> float:
    """The smoothed seconds per row after one more measurement (the first sets it).

    An exponential average whose rise is bounded: one measurement counts as at most twice the
    estimate, so a single slow call (a garbage collection or page faults inside it) moves it
    by at most 20% and a fast model stays on the event loop; a model that really became slower
    is followed within a few calls (x1.2 per call). Falls are followed at once.
    """
    if previous is None:
        return measured
    return previous + SPEED_SMOOTHING * (min(measured, SPEED_MAX_STEP * previous) - previous)


def worker_share(quota: int, workers: int) -> int:
    """One of ``workers`` server processes' share of a whole-number quota (burst, max_concurrent).

    Rounded up, so a quota never becomes 0 (a tenant allowed 1 request in flight may have one
    in each process: the total may exceed the quota by at most ``workers - 1``).
    """
    return max(1, math.ceil(quota / max(1, workers)))
