"""Tenants' quotas held in Redis for every router together (``SHARDLINE_TENANCY_QUOTA_STORE``).

One router holds a tenant's quotas in its own process (``admission.TenantGate``, ``generation.LlmGate``); N
routers doing that give a tenant N times its quota. With a quota store, every router holds them in one Redis:

- **rate** (``rate.requests_per_second``, ``burst``): a token bucket in a hash, refilled on Redis's own clock
  (``TIME``) by a Lua script (EVALSHA). A router takes a small batch of tokens at a time, its **local
  allowance** (``allowance``: at most 50 ms of the rate, at most ``MAX_ALLOWANCE``, at most the burst), and
  admits from it without asking Redis. Every request admitted was a token taken from the one bucket, so over
  any time the total is at most ``burst + rate * t`` plus the tokens routers hold unspent:
  **the global overshoot is at most N x (allowance - 1) requests** (N routers), and none in the long run.
- **concurrency** (``max_concurrent``): a lease per request, a member of a sorted set scored by its expiry
  (``LEASE_TTL_S``); a router renews the leases it holds every ``LEASE_TTL_S / 3``, so a router that dies
  gives its slots back within ``LEASE_TTL_S``. Rate and concurrency are taken by one script, atomically.
- **LLM tokens** (``tokens_per_minute``): a token bucket like the rate's; a generation starts when it holds at
  least one token, and the tokens a stream reports are taken as they come (a debt flushed to Redis at once,
  in the background, so the bucket can go below zero by the tokens in flight: a stream stops when this
  router's view of the bucket is empty, as with one router). **streams** (``max_streams``): leases as above.

nginx's fast lane in front of a router holds rate and concurrency in the same Redis with these same scripts
(``lane_store``: their text and SHA1 written into its settings; online/router/front_lane.lua); it passes LLM
streams on to the router, which holds their tokens and streams here.

**Redis unreachable** (refused, reset, or no answer within ``TIMEOUT_S``): the router does not fail the
request. It holds 1/N of each quota in its own process (``SHARDLINE_TENANCY_QUOTA_STORE_ROUTERS`` = N,
``worker_share``), logs the outage once (a warning; an info line when Redis answers again), counts each
request so admitted (``shardline_router_quota_store_fallbacks_total``) and tries Redis again after
``RETRY_S``. A request admitted through Redis is never failed by Redis going away: giving its lease back is
best effort (the lease expires by itself).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import uuid
from dataclasses import replace
from typing import Any, Callable
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.exceptions import RedisError

from shardline.errors import RateLimited
from shardline.online.admission import TenantGate, retry_after, worker_share
from shardline.online.generation import LlmGate
from shardline.online.tenants import Tenant

log = logging.getLogger("shardline.router.quotas")

LEASE_TTL_S = 30.0  # a dead router's concurrency and stream slots come back within this
TIMEOUT_S = 0.25  # a Redis call that takes longer counts as Redis unreachable
RETRY_S = 1.0  # how long a router holds quotas locally before trying Redis again
MAX_ALLOWANCE = 16  # the most rate tokens a router takes at a time
PREFIX = "shardline:quota:"

# Rate and concurrency together. KEYS: the rate bucket, the leases. ARGV: rate, burst, tokens wanted (0: none),
# max leases (0: no concurrency quota), the lease, its TTL in ms. Returns {status, value}:
# status >= 0: admitted, `status` tokens taken; -1: at max_concurrent (value: leases held);
# -2: no token (value: the seconds until one is there).
ADMIT = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local most = tonumber(ARGV[4])
if most > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
  local held = redis.call('ZCARD', KEYS[2])
  if held >= most then return {-1, tostring(held)} end
end
local got = 0
local want = tonumber(ARGV[3])
if want > 0 then
  local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
  local now = now_ms / 1000
  local b = redis.call('HMGET', KEYS[1], 'tokens', 'at')
  local tokens, at = tonumber(b[1]), tonumber(b[2])
  if tokens == nil or at == nil then tokens, at = burst, now end
  if now > at then tokens, at = math.min(burst, tokens + (now - at) * rate), now end
  got = math.min(want, math.floor(tokens))
  if got < 1 then
    redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(at))
    return {-2, tostring((1 - tokens) / rate)}
  end
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - got), 'at', tostring(at))
  redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 60000)
end
if most > 0 then
  redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[6]), ARGV[5])
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[6]) * 2)
end
return {got, '0'}
"""

