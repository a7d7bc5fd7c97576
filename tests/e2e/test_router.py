"""`shardline router` as a user runs it: a subprocess over 3 `shardline serve` replicas it starts itself
(and, for failover, one over two groups of replicas started by hand), spoken to with tritonclient, the
openai client and plain HTTP; a replica SIGKILLed under load; rollouts started and ended with
`shardline rollout`, stepped, promoted and rolled back by the router itself.

The router relays every request itself here (SHARDLINE_ROUTER_DATA_PLANE=python: what runs where
nginx's Lua module is not installed, and what answers every request nginx passes on); test_router_front.py
runs it with nginx in front."""

from __future__ import annotations

import hashlib
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
from shardline.online.router.placement import rank
from shardline.storage.registry import AliasMove, ModelRegistry
from tests.conftest import BuiltModel
from tests.e2e.conftest import SHARDLINE
from tests.support.routers import (
    CHURN,
    KEY,
    MODEL,
    PLANES,
    TIGHT_KEY,
    _churn,
    _env,
    _eventually,
    _infer_body,
    _scrape,
    _stop,
    _tenants,
    _wait_for_log,
    _wait_ready,
    home,  # noqa: F401 - the module's registry (a fixture)
    key,
    none_lost,
    steady_load,
    v2_inputs,
)
from tests.tensor_models import mlp_bundle

pytestmark = pytest.mark.timeout(300)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


@dataclass
class Routed:
    url: str
    log: Path
    replicas: dict[str, int]  # url -> pid, as the router started them
    metrics: str


