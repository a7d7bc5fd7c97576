"""Traces as a user turns them on (the standard ``OTEL_*`` variables), sent to an OTLP receiver on loopback:
`shardline router --local-replicas 1` (the router alone, and nginx in front) over a real `shardline serve`
replica, with a V2 inference and a streamed chat completion. The client's ``traceparent`` is the root; the
router's server span, the replica's, the batcher's and the runtime's hang under it; a stream's spans last
until its last token; the access log carries the trace id. Tracing off (the default) exports nothing and
still writes the caller's trace id in the access log."""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import orjson
import pytest

from shardline.build.examples import breast_cancer
from shardline.build.llm_build import package_tiny_llm
from shardline.local_ports import reserve_port as free_port
from shardline.online.router.nginx_front import find_nginx
from shardline.online.tenants import hash_api_key
from shardline.storage.registry import ModelRegistry
from tests.e2e.conftest import SHARDLINE
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.support.routers import _env, _stop, _wait_ready
from tests.tensor_models import breast_cancer_bundle

KEY = "sk-traced"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{CALLER}-01"
SERVER, INTERNAL = 2, 1
pytestmark = pytest.mark.timeout(300)


@dataclass
class Traced:
    url: str
    log: Path
    receiver: OtlpReceiver | None
    plane: str


def _home(home: Path) -> Path:
    package_tiny_llm(home / "tiny-bundle", name="tiny")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias("tiny", "prod", registry.push(home / "tiny-bundle").version or 1)
    registry.set_alias("churn", "prod", registry.push(breast_cancer_bundle(home / "churn", "churn", "logreg")).version or 1)
    tenants = home / "tenants.yaml"
    tenants.write_text("tenants:\n  - name: acme\n"
                       f"    api_keys_sha256: [\"{hash_api_key(KEY)}\"]\n"
                       "    models: [\"tiny@prod\", \"churn@prod\"]\n")
    return tenants


def _start(home: Path, plane: str, receiver: OtlpReceiver | None) -> Iterator[Traced]:
    tenants = _home(home)
    otel = ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
             "OTEL_BSP_SCHEDULE_DELAY": "200"} if receiver is not None else {})
    port = free_port()
    log = home / "router.log"
    with open(log, "wb") as sink:
        router = subprocess.Popen([*SHARDLINE, "router", "--local-replicas", "1", "--tenants", str(tenants),
                                   "--port", str(port), "--metrics-port", str(free_port())],
                                  env=_env(home, SHARDLINE_ROUTER_DATA_PLANE=plane, **otel),
                                  stdout=sink, stderr=subprocess.STDOUT, cwd=home)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, router, log, available=1)
        yield Traced(url, log, receiver, plane)
    finally:
        _stop(router)


@pytest.fixture(scope="module", params=["python", "nginx"])
def traced(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    if request.param == "nginx" and find_nginx() is None:
        pytest.skip("nginx with its Lua module is not installed (make setup installs it)")
    with OtlpReceiver() as receiver:
        yield from _start(tmp_path_factory.mktemp(f"traced-{request.param}"), request.param, receiver)


def _infer_body() -> bytes:
    data = breast_cancer()
    rows = data.features[:4]
    return orjson.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [4], "data": rows[:, j].tolist()}
                                    for j, n in enumerate(data.names)]})


def _headers(traceparent: str = TRACEPARENT) -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}", "traceparent": traceparent}


def _trace(receiver: OtlpReceiver, trace_id: str, names: set[str]) -> dict[str, ReceivedSpan]:
    spans = receiver.wait_for(lambda got: names <= {s.name for s in got if s.trace_id == trace_id})
    mine = {s.name: s for s in spans if s.trace_id == trace_id}
    assert names <= set(mine), f"spans of trace {trace_id}: {sorted(mine)}; wanted {sorted(names)}"
    return mine


