"""Failure decisions of the router (pure: the caller passes the time and the randomness).

- ``Breaker``: one replica's circuit breaker. Closed, it passes requests and counts failures; it
  opens after ``consecutive_failures`` in a row, or when at least ``min_requests`` answers in the
  last ``window_s`` hold more than ``error_rate`` failures. Open, it passes nothing for ``open_s``
  (doubled at each re-open, up to ``max_open_s``); then it is half-open: ``probes`` requests at a
  time go through, ``probes`` successes close it, one failure opens it again.
- ``RetryBudget``: retries stay a bounded share of the traffic (``ratio`` of the requests of the
  last ``window_s``, plus ``min_per_s`` a second so that a quiet router can still retry), so a
  failing replica set is not hit with a multiple of its load (Finagle's and Envoy's retry budgets).
  One budget covers both lanes: nginx's fast lane's requests and retries are ``record``-ed as read.
- ``backoff_s``: exponential backoff with full jitter (a uniform draw up to ``base * 2**attempt``,
  capped), so retries of many callers do not arrive together.
- ``latency_outliers``: which replicas answer so much slower than the others for the same models
  that they should rest (ejected for a while, as Envoy's outlier detection does for errors).
- ``stalled``: whether a replica's oldest try has waited past the stall time with nothing heard from the
  replica since it was sent (then its health is probed: a replica that does not answer is hung).
- ``Deadline``: what is left of a request's time (``X-Shardline-Timeout-Ms``, else the router's
  default); no retry starts past it, and what is left is passed on to the replica.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Deque, Literal

from shardline.online.admission import asked_timeout_s

BreakerState = Literal["closed", "open", "half_open"]


@dataclass(frozen=True)
class BreakerPolicy:
    """When a replica's breaker opens and how it recovers (see the module docstring)."""

    consecutive_failures: int = 5
    error_rate: float = 0.5
    min_requests: int = 20
    window_s: float = 10.0
    open_s: float = 2.0
    max_open_s: float = 30.0
    probes: int = 2


@dataclass
class Breaker:
    """One replica's circuit breaker; every method takes ``now``, seconds on a monotonic clock."""

    policy: BreakerPolicy = field(default_factory=BreakerPolicy)
    state: BreakerState = "closed"
    consecutive: int = 0
    opened_at: float = 0.0
    open_for: float = 0.0
    probing: int = 0  # half-open: probes in flight
    probe_successes: int = 0
    _answers: Deque[tuple[float, bool]] = field(default_factory=collections.deque, repr=False)
    _failed: int = 0  # failures among _answers

    def allows(self, now: float) -> bool:
        """Whether a request may go to the replica now (a half-open breaker counts it as a probe)."""
        if self.state == "open":
            if now - self.opened_at < self.open_for:
                return False
            self.state, self.probing, self.probe_successes = "half_open", 0, 0
        if self.state == "half_open":
            if self.probing >= self.policy.probes:
                return False
            self.probing += 1
        return True

    def closed_to(self, now: float) -> bool:
        """Whether ``allows`` would refuse now; unlike ``allows`` it takes no probe (for ranking replicas)."""
        if self.state == "open":
            return now - self.opened_at < self.open_for
        return self.state == "half_open" and self.probing >= self.policy.probes

    def record(self, ok: bool, now: float) -> None:
        """An answer of the replica: ``ok`` False for a connection failure, a time-out or a 5xx."""
        if self.state == "half_open":
            self.probing = max(0, self.probing - 1)
            if not ok:
                self._open(now, again=True)
                return
            self.probe_successes += 1
            if self.probe_successes >= self.policy.probes:
                self.state, self.consecutive, self.open_for = "closed", 0, 0.0
                self._answers.clear()
                self._failed = 0
            return
        if self.state == "open":
            return  # an answer of a request sent before it opened
        self._answers.append((now, ok))
        self._failed += not ok
        while self._answers and now - self._answers[0][0] > self.policy.window_s:
            self._failed -= not self._answers.popleft()[1]
        self.consecutive = 0 if ok else self.consecutive + 1
        if self.consecutive >= self.policy.consecutive_failures or (
            len(self._answers) >= self.policy.min_requests and self._failed > self.policy.error_rate * len(self._answers)
        ):
            self._open(now, again=False)

    def _open(self, now: float, again: bool) -> None:
        base = self.policy.open_s
        self.open_for = min(self.policy.max_open_s, self.open_for * 2 if again and self.open_for else base)
        self.state, self.opened_at, self.consecutive, self.probing = "open", now, 0, 0
        self._answers.clear()
        self._failed = 0