@pytest.fixture(scope="module")
def routed(home: Path, prefect_api: str) -> Iterator[Routed]:
    """`shardline router --local-replicas 3`, ready with all three (its rollout events go to the session's
    Prefect server)."""
    tenants = _tenants(home / "tenants.yaml")
    port = free_port()
    log = home / "router.log"
    with open(log, "wb") as sink:
        metrics_port = free_port()
        router = subprocess.Popen([*SHARDLINE, "router", "--local-replicas", "3", "--tenants", str(tenants), "--port",
                                   str(port), "--metrics-port", str(metrics_port)],
                                  # health checks every 10 s: the SIGKILL test's breaker must open on the failed
                                  # requests before an active check takes the replica out (1 s made that a race)
                                  env=_env(home, PREFECT_API_URL=prefect_api, SHARDLINE_ROUTER_HEALTH_INTERVAL_S="10"),
                                  stdout=sink,
                                  stderr=subprocess.STDOUT, cwd=home)
    url = f"http://127.0.0.1:{port}"
    replicas: dict[str, int] = {}
    try:
        _wait_ready(url, router, log, available=3)
        for pid, replica in re.findall(r"started replica \d \(pid (\d+)\) on (http://[0-9.:]+)", log.read_text()):
            replicas[replica] = int(pid)
        assert len(replicas) == 3
        yield Routed(url, log, replicas, f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        code = _stop(router)
    assert code in (0, -signal.SIGTERM), log.read_text()[-4000:]  # uvicorn re-raises the signal after a clean stop
    pids = [int(p) for p in re.findall(r"started replica \d \(pid (\d+)\)", log.read_text())]
    assert pids and not any(_alive(p) for p in pids)  # the router stopped every replica it started


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_through_the_router_scores_like_scikit_learn(
    routed: Routed, breast_cancer_model: BuiltModel, binary: bool
) -> None:
    client = triton.InferenceServerClient(routed.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready()
    rows = breast_cancer_model.data.features[:40]
    outputs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("label", "probabilities")]
    result = client.infer(MODEL, v2_inputs(breast_cancer_model, rows, binary), outputs=outputs, headers=key(),
                          request_compression_algorithm="gzip", request_id="via-router")

    np.testing.assert_array_equal(result.as_numpy("label"), breast_cancer_model.estimator.predict(rows.astype(np.float32)))
    assert result.get_response()["model_version"] == "1"  # the alias pinned at the router
    assert result.get_response()["id"] == "via-router"
    metadata = client.get_model_metadata(MODEL, headers=key())
    assert metadata["versions"] == ["1"] and [i["name"] for i in metadata["inputs"]] == breast_cancer_model.data.names
    assert client.is_model_ready(MODEL, "1", headers=key())
    assert client.get_model_config(MODEL, headers=key())["version_policy"] == {"specific": {"versions": [1]}}


def test_the_openai_client_through_the_router(routed: Routed) -> None:
    client = openai.OpenAI(base_url=f"{routed.url}/v1", api_key=KEY, max_retries=0)
    one = client.embeddings.create(model="minilm", input="the router pins minilm@prod")
    assert one.model == "minilm:1" and len(one.data[0].embedding) == 384
    assert {m.id for m in client.models.list()} >= {"minilm", MODEL}
    assert client.models.retrieve("minilm").id == "minilm"  # GET /v1/models/{model}, passed on to a replica
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4' is not available to tenant 'acme'"):
        client.embeddings.create(model="gpt-4", input="hi")
    with pytest.raises(openai.BadRequestError, match="breast-cancer:1 is not an embedding model"):
        client.embeddings.create(model=MODEL, input="hi")
    with pytest.raises(openai.AuthenticationError, match="the API key is not valid"):
        openai.OpenAI(base_url=f"{routed.url}/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_kserve_v1_predict_through_the_router_pins_the_alias(routed: Routed, breast_cancer_model: BuiltModel) -> None:
    rows = breast_cancer_model.data.features[:20]
    body = orjson.dumps({"instances": rows.tolist()})
    with httpx.Client(base_url=routed.url, headers=key(), timeout=60) as client:
        before = _scrape(routed.metrics).get(("shardline_router_requests_total", (("code", "200"), ("model", f"{MODEL}:1"))), 0)
        latest = client.post(f"/v1/models/{MODEL}:predict", content=body)
        pinned = client.post(f"/v1/models/{MODEL}/versions/1:predict", content=body)
        unknown = client.post(f"/v1/models/{MODEL}/versions/7:predict", content=body)
        hidden = client.post("/v1/models/gpt-4:predict", content=body)
        short = client.post(f"/v1/models/{MODEL}:predict", content=b'{"instances": [[1.0]]}')
    wrong = httpx.post(f"{routed.url}/v1/models/{MODEL}:predict", content=body, headers={"Authorization": "Bearer sk-no"})

    assert latest.status_code == 200, latest.text
    assert [p["label"] for p in latest.json()["predictions"]] == breast_cancer_model.estimator.predict(
        rows.astype(np.float32)).tolist()
    assert pinned.json() == latest.json()
    # the router's own refusals and the replica's, all in V2's form (KServe V1's), not OpenAI's, though under /v1/
    assert unknown.status_code == 404 and unknown.json() == {
        "error": "breast-cancer:7 does not exist; model 'breast-cancer' has versions [1]"}
    assert hidden.status_code == 404 and list(hidden.json()) == ["error"]
    assert hidden.json()["error"].startswith("model 'gpt-4' is not available to tenant 'acme'")
    assert short.status_code == 400 and short.json()["error"].startswith("instances[0] is a list of 1 values")
    assert wrong.status_code == 401 and wrong.json()["error"].startswith("the API key is not valid")
    after = _scrape(routed.metrics)[("shardline_router_requests_total", (("code", "200"), ("model", f"{MODEL}:1")))]
    assert after == before + 2  # both answers counted under the version the alias pinned
    # V1's liveness and readiness, as KServe's client asks them
    assert httpx.get(routed.url + "/").json() == {"status": "alive"}
    assert httpx.get(f"{routed.url}/v1/models/{MODEL}", headers=key()).json()["ready"] is True


def test_a_malformed_content_length_gets_the_routers_json_400(routed: Routed) -> None:
    port = int(routed.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in status.lower(), answer
    assert orjson.loads(body) == {"error": "the request is not valid HTTP/1.1 (Invalid character in Content-Length); "
                                           "send Content-Length once, the body's size in ASCII digits"}


def test_a_blank_text_through_the_router_is_the_replicas_400_naming_the_entry(routed: Routed) -> None:
    # whitespace only was embedded as the empty string's vector, through the router as on serve
    with httpx.Client(base_url=routed.url, headers=key()) as client:
        answer = client.post("/v1/embeddings", json={"model": "minilm", "input": ["one", " \n "]})
        v2 = client.post("/v2/models/minilm/infer", json={"inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [2], "data": ["\t", "two"]}]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "input[1]"
    assert answer.json()["error"]["message"] == ("field 'input[1]' is only whitespace; send the text to embed or "
                                                 "leave the entry out")
    assert v2.status_code == 400
    assert v2.json() == {"error": "input 'text': element 0 is only whitespace; send the text to embed in each "
                                  "element, or leave that one out"}


def test_a_get_on_infer_is_the_replicas_405_naming_the_path_as_sent(routed: Routed) -> None:
    # the router pinned the version of any /infer, a GET's too: the 405 named a path the client never sent
    got = httpx.get(f"{routed.url}/v2/models/{MODEL}/infer", headers=key())
    assert got.status_code == 405 and got.json()["error"] == f"/v2/models/{MODEL}/infer does not take GET"


def test_head_and_a_trailing_slash_are_answered_as_serve_answers_them(routed: Routed,
                                                                      breast_cancer_model: BuiltModel) -> None:
    # HEAD was relayed as HEAD: the router's parser then waited for the body the answer's Content-Length
    # promised until the replica closed the connection (~5 s), counted a failed try, tried another replica and
    # fed both breakers, and answered 503 after 10 s. A trailing slash got the replica's redirect to its own
    # address, which takes requests only from the router.
    plain = {**key(), "Accept-Encoding": "identity"}
    failures_before = routed.log.read_text().count("failed:")
    started = time.monotonic()
    head = httpx.head(f"{routed.url}/v2/models/{MODEL}", headers=plain, timeout=30)
    metadata = httpx.get(f"{routed.url}/v2/models/{MODEL}", headers=plain)
    assert head.status_code == 200 and head.content == b"" and time.monotonic() - started < 4
    assert head.headers["content-length"] == metadata.headers["content-length"] == str(len(metadata.content))
    assert httpx.head(f"{routed.url}/v1/models", headers=key(), timeout=30).status_code == 200
    for path in ("/v2/", f"/v2/models/{MODEL}/", "/v1/models/"):
        got = httpx.get(routed.url + path, headers=key())
        assert got.status_code == 200 and got.json() == httpx.get(routed.url + path[:-1], headers=key()).json(), path
    assert httpx.post(f"{routed.url}/v1/embeddings/", headers=key(),
                      json={"model": "minilm", "input": "slash"}).json()["model"] == "minilm:1"  # pinned as without
    scored = httpx.post(f"{routed.url}/v2/models/{MODEL}/infer/", content=_infer_body(breast_cancer_model), headers=key())
    assert scored.status_code == 200 and scored.json()["model_version"] == "1"
    assert routed.log.read_text().count("failed:") == failures_before  # no replica blamed



def test_versions_made_up_by_a_client_add_no_series(routed: Routed, breast_cancer_model: BuiltModel) -> None:
    # Each version string a client sent became a label of its own (a counter, 16 histogram lines, an in-flight
    # gauge), though no replica had it: a tenant could grow the router's series without bound.
    body = _infer_body(breast_cancer_model)
    made_up = [f"{MODEL}:{n}" for n in (1001, 1002, 1003)] + [f"{MODEL}:zz1001", "minilm:abc1001"]
    with httpx.Client(base_url=routed.url, headers=key()) as client:
        before = _scrape(routed.metrics)
        assert [client.post(f"/v2/models/{MODEL}/versions/{n}/infer", content=body).status_code
                for n in (1001, 1002, 1003)] == [404] * 3
        assert client.get(f"/v2/models/{MODEL}/versions/zz1001").status_code == 400  # not a version number
        assert client.post("/v1/embeddings", json={"model": "minilm:abc1001", "input": "x"}).status_code == 400
        # a version that exists labels its series once a replica has answered it (churn:2, no alias points at it)
        named = client.post(f"/v2/models/{CHURN}/versions/2/infer", content=body)
        assert named.status_code == 200 and named.json()["model_version"] == "2"
    series = _scrape(routed.metrics)
    labels = {dict(labels).get("model") for _, labels in series}
    assert not labels & set(made_up), sorted(m for m in labels if m and m in made_up)
    assert series[("shardline_router_requests_total", (("code", "200"), ("model", f"{CHURN}:2")))] == 1
    # counted as no model version: 3 answers 404 and two 400 more than before, and nothing left in flight
    dash = (("model", "-"),)
    assert (series[("shardline_router_requests_total", (("code", "404"), *dash))]
            - before.get(("shardline_router_requests_total", (("code", "404"), *dash)), 0)) == 3
    assert (series[("shardline_router_requests_total", (("code", "400"), *dash))]
            - before.get(("shardline_router_requests_total", (("code", "400"), *dash)), 0)) == 2
    in_flight = {dict(labels)["model"]: value for (name, labels), value in series.items()
                 if name == "shardline_router_in_flight"}
    assert set(in_flight.values()) <= {0.0} and f"{CHURN}:2" not in in_flight, in_flight  # taken and given back as '-'


def test_replicas_take_requests_only_through_the_router(routed: Routed, breast_cancer_model: BuiltModel) -> None:
    replica = next(iter(routed.replicas))
    direct = httpx.get(f"{replica}/v2/models/{MODEL}", headers=key())
    assert direct.status_code == 401 and "only through its router" in direct.json()["error"]
    # a client cannot name another tenant: the router sends the tenant its key belongs to
    spoofed = httpx.get(f"{routed.url}/v2/models/minilm", headers={"Authorization": f"Bearer {TIGHT_KEY}",
                                                                   "X-Shardline-Tenant": "acme"})
    assert spoofed.status_code == 404 and "not available to tenant 'tight'" in spoofed.json()["error"]


def test_a_tenants_rate_is_held_for_all_replicas_together(routed: Routed, breast_cancer_model: BuiltModel) -> None:
    rows = breast_cancer_model.data.features[:1]
    body = orjson.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [1], "data": [float(rows[0, j])]}
                                    for j, n in enumerate(breast_cancer_model.data.names)]})
    with httpx.Client(base_url=routed.url, headers={"Authorization": f"Bearer {TIGHT_KEY}"}) as client:
        statuses = [client.post(f"/v2/models/{MODEL}/infer", content=body).status_code for _ in range(15)]
        refused = client.post(f"/v2/models/{MODEL}/infer", content=body)
    # burst 5 (and about 1 a second more): with a share per replica, 3 replicas would have let ~15 through
    assert 5 <= statuses.count(200) <= 7 and statuses.count(429) == 15 - statuses.count(200), statuses
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert "over its rate of 1 requests/s" in refused.json()["error"]
    # as `shardline serve` holds it: every request with a key counts, health checks do not
    with httpx.Client(base_url=routed.url, headers={"Authorization": f"Bearer {TIGHT_KEY}"}) as client:
        paths = ["/v2", "/v1/models", f"/v1/models/{MODEL}", f"/v2/models/{MODEL}", f"/v2/models/{MODEL}/ready"]
        held = [client.get(path).status_code for path in paths]
        # 429 each (the rate gives one token a second back: one may have come in the meantime)
        assert held.count(429) >= len(paths) - 1 and set(held) <= {200, 429}, held
        assert [client.get(p).status_code for p in ("/v2/health/live", "/v2/health/ready", "/health")] == [200] * 3
    unknown = httpx.get(f"{routed.url}/v2/models/{MODEL}", headers={"Authorization": "Bearer not-a-key"})
    assert unknown.status_code == 401
    # what the router refused itself is counted: as no model version (no replica saw it), and by the quota
    series = _scrape(routed.metrics)
    assert series[("shardline_rate_limited_total", (("quota", "rate"), ("tenant", "tight")))] == statuses.count(429) + 1 + held.count(429)
    assert series[("shardline_router_requests_total", (("code", "429"), ("model", "-")))] >= statuses.count(429) + 1 + held.count(429)
    assert series[("shardline_router_requests_total", (("code", "401"), ("model", "-")))] >= 1


def test_a_replica_killed_under_load_loses_no_request_and_its_breaker_recovers(
    routed: Routed, breast_cancer_model: BuiltModel
) -> None:
    body = _infer_body(breast_cancer_model)
    expected = breast_cancer_model.estimator.predict(breast_cancer_model.data.features[:4].astype(np.float32)).tolist()
    victim = rank(f"{MODEL}:1", list(routed.replicas))[0]  # the replica the model's requests go to first
    with steady_load(routed.url, body) as outcomes:
        time.sleep(1.0)
        before = len(outcomes)
        os.kill(routed.replicas[victim], signal.SIGKILL)
        _wait_for_log(routed.log, re.escape(victim) + r": breaker closed -> open", 20)
        _wait_for_log(routed.log, r"replica \d exited with -9", 20)
        _wait_for_log(routed.log, re.escape(victim) + r": breaker open -> half_open", 60)
        _wait_for_log(routed.log, re.escape(victim) + r": breaker half_open -> closed", 30)
    answered = none_lost(outcomes, before, expected)
    ready = httpx.get(f"{routed.url}/v2/health/ready").json()
    assert ready == {"ready": True, "group": "local", "available": 3}
    series = _scrape(routed.metrics)
    assert series[("shardline_router_requests_total", (("code", "200"), ("model", f"{MODEL}:1")))] >= len(answered)
    assert series[("shardline_router_retries_total", (("model", f"{MODEL}:1"),))] >= 1  # the kill was retried around
    for replica in routed.replicas:
        labels = (("group", "local"), ("replica", replica))
        assert series[("shardline_router_replica_available", labels)] == 1.0
        assert series[("shardline_router_breaker_state", labels)] == 0.0
    assert series[("shardline_router_in_flight", (("model", f"{MODEL}:1"),))] == 0.0


# The tests that also run with nginx in front (PLANES): failover (nginx's fast lane follows the router's active
# group), and scaling from zero (every request left to the router's activator).


@pytest.mark.parametrize("plane", PLANES)
def test_traffic_fails_over_to_the_next_group_and_comes_back(home: Path, breast_cancer_model: BuiltModel,
                                                             plane: str) -> None:
    router_key = "router-key-for-the-failover-test"
    digest = hashlib.sha256(router_key.encode()).hexdigest()
    tenants = _tenants(home / "tenants.yaml")
    ports = {"east": free_port(), "west": free_port()}
    config = home / "router.yaml"
    config.write_text("groups:\n" + "".join(
        f"  - name: {g}\n    priority: {i}\n    replicas: [\"http://127.0.0.1:{ports[g]}\"]\n" for i, g in enumerate(ports)))
    env = _env(home, SHARDLINE_TENANCY_ROUTER_KEY_SHA256=digest)

    def replica(group: str) -> subprocess.Popen[bytes]:
        with open(home / f"{group}.log", "ab") as sink:
            return subprocess.Popen([*SHARDLINE, "serve", "--port", str(ports[group]), "--metrics-port", "off",
                                     "--tenants", str(tenants)], env=env, stdout=sink, stderr=subprocess.STDOUT)

    servers = {g: replica(g) for g in ports}
    port = free_port()
    log = home / f"router-groups-{plane}.log"
    with open(log, "wb") as sink:
        router = subprocess.Popen([*SHARDLINE, "router", "--config", str(config), "--tenants", str(tenants), "--port",
                                   str(port), "--metrics-port", "off"],
                                  env=_env(home, SHARDLINE_ROUTER_KEY=router_key, SHARDLINE_ROUTER_FAILBACK_S="2",
                                           SHARDLINE_ROUTER_DATA_PLANE=plane),
                                  stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    body = _infer_body(breast_cancer_model)

    def infer() -> int:
        return httpx.post(f"{url}/v2/models/{MODEL}/infer", content=body, headers=key(), timeout=20).status_code

    def group() -> str | None:
        return httpx.get(f"{url}/v2/health/ready").json()["group"]

    def until(what: str | None, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while group() != what:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)

    try:
        _wait_ready(url, router, log, available=2)
        until("east")  # at once, or failback_s after east came up, if west was ready first
        assert infer() == 200
        _stop(servers["east"])
        assert infer() == 200  # retried on west at once, before any health check noticed
        until("west")
        assert [infer() for _ in range(5)] == [200] * 5
        servers["east"] = replica("east")
        until("east")  # back after it has been up for failback_s
        assert infer() == 200
        _stop(servers["west"])
        _stop(servers["east"])
        until(None)
        down = httpx.post(f"{url}/v2/models/{MODEL}/infer", content=body, headers=key(), timeout=20)
        assert down.status_code == 503 and "no replica can take the request now" in down.json()["error"]
        assert down.headers["retry-after"] == "1"
    finally:
        for server in servers.values():
            _stop(server)
        assert _stop(router) in (0, -signal.SIGTERM), log.read_text()[-3000:]


# -- rollouts ----------------------------------------------------------------------------------------


def _rows_body(rows: np.ndarray, names: list[str]) -> bytes:
    return orjson.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [len(rows)], "data": rows[:, j].tolist()}
                                    for j, n in enumerate(names)]})


