"""Quotas, shedding and scale to zero over real HTTP, each on a server with its own settings."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import orjson
import pytest

from shardline.online.app import create_app
from shardline.online.metrics import metrics_app
from shardline.online.server import build_plane
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.online.testing import serve_listeners_in_thread
from shardline.settings import ModelServing, OnlineSettings, RuntimeSettings, StorageSettings
from shardline.storage.registry import ModelRegistry

from tests.conftest import BuiltModel

MODEL = "breast-cancer"
KEYS = {"gold": "sk-gold", "bronze": "sk-bronze", "metered": "sk-metered"}


@pytest.fixture(scope="module")
def home(breast_cancer_model: BuiltModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("online-scaling")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias(MODEL, "prod", registry.push(breast_cancer_model.bundle_dir).version or 1)
    return home


TENANTS = {"tenants": [
    {"name": "gold", "api_keys_sha256": [hash_api_key(KEYS["gold"])], "models": [f"{MODEL}@prod"], "priority": "high"},
    {"name": "bronze", "api_keys_sha256": [hash_api_key(KEYS["bronze"])], "models": [f"{MODEL}@prod"], "priority": "low"},
    {"name": "metered", "api_keys_sha256": [hash_api_key(KEYS["metered"])], "models": [f"{MODEL}@prod"],
     # one token per 100 s: the test's requests see the burst only, however slowly the machine runs them
     "rate": {"requests_per_second": 0.01, "burst": 2}, "max_concurrent": 1},
]}


@contextmanager
def server(home: Path, **settings: Any) -> Iterator[tuple[str, str, Any]]:
    """A server with these settings: its URL, its metrics listener's, its data plane."""
    cache = home / f"cache-{uuid.uuid4().hex[:8]}"  # the model cache is per process and folder: one per server
    plane = build_plane(OnlineSettings(**settings), StorageSettings(home=str(home), cache_dir=str(cache)),
                        RuntimeSettings(device="cpu", intra_op_threads=1), TenantDirectory.from_config(TENANTS))
    with serve_listeners_in_thread(create_app(plane, log_requests=False),
                                   metrics_app=metrics_app(plane.metrics.exposition)) as served:
        yield served.url, served.metrics_url or "", plane


def body(model: BuiltModel, start: int, rows: int = 1) -> bytes:
    features = model.data.features[start:start + rows]
    return orjson.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [rows], "data": features[:, j].tolist()}
                                    for j, n in enumerate(model.data.names)]})


def infer(url: str, tenant: str, content: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v2/models/{MODEL}/infer", headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                      content=content, timeout=30)


def test_a_tenant_over_its_rate_or_concurrency_gets_429_with_retry_after(home: Path, breast_cancer_model: BuiltModel) -> None:
    slow = {MODEL: ModelServing(max_batch_wait_ms=1500, max_batch_size=64)}  # a lone request waits 1.5 s
    with server(home, models=slow) as (url, metrics_url, _):
        with ThreadPoolExecutor(2) as pool:
            held = pool.submit(infer, url, "metered", body(breast_cancer_model, 0))
            wait_for(lambda: 'shardline_tenant_in_flight{tenant="metered"} 1.0' in httpx.get(f"{metrics_url}/metrics").text)
            second = infer(url, "metered", body(breast_cancer_model, 1))
            assert held.result().status_code == 200
        assert second.status_code == 429 and second.headers["retry-after"] == "1"
        assert "has 1 requests in flight, its max_concurrent" in second.json()["error"]
        # the bucket (burst 2) gave one token to the held request; a refused request takes none
        assert infer(url, "metered", body(breast_cancer_model, 2)).status_code == 200
        fourth = infer(url, "metered", body(breast_cancer_model, 3))
        assert fourth.status_code == 429 and int(fourth.headers["retry-after"]) >= 1
        assert "over its rate of 0.01 requests/s (burst 2); retry after" in fourth.json()["error"]
        assert infer(url, "gold", body(breast_cancer_model, 2)).status_code == 200  # other tenants are not held back
        metrics = httpx.get(f"{metrics_url}/metrics").text
        assert 'shardline_rate_limited_total{quota="concurrency",tenant="metered"} 1.0' in metrics
        assert 'shardline_rate_limited_total{quota="rate",tenant="metered"} 1.0' in metrics


def test_every_keyed_request_counts_against_the_rate_and_health_against_nothing(home: Path) -> None:
    # serve let GET /v2, /v1/models and /v1/models/{model} past the rate that metadata, readiness and inference
    # were held to (the router held them all): one tenant had two rules depending on the tier it called
    with server(home) as (url, _, _):
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEYS['metered']}"}) as client:
            assert client.get("/v2").status_code == 200  # the burst (2): one token each
            assert client.get("/v1/models").status_code == 200
            paths = ["/v2", "/v1/models", f"/v1/models/{MODEL}", f"/v2/models/{MODEL}", f"/v2/models/{MODEL}/ready"]
            refused = {path: client.get(path) for path in paths}
            assert {path: r.status_code for path, r in refused.items()} == dict.fromkeys(paths, 429)
            assert "over its rate of 0.01 requests/s (burst 2)" in refused["/v2"].json()["error"]
            assert "over its rate of 0.01 requests/s" in refused["/v1/models"].json()["error"]["message"]
            assert int(refused[f"/v1/models/{MODEL}"].headers["retry-after"]) >= 1
            health = ["/v2/health/live", "/v2/health/ready", "/health"]
            assert {path: client.get(path).status_code for path in health} == dict.fromkeys(health, 200)