def test_an_inference_is_one_trace_from_the_callers_span_to_the_runtime(traced: Traced) -> None:
    assert traced.receiver is not None
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    answer = httpx.post(f"{traced.url}/v2/models/churn/infer", content=_infer_body(),
                        headers=_headers(f"00-{trace_id}-{CALLER}-01"), timeout=30)
    assert answer.status_code == 200, answer.text
    spans = _trace(traced.receiver, trace_id, {"shardline.runtime.predict"})
    traced.receiver.wait_for(lambda got: any(s.trace_id == trace_id and s.service == "shardline-serve"
                                             and s.kind == SERVER for s in got))
    # the replica's path names the version the router pinned (nginx's lane: the path as the caller sent it)
    replica = next(s for s in traced.receiver.spans if s.trace_id == trace_id and s.service == "shardline-serve"
                   and s.kind == SERVER)
    assert replica.name.startswith("POST /v2/models/churn/") and replica.name.endswith("/infer")
    assert replica.kind == SERVER and replica.attributes["http.response.status_code"] == 200
    assert replica.attributes["shardline.model"] == "churn" and replica.attributes["shardline.tenant"] == "acme"
    assert traced.plane == "nginx" or replica.parent_id != CALLER  # the router alone is always in the path
    if replica.parent_id != CALLER:  # through the router (nginx's fast lane passes the caller's traceparent on)
        routers = [s for s in traced.receiver.wait_for(lambda got: any(
            s.trace_id == trace_id and s.service == "shardline-router" for s in got)) if s.trace_id == trace_id
            and s.service == "shardline-router"]
        (router,) = routers
        assert router.kind == SERVER and router.parent_id == CALLER and replica.parent_id == router.span_id
        assert router.start_ns <= replica.start_ns <= router.end_ns  # (its end adds the access log line after)
    predict = spans["shardline.runtime.predict"]
    assert predict.attributes["shardline.batch.rows"] >= 4 and predict.attributes["shardline.model"] == "churn:1"
    below = {s.span_id: s for s in traced.receiver.spans if s.trace_id == trace_id}
    chain, span = [], predict  # the runtime's call hangs under the replica's span, through the batcher or directly
    while span.parent_id in below:
        span = below[span.parent_id]
        chain.append(span.name)
    assert replica.name in chain, chain
    assert len([s for s in below.values() if s.name == "shardline.runtime.predict"]) == 1


def test_a_streams_spans_last_until_its_last_token_with_the_genai_attributes(traced: Traced) -> None:
    assert traced.receiver is not None
    trace_id = "5b8efff798038103d269b633813fc60c"
    body = {"model": "tiny@prod", "messages": [{"role": "user", "content": "tell a story"}], "max_tokens": 24,
            "stream": True}
    with httpx.stream("POST", f"{traced.url}/v1/chat/completions", json=body,
                      headers=_headers(f"00-{trace_id}-{CALLER}-01"), timeout=60) as answer:
        assert answer.status_code == 200
        lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
        done = time.time_ns()
    assert lines[-1] == "data: [DONE]"
    spans = _trace(traced.receiver, trace_id, {"chat tiny", "POST /v1/chat/completions"})
    generation = spans["chat tiny"]
    assert generation.attributes["gen_ai.operation.name"] == "chat"
    assert generation.attributes["gen_ai.request.model"] == "tiny"
    assert generation.attributes["gen_ai.usage.output_tokens"] == 24
    assert generation.attributes["gen_ai.usage.input_tokens"] > 0
    assert generation.attributes["gen_ai.response.finish_reasons"] == ["length"]
    servers = [s for s in traced.receiver.wait_for(lambda got: len(
        [s for s in got if s.trace_id == trace_id and s.kind == SERVER]) >= 2) if s.trace_id == trace_id
        and s.kind == SERVER]  # /v1 goes through the router on both planes: its span, and the replica's
    assert {s.service for s in servers} == {"shardline-router", "shardline-serve"} and all(s.parent_id in {CALLER} | {o.span_id for o in servers} for s in servers)
    for server in servers:  # every server span ends after the generation's last token, not when its handler returned
        assert server.end_ns >= generation.end_ns, (server.service, server.end_ns - generation.end_ns)
        assert server.end_ns <= done + 1_000_000_000  # (clocks of one machine)


def test_the_access_log_carries_the_trace_id(traced: Traced) -> None:
    trace_id = "c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6"
    answer = httpx.post(f"{traced.url}/v2/models/churn/infer", content=_infer_body(),
                        headers=_headers(f"00-{trace_id}-{CALLER}-01"), timeout=30)
    assert answer.status_code == 200
    lines = _lines_of_trace(traced.log, trace_id)
    assert any(line.get("msg") == "request" and line["trace_id"] == trace_id for line in lines), lines


def _lines_of_trace(router_log: Path, trace_id: str, timeout_s: float = 10) -> list[dict[str, object]]:
    """The replicas' JSON log lines of the trace, once its access-log line is there (the access log is written in
    batches, at most 0.25 s late, after the lines logged while the request ran)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [orjson.loads(line) for line in _replica_logs(router_log).splitlines()
                 if line.startswith("{") and trace_id in line]
        if any(line.get("msg") == "request" for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


def _replica_logs(router_log: Path) -> str:
    """The local replicas' logs (in the folder the router's log names)."""
    folder = re.search(r"\(logs in (\S+)\)", router_log.read_text(errors="replace"))
    assert folder is not None, router_log.read_text()
    return "".join(p.read_text(errors="replace") for p in sorted(Path(folder.group(1)).glob("replica-*.log")))


def test_tracing_off_exports_nothing_and_the_log_still_names_the_callers_trace(
        tmp_path: Path) -> None:
    with OtlpReceiver() as receiver:
        for off in _start(tmp_path, "python", None):
            answer = httpx.post(f"{off.url}/v2/models/churn/infer", content=_infer_body(), headers=_headers(),
                                timeout=30)
            assert answer.status_code == 200
            lines = _lines_of_trace(off.log, TRACE)
            assert any(line.get("msg") == "request" and line["trace_id"] == TRACE for line in lines), lines
        assert receiver.spans == []