def _churn_history(home: Path) -> list[AliasMove]:
    return ModelRegistry(str(home / "registry")).alias_history(CHURN, "prod")


def _events(api_url: str, name: str, since: float) -> list[dict[str, Any]]:
    from datetime import datetime, timezone

    body = {"filter": {"event": {"name": [name]}, "resource": {"id": [f"shardline.model.{CHURN}"]},
                       "occurred": {"since": datetime.fromtimestamp(since, timezone.utc).isoformat()}}}
    found: list[dict[str, Any]] = httpx.post(f"{api_url}/events/filter", json=body, timeout=30).json()["events"]
    return found


def _start(shardline: Any, home: Path, *args: str) -> str:
    """`shardline rollout start churn ...` on the router's home; the rollout's id once the router has read it."""
    run = shardline("rollout", "start", CHURN, *args, SHARDLINE_STORAGE_HOME=str(home))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "gate evaluation" in run.stdout and "replay golden" in run.stdout, run.stdout
    rollout_id = re.search(r"rollout ([0-9a-f]{12}) started", run.stdout)
    assert rollout_id, run.stdout
    registry = ModelRegistry(str(home / "registry"))
    _eventually(lambda: registry.rollout_reports(CHURN, rollout_id.group(1)), 20, "the router never read the rollout")
    return rollout_id.group(1)


