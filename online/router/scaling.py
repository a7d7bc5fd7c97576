"""How many replicas a group wants (pure), for an autoscaler outside (KEDA, an HPA) and for the
router's own local replicas.

- ``wanted(demand, policy)``: ``ceil(demand / target_in_flight)`` within ``[min, max]``, where
  demand is the requests being answered plus those waiting for a replica; at least one while
  there is any demand (so a group scaled to zero comes back for the first request).
- ``Scaler``: the decisions over time, as Kubernetes' HPA makes them. Every tick it records what
  is wanted; it scales up to the lowest figure wanted over the last ``up_delay_s`` (a burst
  shorter than that starts nothing), at once from zero (a request is waiting); it scales down to
  the highest figure wanted over the last ``down_delay_s`` (load must stay low that long, so a
  lull does not stop a replica that the next burst needs).
- ``Activator``: with the group at zero, requests wait in a bounded queue while a replica starts
  (the demand that starts it), and go on as soon as one is ready; none fails for it unless the
  queue is full or its deadline passes.
"""

from __future__ import annotations

import asyncio
import collections
import math
from dataclasses import dataclass, field
from typing import Deque


@dataclass(frozen=True)
class ScalePolicy:
    """The bounds and pace of scaling (``SHARDLINE_ROUTER_*`` settings; docs/routing.md)."""

    target_in_flight: float = 4.0
    min_replicas: int = 1
    max_replicas: int = 1
    up_delay_s: float = 2.0
    down_delay_s: float = 60.0


def wanted(demand: float, policy: ScalePolicy) -> int:
    """Replicas wanted for ``demand`` requests in flight or waiting (see the module docstring)."""
    figure = math.ceil(demand / policy.target_in_flight) if demand > 0 else 0
    return max(policy.min_replicas, min(policy.max_replicas, figure))


@dataclass
class Scaler:
    """Replicas to run, decided from the figures wanted over time (see the module docstring)."""

    policy: ScalePolicy
    _seen: Deque[tuple[float, int]] = field(default_factory=collections.deque)
    _since: float | None = None  # when the first figure was recorded

    def observe(self, now: float, demand: float) -> int:
        """Record the figure wanted for ``demand`` now; returns it."""
        figure = wanted(demand, self.policy)
        self._seen.append((now, figure))
        if self._since is None:
            self._since = now
        horizon = now - max(self.policy.up_delay_s, self.policy.down_delay_s)
        while len(self._seen) > 1 and self._seen[0][0] < horizon:
            self._seen.popleft()
        return figure

    def decide(self, now: float, current: int) -> int:
        """How many replicas should run now, given ``current`` run."""
        if not self._seen:
            return max(self.policy.min_replicas, min(self.policy.max_replicas, current))
        latest = self._seen[-1][1]
        if current == 0 and latest > 0:
            return latest  # a request waits: no delay from zero
        up = min(f for t, f in self._seen if t >= now - self.policy.up_delay_s) if self.policy.up_delay_s else latest
        if up > current:
            return up
        assert self._since is not None
        if now - self._since < self.policy.down_delay_s:
            return current  # not watched long enough to know the load stayed low
        down = max(f for t, f in self._seen if t >= now - self.policy.down_delay_s)
        return min(current, down) if down < current else current


class Activator:
    """Requests held while no replica is up and one is starting (a group scaled to zero): at most
    ``limit`` at a time, each until a replica becomes available or its deadline passes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.waiting: collections.Counter[str] = collections.Counter()  # by model
        self._ready = asyncio.Event()

    @property
    def total(self) -> int:
        """Requests held now."""
        return sum(self.waiting.values())

    def notify(self) -> None:
        """A replica became available: wake every request held."""
        self._ready.set()
        self._ready = asyncio.Event()

    async def wait(self, model: str, timeout_s: float) -> bool:
        """Hold a request until a replica may be available; False when the queue is full or the time ran out."""
        if self.total >= self.limit or timeout_s <= 0:
            return False
        self.waiting[model] += 1
        try:
            async with asyncio.timeout(timeout_s):
                await self._ready.wait()
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self.waiting[model] -= 1
            if not self.waiting[model]:
                del self.waiting[model]