@dataclass
class RetryBudget:
    """Retries allowed: at most ``ratio`` of the requests of the last ``window_s`` seconds, plus
    ``min_per_s`` a second. Counts are kept per whole second, so memory is bounded by the window."""

    ratio: float = 0.2
    min_per_s: float = 5.0
    window_s: int = 10
    _requests: Deque[list[int]] = field(default_factory=collections.deque, repr=False)  # [second, requests, retries]

    def _bucket(self, now: float) -> list[int]:
        second = int(now)
        while self._requests and self._requests[0][0] <= second - self.window_s:
            self._requests.popleft()
        if not self._requests or self._requests[-1][0] != second:
            self._requests.append([second, 0, 0])
        return self._requests[-1]

    def request(self, now: float) -> None:
        """Count a request (its first try)."""
        self._bucket(now)[1] += 1

    def record(self, now: float, requests: int, retries: int) -> None:
        """Count requests and retries made elsewhere: what nginx's fast lane did since it was last read."""
        bucket = self._bucket(now)
        bucket[1] += requests
        bucket[2] += retries

    def has_room(self, now: float) -> bool:
        """Whether one more retry now stays within the budget."""
        self._bucket(now)
        requests = sum(b[1] for b in self._requests)
        retries = sum(b[2] for b in self._requests)
        return retries + 1 <= self.ratio * requests + self.min_per_s * self.window_s

    def try_retry(self, now: float) -> bool:
        """Take one retry if the budget has one; False when retrying now would pass the budget."""
        if not self.has_room(now):
            return False
        self._bucket(now)[2] += 1
        return True


def backoff_s(attempt: int, draw: float, base_s: float = 0.005, cap_s: float = 0.25) -> float:
    """The wait before retry number ``attempt`` (1 for the first): ``draw`` (uniform in [0, 1)) times
    ``min(cap_s, base_s * 2**(attempt - 1))``: full jitter."""
    if attempt < 1:
        raise ValueError(f"retry attempts count from 1, got {attempt}")
    return draw * min(cap_s, base_s * math.pow(2, attempt - 1))


def stalled(oldest_sent: float | None, heard: float, probed: float, now: float, stall_s: float) -> bool:
    """Whether a replica should have its health probed now: a try sent at ``oldest_sent`` (the oldest still
    waiting for its answer; None: none waits) has waited past ``stall_s``, the replica has answered nothing since
    it was sent (``heard``: its last answer), and it was not probed within ``stall_s`` (``probed``). A replica
    that answers others meanwhile is slow for that request, not hung."""
    if oldest_sent is None or stall_s <= 0 or now - oldest_sent < stall_s:
        return False
    return heard <= oldest_sent and now - probed >= stall_s


@dataclass(frozen=True)
class Deadline:
    """When a request must be answered by, in seconds on the router's monotonic clock."""

    at: float

    @classmethod
    def from_header(cls, value: str | None, now: float, default_s: float, max_s: float) -> "Deadline":
        """The deadline a ``X-Shardline-Timeout-Ms`` value asks for (at most ``max_s``), else ``default_s``
        from now; a value that is not a positive number of milliseconds counts as absent."""
        asked = asked_timeout_s(value)
        seconds = default_s if asked is None else asked
        return cls(now + min(seconds, max_s))

    def left(self, now: float) -> float:
        """Seconds left (negative once it has passed)."""
        return self.at - now

    def header(self, now: float) -> str:
        """What is left, in whole milliseconds, for the replica's ``X-Shardline-Timeout-Ms``."""
        return str(max(1, int(self.left(now) * 1000)))


@dataclass(frozen=True)
class OutlierPolicy:
    """When a replica is ejected for latency (see ``latency_outliers``)."""

    ratio: float = 3.0  # slower than this many times the other replicas' median for the same model
    floor_ms: float = 10.0  # and by at least this much (sub-millisecond jitter ejects nobody)
    min_answers: int = 20  # answers of a model behind each figure compared
    max_fraction: float = 0.34  # of a group's replicas ejected at once, at most (at least one of three)
    eject_s: float = 30.0  # the first ejection; doubled for each one after, up to max_eject_s
    max_eject_s: float = 300.0


def latency_outliers(latency: dict[str, dict[str, tuple[float, int]]], policy: OutlierPolicy) -> list[str]:
    """Replicas to eject for latency, slowest first.

    ``latency`` is, per replica, per model version: (EWMA of answer time in ms, answers). Replicas are
    compared model by model (rendezvous hashing puts models on different replicas, and a slow model
    is no fault of its replica): a replica is an outlier when, for every model it shares with
    another replica (with ``min_answers`` each, at least one such model), its time passes the
    others' median by ``ratio`` and by ``floor_ms``. At most ``max_fraction`` of the replicas are
    returned, rounded down (one of three by default; none of two: half the capacity is too much to
    rest for slowness).
    """
    votes: dict[str, list[bool]] = {}
    models = {m for figures in latency.values() for m in figures}
    for model in models:
        seen = {r: f[model] for r, f in latency.items() if model in f and f[model][1] >= policy.min_answers}
        if len(seen) < 2:
            continue
        for replica, (ewma, _) in seen.items():
            others = sorted(e for r, (e, _) in seen.items() if r != replica)
            middle = others[len(others) // 2] if len(others) % 2 else (others[len(others) // 2 - 1] + others[len(others) // 2]) / 2
            votes.setdefault(replica, []).append(ewma > policy.ratio * middle and ewma - middle > policy.floor_ms)
    slow = [r for r, v in votes.items() if v and all(v)]
    if not slow:
        return []
    cap = math.floor(policy.max_fraction * len(latency))
    worst = {r: max(f[0] for f in latency[r].values()) for r in slow}
    return sorted(slow, key=lambda r: -worst[r])[:cap]