def test_shadow_answers_never_reach_the_caller_and_their_disagreement_is_reported(
    routed: Routed, home: Path, shardline: Any, breast_cancer_model: BuiltModel, prefect_api: str
) -> None:
    since = time.time()
    rollout_id = _start(shardline, home, "--candidate", f"{CHURN}:2", "--shadow", "100%", "--max-disagreement", "0.5")
    names = breast_cancer_model.data.names
    expected_disagreement = 0
    with httpx.Client(base_url=routed.url, headers=key(), timeout=20) as client:
        for chunk in np.array_split(breast_cancer_model.data.features.astype(np.float32), 57):
            body = _rows_body(chunk, names)
            through = client.post(f"/v2/models/{CHURN}/infer", content=body)
            alone = client.post(f"/v2/models/{CHURN}/versions/1/infer", content=body)
            assert through.status_code == 200 and through.content == alone.content  # the primary's answer, bit for bit
            candidate = client.post(f"/v2/models/{CHURN}/versions/2/infer", content=body).json()
            expected_disagreement += sum(a != b for a, b in zip(through.json()["outputs"][0]["data"],
                                                                 candidate["outputs"][0]["data"]))
    registry = ModelRegistry(str(home / "registry"))

    def compared() -> dict[str, Any] | None:
        reports = registry.rollout_reports(CHURN, rollout_id)
        shadow = next(iter(reports.values()), {}).get("shadow") or {}
        return shadow if shadow.get("rows") == 569 else None

    shadow = _eventually(compared, 20, f"the shadow comparisons never covered the 569 rows: {registry.rollout_reports(CHURN, rollout_id)}")
    assert shadow["disagree"] == expected_disagreement and shadow["skipped"] == 0
    assert shadow["label_agreement"] == pytest.approx(1 - expected_disagreement / 569)
    series = _scrape(routed.metrics)
    assert series.get(("shardline_router_shadow_rows_total", (("agree", "false"), ("model", f"{CHURN}:2"))), 0) == \
        expected_disagreement
    status = shardline("rollout", "status", CHURN, SHARDLINE_STORAGE_HOME=str(home))
    assert status.returncode == 0 and f"rollout {rollout_id} running: shadow of version 2" in status.stdout, status.stdout
    assert f"shadow 569 rows compared, {expected_disagreement / 569:.1%} disagree" in status.stdout
    aborted = shardline("rollout", "abort", CHURN, "--reason", "seen enough", SHARDLINE_STORAGE_HOME=str(home))
    assert aborted.returncode == 0 and "churn@prod -> churn:1" in aborted.stdout and "aborted by hand: seen enough" in \
        aborted.stdout, aborted.stdout + aborted.stderr
    again = shardline("rollout", "abort", CHURN, SHARDLINE_STORAGE_HOME=str(home))
    assert again.returncode != 0 and "no rollout runs on churn@prod" in again.stderr
    assert "Traceback" not in again.stderr
    for event in ("shardline.rollout.started", "shardline.rollout.aborted"):
        _eventually(lambda e=event: _events(prefect_api, e, since), 30, f"no {event} event")