# A token bucket charged ``count`` (it may go below zero: the tokens a stream generated are spent whatever
# the bucket holds). KEYS: the bucket. ARGV: rate, burst, count. Returns the tokens left (a string).
CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, burst, count = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens, at = tonumber(b[1]), tonumber(b[2])
if tokens == nil or at == nil then tokens, at = burst, now end
if now > at then tokens, at = math.min(burst, tokens + (now - at) * rate), now end
tokens = math.max(tokens - count, -burst)
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(at))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 60000)
return tostring(tokens)
"""

# Leases renewed. KEYS: a lease set. ARGV: TTL in ms, then the leases (only those still there are renewed).
RENEW = """
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_ms, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 2)
return #ARGV - 1
"""


def allowance(requests_per_second: float, burst: int) -> int:
    """The rate tokens one router takes from Redis at a time: 50 ms of the rate, at least 1, at most
    ``MAX_ALLOWANCE`` and the burst (the global overshoot is at most routers x (allowance - 1))."""
    return max(1, min(MAX_ALLOWANCE, burst, math.floor(requests_per_second * 0.05)))


def key(tenant: str, quota: str) -> str:
    """The Redis key of a tenant's quota (``rate``, ``inflight``, ``tokens``, ``streams``)."""
    return f"{PREFIX}{{{tenant}}}:{quota}"  # one hash slot per tenant: its keys go to one script


def lane_store(url: str, routers: int) -> dict[str, Any]:
    """What nginx's fast lane (online/router/front_lane.lua) needs to hold the quotas in the same Redis with the
    same scripts: the server (host, port, db, credentials), N, the lease TTL, how long to hold quotas locally after
    an error, and ``ADMIT`` and ``RENEW`` with their SHA1 (the lane runs them by EVALSHA; one copy of their text).

    Raises:
        ValueError: a ``rediss://`` URL (the lane speaks plain TCP to Redis; see ``lane_reaches``).
    """
    if not lane_reaches(url):
        raise ValueError(f"nginx's lane cannot reach the quota store {url} (TLS)")
    parts = urlsplit(url)
    path = parts.path.strip("/")
    return {"host": parts.hostname or "127.0.0.1", "port": parts.port or 6379, "db": int(path) if path else 0,
            "username": unquote(parts.username) if parts.username else None,
            "password": unquote(parts.password) if parts.password else None,
            "routers": routers, "lease_ttl_ms": int(LEASE_TTL_S * 1000), "retry": RETRY_S,
            "admit": ADMIT, "admit_sha": hashlib.sha1(ADMIT.encode()).hexdigest(),
            "renew": RENEW, "renew_sha": hashlib.sha1(RENEW.encode()).hexdigest()}


def lane_reaches(url: str) -> bool:
    """Whether nginx's lane can hold quotas in this store: plain ``redis://`` (not TLS, ``rediss://``)."""
    return urlsplit(url).scheme == "redis"


