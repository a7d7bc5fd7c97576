"""The router's request path: authenticate, ask the tenant's budget (hard: 429; soft: the model's cheaper group,
``router.yaml``'s ``fallbacks:``), hold the tenant's quotas, pin the version (a rollout's
pick for the caller, ``rollouts``), pick a replica (held by the activator while one starts from
zero, ``scaling``), forward (hedged when set), retry elsewhere within the budget and the deadline,
and mirror a shadow copy in the background.

``Router.handle(Incoming) -> Answer`` is protocol-free (no web framework): the ASGI adapter
(``online/router/service.py``) reads the request into an ``Incoming`` and writes the ``Answer``. The
decisions are the pure functions of ``placement``, ``health`` and ``rollouts`` over the state of
the ``ReplicaSet`` and the ``RolloutBook``; ``upstream`` is the HTTP/1.1 client to the replicas;
``messages`` has the request and answer types, request ids and the router's own answers.

What a replica is sent: the request as the client sent it (body bytes untouched but for an
OpenAI body's ``model``, pinned to the version the router resolved), with ``Authorization:
Bearer <router key>``, ``X-Shardline-Tenant: <tenant>`` (a client's own is dropped),
``X-Shardline-Timeout-Ms`` (what is left of the deadline) and ``X-Request-Id``. What the client
gets: the replica's answer as it came (status, body, Content-Encoding), or the router's own error
in the protocol's form.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import random
import re
import time
from typing import Awaitable, Callable
from urllib.parse import urlsplit

import orjson

from shardline.agreement import compare
from shardline.bundle import ModelRef
from shardline.errors import (
    BudgetExceeded,
    DeadlineExceeded,
    RateLimited,
    ReplicasUnavailable,
    ShardlineError,
)
from shardline.online.admission import TenantGate
from shardline.online.bodies import decode_body
from shardline.online.budgets import BudgetBoard
from shardline.online.errors import error_status, shown
from shardline.online.generation import LlmGate
from shardline.online.headers import (
    BUDGET_HEADER,
    FALLBACK_HEADER,
    GATED_HEADER,
    REQUEST_ID_HEADER,
    ROUTE_KEY_HEADER,
    TENANT_HEADER,
    TIMEOUT_HEADER,
    VARIANT_HEADER,
)
from shardline.online.models import ModelDirectory
from shardline.online.protocols.forms import openai_form
from shardline.online.quota_store import Held, QuotaStore
from shardline.online.router.compare import decode_answer
from shardline.online.router.health import Deadline, RetryBudget, backoff_s
from shardline.online.router.messages import (
    REQUEST_ID,
    Answer,
    Incoming,
    Pinned,
    Tries,
    error_answer,
    json_answer,
    new_request_id,
)
from shardline.online.router.metrics import RouterMetrics
from shardline.online.router.placement import choose
from shardline.online.router.replicas import Replica, ReplicaSet
from shardline.online.router.rollouts import RolloutBook, Route
from shardline.online.router.scaling import Activator
from shardline.online.router.streams import GENERATION_PATHS, PROMPT_TOKENS_HEADER, affinity, metered
from shardline.online.router.upstream import Relay, UpstreamFailed, UpstreamPool, header_lines
from shardline.online.tenants import Tenant, TenantDirectory, not_available
from shardline.openai_wire import request_object
from shardline.settings import RouterSettings
from shardline.storage.rollouts import Rollout

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({502, 503, 504})  # the replica could not serve it; another may (inference is idempotent)
# Not passed on, either way: hop-by-hop headers (RFC 9110 7.6.1), and what the router sets itself.
_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
})
_NOT_ANSWERED = _HOP | {b"date", b"server"}  # the router's server writes its own date and server
_SET_HERE = frozenset({b"authorization", TENANT_HEADER.encode(), TIMEOUT_HEADER.encode(), VARIANT_HEADER.encode(),
                       REQUEST_ID_HEADER.encode(), GATED_HEADER.encode()})
_NOT_SENT = _HOP | _SET_HERE
_TENANT, _VARIANT, _BUDGET = TENANT_HEADER.encode(), VARIANT_HEADER.encode(), BUDGET_HEADER.encode()
_ROUTE_KEY, _TIMEOUT, _GATED = ROUTE_KEY_HEADER.encode(), TIMEOUT_HEADER.encode(), GATED_HEADER.encode()
_MODEL_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(/infer|/ready|/config)?/?$")
_PREDICT_PATH = re.compile(r"^/v1/models/([^/]+?)(?:/versions/([^/]+))?:predict$")  # KServe V1 (kserve_v1.py)
MAX_REMEMBERED = 65_536  # (replica, version) pairs known to have answered (past it, none counts as first)
MAX_VERSIONS = 4_096  # model versions known to exist (pinned here, or answered by a replica): the metrics' labels
MAX_MIRRORS = 64  # shadow copies in flight at once; more are skipped (counted), never queued
_BODY_MODEL_PATHS = frozenset({"/v1/embeddings", "/v1/completions", "/v1/chat/completions"})


class Router:
    """One router: its tenants, model directory, replicas and the HTTP client that reaches them."""

    def __init__(
        self,
        settings: RouterSettings,
        tenants: TenantDirectory,
        directory: ModelDirectory,
        replicas: ReplicaSet,
        key: str,
        clock: Callable[[], float] = time.monotonic,
        draw: Callable[[], float] = random.random,
        rollouts: RolloutBook | None = None,
        activator: Activator | None = None,
        budgets: BudgetBoard | None = None,
    ) -> None:
        self.settings = settings
        self.tenants = tenants
        self.directory = directory
        self.replicas = replicas
        self._key = f"Bearer {key}".encode()
        self._clock = clock
        self._draw = draw
        self._gates: dict[str, TenantGate] = {}
        self._llm_gates: dict[str, LlmGate] = {}  # tenants' generations in flight and token quotas
        self.retry_budget = RetryBudget(settings.retry_budget_ratio, settings.retry_min_per_s)
        self._pools: dict[str, UpstreamPool] = {}
        self.metrics = RouterMetrics(replicas, clock, settings.target_in_flight)
        self.rollouts = rollouts
        self.activator = activator  # set: the replicas scale from zero, and requests wait for one to start
        self.metrics.activator = activator
        self._mirrors: set[asyncio.Task[None]] = set()
        self._answered: set[tuple[str, str]] = set()  # (replica, model version) pairs that have answered
        # Model versions (name:version) known to exist: pinned here (an alias, a rollout) or answered below 400 by a
        # replica. Only these label the metrics: a version a client names is "-" until then (``_measured``).
        self._versions: set[str] = set()
        self._abandoned: set[asyncio.Task[object]] = set()  # tries given up on a hung replica (``abandon``)
        self.fallbacks: dict[tuple[str, str], str] = {}  # (model name, group) -> the variant that group answers with
        self.behind_edge = False  # nginx in front: it holds the rate and concurrency quotas it marks
        self.quotas: QuotaStore | None = None  # set: every router holds the tenants' quotas in one Redis
        # the tenants' budget states (docs/cost.md); without a ledger store, every tenant is within its budget
        self.budgets = budgets if budgets is not None else BudgetBoard(None, 0.0)

    async def start(self) -> None:
        """Ready the connection pools (connections open on first use); read the budget states (then on a thread)."""
        self._pools = {}
        self.budgets.start()

    async def stop(self) -> None:
        """Let the shadow copies in flight finish (a few seconds at most), then close the pools' idle connections."""
        if self._mirrors:
            await asyncio.wait(list(self._mirrors), timeout=5)
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self.budgets.stop()
        if self.quotas is not None:
            await self.quotas.close()

    def _pool(self, url: str) -> UpstreamPool:
        pool = self._pools.get(url)
        if pool is None:
            parts = urlsplit(url)
            pool = self._pools[url] = UpstreamPool(parts.hostname or "127.0.0.1", parts.port or 80)
        return pool

    # -- the request path ----------------------------------------------------------------

    async def handle(self, request: Incoming) -> Answer:
        """Answer one request (never raises for a client's or a replica's fault)."""
        request_id = request.header(REQUEST_ID) or new_request_id()
        if len(request.path) > 1 and request.path[-1] == "/":  # as serve reads it: /v1/embeddings/ is /v1/embeddings
            request.path = request.path[:-1]
        openai = openai_form(request.path)
        try:
            answer = await self._route(request, request_id)
        except ShardlineError as e:
            answer = error_answer(e, openai, request_id)
            if isinstance(e, RateLimited):
                self.metrics.rate_limited[(e.tenant, e.quota)] += 1
            if not request.measured:  # refused before any replica was asked
                self.metrics.refused(answer.status)
            return answer
        if request.budget and not any(k == _BUDGET for k, _ in answer.headers):  # a replica may have said it
            answer.headers.append((_BUDGET, request.budget.encode()))
        return answer

    async def _route(self, request: Incoming, request_id: str) -> Answer:
        path = request.path
        if path == "/health":  # vLLM's probe, which LLM load clients and gateways send first: no key, no body
            return Answer(200)
        if path == "/v2/health/live":
            return json_answer(200, {"live": True})
        if path == "/" and request.method in ("GET", "HEAD"):  # KServe V1's liveness, as serve answers it
            return json_answer(200, {"status": "alive"})
        if path == "/v2/health/ready":
            group = self.replicas.active_group()
            now = self._clock()
            available = sum(self.replicas.available(r, now) for r in self.replicas.replicas.values())
            ready = group is not None or self.activator is not None  # scaled to zero: a request starts one
            return json_answer(200 if ready else 503, {"ready": ready, "group": group, "available": available})
        tenant = self._edge_tenant(request) if self.behind_edge else None
        if tenant is None:
            tenant = self.tenants.authenticate(request.header(b"authorization"))
        matched = _MODEL_PATH.match(path)
        if matched is not None:
            name, version, tail = matched.group(1), matched.group(2), matched.group(3)
            if tenant.reference_for(name) is None:
                raise not_available(tenant, name)
            infer = tail == "/infer" and request.method == "POST"  # (another method: the replica's 405, path as sent)
            if infer:
                self._check_budget(tenant, request)
            route = mirror = None
            if infer and version is None:  # pin the version here, so every replica serves the same one
                route, version = await self._pinned(tenant, request, name)
                path = f"/v2/models/{name}/versions/{version}/infer"
                if route.shadow is not None:
                    mirror = (f"/v2/models/{name}/versions/{route.shadow}/infer", request.body, f"{name}:{route.shadow}")
            key = f"{name}:{version}" if version else str(tenant.models[name])
            return await self._admitted(tenant, request, path, request.body, key, request_id, route, mirror)
        predict = _PREDICT_PATH.match(path) if request.method == "POST" else None
        if predict is not None:  # pinned as a V2 inference is; no shadow copy (its comparison reads V2 answers)
            name, version = predict.group(1), predict.group(2)
            if tenant.reference_for(name) is None:
                raise not_available(tenant, name)
            self._check_budget(tenant, request)
            route = None
            if version is None:
                route, version = await self._pinned(tenant, request, name)
                path = f"/v1/models/{name}/versions/{version}:predict"
            return await self._admitted(tenant, request, path, request.body, f"{name}:{version}", request_id, route)
        if path in _BODY_MODEL_PATHS and request.method == "POST":
            self._check_budget(tenant, request)
            pinned = await self._pin_body_model(tenant, request)
            route = pinned.route
            model = pinned.key.split("|", 1)[0]
            mirror = ((path, pinned.mirror, f"{model.split(':')[0]}:{route.shadow}")
                      if pinned.mirror and route and not pinned.stream else None)
            return await self._admitted(tenant, request, path, pinned.body, pinned.key, request_id, route, mirror,
                                        pinned.stream, pinned.include_usage)
        if path.startswith(("/v2", "/v1/")):
            return await self._admitted(tenant, request, path, request.body, path, request_id)
        self.metrics.refused(404)
        return json_answer(404, {"error": f"no route {shown(path)}; the router serves /v2 and /v1 as `shardline serve` does"})

    def _check_budget(self, tenant: Tenant, request: Incoming) -> None:
        """The tenant's budget, as the states published for both tiers say (``online/budgets.py``, read on a
        thread): warn and soft are noted on the request (its answer says so; soft goes to the model's cheaper
        group, ``forward``).

        Raises:
            BudgetExceeded: the tenant is at its hard limit (429 with the figures, Retry-After to the month's end).
        """
        try:
            state = self.budgets.check(tenant.name)
        except BudgetExceeded:
            self.metrics.budget_requests.labels(tenant.name, "hard").inc()
            raise
        if state is not None:
            self.metrics.budget_requests.labels(tenant.name, state.state).inc()
            request.budget = state.state

    def _cheaper_group(self, model: str) -> str | None:
        """The group ``router.yaml``'s ``fallbacks:`` names for the model (``name:version``), None without one."""
        name = model.split(":", 1)[0]
        return next((group for (fallback, group) in self.fallbacks if fallback == name), None)

    def _edge_tenant(self, request: Incoming) -> Tenant | None:
        """Behind nginx: the tenant of a fast-lane request it could not place (no replica left to try),
        which it passes on as it would to a replica: with the router's key and the tenant it authenticated."""
        sent = request.header(b"authorization")
        if sent is None or not hmac.compare_digest(sent.encode("latin-1"), self._key) or request.header(_TENANT) is None:
            return None
        tenant = self.tenants.tenants.get(request.header(_TENANT) or "")
        if tenant is None:
            return None
        request.headers.append((_GATED, tenant.name.encode()))  # admitted by the data plane already
        return tenant

    async def _pinned(self, tenant: Tenant, request: Incoming, name: str) -> tuple[Route, str]:
        """The route of an inference that names no version (V2's and KServe V1's), and the version it pins."""
        route = await self._version_for(tenant, request, tenant.models[name])
        return route, str(route.version)

    async def _version_for(self, tenant: Tenant, request: Incoming, ref: ModelRef) -> Route:
        """The version a reference means for this caller now: a rollout's pick (by the request key, else the
        tenant) while one runs on the alias, else the alias's version."""
        if ref.version is not None:
            return Route(ref.version)
        alias = ref.alias or "prod"
        if self.rollouts is not None:
            caller = request.header(_ROUTE_KEY) or f"tenant:{tenant.name}"
            route = self.rollouts.route(ref.name, alias, caller, self._draw())
            if route is not None:
                return route
        return Route((await self.directory.resolve(ref)).version)

    async def _pin_body_model(self, tenant: Tenant, request: Incoming) -> Pinned:
        """An OpenAI body with its ``model`` pinned to the version the tenant's reference means now, its
        placement key (a generation's with its affinity: ``streams.affinity``), its route, the body to mirror
        to a shadow candidate (None: no mirror), and whether the answer is streamed."""
        encoding = request.header(b"content-encoding")
        body = decode_body(request.body, encoding, self.settings.max_body_bytes) if encoding else request.body
        generation = request.path in GENERATION_PATHS
        doc = request_object(body, generation)  # serve's words for a body that is not one, or names no model
        name, alias, version = ModelRef.split(doc["model"].strip())
        listed = tenant.reference_for(name)
        if listed is None:
            raise not_available(tenant, name)
        stream = generation and doc.get("stream") is True
        options = doc.get("stream_options")
        usage = stream and isinstance(options, dict) and options.get("include_usage") is True
        near = f"|{affinity(doc, request.header(_ROUTE_KEY))}" if generation else ""
        if version is not None:  # pinned by the client: sent as it came
            return Pinned(request.body, f"{name}:{version}{near}", None, None, stream, usage)
        ref = ModelRef(name=name, alias=alias) if alias is not None else listed
        route = await self._version_for(tenant, request, ref)
        doc["model"] = f"{name}:{route.version}"
        if encoding:  # sent on plain
            request.headers = [(k, v) for k, v in request.headers if k != b"content-encoding"]
        pinned = orjson.dumps(doc)
        mirror = None
        if route.shadow is not None:
            doc["model"] = f"{name}:{route.shadow}"
            mirror = orjson.dumps(doc)
        return Pinned(pinned, f"{name}:{route.version}{near}", route, mirror, stream, usage)

    def _gate(self, tenant: Tenant) -> TenantGate:
        gate = self._gates.get(tenant.name)
        if gate is None or gate.tenant is not tenant:
            gate = self._gates[tenant.name] = TenantGate(tenant, 1, self._clock, lambda *_: None)
        return gate

    async def _admitted(self, tenant: Tenant, request: Incoming, path: str, body: bytes, key: str,
                        request_id: str, route: Route | None = None,
                        mirror: tuple[str, bytes, str] | None = None, stream: bool = False,
                        include_usage: bool = False) -> Answer:
        # The tenant's rate and concurrency, for every replica together (held while a stream runs), unless
        # the data plane in front has held them (it marks the requests it admitted; a client's mark never gets here).
        gate: TenantGate | _Admitted | Held
        if self.behind_edge and request.header(_GATED) == tenant.name:
            gate = _ADMITTED
        elif self.quotas is not None:
            gate = await self.quotas.admit(tenant)  # held in Redis for every router (online/quota_store.py)
        else:
            gate = self._gate(tenant)
            gate.__enter__()
        llm = None
        try:
            if path in GENERATION_PATHS:
                if self.quotas is not None:
                    opened = await self.quotas.open_llm(tenant)
                else:
                    opened = self._llm_gate(tenant)
                    opened.open(0)  # its generations in flight, and a token quota not spent
                llm = opened  # given back below only once taken: a refused stream gives back no one else's slot
            answer = await self._measured(tenant, request, path, body, key, request_id, route, mirror, stream)
        except BaseException:
            if llm is not None:
                llm.close()
            gate.__exit__(None, None, None)
            raise
        if llm is None:
            gate.__exit__(None, None, None)
            return answer

        def done() -> None:
            assert llm is not None
            llm.close()
            gate.__exit__(None, None, None)

        if answer.stream is None:
            if answer.status == 200:
                llm.spend(_usage_tokens(answer.body))
            done()
            return answer
        prompt = next((v for k, v in answer.headers if k == PROMPT_TOKENS_HEADER), b"0")
        answer.stream = metered(answer.stream, llm, int(prompt) if prompt.isdigit() else 0,
                                path.endswith("/chat/completions"), done, include_usage)
        return answer

    def _llm_gate(self, tenant: Tenant) -> LlmGate:
        gate = self._llm_gates.get(tenant.name)
        if gate is None or gate.tenant is not tenant:
            gate = self._llm_gates[tenant.name] = LlmGate(tenant, self._clock)
        return gate

    async def _measured(self, tenant: Tenant, request: Incoming, path: str, body: bytes, key: str, request_id: str,
                        route: Route | None, mirror: tuple[str, bytes, str] | None, stream: bool) -> Answer:
        routed = request.header(_ROUTE_KEY)
        model = key.split("|", 1)[0] if ":" in key else "-"
        if route is not None:  # pinned here (an alias's version, a rollout's pick): it exists
            self._know(model)
        # A version the client named labels the series only once it is known to exist (as serve labels a model
        # only once resolved): names made up by clients must not grow them. Until then, and for those that never
        # exist, "-"; the in-flight count is given back under the label it was taken with.
        taken = model if model in self._versions else "-"
        request.measured = True
        started = self._clock()
        self.metrics.started(taken)
        tries = Tries()
        status, shed, answered = 500, False, False
        try:
            answer = await self.forward(tenant, request, path, body, f"{key}|{routed}" if routed else key,
                                        request_id, tries, stream=stream)
            status, shed, answered = answer.status, _shed(answer), True
            if mirror is not None and route is not None and route.rollout is not None:
                self._mirror(tenant, request, mirror, route.rollout, answer, request_id)
            return answer
        except ShardlineError as e:
            status = error_status(e)[0]
            raise
        finally:
            seconds = self._clock() - started
            if answered and status < 400:  # a replica answered it: the version exists
                self._know(model)
            label = model if model in self._versions else "-"
            self.metrics.answered(label, status, seconds, max(0, tries.count - 1), taken)
            if route is not None and route.rollout is not None and self.rollouts is not None:
                self.rollouts.record(route, status, None if tries.first else seconds, shed)
                self.metrics.rollout_answer(model, route.arm or "-", status >= 500 and not shed)

    def _know(self, model: str) -> None:
        """``model`` (``name:version``) exists: it may label the metrics (up to ``MAX_VERSIONS`` of them)."""
        if model != "-" and len(self._versions) < MAX_VERSIONS:
            self._versions.add(model)

    def _mirror(self, tenant: Tenant, request: Incoming, mirror: tuple[str, bytes, str], rollout: Rollout,
                primary: Answer, request_id: str) -> None:
        """Send a copy to the shadow candidate in the background (at most ``MAX_MIRRORS`` at a time); its
        answer is compared with the primary's and dropped."""
        assert self.rollouts is not None
        if len(self._mirrors) >= MAX_MIRRORS:
            self.rollouts.skipped_shadow(rollout)
            return
        task = asyncio.get_running_loop().create_task(self._shadow(tenant, request, mirror, rollout, primary, request_id))
        self._mirrors.add(task)
        task.add_done_callback(self._mirrors.discard)

    async def _shadow(self, tenant: Tenant, request: Incoming, mirror: tuple[str, bytes, str], rollout: Rollout,
                      primary: Answer, request_id: str) -> None:
        assert self.rollouts is not None
        path, body, key = mirror
        started = self._clock()
        tries = Tries()
        try:
            answer = await self.forward(tenant, request, path, body, key, f"{request_id}-shadow", tries, retry=False)
        except ShardlineError as e:
            answer = Answer(error_status(e)[0])
        seconds = None if tries.first else self._clock() - started
        comparison = None
        if primary.status == 200:
            try:
                reference = decode_answer(primary.headers, primary.body)
            except (ValueError, KeyError, TypeError):
                reference = None
            if reference is not None:
                try:
                    comparison = (compare(reference, decode_answer(answer.headers, answer.body))
                                  if answer.status == 200 else compare(reference, {}))
                except (ValueError, KeyError, TypeError):
                    comparison = compare(reference, {})
        self.rollouts.record_shadow(rollout, comparison, answer.status, seconds)
        if comparison is not None:
            self.metrics.shadow_rows(key, comparison.rows, comparison.disagree)

    async def forward(self, tenant: Tenant, request: Incoming, path: str, body: bytes, key: str,
                      request_id: str, tries: Tries | None = None, retry: bool = True, stream: bool = False) -> Answer:
        """Send the request to the replica the key's order and the loads pick; on a failure the replica
        could not help (no connection, 502-504), to the next, within the retries, the budget and the deadline
        (``retry`` False: one try, outside the budget, as for a shadow copy).

        Raises:
            ReplicasUnavailable: no replica is available, or every try failed (or the budget was spent).
            DeadlineExceeded: the deadline passed before any replica answered.
        """
        now = self._clock()
        deadline = Deadline.from_header(request.header(_TIMEOUT), now,
                                        self.settings.request_timeout_s, self.settings.max_timeout_s)
        headers = header_lines([(k, v) for k, v in request.headers if k not in _NOT_SENT] + [
            (b"authorization", self._key), (_TENANT, tenant.name.encode()),
            (REQUEST_ID, request_id.encode("latin-1"))])  # as it came: header values are Latin-1
        target = path + ("?" + request.query.decode("latin-1") if request.query else "")
        if retry:
            self.retry_budget.request(now)
        tried: set[str] = set()
        last: Answer | None = None
        attempt = 0
        model = key.split("|", 1)[0]
        hedge = self.settings.hedge_after_ms / 1000 if retry and not stream else 0.0  # a stream is not hedged
        send: Callable[[Replica], Awaitable[Answer | None]] = functools.partial(
            self._send, method=request.method, target=target, headers=headers, body=body, deadline=deadline, model=model,
            stream=stream)
        if self.fallbacks:
            send = functools.partial(self._fallback_send, send, model)
        prefer = self._cheaper_group(model) if request.budget == "soft" else None  # past a budget's soft limit
        while True:
            replica = self._pick(key, tried, prefer)
            if replica is None and not tried and self.activator is not None:
                while replica is None and await self.activator.wait(model, deadline.left(self._clock())):
                    replica = self._pick(key, tried, prefer)
            if replica is None:
                break
            tried.add(replica.url)
            if tries is not None:
                tries.count += 1
            sent = self._clock()
            if hedge > 0:
                answer, replica = await self._hedged(send, replica, key, tried, tries, hedge, prefer)
            else:
                answer = await send(replica)
            if answer is not None and answer.status not in RETRY_STATUSES:
                if tries is not None:
                    pair = (replica.url, model)
                    tries.first = pair not in self._answered
                    # remembered once the model answered (a client's 4xx, for a version made up, leaves no trace)
                    if tries.first and answer.status < 400 and len(self._answered) < MAX_REMEMBERED:
                        self._answered.add(pair)
                return answer
            last = answer if answer is not None else last
            now = self._clock()
            if deadline.left(now) <= 0:
                raise DeadlineExceeded(
                    f"no replica answered within the request's deadline ({_ms(deadline, now)}); retry, or send a "
                    f"longer {TIMEOUT_HEADER}"
                )
            attempt += 1
            if not retry or attempt > self.settings.retries:
                break
            if answer is None and replica.hung_at >= sent:
                continue  # its replica hung: the try was given up, not failed; the request moves on at once
            if not self.retry_budget.try_retry(now):
                break
            await asyncio.sleep(min(backoff_s(attempt, self._draw()), max(0.0, deadline.left(now))))
        if last is not None:
            return last  # the last replica's own 502-504 (a shed request's 503 carries its Retry-After)
        raise ReplicasUnavailable(
            "no replica can take the request now (none is up, or every one tried failed); retry after the "
            "Retry-After seconds", 1.0,
        )

    def abandon(self, replica: Replica, now: float) -> int:
        """``replica`` is hung (a stalled try's health probe went unanswered): take it out until a health check
        passes, and give up the tries waiting on it, so that each request moves to another replica at once (a
        move, not a retry). A given-up try's connection is closed (``UpstreamPool``), and a replica does not start a
        request whose client closed behind it (``online/connection.py``): a copy still in the stopped replica's
        socket costs it nothing; one it had begun before it stopped it finishes. Returns how many were moved."""
        replica.healthy = False
        replica.hung_at = now
        waiting = [task for task in replica.waiting if isinstance(task, asyncio.Task) and not task.done()]
        for task in waiting:
            self._abandoned.add(task)
            task.cancel()
        self.metrics.hung.labels(replica.group, replica.url).inc()
        log.warning("replica %s is hung: no answer to a health probe after a try stalled; taken out until a health "
                    "check passes, %d waiting requests moved to other replicas", replica.url, len(waiting))
        return len(waiting)

    def _pick(self, key: str, tried: set[str], prefer: str | None = None) -> Replica | None:
        now = self._clock()
        while True:
            order = self.replicas.order(key, prefer)
            url = choose([r.url for r in order], {r.url: r.in_flight for r in order}, self.settings.balance, tried)
            if url is None:
                return None
            replica = self.replicas.replicas[url]
            before = replica.breaker.state
            allowed = replica.breaker.allows(now)
            _note(replica, before)
            if allowed:
                return replica
            tried.add(url)  # half-open with its probes out: the next one

    async def _hedged(self, send: Callable[[Replica], Awaitable[Answer | None]], replica: Replica, key: str,
                      tried: set[str], tries: Tries | None, after_s: float,
                      prefer: str | None = None) -> tuple[Answer | None, Replica]:
        """Send to ``replica``; if it has not answered after ``after_s``, send a copy to the next replica too
        (within the retry budget): the first good answer wins and the other copy is cancelled."""
        first = asyncio.ensure_future(send(replica))
        done, _ = await asyncio.wait({first}, timeout=after_s)
        if done:
            return first.result(), replica
        other = self._pick(key, tried, prefer)
        if other is None or not self.retry_budget.try_retry(self._clock()):
            return await first, replica
        tried.add(other.url)
        if tries is not None:
            tries.count += 1
        copies = {first: replica, asyncio.ensure_future(send(other)): other}
        pending = set(copies)
        last: tuple[Answer | None, Replica] = (None, replica)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    answer = task.result()
                    if answer is not None and answer.status not in RETRY_STATUSES:
                        self.metrics.hedged(copies[task] is other)
                        return answer, copies[task]
                    last = (answer, copies[task]) if answer is not None or last[0] is None else last
            return last
        finally:
            for task in pending:
                task.cancel()  # the loser: its connection is closed, its replica's breaker not charged
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def _fallback_send(self, send: Callable[..., Awaitable[Answer | None]], model: str,
                             replica: Replica) -> Answer | None:
        """Send to ``replica``; on a group where the model declares a fallback, ask for its variant and mark the
        answer (``X-Shardline-Fallback: name:version#variant``)."""
        name = model.split(":", 1)[0]
        variant = self.fallbacks.get((name, replica.group))
        if variant is None:
            return await send(replica)
        answer = await send(replica, variant=variant)
        if answer is not None and answer.status < 400:
            answer.headers.append((FALLBACK_HEADER.encode(), f"{model}#{variant}".encode()))
            self.metrics.fallback(model, variant)
        return answer

    async def _send(self, replica: Replica, method: str, target: str, headers: bytes,
                    body: bytes, deadline: Deadline, model: str = "-", variant: str | None = None,
                    stream: bool = False) -> Answer | None:
        """The replica's answer, or None when it gave none (no connection, reset, time-out). ``headers``:
        the request's header lines (``header_lines``), to which the deadline left (and the variant) are added.
        ``stream``: a 200's body is passed on as it comes (the replica counts as busy until it ends)."""
        now = self._clock()
        sent = b"%s%s: %s\r\n" % (headers, _TIMEOUT, deadline.header(now).encode())
        if variant is not None:
            sent += b"%s: %s\r\n" % (_VARIANT, variant.encode())
        replica.in_flight += 1
        ok, cancelled, streaming = False, False, False
        task = asyncio.current_task()
        if (replica.url, model) in self._answered:  # a first answer may be a model loading (holding the GIL): unwatched
            replica.waiting[task] = now  # watched for a stall until its answer begins (``RouterService``)
        try:
            pool = self._pool(replica.url)
            pieces = None
            if stream:
                status, raw, pieces = await pool.stream(method, target, sent, body, max(0.001, deadline.left(now)))
                if status == 200:
                    streaming = True
                else:  # an error's JSON: read whole, so that it may be retried elsewhere
                    payload = b"".join([piece async for piece in pieces])
                    pieces = None
            else:
                status, raw, payload = await pool.request(method, target, sent, body, max(0.001, deadline.left(now)))
            replica.waiting.pop(task, None)
            replica.heard = self._clock()
            answer = Answer(status, [(k, v) for k, v in raw if k not in _NOT_ANSWERED], b"" if streaming else payload)
            if pieces is not None:
                answer.stream = _busy_until_done(pieces, replica)
            ok = answer.status not in RETRY_STATUSES or answer.status == 503 and _shed(answer)
            if answer.status < 400:  # a good answer is timed per model; a client's error (a version made up) is not
                replica.answered(model, (self._clock() - now) * 1000)
            return answer
        except UpstreamFailed as e:
            log.info("replica %s failed: %s", replica.url, e)
            return None
        except asyncio.CancelledError:
            if task in self._abandoned:  # its replica hung (a health probe went unanswered): given up, moved on
                self._abandoned.discard(task)
                assert task is not None
                task.uncancel()
                return None
            cancelled = True  # a hedge's loser, or the client went: no fault of the replica
            raise
        finally:
            replica.waiting.pop(task, None)
            if not streaming:
                replica.in_flight -= 1  # a stream's ends with it (_busy_until_done)
            if not cancelled:
                before = replica.breaker.state
                replica.breaker.record(ok, self._clock())
                _note(replica, before)


class _Admitted:
    """The gate of a request the data plane in front has admitted already: nothing to hold."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_ADMITTED = _Admitted()


def _busy_until_done(pieces: Relay, replica: Replica) -> Relay:
    """A streamed answer's pieces; the replica counts one more request in flight until the stream ends or is closed."""

    async def done(_: bool) -> None:
        replica.in_flight -= 1

    return Relay(pieces, done)


def _usage_tokens(body: bytes) -> int:
    """The total tokens a generation's JSON answer reports (0 when it does not say)."""
    try:
        usage = orjson.loads(body).get("usage") or {}
        return int(usage.get("total_tokens") or 0)
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        return 0


def _note(replica: Replica, before: str) -> None:
    """Log a breaker's change of state (operators follow a replica's failures and recovery by these)."""
    after = replica.breaker.state
    if after != before:
        log.warning("replica %s: breaker %s -> %s", replica.url, before, after)


def _shed(answer: Answer) -> bool:
    """A 503 that a healthy replica gave on purpose (it shed the request, with Retry-After): no fault of it."""
    return any(k == b"retry-after" for k, _ in answer.headers)


def _ms(deadline: Deadline, now: float) -> str:
    return f"{(now - deadline.at) * 1000:.0f} ms past it"
