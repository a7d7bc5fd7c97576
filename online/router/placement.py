"""Which replica serves a request: rendezvous hashing with bounded loads (pure).

Every model (or request key) ranks the replicas by a hash of (key, replica): the same order on
every router, with no shared state. The first replica in that order whose load is under the
bound takes the request; one over it spills the request to the next in the order, so a hot
model spreads over as few replicas as its load needs, and each replica keeps few models hot.

- ``rank``: the replicas in a key's order (highest score first).
- ``load_bound``: the most in-flight requests a replica may hold before it is passed over:
  ``ceil(c * (total + 1) / n)`` (Mirrokni, Thorup and Zadimoghaddam's bound, as HAProxy's
  ``hash-balance-factor`` and Envoy's ``hash_balance_factor`` apply it), so no replica carries more
  than ``c`` times the mean.
- ``choose``: the replica for one request, given the loads and the replicas to skip (unhealthy,
  already tried).

Why rendezvous rather than a ring of virtual nodes: adding or removing one of N replicas moves
exactly the keys that ranked it first (1/N of them, up to sampling), with no virtual-node count
to tune, and a key's whole order is the natural list of replicas to retry and spill to.
"""

from __future__ import annotations

import hashlib
import math
from typing import Collection, Iterable, Mapping, Sequence

# c: a replica is passed over once it holds more than c times the mean load (the default).
DEFAULT_BALANCE = 1.25


def score(key: str, replica: str) -> int:
    """The rendezvous score of ``replica`` for ``key``: 64 bits of BLAKE2b over both (stable across
    processes and machines, unlike Python's ``hash``)."""
    digest = hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(key: str, replicas: Iterable[str]) -> list[str]:
    """``replicas`` in ``key``'s order: highest score first (ties, which 64 bits make vanishingly
    rare, by name)."""
    return sorted(replicas, key=lambda r: (-score(key, r), r))


def load_bound(total: int, replicas: int, balance: float = DEFAULT_BALANCE) -> int:
    """The in-flight requests a replica may hold and still take one more: ``ceil(balance * (total + 1)
    / replicas)``, at least 1. ``total`` is the load over every replica before this request.

    Raises:
        ValueError: ``balance`` is below 1 (no assignment could meet it) or there are no replicas.
    """
    if balance < 1.0:
        raise ValueError(f"the load balance factor must be at least 1.0, got {balance}")
    if replicas < 1:
        raise ValueError("a load bound needs at least one replica")
    return max(1, math.ceil(balance * (total + 1) / replicas))


def choose(
    order: Sequence[str],
    loads: Mapping[str, int],
    balance: float = DEFAULT_BALANCE,
    skip: Collection[str] = (),
) -> str | None:
    """The replica for one request: the first of ``order`` (a key's ``rank``) not in ``skip`` whose
    load is under the bound over the replicas not skipped. One always is: were every one at the bound,
    their loads would add up to more than the total. None when every replica is skipped.

    Loads missing from ``loads`` count as 0.
    """
    eligible = [r for r in order if r not in skip]
    if not eligible:
        return None
    bound = load_bound(sum(loads.get(r, 0) for r in eligible), len(eligible), balance)
    return next(r for r in eligible if loads.get(r, 0) < bound)