class QuotaStore:
    """Every tenant's quotas in one Redis, for all routers (see the module docstring)."""

    def __init__(self, url: str, routers: int, clock: Callable[[], float],
                 registry: CollectorRegistry | None = None) -> None:
        self.url = url
        self.routers = routers
        self.clock = clock
        self.redis = aioredis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S,
                                             retry_on_timeout=False, health_check_interval=0)
        self._admit = self.redis.register_script(ADMIT)
        self._charge = self.redis.register_script(CHARGE)
        self._renew = self.redis.register_script(RENEW)
        self._allowance: dict[str, int] = {}  # tenant -> rate tokens this router holds
        self._refilling: set[str] = set()  # tenants whose allowance a request is refilling from Redis now
        self._leases: dict[str, set[str]] = {}  # lease set key -> the leases this router holds there
        self._local: dict[str, TenantGate] = {}  # Redis unreachable: 1/N of the quotas here
        self._local_llm: dict[str, LlmGate] = {}
        self._down_until: float | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._renewer: asyncio.Task[None] | None = None
        self.fallbacks = Counter("shardline_router_quota_store_fallbacks_total",
                                 "Requests admitted on this router's share of a quota while Redis was unreachable",
                                 registry=registry)
        self.up = Gauge("shardline_router_quota_store_up", "Whether the quota store (Redis) answered last",
                        registry=registry)
        self.up.set(1)

    # -- Redis reachable or not --------------------------------------------------------------

    def _reachable(self) -> bool:
        return self._down_until is None or self.clock() >= self._down_until

    def _lost(self, error: BaseException) -> None:
        if self._down_until is None:
            log.warning("quota store %s unreachable (%s): each router holds 1/%d of every quota until it answers",
                        self.url, error, self.routers)
            self.up.set(0)
        self._down_until = self.clock() + RETRY_S

    def _answered(self) -> None:
        if self._down_until is not None:
            log.info("quota store %s answers again: quotas are shared again", self.url)
            self._down_until = None
            self.up.set(1)
        if self._renewer is None:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_leases())

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        async with asyncio.timeout(TIMEOUT_S * 2):
            return await script(keys=keys, args=args)

    # -- rate and concurrency ----------------------------------------------------------------

    async def admit(self, tenant: Tenant) -> "Held":
        """Take one of the tenant's concurrent requests and a token of its rate, or refuse.

        Raises:
            RateLimited: over ``max_concurrent`` or the rate (the same messages as one router's gate).
        """
        rate, most = tenant.rate, tenant.max_concurrent
        if rate is None and most is None:
            return Held(self, None, None, None)
        if self._reachable():
            name = tenant.name
            # A token of the allowance is taken before the call (other requests run while it waits) and given back
            # if Redis does not admit the request; the tokens Redis gives are added to what the allowance holds then.
            # One request at a time refills the allowance; the others waiting on Redis meanwhile ask for their own
            # token only, so that what a router holds unspent stays under one allowance (a refill per request in
            # flight left dozens stranded when Redis was slow).
            have = self._allowance.get(name, 0)
            mine = rate is not None and have > 0
            if mine:
                self._allowance[name] = have - 1
            refill = rate is not None and not mine and name not in self._refilling
            want = 0 if rate is None or mine else allowance(rate.requests_per_second, rate.burst) if refill else 1
            if want or most is not None:
                lease = uuid.uuid4().hex if most is not None else ""
                leases = key(name, "inflight")
                if refill:
                    self._refilling.add(name)
                try:
                    status, value = await self._call(self._admit, [key(name, "rate"), leases], [
                        rate.requests_per_second if rate else 0, rate.burst if rate else 0, want, most or 0, lease,
                        int(LEASE_TTL_S * 1000)])
                except (RedisError, OSError, asyncio.TimeoutError) as e:
                    self._lost(e)
                    if mine:
                        self._allowance[name] += 1
                else:
                    self._answered()
                    status = int(status)
                    if status == -1:
                        if mine:
                            self._allowance[name] += 1
                        raise RateLimited(
                            f"tenant {name!r} has {int(value)} requests in flight, its max_concurrent; wait for one "
                            "to finish or ask for a larger quota", name, 1, "concurrency")
                    if status == -2:
                        assert rate is not None
                        wait = retry_after(float(value))
                        raise RateLimited(
                            f"tenant {name!r} is over its rate of {rate.requests_per_second:g} requests/s (burst "
                            f"{rate.burst}); retry after {wait} s", name, wait)
                    if want:
                        self._allowance[name] = self._allowance.get(name, 0) + status - 1
                    if most is not None:
                        self._leases.setdefault(leases, set()).add(lease)
                        return Held(self, None, leases, lease)
                    return Held(self, None, None, None)
                finally:
                    if refill:
                        self._refilling.discard(name)
            else:
                return Held(self, None, None, None)  # a token of the allowance, taken above
        gate = self._local_gate(tenant)
        gate.__enter__()
        self.fallbacks.inc()
        return Held(self, gate, None, None)

    def _local_gate(self, tenant: Tenant) -> TenantGate:
        gate = self._local.get(tenant.name)
        if gate is None or gate.tenant is not tenant:
            gate = self._local[tenant.name] = TenantGate(tenant, self.routers, self.clock, lambda *_: None)
        return gate

    def release(self, leases: str, lease: str) -> None:
        """Give a lease back (best effort: a lease Redis does not hear about expires by itself)."""
        held = self._leases.get(leases)
        if held is not None:
            held.discard(lease)
        self._later(self.redis.zrem(leases, lease))

    def _later(self, call: Any, timeout: float | None = TIMEOUT_S * 2) -> None:
        async def run() -> None:
            try:
                async with asyncio.timeout(timeout):
                    await call
            except (RedisError, OSError, asyncio.TimeoutError):
                pass  # the lease expires by itself

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _renew_leases(self) -> None:
        while True:
            await asyncio.sleep(LEASE_TTL_S / 3)
            for leases, held in list(self._leases.items()):
                if not held:
                    continue
                try:
                    await self._call(self._renew, [leases], [int(LEASE_TTL_S * 1000), *held])
                except (RedisError, OSError, asyncio.TimeoutError):
                    break  # tried again next round; the requests go on whatever happens

    # -- LLM tokens and streams --------------------------------------------------------------

    async def open_llm(self, tenant: Tenant) -> LlmGate:
        """Take one of the tenant's streams, refusing when its token bucket is empty (``LlmGate.open(0)``).

        Raises:
            RateLimited: at ``max_streams``, or no token left this minute.
        """
        tpm, most = tenant.tokens_per_minute, tenant.max_streams
        if (tpm is None and most is None) or not self._reachable():
            return await self._open_local(tenant)
        name = tenant.name
        lease = uuid.uuid4().hex if most is not None else ""
        leases = key(name, "streams")
        try:
            tokens = None
            if tpm is not None:
                tokens = float(await self._call(self._charge, [key(name, "tokens")], [tpm / 60.0, tpm, 0]))
                if tokens < 1:
                    wait = retry_after((1 - tokens) / (tpm / 60.0))
                    raise RateLimited(f"tenant {name!r} is over its {tpm} tokens per minute; retry after {wait} s",
                                      name, wait, "tokens")
            if most is not None:
                status, value = await self._call(self._admit, [key(name, "rate"), leases],
                                                 [0, 0, 0, most, lease, int(LEASE_TTL_S * 1000)])
                if int(status) == -1:
                    raise RateLimited(f"tenant {name!r} has {int(value)} generations in flight, its max_streams; wait "
                                      "for one to finish or ask for a larger quota", name, 1, "streams")
                self._leases.setdefault(leases, set()).add(lease)
        except (RedisError, OSError, asyncio.TimeoutError) as e:
            self._lost(e)
            return await self._open_local(tenant)
        self._answered()
        return SharedLlmGate(self, tenant, tokens, leases if most is not None else None, lease)

    async def _open_local(self, tenant: Tenant) -> LlmGate:
        gate = self._local_llm.get(tenant.name)
        if gate is None or gate.tenant.name != tenant.name or gate.tenant.models is not tenant.models:
            share = replace(
                tenant,
                tokens_per_minute=None if tenant.tokens_per_minute is None
                else worker_share(tenant.tokens_per_minute, self.routers),
                max_streams=None if tenant.max_streams is None else worker_share(tenant.max_streams, self.routers))
            gate = self._local_llm[tenant.name] = LlmGate(share, self.clock)
        gate.open(0)
        if tenant.tokens_per_minute is not None or tenant.max_streams is not None:
            self.fallbacks.inc()
        return gate

    async def close(self) -> None:
        """Stop renewing leases, let the releases under way finish, close the connections."""
        if self._renewer is not None:
            self._renewer.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1)
        await self.redis.aclose()


