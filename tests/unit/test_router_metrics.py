"""The router's per-request series (tallied on the request path, exported at each scrape) read as
Prometheus reads them, and the request ids it makes for requests that come without one."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from shardline.online.router.config import RouterConfig
from shardline.online.router.health import BreakerPolicy
from shardline.online.router.metrics import LATENCY_BUCKETS, RouterMetrics
from shardline.online.router.replicas import ReplicaSet
from shardline.online.router.messages import new_request_id


def _metrics() -> RouterMetrics:
    config = RouterConfig.model_validate({"groups": [{"name": "g", "replicas": ["http://127.0.0.1:1"]}]})
    return RouterMetrics(ReplicaSet(config, BreakerPolicy(), 10.0, lambda: 0.0), lambda: 0.0)


def _samples(metrics: RouterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.exposition()[0].decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_answers_are_counted_by_model_and_code_and_timed_in_cumulative_buckets() -> None:
    metrics = _metrics()
    for model, status, seconds in [("m:1", 200, 0.0004), ("m:1", 200, 0.003), ("m:1", 503, 0.2), ("m:1", 200, 50.0),
                                   ("m:1", 200, 0.001), ("-", 401, 0.0001)]:
        metrics.started(model)
        metrics.answered(model, status, seconds, 0)
    got = _samples(metrics)
    assert got[("shardline_router_requests_total", (("code", "200"), ("model", "m:1")))] == 4
    assert got[("shardline_router_requests_total", (("code", "503"), ("model", "m:1")))] == 1
    assert got[("shardline_router_requests_total", (("code", "401"), ("model", "-")))] == 1
    bucket = {le: got[("shardline_router_request_seconds_bucket", (("le", le), ("model", "m:1")))]
              for le in ("0.001", "0.005", "0.25", "30.0", "+Inf")}
    assert bucket == {"0.001": 2, "0.005": 3, "0.25": 4, "30.0": 4, "+Inf": 5}  # 0.001 is in le="0.001"
    assert got[("shardline_router_request_seconds_count", (("model", "m:1"),))] == 5
    assert abs(got[("shardline_router_request_seconds_sum", (("model", "m:1"),))] - 50.2044) < 1e-9
    assert len([k for k in got if k[0] == "shardline_router_request_seconds_bucket" and k[1][1] == ("model", "m:1")]) \
        == len(LATENCY_BUCKETS) + 1
    assert got[("shardline_router_in_flight", (("model", "m:1"),))] == 0


def test_request_ids_are_32_hex_digits_and_never_repeat() -> None:
    ids = [new_request_id() for _ in range(10_000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)
