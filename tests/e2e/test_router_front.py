"""`shardline router` with its data plane in front, as a user runs it where nginx's Lua module is installed
(online/router/nginx_front.py): pinned V2 inference answered by the fast lane, everything else by the router behind it, the tenants' quotas held once
for both lanes, the pins following an alias, a replica SIGKILLed under load through the fast lane, and the
fast lane's retries within the router's retry budget. The router's own relay is tested in test_router.py."""

from __future__ import annotations

import http.server
import os
import re
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import openai
import orjson
import pytest
import tritonclient.http as triton

from shardline.local_ports import reserve_port as free_port
from shardline.online.router.front import FAST_BODY_BYTES
from shardline.online.router.nginx_front import find_nginx
from shardline.online.router.placement import rank
from shardline.online.tenants import hash_api_key
from shardline.storage.registry import ModelRegistry
from shardline.storage.rollouts import Rollout
from tests.conftest import BuiltModel
from tests.e2e.conftest import SHARDLINE
from tests.support.routers import (
    CHURN,
    KEY,
    MODEL,
    TIGHT_KEY,
    _env,
    _eventually,
    _infer_body,
    _scrape,
    _stop,
    _wait_ready,
    home,  # noqa: F401 - the module's registry (breast-cancer, minilm, churn 1-3)
    none_lost,
    steady_load,
    v2_inputs,
)

pytestmark = pytest.mark.timeout(300)
NARROW_KEY = "sk-router-narrow"
PLANES = [pytest.param("nginx", marks=pytest.mark.skipif(find_nginx() is None, reason=(
              "nginx's Lua module is not installed (apt-get install nginx-light libnginx-mod-http-lua)")))]


@dataclass
class Edged:
    url: str
    log: Path
    replicas: dict[str, int]  # url -> pid
    metrics: str
    plane: str  # nginx
    folder: Path  # the data plane's files: its control socket


def _tenants(path: Path) -> Path:
    path.write_text(
        "tenants:\n"
        "  - name: acme\n"
        f"    api_keys_sha256: [\"{hash_api_key(KEY)}\"]\n"
        "    models: [\"breast-cancer@prod\", \"minilm@prod\", \"churn@prod\"]\n"
        "    rate: {requests_per_second: 5000, burst: 5000}\n"
        "    max_concurrent: 64\n"
        "  - name: tight\n"
        f"    api_keys_sha256: [\"{hash_api_key(TIGHT_KEY)}\"]\n"
        "    models: [\"breast-cancer@prod\", \"minilm@prod\"]\n"
        "    rate: {requests_per_second: 1, burst: 6}\n"
        "  - name: narrow\n"
        f"    api_keys_sha256: [\"{hash_api_key(NARROW_KEY)}\"]\n"
        "    models: [\"breast-cancer@prod\"]\n"
        "    max_concurrent: 2\n"
    )
    return path


@pytest.fixture(scope="module", params=PLANES)
def edged(home: Path, request: pytest.FixtureRequest) -> Iterator[Edged]:  # noqa: F811 - the imported fixture
    plane = request.param
    tenants = _tenants(home / f"tenants-edge-{plane}.yaml")
    port, metrics_port = free_port(), free_port()
    log = home / f"router-edge-{plane}.log"
    with open(log, "wb") as sink:
        router = subprocess.Popen([*SHARDLINE, "router", "--local-replicas", "3", "--tenants", str(tenants), "--port",
                                   str(port), "--metrics-port", str(metrics_port)],
                                  env=_env(home, SHARDLINE_ROUTER_DATA_PLANE=plane), stdout=sink,
                                  stderr=subprocess.STDOUT, cwd=home)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, router, log, available=3)
        text = log.read_text()
        replicas = {u: int(p) for p, u in re.findall(r"started replica \d \(pid (\d+)\) on (http://[0-9.:]+)", text)}
        folder = re.search(rf"{plane} \d+ in front of the router \(its files in (/\S+?)\)", text)
        logs = re.search(r"local replicas: .* \(logs in (/\S+?)\)", text)
        assert folder is not None and logs is not None and len(replicas) == 3, text[-3000:]
        yield Edged(url, log, replicas, f"http://127.0.0.1:{metrics_port}/metrics", plane, Path(folder.group(1)))
    finally:
        code = _stop(router)
    assert code in (0, -signal.SIGTERM), log.read_text()[-4000:]
    assert not Path(folder.group(1)).exists()  # the data plane stopped with the router, its folder removed
    assert not Path(logs.group(1)).exists()  # and the local replicas' (no shardline-* folder left in the temp dir)