class Held:
    """One admitted request's hold on its tenant's rate and concurrency (``__exit__`` gives it back)."""

    __slots__ = ("store", "gate", "leases", "lease")

    def __init__(self, store: QuotaStore, gate: TenantGate | None, leases: str | None, lease: str | None) -> None:
        self.store = store
        self.gate = gate
        self.leases = leases
        self.lease = lease

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        if self.gate is not None:
            self.gate.__exit__(None, None, None)
        elif self.leases is not None and self.lease is not None:
            self.store.release(self.leases, self.lease)


class SharedLlmGate(LlmGate):
    """One generation's hold on its tenant's streams and tokens in Redis: ``spend`` charges the shared bucket
    (in the background; the stream stops when this router's last view of it is empty), ``close`` gives the
    stream's lease back."""

    __slots__ = ("store", "tokens", "debt", "flushing", "leases", "lease")

    def __init__(self, store: QuotaStore, tenant: Tenant, tokens: float | None, leases: str | None,
                 lease: str) -> None:
        super().__init__(tenant, store.clock)
        self.bucket = None  # type: ignore[misc]  # mypy misreads the base class's slot; the shared bucket is Redis's
        self.store = store
        self.tokens = tokens  # the bucket as last seen (None: no token quota)
        self.debt = 0  # tokens spent here and not yet charged in Redis
        self.flushing = False
        self.leases = leases
        self.lease = lease

    def open(self, prompt_tokens: int) -> None:  # opened by QuotaStore.open_llm
        return None

    def spend(self, tokens: int) -> bool:
        if self.tokens is None or not tokens:
            return True
        enough = self.tokens >= tokens
        self.tokens -= tokens
        self.debt += tokens
        if not self.flushing:
            self.flushing = True
            self.store._later(self._flush(), None)
        return enough

    async def _flush(self) -> None:
        tpm = self.tenant.tokens_per_minute
        assert tpm is not None
        try:
            while self.debt:
                debt, self.debt = self.debt, 0
                try:
                    left = float(await self.store._call(self.store._charge, [key(self.tenant.name, "tokens")],
                                                        [tpm / 60.0, tpm, debt]))
                except (RedisError, OSError, asyncio.TimeoutError) as e:
                    self.store._lost(e)
                    return
                self.tokens = left - self.debt
        finally:
            self.flushing = False

    def close(self) -> None:
        if self.leases is not None:
            self.store.release(self.leases, self.lease)