def test_a_canary_that_fails_on_some_inputs_is_rolled_back_by_the_router(
    routed: Routed, home: Path, shardline: Any, breast_cancer_model: BuiltModel, prefect_api: str
) -> None:
    since = time.time()
    rollout_id = _start(shardline, home, "--candidate", "3", "--steps", "50,100", "--interval", "1h",
                        "--min-requests", "20")
    names = breast_cancer_model.data.names
    rows = breast_cancer_model.data.features[:2].astype(np.float32)
    hostile = rows.copy()
    hostile[:, 0] = 5000.0  # a first feature the candidate fails on (the baseline scores it)
    statuses: list[int] = []

    def rolled_back() -> bool:
        with httpx.Client(base_url=routed.url, headers=key(), timeout=20) as client:
            for i in range(40):
                body = _rows_body(hostile if i % 2 else rows, names)
                answer = client.post(f"/v2/models/{CHURN}/infer", content=body, headers={"X-Shardline-Route-Key": f"k{i}"})
                statuses.append(answer.status_code)
        last = _churn_history(home)[-1]
        return last.action == "rollback" and last.rollout is not None and last.rollout.id == rollout_id

    _eventually(rolled_back, 40, "the router never rolled the failing canary back")
    assert set(statuses) <= {200, 500} and 500 in statuses  # the canary's share of callers met its errors
    last = _churn_history(home)[-1]
    assert last.version == 1 and last.by.startswith("router-") and "candidate error rate" in last.reason
    with httpx.Client(base_url=routed.url, headers=key(), timeout=20) as client:  # every caller back on version 1
        answers = [client.post(f"/v2/models/{CHURN}/infer", content=_rows_body(hostile, names),
                               headers={"X-Shardline-Route-Key": f"k{i}"}) for i in range(20)]
    assert {(a.status_code, a.json()["model_version"]) for a in answers} == {(200, "1")}
    [event] = _eventually(lambda: _events(prefect_api, "shardline.rollout.rolled-back", since), 30, "no rolled-back event")
    assert event["payload"]["rollout"] == rollout_id and event["payload"]["candidate"] == 3
    assert event["payload"]["observed"]["candidate"]["errors"] > 0
    # the router's events keep docs/drift.md's contract too: the version prod is on, labelled and in the payload
    assert event["resource"]["shardline.version"] == "1" and event["resource"]["shardline.alias"] == "prod"
    assert (event["payload"]["name"], event["payload"]["reference"]) == (CHURN, f"{CHURN}@prod")


def test_a_good_canary_steps_to_all_traffic_and_is_promoted(
    routed: Routed, home: Path, shardline: Any, breast_cancer_model: BuiltModel, prefect_api: str
) -> None:
    since = time.time()
    # No latency verdict: a p99 spike on the other xdist worker's load would roll the canary back (the p99
    # criterion has its own tests in tests/unit/test_rollouts.py); this test is about stepping and promotion.
    rollout_id = _start(shardline, home, "--candidate", "2", "--steps", "50,100", "--interval", "2s",
                        "--min-requests", "10", "--max-p99-ratio", "1000")
    body = _rows_body(breast_cancer_model.data.features[:3].astype(np.float32), breast_cancer_model.data.names)
    versions: set[str] = set()

    def promoted() -> bool:
        with httpx.Client(base_url=routed.url, headers=key(), timeout=20) as client:
            for i in range(30):
                answer = client.post(f"/v2/models/{CHURN}/infer", content=body, headers={"X-Shardline-Route-Key": f"c{i}"})
                assert answer.status_code == 200, answer.text
                versions.add(answer.json()["model_version"])
        return _churn_history(home)[-1].action == "promote"

    _eventually(promoted, 60, lambda: f"the canary never reached promotion: {_churn_history(home)[-3:]}")
    moves = [m for m in _churn_history(home) if m.rollout is not None and m.rollout.id == rollout_id]
    assert [(m.action, m.rollout.weight if m.rollout else None) for m in moves] == [
        ("canary", 50), ("canary", 100), ("promote", 100)]
    assert moves[-1].version == 2 and all(m.by.startswith("router-") for m in moves[1:])
    assert versions == {"1", "2"}
    for event in ("shardline.rollout.stepped", "shardline.rollout.promoted"):
        _eventually(lambda e=event: _events(prefect_api, e, since), 30, f"no {event} event")


