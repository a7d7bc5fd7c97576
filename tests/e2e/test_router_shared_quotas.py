"""Two routers, one Redis: a tenant's quotas held for both together (SHARDLINE_TENANCY_QUOTA_STORE,
online/quota_store.py), and Redis stopped mid-load losing no request; with each data plane: the routers alone, and
each with nginx in front, whose lane holds the quotas in the same Redis (online/router/front_lane.lua)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import orjson
import pytest

from shardline.local_ports import reserve_port as free_port
from shardline.online.tenants import hash_api_key
from shardline.storage.registry import ModelRegistry
from tests.conftest import BuiltModel
from tests.e2e.conftest import SHARDLINE
from tests.support.redis_server import RedisServer, redis_server
from tests.support.routers import MODEL, PLANES, _env, _scrape, _stop, _wait_ready

pytestmark = pytest.mark.timeout(180)

METERED_KEY = "sk-shared-metered"
# The tenant's requests a second, for both routers together. Low, so that the client's own pace is not the test: a
# Python client offering 300/s reached 136/s in a loaded CI run, too few for a quota per router to show.
RATE = 40
# Its burst: half a second of the rate, so that a router or the client stalled for a moment by a loaded machine (the
# suite's other process beside it) loses none of the tokens that refill meanwhile. With a burst of 10 they did: 366
# admitted where 410 were due, and 197 where 0.8 x 251 were, once each in full runs.
BURST = 20
OFFERED = 160  # what the test sends, both routers together: 4x the rate


@dataclass
class Pair:
    plane: str
    urls: list[str]
    metrics: list[str]
    logs: list[Path]
    redis: RedisServer


@pytest.fixture(scope="module", params=PLANES)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         breast_cancer_model: BuiltModel) -> Iterator[Pair]:
    """Two `shardline router --local-replicas 1` on one tenants file and one redis-server, with the data plane."""
    plane = request.param
    home = tmp_path_factory.mktemp(f"shared-quotas-{plane}")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias(MODEL, "prod", registry.push(breast_cancer_model.bundle_dir).version or 1)
    tenants = home / "tenants.yaml"
    tenants.write_text(
        "tenants:\n"
        "  - name: metered\n"
        f"    api_keys_sha256: [\"{hash_api_key(METERED_KEY)}\"]\n"
        f"    models: [\"{MODEL}@prod\"]\n"
        f"    rate: {{requests_per_second: {RATE}, burst: {BURST}}}\n"
        "    max_concurrent: 200\n"
    )
    redis = redis_server(home)
    routers: list[subprocess.Popen[bytes]] = []
    urls, metrics, logs = [], [], []
    try:
        for i in range(2):
            port, metrics_port = free_port(), free_port()
            log = home / f"router-{i}.log"
            with open(log, "wb") as sink:
                routers.append(subprocess.Popen(
                    [*SHARDLINE, "router", "--local-replicas", "1", "--tenants", str(tenants), "--port", str(port),
                     "--metrics-port", str(metrics_port)],
                    env=_env(home, SHARDLINE_TENANCY_QUOTA_STORE=redis.url, SHARDLINE_TENANCY_QUOTA_STORE_ROUTERS="2",
                             SHARDLINE_ROUTER_DATA_PLANE=plane),
                    stdout=sink, stderr=subprocess.STDOUT, cwd=home))
            urls.append(f"http://127.0.0.1:{port}")
            metrics.append(f"http://127.0.0.1:{metrics_port}/metrics")
            logs.append(log)
        for url, router, log in zip(urls, routers, logs):
            _wait_ready(url, router, log, available=1)
            if plane == "nginx":  # its lane holds the quotas in Redis too
                assert "nginx's fast lane is on and holds the rate and concurrency quotas there" in log.read_text()
        yield Pair(plane, urls, metrics, logs, redis)
    finally:
        for router in routers:
            _stop(router)
        redis.stop()


def _body(model: BuiltModel) -> bytes:
    row = model.data.features[0]
    return orjson.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [1], "data": [float(row[j])]}
                                    for j, n in enumerate(model.data.names)]})


async def _paced(urls: list[str], body: bytes, seconds: float, during: Any = None,
                 finished: list[float] | None = None) -> list[tuple[float, Any, Any]]:
    """OFFERED requests a second for ``seconds``, alternating between the routers; each outcome with its send time:
    (sent, status, Retry-After), or (sent, "lost", error) for one dropped or hung. ``during(elapsed)`` is called
    as the load runs (the test's action mid-load); ``finished`` is given the seconds until the last answer."""
    outcomes: list[tuple[float, Any, Any]] = []
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    headers = {"Authorization": f"Bearer {METERED_KEY}"}
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(base_url=u, headers=headers, limits=limits,
                                                                     timeout=20)) for u in urls]

        async def one(client: httpx.AsyncClient, sent: float) -> None:
            try:
                answer = await client.post(f"/v2/models/{MODEL}/infer", content=body)
            except httpx.HTTPError as e:
                outcomes.append((sent, "lost", repr(e)))
                return
            outcomes.append((sent, answer.status_code, answer.headers.get("retry-after")))

        tasks = []
        start = time.monotonic()
        n = 0
        while (elapsed := time.monotonic() - start) < seconds:
            due = start + n / OFFERED
            if due > time.monotonic():
                await asyncio.sleep(due - time.monotonic())
            tasks.append(asyncio.create_task(one(clients[n % len(clients)], time.monotonic() - start)))
            n += 1
            if during is not None:
                during(elapsed)
        await asyncio.gather(*tasks)
        if finished is not None:
            finished.append(time.monotonic() - start)
    return outcomes