def test_overload_sheds_low_priority_with_503_while_high_priority_is_served(home: Path, breast_cancer_model: BuiltModel) -> None:
    # A queue of 4: low priority may fill 2 of it, high all 4; a batch runs when 4 requests are queued (or after 10 s).
    held = {MODEL: ModelServing(max_batch_wait_ms=10_000, max_batch_size=4, queue_capacity=4)}
    with server(home, models=held) as (url, metrics_url, _):
        with ThreadPoolExecutor(8) as pool:
            low = [pool.submit(infer, url, "bronze", body(breast_cancer_model, i)) for i in range(2)]
            wait_for(lambda: queued(metrics_url, "low") == 2)
            shed = infer(url, "bronze", body(breast_cancer_model, 3))
            high = [pool.submit(infer, url, "gold", body(breast_cancer_model, 10 + i)) for i in range(2)]
            answers = [f.result() for f in low + high]

        assert shed.status_code == 503 and int(shed.headers["retry-after"]) >= 1
        assert "it is shed to keep latency bounded" in shed.json()["error"]
        assert [a.status_code for a in answers] == [200] * 4
        metrics = httpx.get(f"{metrics_url}/metrics").text
        assert 'shardline_shed_total{model="breast-cancer",priority="low",tenant="bronze",version="1"} 1.0' in metrics
        assert 'shardline_batch_requests_count{model="breast-cancer",version="1"} 1.0' in metrics  # all four in one batch


def test_a_request_past_its_deadline_is_answered_504_and_never_scored(home: Path, breast_cancer_model: BuiltModel) -> None:
    # A lone request of 3 rows waits 3 s in the queue for companions: longer than the 1 s the caller gives it.
    # Two such requests together fill a batch (6 rows), which runs at once.
    held = {MODEL: ModelServing(max_batch_wait_ms=3000, max_batch_size=6)}
    with server(home, models=held) as (url, metrics_url, _):
        def timed(timeout: str, start: int) -> httpx.Response:
            return httpx.post(f"{url}/v2/models/{MODEL}/infer", content=body(breast_cancer_model, start, 3), timeout=30,
                              headers={"Authorization": f"Bearer {KEYS['gold']}", "X-Shardline-Timeout-Ms": timeout})

        late = timed("1000", 0)
        assert late.status_code == 504, late.text
        assert late.json()["error"] == ("the request's deadline (x-shardline-timeout-ms) passed while it waited in the "
                                        "queue of model 'breast-cancer'; retry, or send a longer "
                                        "x-shardline-timeout-ms")
        # the batcher drops the request whose caller was answered when its batch's wait ends
        wait_for(lambda: queued(metrics_url, "high") == 0)
        metrics = httpx.get(f"{metrics_url}/metrics").text
        assert 'shardline_batch_requests_count{model="breast-cancer",version="1"}' not in metrics  # no batch ran
        assert [line.rsplit(" ", 1)[1] for line in metrics.splitlines()
                if line.startswith("shardline_requests_total{") and 'code="504"' in line] == ["1.0"]

        # a deadline it can meet, and a value that is not a number of milliseconds (counted as none), are scored
        expected = breast_cancer_model.estimator.predict(breast_cancer_model.data.features[:3].astype(np.float32)).tolist()
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda timeout: timed(timeout, 0), ("60000", "soon")))
        for answer in answers:
            assert answer.status_code == 200, answer.text
            assert answer.json()["outputs"][0]["data"] == expected
        metrics = httpx.get(f"{metrics_url}/metrics").text
        assert 'shardline_batch_requests_sum{model="breast-cancer",version="1"} 2.0' in metrics  # the two, not the late one


def queued(metrics_url: str, priority: str) -> float:
    """Requests of this priority in the server's queues now (``shardline_queue_depth``)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{metrics_url}/metrics").text.splitlines()
               if line.startswith("shardline_queue_depth{") and f'priority="{priority}"' in line)


def wait_for(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_an_idle_model_scales_to_zero_and_reloads_under_concurrent_requests(
    home: Path, breast_cancer_model: BuiltModel
) -> None:
    # idle for 3 s, the model is unloaded: long enough for the checks after the second burst on a loaded machine
    with server(home, idle_timeout_s=3, reap_interval_s=0.1) as (url, metrics_url, plane):
        ready = f"{url}/v2/models/{MODEL}/ready"
        auth = {"Authorization": f"Bearer {KEYS['gold']}"}
        first = infer(url, "gold", body(breast_cancer_model, 0, 8))
        assert first.status_code == 200
        assert httpx.get(ready, headers=auth).json()["ready"] is True

        wait_for(lambda: httpx.get(ready, headers=auth).json()["state"] == "unloaded")
        # scaled to zero, still ready: the next request loads it
        assert httpx.get(ready, headers=auth).json() == {"name": MODEL, "version": "1", "ready": True, "state": "unloaded"}
        assert plane.cache.loaded() == []
        metrics = httpx.get(f"{metrics_url}/metrics").text
        assert 'shardline_model_loaded{model="breast-cancer",version="1"} 0.0' in metrics
        assert 'shardline_model_unloads_total{model="breast-cancer",version="1"} 1.0' in metrics

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda i: infer(url, "gold", body(breast_cancer_model, i * 8, 8)), range(16)))
        assert [a.status_code for a in answers] == [200] * 16  # the first waits for the load, the rest queue
        labels = np.concatenate([np.array(a.json()["outputs"][0]["data"]) for a in answers])
        features = breast_cancer_model.data.features[:128].astype(np.float32)
        np.testing.assert_array_equal(labels, breast_cancer_model.estimator.predict(features))
        assert httpx.get(ready, headers=auth).json()["state"] == "loaded"
        metrics = httpx.get(f"{metrics_url}/metrics").text
        assert 'shardline_model_loads_total{model="breast-cancer",version="1"} 2.0' in metrics