def test_a_release_goes_through_staging_and_a_canary_to_prod_with_every_step_in_the_history(
    routed: Routed, home: Path, cli_env: dict[str, str], tmp_path: Path, breast_cancer_model: BuiltModel
) -> None:
    """`shardline model release` (the release-model flow), as CI runs it after push: staging through the gates,
    a canary on prod that the router steps and promotes under live traffic, the verdict as its exit code."""
    registry = ModelRegistry(str(home / "registry"))
    pushed = registry.push(_churn(tmp_path / "churn-4", "logreg", fails_from=1e9))  # a new, good version
    env = {**cli_env, "SHARDLINE_STORAGE_HOME": str(home)}
    with open(tmp_path / "release.log", "w") as log:
        release = subprocess.Popen([*SHARDLINE, "model", "release", f"{CHURN}:{pushed.version}", "--steps", "50,100",
                                    "--interval", "2s", "--min-requests", "10", "--wait", "90s", "--reason", "ci"],
                                   env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    body = _rows_body(breast_cancer_model.data.features[:3].astype(np.float32), breast_cancer_model.data.names)
    with httpx.Client(base_url=routed.url, headers=key(), timeout=20) as client:
        while release.poll() is None:  # live traffic until the release has its verdict
            for i in range(20):
                assert client.post(f"/v2/models/{CHURN}/infer", content=body,
                                   headers={"X-Shardline-Route-Key": f"r{i}"}).status_code == 200
    output = (tmp_path / "release.log").read_text()
    assert release.returncode == 0, output
    assert f"{CHURN}:{pushed.version} released: promoted" in output
    staging = registry.alias_history(CHURN, "staging")[-1]
    assert (staging.version, staging.action, staging.reason) == (pushed.version, "promote", "ci")
    moves = [m for m in _churn_history(home) if m.version == pushed.version or
             (m.rollout is not None and m.rollout.candidate == pushed.version)]
    assert [(m.action, m.rollout.weight if m.rollout else None) for m in moves] == [
        ("canary", 50), ("canary", 100), ("promote", 100)]
    assert registry.current_move(CHURN, "prod").version == pushed.version  # type: ignore[union-attr]


# -- scaling from zero ---------------------------------------------------------------------------------


@pytest.mark.parametrize("plane", PLANES)
def test_scaled_to_zero_the_router_holds_requests_while_a_replica_starts_and_loses_none(
    home: Path, breast_cancer_model: BuiltModel, plane: str
) -> None:
    tenants = _tenants(home / "tenants-zero.yaml")
    port, metrics_port = free_port(), free_port()
    log = home / f"router-zero-{plane}.log"
    with open(log, "wb") as sink:
        router = subprocess.Popen(
            [*SHARDLINE, "router", "--local-replicas", "2", "--min-replicas", "0", "--tenants", str(tenants), "--port",
             str(port), "--metrics-port", str(metrics_port)],
            env=_env(home, SHARDLINE_ROUTER_SCALE_DOWN_DELAY_S="3", SHARDLINE_ROUTER_DATA_PLANE=plane), stdout=sink,
            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    body = _infer_body(breast_cancer_model)
    expected = breast_cancer_model.estimator.predict(breast_cancer_model.data.features[:4].astype(np.float32)).tolist()

    def burst(n: int) -> list[Any]:
        outcomes: list[Any] = []

        def one() -> None:
            try:
                answer = httpx.post(f"{url}/v2/models/{MODEL}/infer", content=body, headers=key(), timeout=60)
                outcomes.append((answer.status_code, answer.json()["outputs"][0]["data"]))
            except (httpx.HTTPError, ValueError, KeyError) as e:
                outcomes.append(("lost", repr(e)))

        threads = [threading.Thread(target=one) for _ in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=90)
        return outcomes

    try:
        _wait_ready(url, router, log, available=0)  # ready at zero: a request starts a replica
        assert "none until a request comes" in log.read_text() and "started replica" not in log.read_text()
        first = burst(12)
        assert first == [(200, expected)] * 12, first
        assert re.search(r"scaling the local replicas from 0 to [12] \(demand \d+", log.read_text())
        series = _scrape(f"http://127.0.0.1:{metrics_port}/metrics")
        assert series[("shardline_router_cold_start_seconds_count", ())] >= 1
        assert series[("shardline_router_replicas", (("group", "local"),))] >= 1
        _wait_for_log(log, r"scaling the local replicas from \d to 0", 30)  # idle past the scale-down delay
        pids = [int(p) for p in re.findall(r"started replica \d \(pid (\d+)\)", log.read_text())]
        _eventually(lambda: not any(_alive(p) for p in pids), 20, "a replica scaled away is still running")
        second = burst(8)  # from zero again
        assert second == [(200, expected)] * 8, second
    finally:
        code = _stop(router)
    assert code in (0, -signal.SIGTERM), log.read_text()[-4000:]


# -- degraded mode: a fallback variant -----------------------------------------------------------------


def _mlp_with_int8(home: Path) -> Any:
    """mlp:1 (an MLP classifier, where int8 quantization applies) with its int8 variant, as prod; its estimator."""
    from shardline.quality.variants import make_variant

    bundle, estimator = mlp_bundle(home)
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias("mlp", "prod", registry.push(bundle).version or 1)
    make_variant(registry, "mlp:1", "int8")
    return estimator


def test_a_model_falls_back_to_its_int8_variant_on_the_cpu_group_marked_in_the_answer(
    home: Path, breast_cancer_model: BuiltModel
) -> None:
    estimator = _mlp_with_int8(home)
    router_key = "router-key-for-the-fallback-test"
    tenants = _tenants(home / "tenants-fallback.yaml")
    ports = {"gpu": free_port(), "cpu": free_port()}
    config = home / "router-fallback.yaml"
    config.write_text("groups:\n" + "".join(
        f"  - name: {g}\n    priority: {i}\n    replicas: [\"http://127.0.0.1:{ports[g]}\"]\n" for i, g in enumerate(ports))
        + "fallbacks:\n  - {model: mlp, variant: int8, group: cpu}\n")
    env = _env(home, SHARDLINE_TENANCY_ROUTER_KEY_SHA256=hashlib.sha256(router_key.encode()).hexdigest())
    servers = {}
    for group, port in ports.items():
        with open(home / f"fallback-{group}.log", "ab") as sink:
            servers[group] = subprocess.Popen([*SHARDLINE, "serve", "--port", str(port), "--metrics-port", "off",
                                               "--tenants", str(tenants)], env=env, stdout=sink, stderr=subprocess.STDOUT)
    port, metrics_port = free_port(), free_port()
    log = home / "router-fallback.log"
    with open(log, "wb") as sink:
        router = subprocess.Popen([*SHARDLINE, "router", "--config", str(config), "--tenants", str(tenants), "--port",
                                   str(port), "--metrics-port", str(metrics_port)],
                                  env=_env(home, SHARDLINE_ROUTER_KEY=router_key, SHARDLINE_ROUTER_FAILBACK_S="2"),
                                  stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    rows = breast_cancer_model.data.features[:60].astype(np.float32)
    body = _rows_body(rows, breast_cancer_model.data.names)
    expected = estimator.predict(rows).tolist()

    def infer() -> httpx.Response:
        return httpx.post(f"{url}/v2/models/mlp/infer", content=body, headers=key(), timeout=30)

    try:
        _wait_ready(url, router, log, available=2)
        # the gpu group takes traffic at once, or failback_s after it came up if the cpu group was ready first
        _eventually(lambda: httpx.get(f"{url}/v2/health/ready").json()["group"] == "gpu", 30, log.read_text()[-3000:])
        primary = infer()
        assert primary.status_code == 200 and "x-shardline-fallback" not in primary.headers
        assert primary.json()["outputs"][0]["data"] == expected
        _stop(servers["gpu"])  # the primary group is gone
        degraded = [infer() for _ in range(3)]
        assert {a.status_code for a in degraded} == {200}
        assert {a.headers.get("x-shardline-fallback") for a in degraded} == {"mlp:1#int8"}  # marked in the answer
        labels = degraded[0].json()["outputs"][0]["data"]
        assert sum(a == b for a, b in zip(labels, expected)) >= 57  # int8: within its golden-set delta
        other = httpx.post(f"{url}/v2/models/{MODEL}/infer", content=_infer_body(breast_cancer_model), headers=key(),
                           timeout=30)
        assert other.status_code == 200 and "x-shardline-fallback" not in other.headers  # no fallback declared
        series = _scrape(f"http://127.0.0.1:{metrics_port}/metrics")
        assert series[("shardline_router_fallbacks_total", (("model", "mlp:1"), ("variant", "int8")))] == 3
    finally:
        for server in servers.values():
            _stop(server)
        assert _stop(router) in (0, -signal.SIGTERM), log.read_text()[-3000:]


def open_loop(url: str, body: bytes, rate: float, seconds: float,
              during: Any = None, id_prefix: str | None = None) -> list[tuple[int | str, float]]:
    """POST ``body`` to the model's infer path at ``rate`` a second for ``seconds``, each request at its intended
    time whatever the others do (an open loop, as users' traffic comes); ``during(elapsed)`` is called between
    sends; with ``id_prefix``, the n-th request is sent with ``X-Request-Id: <id_prefix><n>``. Returns (status, or
    the error's name, and seconds from the intended send to the answer) per request."""
    import asyncio

    async def run() -> list[tuple[int | str, float]]:
        results: list[tuple[int | str, float]] = []
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=url, headers=key(), timeout=30, limits=limits) as client:
            async def one(at: float, n: int) -> None:
                headers = {"X-Request-Id": f"{id_prefix}{n}"} if id_prefix is not None else None
                try:
                    answer = await client.post(f"/v2/models/{MODEL}/infer", content=body, headers=headers)
                    results.append((answer.status_code, time.monotonic() - at))
                except httpx.HTTPError as e:
                    results.append((type(e).__name__, time.monotonic() - at))

            start, sent, tasks = time.monotonic(), 0, []
            while sent < rate * seconds:
                at = start + sent / rate
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                tasks.append(asyncio.ensure_future(one(at, sent)))
                sent += 1
                if during is not None:
                    during(time.monotonic() - start)
            await asyncio.gather(*tasks)
        return results

    return asyncio.run(run())


def _stop_between(pid: int, start_s: float, end_s: float, stopped: list[int]) -> Any:
    """``open_loop``'s ``during``: SIGSTOP ``pid`` at ``start_s``, SIGCONT at ``end_s``, each noted in ``stopped``
    (the pid, then -1)."""
    def during(elapsed: float) -> None:
        if elapsed >= start_s and not stopped:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        elif elapsed >= end_s and stopped[-1] != -1:
            os.kill(pid, signal.SIGCONT)
            stopped.append(-1)

    return during


def _local_router(home: Path, name: str, replicas: int, plane: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    """``shardline router --local-replicas N`` on the plane, logging to ``router-<name>-<plane>.log``; its
    process, URL and log."""
    tenants = _tenants(home / f"tenants-{name}-{plane}.yaml")
    port = free_port()
    log = home / f"router-{name}-{plane}.log"
    with open(log, "wb") as sink:
        router = subprocess.Popen([*SHARDLINE, "router", "--local-replicas", str(replicas), "--tenants", str(tenants),
                                   "--port", str(port), "--metrics-port", "off"],
                                  env=_env(home, SHARDLINE_ROUTER_DATA_PLANE=plane), stdout=sink,
                                  stderr=subprocess.STDOUT, cwd=home)
    return router, f"http://127.0.0.1:{port}", log


@pytest.mark.parametrize("plane", PLANES)
def test_a_hung_replica_costs_a_request_a_bounded_delay_not_its_deadline(home: Path, breast_cancer_model: BuiltModel,
                                                                         plane: str) -> None:
    """50 requests/s through the router over 3 local replicas, and the replica first in the model's order is
    stopped (SIGSTOP: its socket takes connections, nothing answers) for 8 s: every answer is 200, and no more than
    a tenth took over 2 s (bench/README.md has the figures: on a quiet machine the slowest took well under 1 s). Had the
    requests waited for the stopped replica, the first in its order for most of them, hundreds would have taken
    seconds; a share, not the slowest one, so that a machine loaded by other tests (a client that lags, a try's
    bound that grows with the model's usual time) does not fail it. Then the router took the replica out, and back."""
    router, url, log = _local_router(home, "hung", 3, plane)
    body = _infer_body(breast_cancer_model)
    stopped: list[int] = []
    try:
        _wait_ready(url, router, log, available=3)
        replicas = {u: int(p) for p, u in re.findall(r"started replica \d \(pid (\d+)\) on (http://[0-9.:]+)",
                                                      log.read_text())}
        victim_url = rank(f"{MODEL}:1", list(replicas))[0]
        victim = replicas[victim_url]
        if plane == "nginx":
            _eventually(lambda: f"fast lane: acme/{MODEL} ->" in log.read_text(), 20, "the model was never pinned")
        warm = open_loop(url, body, 50, 2)  # every replica loads the model; the lane learns its usual time
        assert {status for status, _ in warm} == {200}

        results = open_loop(url, body, 50, 10, _stop_between(victim, 1.0, 9.0, stopped))
        assert stopped == [victim, -1]
        statuses = {status for status, _ in results}
        late = sorted(seconds for _, seconds in results if seconds > 2.0)
        assert statuses == {200}, f"{[r for r in results if r[0] != 200][:5]}"
        # at most a tenth: a full run on a machine ~1.6x slower than usual had 25 of 500 between 2.0 and 3.6 s on
        # the nginx plane (its try's bound grows with the model's usual time, 40-70 ms there); waiting for the
        # stopped replica would make it hundreds
        assert len(late) <= 0.1 * len(results), (
            f"{len(late)} of {len(results)} requests took over 2 s ({', '.join(f'{s:.2f}' for s in late[-5:])} the "
            f"slowest): they waited for the stopped replica; the router's log ends:\n{log.read_text()[-3000:]}")

        def back_in() -> bool:  # its health check passed again after the router took it out
            text = log.read_text()
            out = max(text.rfind(f"replica {victim_url} is hung"), text.rfind(f"replica {victim_url} is not ready"))
            return out >= 0 and text.find(f"replica {victim_url} is ready", out) > out

        # Back in, not "available": answers slowed by the backlog it woke to may have it ejected for latency for
        # a while as well (outlier detection, a separate mechanism, tested in test_router_decisions.py).
        _eventually(back_in, 30, lambda: "the stopped replica never came back; the router's log ends:\n"
                    + log.read_text()[-3000:])
        if plane == "python":
            assert f"replica {victim_url} is hung: no answer to a health probe" in log.read_text()
    finally:
        if stopped and stopped[-1] != -1:
            os.kill(victim, signal.SIGCONT)
        _stop(router)


@pytest.mark.parametrize("plane", PLANES)
def test_a_stalled_only_replica_is_waited_for_not_taken_out(home: Path, breast_cancer_model: BuiltModel,
                                                           plane: str) -> None:
    """One replica, stopped for 1.5 s under 20 requests/s (as an overloaded machine's only replica stalls): with
    nowhere to move its requests the router keeps it, and every request is answered 200, late, not 503."""
    router, url, log = _local_router(home, "only", 1, plane)
    body = _infer_body(breast_cancer_model)
    stopped: list[int] = []
    try:
        _wait_ready(url, router, log, available=1)
        [only] = [int(p) for p in re.findall(r"started replica \d \(pid (\d+)\)", log.read_text())]
        if plane == "nginx":
            _eventually(lambda: f"fast lane: acme/{MODEL} ->" in log.read_text(), 20, "the model was never pinned")
        assert {status for status, _ in open_loop(url, body, 20, 1)} == {200}

        results = open_loop(url, body, 20, 4, _stop_between(only, 0.5, 2.0, stopped))
        assert stopped == [only, -1]
        assert [r for r in results if r[0] != 200] == [], log.read_text()[-3000:]
        assert max(seconds for _, seconds in results) >= 1.0  # they did wait for it
        text = log.read_text()
        assert "is hung" not in text, text[-3000:]
        if plane == "python":
            assert "but no other replica is up: kept" in text, text[-3000:]
    finally:
        if stopped and stopped[-1] != -1:
            os.kill(only, signal.SIGCONT)
        _stop(router)


def test_a_request_moved_off_a_hung_replica_is_scored_once(home: Path, breast_cancer_model: BuiltModel) -> None:
    """Two `serve` replicas behind a router (``--config``); the first in the model's order is stopped (SIGSTOP) while
    20 requests/s, each with its own X-Request-Id, come for 3 s, then continued. The router takes it out as hung and
    moves the requests waiting on it: every one is answered 200, and scored by one replica only (their access logs:
    a line per request, which is what the metering ledger counts). The stopped replica found the given-up copies in
    its socket's buffer when it woke, the router's connection closed behind each: it scored them all, and the tenant
    was charged twice for each moved request."""
    router_key = "router-key-for-the-hung-test"
    tenants = _tenants(home / "tenants-moved.yaml")
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    config = home / "router-moved.yaml"
    config.write_text("groups:\n  - name: local\n    replicas: [" + ", ".join(f'"{u}"' for u in urls) + "]\n")
    env = _env(home, SHARDLINE_TENANCY_ROUTER_KEY_SHA256=hashlib.sha256(router_key.encode()).hexdigest())
    logs = [home / f"moved-replica-{i}.log" for i in range(2)]
    servers = []
    for port, replica_log in zip(ports, logs):
        with open(replica_log, "wb") as sink:
            servers.append(subprocess.Popen([*SHARDLINE, "serve", "--port", str(port), "--metrics-port", "off",
                                             "--tenants", str(tenants)], env=env, stdout=sink,
                                            stderr=subprocess.STDOUT))
    port = free_port()
    log = home / "router-moved.log"
    with open(log, "wb") as sink:
        router = subprocess.Popen([*SHARDLINE, "router", "--config", str(config), "--tenants", str(tenants), "--port",
                                   str(port), "--metrics-port", "off"],
                                  env=_env(home, SHARDLINE_ROUTER_KEY=router_key), stdout=sink,
                                  stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    body = _infer_body(breast_cancer_model)
    victim_url = rank(f"{MODEL}:1", urls)[0]
    victim = servers[urls.index(victim_url)]
    stopped = False
    try:
        _wait_ready(url, router, log, available=2)
        assert {status for status, _ in open_loop(url, body, 20, 2)} == {200}  # both replicas have the model loaded
        os.kill(victim.pid, signal.SIGSTOP)  # nothing in flight: every copy sent to it waits in its socket
        stopped = True
        results = open_loop(url, body, 20, 4, lambda elapsed: None, id_prefix="moved-")
        os.kill(victim.pid, signal.SIGCONT)
        stopped = False
        assert {status for status, _ in results} == {200}, log.read_text()[-3000:]
        assert f"replica {victim_url} is hung" in log.read_text(), log.read_text()[-3000:]
        sent = {f"moved-{n}" for n in range(len(results))}

        def scored() -> dict[str, list[tuple[int, int]]]:
            lines: dict[str, list[tuple[int, int]]] = {}
            for i, replica_log in enumerate(logs):
                for line in replica_log.read_text(errors="replace").splitlines():
                    if '"msg":"request"' in line and '"request_id":"moved-' in line:
                        fields = orjson.loads(line)
                        lines.setdefault(fields["request_id"], []).append((i, fields["status"]))
            return lines

        # the stopped replica has read what waited for it (a line for each copy it took up), once it is back in
        _eventually(lambda: httpx.get(f"{url}/v2/health/ready").json()["available"] == 2, 30,
                    lambda: log.read_text()[-3000:])
        _eventually(lambda: any(i == urls.index(victim_url) for v in scored().values() for i, _ in v), 10,
                    "the stopped replica logged none of the requests sent to it")
        lines = scored()
        twice = {request_id: v for request_id, v in lines.items() if [s for _, s in v].count(200) != 1}
        assert set(lines) == sent and not twice, f"{len(twice)} of {len(sent)} scored twice: {sorted(twice.items())[:5]}"
        # the given-up copies it read were not started: 499 (client gone), which the metering ledger does not count
        given_up = [request_id for request_id, v in lines.items() if (urls.index(victim_url), 499) in v]
        moved = sum(int(n) for n in re.findall(rf"replica {re.escape(victim_url)} is hung.*?(\d+) waiting requests moved",
                                               log.read_text()))
        assert moved >= 1 and len(given_up) <= moved, (given_up, moved)
    finally:
        if stopped:
            os.kill(victim.pid, signal.SIGCONT)
        for server in servers:
            _stop(server)
        _stop(router)