def test_a_tenants_rate_is_held_for_both_routers_together(pair: Pair, breast_cancer_model: BuiltModel) -> None:
    seconds = 4.0
    done: list[float] = []
    outcomes = asyncio.run(_paced(pair.urls, _body(breast_cancer_model), seconds, finished=done))
    assert [o for o in outcomes if o[1] not in (200, 429)] == []
    admitted = sum(o[1] == 200 for o in outcomes)
    # the burst, then the rate while requests came in (the last may reach a busy router late: the window runs
    # to the last answer): 180 for 4 s, where a quota per router would give ~360
    allowed = (BURST + RATE * seconds, BURST + RATE * max(seconds, done[0]))
    # enough was offered that a quota held per router would show: each router admitting up to the quota of the
    # 4 s would admit at least 1.5x it together (the bound is on what the test needs, not on the client's pace, which
    # a loaded CI machine has slowed to under half; and not on the window to the last answer, which a stalled router
    # stretched to 9 s in another CI run: what is offered in 4 s could never be 1.5x that window's)
    assert len(outcomes) >= 1.5 * allowed[0], (len(outcomes), allowed)
    assert 0.9 * allowed[0] <= admitted <= 1.05 * allowed[1], (admitted, allowed)
    assert all(o[2] is not None and int(o[2]) >= 1 for o in outcomes if o[1] == 429)


def test_redis_stopped_mid_load_loses_no_request_and_each_router_holds_its_share(
        pair: Pair, breast_cancer_model: BuiltModel) -> None:
    time.sleep(BURST / RATE + 0.2)  # the last test's bucket refills past its burst
    logged = [log.read_text().count("unreachable") for log in pair.logs]
    done: list[float] = []

    def stop_redis(elapsed: float) -> None:
        if elapsed >= 1.0 and pair.redis.process is not None:
            pair.redis.stop()

    try:
        outcomes = asyncio.run(_paced(pair.urls, _body(breast_cancer_model), 4.0, stop_redis, done))
    finally:
        if pair.redis.process is None:
            pair.redis.start()
    assert [o for o in outcomes if o[1] not in (200, 429)] == []  # no 5xx, no dropped connection
    assert all(o[2] is not None and int(o[2]) >= 1 for o in outcomes if o[1] == 429)
    # Redis gone (from 1 s on, after the outage is seen): each router admits its half of the rate, so together
    # about the quota still, never the double that a whole quota per router would give (the window runs to the
    # last answer: on a loaded machine a router may take the last requests late)
    after = [o for o in outcomes if o[0] >= 1.5]
    span = max(o[0] for o in after) - 1.5
    admitted = sum(o[1] == 200 for o in after)
    local_burst = -(-BURST // 2)  # each router's share of the burst while it cannot reach Redis
    # The floor is for a router that refuses everything without Redis: a loaded machine's stalls longer than the
    # burst lose tokens (a CI run admitted 211 of the 280 that 0.8x the rate asked, the 4 s run taking 5 s)
    assert 0.5 * RATE * span <= admitted <= 2 * local_burst + 1.2 * RATE * max(span, done[0] - 1.5), \
        (admitted, span, done)
    for url, log, before in zip(pair.metrics, pair.logs, logged):
        assert _scrape(url).get(("shardline_router_quota_store_fallbacks_total", ()), 0) > 0
        assert log.read_text().count("unreachable") == before + 1  # logged once per outage