def _control(edged: Edged, command: str) -> str:
    """One GET of nginx's control socket."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(edged.folder / "control.sock"))
        s.sendall(f"GET {command} HTTP/1.0\r\nHost: control\r\n\r\n".encode())
        return s.makefile().read().partition("\n\n")[2]


def _up(edged: Edged) -> dict[str, bool]:
    """host:port -> whether the fast lane sends the replica requests now, for the replicas it knows."""
    rows = [line.split() for line in _control(edged, "/counts").splitlines() if line.startswith("replica ")]
    return {r[1].removeprefix("http://"): r[3] == "1" for r in rows}


def _read_back(metrics: str, name: str, labels: tuple[tuple[str, str], ...]) -> float:
    """A count the router reads from the data plane every half second, once it has stopped changing: the same for
    1.5 s (three reads; on a loaded machine one read may come late, so a single wait of one period is not enough)."""
    value, steady_since, deadline = None, time.monotonic(), time.monotonic() + 30
    while True:
        now = _scrape(metrics).get((name, labels), 0.0)
        if now != value:
            value, steady_since = now, time.monotonic()
        elif time.monotonic() - steady_since >= 1.5:
            return value
        assert time.monotonic() < deadline, f"{name} never settled: last {value}"
        time.sleep(0.1)


def _fast_lane(edged: Edged, model: str) -> float:
    """Requests the fast lane answered for ``model`` (name:version), as the router last read them."""
    return _read_back(edged.metrics, "shardline_router_fast_lane_requests_total", (("model", model),))


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_is_answered_by_the_fast_lane_like_scikit_learn(
    edged: Edged, breast_cancer_model: BuiltModel, binary: bool
) -> None:
    before = _fast_lane(edged, f"{MODEL}:1")
    client = triton.InferenceServerClient(edged.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready()
    rows = breast_cancer_model.data.features[:16]  # within FAST_BODY_BYTES as JSON too, uncompressed
    outputs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("label", "probabilities")]
    for compression in ("gzip", None):
        result = client.infer(MODEL, v2_inputs(breast_cancer_model, rows, binary), outputs=outputs, headers=key(),
                              request_compression_algorithm=compression, request_id="via-the-fast-lane")
        np.testing.assert_array_equal(result.as_numpy("label"),
                                      breast_cancer_model.estimator.predict(rows.astype(np.float32)))
        assert result.get_response()["model_version"] == "1" and result.get_response()["id"] == "via-the-fast-lane"
    assert _fast_lane(edged, f"{MODEL}:1") == before + 2  # both answered by the fast lane, not the router
    metadata = client.get_model_metadata(MODEL, headers=key())  # the router's lane
    assert metadata["versions"] == ["1"] and [i["name"] for i in metadata["inputs"]] == breast_cancer_model.data.names


def test_kserve_v1_predict_is_answered_by_the_fast_lane_and_the_router_alike(edged: Edged,
                                                                            breast_cancer_model: BuiltModel) -> None:
    rows = breast_cancer_model.data.features[:16]
    expected = breast_cancer_model.estimator.predict(rows.astype(np.float32)).tolist()
    body = orjson.dumps({"instances": rows.tolist()})
    before = _fast_lane(edged, f"{MODEL}:1")
    with httpx.Client(base_url=edged.url, headers=key(), timeout=60) as client:
        fast = client.post(f"/v1/models/{MODEL}:predict", content=body)
        # a deadline is the router's to keep: the router's lane, the same answer
        routed = client.post(f"/v1/models/{MODEL}:predict", content=body, headers={"X-Shardline-Timeout-Ms": "5000"})
        wrong = client.post(f"/v1/models/{MODEL}:predict", content=b'{"instances": [[1.0]]}')
    assert fast.status_code == 200 and [p["label"] for p in fast.json()["predictions"]] == expected, fast.text
    assert routed.json() == fast.json()
    assert wrong.status_code == 400 and wrong.json()["error"].startswith("instances[0] is a list of 1 values")
    assert _fast_lane(edged, f"{MODEL}:1") == before + 2  # the first and the refused one: the replica's answers


def test_head_and_a_trailing_slash_through_the_front(edged: Edged, breast_cancer_model: BuiltModel) -> None:
    # HEAD reached the router as HEAD and waited ~10 s for a body no answer to HEAD has (then 503)
    plain = {**key(), "Accept-Encoding": "identity"}
    started = time.monotonic()
    head = httpx.head(f"{edged.url}/v2/models/{MODEL}", headers=plain, timeout=30)
    assert head.status_code == 200 and head.content == b"" and time.monotonic() - started < 4
    assert head.headers["content-length"] == httpx.get(f"{edged.url}/v2/models/{MODEL}", headers=plain).headers["content-length"]
    rows = breast_cancer_model.data.features[:2]
    body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [2], "data": rows[:, j].tolist()}
                       for j, n in enumerate(breast_cancer_model.data.names)]}
    scored = httpx.post(f"{edged.url}/v2/models/{MODEL}/infer/", json=body, headers=key())
    assert scored.status_code == 200 and scored.json()["model_version"] == "1"
    assert scored.json()["outputs"][0]["data"] == breast_cancer_model.estimator.predict(rows.astype(np.float32)).tolist()
    # a head past the limits: nginx answered its own 400 HTML page where serve and the router answer 431 JSON
    huge = httpx.get(f"{edged.url}/v2/models/{MODEL}", headers={**key(), "X-Big": "x" * 70_000})
    assert huge.status_code == 431, huge.text
    assert huge.json()["error"].startswith("the request's head is too large")


def test_the_fast_lane_places_a_model_where_the_router_does(edged: Edged, breast_cancer_model: BuiltModel) -> None:
    """nginx's lane walks the router's own rendezvous order for the pinned version."""

    def sent() -> dict[str, int]:
        return {r[1]: int(r[4]) for r in (line.split() for line in _control(edged, "/counts").splitlines())
                if r[0] == "replica"}

    before = sent()
    for _ in range(6):  # one at a time: the first in the order is never over its bound
        answer = httpx.post(f"{edged.url}/v2/models/{MODEL}/infer", content=_infer_body(breast_cancer_model),
                            headers=key())
        assert answer.status_code == 200 and answer.json()["model_version"] == "1", answer.text
    moved = {url: n - before.get(url, 0) for url, n in sent().items() if n != before.get(url, 0)}
    assert moved == {rank(f"{MODEL}:1", list(edged.replicas))[0]: 6}


def key() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_a_body_past_the_fast_lanes_limit_is_answered_by_the_router_behind(edged: Edged,
                                                                           breast_cancer_model: BuiltModel) -> None:
    """The fast lane holds a request whole (for a retry); a bigger body streams through the router."""
    names = breast_cancer_model.data.names
    small, big = (np.resize(breast_cancer_model.data.features, (n, len(names))) for n in (16, 400))
    before = _fast_lane(edged, f"{MODEL}:1")
    for rows in (small, big):
        body = orjson.dumps({"inputs": [{"name": name, "datatype": "FP32", "shape": [len(rows)],
                                         "data": rows[:, j].tolist()} for j, name in enumerate(names)]})
        assert (len(body) <= FAST_BODY_BYTES) == (rows is small)
        answer = httpx.post(f"{edged.url}/v2/models/{MODEL}/infer", content=body, headers=key(), timeout=30)
        assert answer.status_code == 200, answer.text
        label = next(o for o in answer.json()["outputs"] if o["name"] == "label")
        np.testing.assert_array_equal(label["data"], breast_cancer_model.estimator.predict(rows.astype(np.float32)))
    assert _fast_lane(edged, f"{MODEL}:1") == before + 1  # the small one only


def test_the_openai_client_and_a_deadline_go_to_the_router_behind(edged: Edged, breast_cancer_model: BuiltModel) -> None:
    client = openai.OpenAI(base_url=f"{edged.url}/v1", api_key=KEY, max_retries=0)
    assert client.embeddings.create(model="minilm", input="through the data plane").model == "minilm:1"
    with pytest.raises(openai.AuthenticationError, match="the API key is not valid"):
        openai.OpenAI(base_url=f"{edged.url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    before = _fast_lane(edged, f"{MODEL}:1")
    timed = httpx.post(f"{edged.url}/v2/models/{MODEL}/infer", content=_infer_body(breast_cancer_model),
                       headers={**key(), "X-Shardline-Timeout-Ms": "5000"})
    assert timed.status_code == 200 and timed.json()["model_version"] == "1"
    assert _fast_lane(edged, f"{MODEL}:1") == before  # a deadline is the router's to keep


def test_a_client_cannot_name_a_tenant_or_claim_its_quota_was_held(edged: Edged, breast_cancer_model: BuiltModel) -> None:
    refused = {code: _read_back(edged.metrics, "shardline_router_requests_total", (("code", str(code)), ("model", "-")))
               for code in (401, 404)}
    spoofed = httpx.get(f"{edged.url}/v2/models/minilm", headers={
        "Authorization": f"Bearer {NARROW_KEY}", "X-Shardline-Tenant": "acme", "X-Shardline-Gated": "acme"})
    assert spoofed.status_code == 404 and "not available to tenant 'narrow'" in spoofed.json()["error"]
    unknown = httpx.get(f"{edged.url}/v2/models/{MODEL}", headers={"Authorization": "Bearer not-a-key"})
    assert unknown.status_code == 401
    # what the router refuses itself is counted, as no model version (no replica ever saw it)
    for code, before in refused.items():
        labels = (("code", str(code)), ("model", "-"))
        assert _read_back(edged.metrics, "shardline_router_requests_total", labels) == before + 1, code
    replica = next(iter(edged.replicas))
    direct = httpx.get(f"{replica}/v2/models/{MODEL}", headers=key())
    assert direct.status_code == 401 and "only through its router" in direct.json()["error"]


def test_a_tenants_rate_is_held_once_for_both_lanes(edged: Edged, breast_cancer_model: BuiltModel) -> None:
    over_rate = (("quota", "rate"), ("tenant", "tight"))
    counted = _read_back(edged.metrics, "shardline_rate_limited_total", over_rate)
    body = _infer_body(breast_cancer_model)
    headers = {"Authorization": f"Bearer {TIGHT_KEY}", "X-Shardline-Gated": "tight"}  # a claim the data plane drops
    statuses, refused = [], []
    with httpx.Client(base_url=edged.url, headers=headers) as client:
        for i in range(20):  # fast lane, router lane (metadata), /v1 and KServe V1's predict, in turn
            answer = (client.post(f"/v2/models/{MODEL}/infer", content=body) if i % 4 == 0
                      else client.get(f"/v2/models/{MODEL}") if i % 4 == 1 else client.get("/v1/models") if i % 4 == 2
                      else client.post(f"/v1/models/{MODEL}:predict", content=b'{"instances": [[0.5]]}'))
            statuses.append(answer.status_code)
            if answer.status_code == 429:
                refused.append((i % 4, answer))
    # burst 6, and about 1 a second more: each lane counting its own would have let all 20 through (a predict
    # admitted is answered 400 by the replica: one value where the model takes 30)
    assert 6 <= len(statuses) - statuses.count(429) <= 8, statuses
    assert {s for i, s in enumerate(statuses) if i % 4 != 3} <= {200, 429} and set(statuses[3::4]) <= {400, 429}
    assert {lane for lane, _ in refused} == {0, 1, 2, 3}
    for lane, answer in refused:
        assert int(answer.headers["retry-after"]) >= 1
        message = answer.json()["error"]
        if lane == 2:  # OpenAI's form; KServe V1's predict, under /v1/ too, takes V2's
            assert message["type"] == "rate_limit_error" and message["code"] == "rate_limit_exceeded"
            message = message["message"]
        assert re.fullmatch(r"tenant 'tight' is over its rate of 1 requests/s \(burst 6\); retry after \d+ s", message)
    # every 429, whichever lane gave it, in the metric a server counts its own in (the dashboards' "Over quota")
    assert _read_back(edged.metrics, "shardline_rate_limited_total", over_rate) == counted + len(refused)


def test_a_tenants_concurrency_is_held_for_requests_in_flight(edged: Edged, breast_cancer_model: BuiltModel) -> None:
    body = _infer_body(breast_cancer_model)
    host, port = edged.url.removeprefix("http://").split(":")
    for _ in range(3):  # through the router's lane (a deadline): each counted in flight, and out again when done
        answer = httpx.post(f"{edged.url}/v2/models/{MODEL}/infer", content=body,
                            headers={"Authorization": f"Bearer {NARROW_KEY}", "X-Shardline-Timeout-Ms": "5000"})
        assert answer.status_code == 200, answer.text
    held = []
    for _ in range(2):  # two requests whose bodies have not all arrived: in flight
        s = socket.create_connection((host, int(port)))
        s.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {NARROW_KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:10])
        held.append(s)
    time.sleep(0.3)
    third = httpx.post(f"{edged.url}/v2/models/{MODEL}/infer", content=body,
                       headers={"Authorization": f"Bearer {NARROW_KEY}"})
    assert third.status_code == 429 and third.headers["retry-after"] == "1"
    assert third.json()["error"] == ("tenant 'narrow' has 2 requests in flight, its max_concurrent; wait for one to "
                                     "finish or ask for a larger quota")
    assert _read_back(edged.metrics, "shardline_rate_limited_total", (("quota", "concurrency"), ("tenant", "narrow"))) == 1
    for s in held:  # the rest of each body: both answered
        s.sendall(body[10:])
        answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        s.close()
    time.sleep(0.2)
    again = httpx.post(f"{edged.url}/v2/models/{MODEL}/infer", content=body,
                       headers={"Authorization": f"Bearer {NARROW_KEY}"})
    assert again.status_code == 200


def test_the_fast_lane_follows_an_alias_and_leaves_a_rollout_to_the_router(edged: Edged, home: Path,  # noqa: F811
                                                                          breast_cancer_model: BuiltModel) -> None:
    registry = ModelRegistry(str(home / "registry"))
    body = _infer_body(breast_cancer_model)

    def version() -> str:
        answer = httpx.post(f"{edged.url}/v2/models/{CHURN}/infer", content=body, headers=key())
        assert answer.status_code == 200, answer.text
        return str(answer.json()["model_version"])

    assert version() == "1"
    registry.set_alias(CHURN, "prod", 2, reason="the fast lane follows")
    try:
        _eventually(lambda: version() == "2", 20, "the fast lane never followed churn@prod to 2")
        before = _fast_lane(edged, f"{CHURN}:2")
        assert before >= 1
        # a rollout on the alias (as `shardline rollout start` records one): the router must see every request
        current = registry.current_move(CHURN, "prod")
        assert current is not None
        registry.move_alias(CHURN, "prod", 2, action="shadow", expected_seq=current.seq, by="test",
                            rollout=Rollout(id="edge-shadow-1", baseline=2, candidate=3, mode="shadow", shadow=1.0))
        _eventually(lambda: f"fast lane: acme/{CHURN} to the router" in edged.log.read_text(), 20,
                    "the pin was never taken off")
        counted = _fast_lane(edged, f"{CHURN}:2")
        assert [version() for _ in range(5)] == ["2"] * 5  # shadow answers never reach the caller
        assert _fast_lane(edged, f"{CHURN}:2") == counted
    finally:
        registry.set_alias(CHURN, "prod", 1, reason="back")
    _eventually(lambda: version() == "1", 20, "the fast lane never came back to churn 1")


def test_a_replica_killed_under_load_loses_no_request_through_the_fast_lane(edged: Edged,
                                                                      breast_cancer_model: BuiltModel) -> None:
    body = _infer_body(breast_cancer_model)
    expected = breast_cancer_model.estimator.predict(breast_cancer_model.data.features[:4].astype(np.float32)).tolist()

    before_fast = _fast_lane(edged, f"{MODEL}:1")
    with steady_load(edged.url, body) as outcomes:
        time.sleep(1.0)
        busiest = max(edged.replicas, key=lambda u: int(_scrape(edged.metrics).get(
            ("shardline_router_replica_in_flight", (("group", "local"), ("replica", u))), 0)))
        victim = busiest.removeprefix("http://")
        before = len(outcomes)
        os.kill(edged.replicas[busiest], signal.SIGKILL)
        _eventually(lambda: _up(edged).get(victim) is False, 20, f"the fast lane never took {victim} out: {_up(edged)}")
        _eventually(lambda: re.search(r"replica \d exited with -9", edged.log.read_text()), 20, "no restart")
        _eventually(lambda: _up(edged).get(victim) is True, 60, f"the fast lane never put {victim} back: {_up(edged)}")
        time.sleep(1.0)
    answered = none_lost(outcomes, before, expected)
    assert _fast_lane(edged, f"{MODEL}:1") - before_fast >= len(answered) * 0.9  # the fast lane carried the load
    assert set(_up(edged).values()) == {True} and len(_up(edged)) == 3


class _Shedding(http.server.BaseHTTPRequestHandler):
    """A replica that is up (ready) and sheds every inference request, as an overloaded one does (503, Retry-After)."""

    protocol_version = "HTTP/1.1"
    hits = 0
    lock = threading.Lock()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer(200 if self.path == "/v2/health/ready" else 404)

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length", 0)))
        with self.lock:
            type(self).hits += 1
        self._answer(503)

    def _answer(self, status: int) -> None:
        body = b'{"error": "overloaded; retry after the Retry-After seconds"}' if status == 503 else b"{}"
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        if status == 503:
            self.send_header("retry-after", "1")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, *args: Any) -> None:
        pass  # the data plane drops the connection of an answer it retries elsewhere


@pytest.mark.parametrize("plane", PLANES)
def test_the_fast_lane_retries_within_the_routers_one_retry_budget(home: Path,  # noqa: F811
                                                                   breast_cancer_model: BuiltModel, plane: str) -> None:
    # Every request to a group that sheds all it gets would be tried 1 + 2 times without a budget: the fast lane's
    # retries count in the router's budget (10% of the requests here, no floor), and the router's own lane finds
    # it spent.
    _Shedding.hits = 0
    stub = _QuietServer(("127.0.0.1", 0), _Shedding)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    config = home / "router-shedding.yaml"
    config.write_text(f"groups:\n  - name: shed\n    replicas: [\"http://127.0.0.1:{stub.server_address[1]}\"]\n")
    port, metrics_port = free_port(), free_port()
    log = home / f"router-budget-{plane}.log"
    with open(log, "wb") as sink:
        router = subprocess.Popen(
            [*SHARDLINE, "router", "--config", str(config), "--tenants", str(_tenants(home / "tenants-budget.yaml")),
             "--port", str(port), "--metrics-port", str(metrics_port)],
            env=_env(home, SHARDLINE_ROUTER_DATA_PLANE=plane, SHARDLINE_ROUTER_KEY="router-key-for-the-budget-test",
                     SHARDLINE_ROUTER_RETRY_BUDGET_RATIO="0.1", SHARDLINE_ROUTER_RETRY_MIN_PER_S="0"),
            stdout=sink, stderr=subprocess.STDOUT)
    url, body, rate, n = f"http://127.0.0.1:{port}", _infer_body(breast_cancer_model), 40, 200
    try:
        _wait_ready(url, router, log, available=1)
        _eventually(lambda: f"fast lane: acme/{MODEL} ->" in log.read_text(), 20, "the model was never pinned")
        start, statuses = time.monotonic(), []
        with httpx.Client(base_url=url, headers=key(), timeout=10) as client:
            for i in range(n):  # 40 a second, for 5 s (inside the budget's 10 s window)
                time.sleep(max(0.0, start + i / rate - time.monotonic()))
                statuses.append(client.post(f"/v2/models/{MODEL}/infer", content=body).status_code)
            retries = _Shedding.hits - n
            counted = _read_back(f"http://127.0.0.1:{metrics_port}/metrics", "shardline_router_fast_lane_retries_total",
                                 (("group", "shed"),))
            routed = client.post(f"/v2/models/{MODEL}/infer", content=body, headers={"x-shardline-timeout-ms": "5000"})
        assert statuses == [503] * n and routed.status_code == 503, routed.text
        assert counted == retries  # the fast lane's retries, read back into the router's metrics
        assert 1 <= retries <= 0.1 * n + 2 * rate * 2, retries  # within a tick or two of the budget; without: 400
        assert _Shedding.hits - n - retries - 1 <= max(0, int(0.1 * (n + 1)) - retries)  # the router's lane: what is left
        assert "fast lane: out of the retry budget" in log.read_text()
    finally:
        _stop(router)
        stub.shutdown()
