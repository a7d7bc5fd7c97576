"""The Open Inference Protocol over real HTTP: tritonclient (binary and JSON), auth, bad requests, parity, metrics.

One real server (uvicorn on a free loopback port, in a thread) serves the real
breast-cancer classifier (version 1, gradient boosting, alias prod; version 2,
logistic regression, alias staging) for the whole module.
"""

from __future__ import annotations

import gzip
import re
import zlib
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from shardline.build.examples import package_breast_cancer
from shardline.online.app import create_app
from shardline.online.metrics import metrics_app
from shardline.online.server import build_plane
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.online.testing import Served, serve_listeners_in_thread
from shardline.runtimes import RuntimeOptions
from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings
from shardline.storage.job_identity import job_key
from shardline.storage.registry import ModelRegistry
from shardline.storage.scoring import ScoringJob, score_shard
from shardline.storage.shards import list_shards

from tests.conftest import BuiltModel

ACME, GLOBEX = "sk-acme-test-key", "sk-globex-test-key"
MODEL = "breast-cancer"
BODY_LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def home(breast_cancer_model: BuiltModel, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A registry with breast-cancer:1 (gbt, prod) and breast-cancer:2 (logreg, staging)."""
    home = tmp_path_factory.mktemp("online-home")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias(MODEL, "prod", registry.push(breast_cancer_model.bundle_dir).version or 1)
    _, logreg = package_breast_cancer(home / "logreg-bundle", kind="logreg")
    registry.set_alias(MODEL, "staging", registry.push(home / "logreg-bundle").version or 2)
    return home, logreg


@pytest.fixture(scope="module")
def served(home: tuple[Path, Any]) -> Iterator[Served]:
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key(ACME)], "models": [f"{MODEL}@prod"], "priority": "high"},
        {"name": "globex", "api_keys_sha256": [hash_api_key(GLOBEX)], "models": ["minilm@prod"]},
    ]})
    settings = OnlineSettings(max_body_bytes=BODY_LIMIT, alias_refresh_s=0)
    plane = build_plane(settings, StorageSettings(home=str(home[0])), RuntimeSettings(device="cpu", intra_op_threads=1), tenants)
    with serve_listeners_in_thread(create_app(plane), metrics_app=metrics_app(plane.metrics.exposition)) as served:
        yield served


@pytest.fixture(scope="module")
def url(served: Served) -> str:
    return served.url


@pytest.fixture
def client(url: str) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(url.removeprefix("http://"))
    yield c
    c.close()


def key(token: str = ACME) -> dict[str, str]:
    """A fresh header dict each call: tritonclient writes its own headers into the dict it is given."""
    return {"Authorization": f"Bearer {token}"}


def v2_inputs(model: BuiltModel, rows: np.ndarray, binary: bool, datatype: str = "FP32") -> list[triton.InferInput]:
    inputs = []
    for j, name in enumerate(model.data.names):
        tensor = triton.InferInput(name, [len(rows)], datatype)
        tensor.set_data_from_numpy(rows[:, j].astype(np.float32 if datatype == "FP32" else np.float64), binary_data=binary)
        inputs.append(tensor)
    return inputs


def json_body(model: BuiltModel, rows: np.ndarray) -> dict[str, Any]:
    return {"inputs": [{"name": n, "datatype": "FP32", "shape": [len(rows)], "data": rows[:, j].tolist()}
                       for j, n in enumerate(model.data.names)]}


# -- the protocol, as tritonclient speaks it --------------------------------------------------------
def test_health_answers_without_a_key_and_everything_else_needs_one(client: triton.InferenceServerClient, url: str) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert httpx.get(f"{url}/v2/health/ready").json() == {"ready": True}
    assert client.get_server_metadata(headers=key())["extensions"] == ["binary_tensor_data", "classification"]
    for path in ("/v2", f"/v2/models/{MODEL}", f"/v2/models/{MODEL}/ready", "/metrics-not-here"):
        response = httpx.get(url + path)
        assert response.status_code in (401, 404) and "error" in response.json()
    refused = httpx.get(f"{url}/v2/models/{MODEL}", headers={"Authorization": "Bearer wrong"})
    assert refused.status_code == 401 and refused.json() == {"error": refused.json()["error"]}
    assert "not valid" in refused.json()["error"]
    wrong_method = httpx.get(f"{url}/v2/models/{MODEL}/infer", headers=key())
    assert wrong_method.status_code == 405 and wrong_method.json() == {"error": f"/v2/models/{MODEL}/infer does not take GET"}


def test_a_trailing_slash_is_the_same_path_and_head_is_get_without_a_body(url: str, breast_cancer_model: BuiltModel) -> None:
    # Starlette answered a trailing slash with a 307 to the path without it, built from the Host header: a
    # replica's own address behind the router, and an empty answer to a POST client that does not follow it
    rows = breast_cancer_model.data.features[:3]
    scored = httpx.post(f"{url}/v2/models/{MODEL}/infer/", json=json_body(breast_cancer_model, rows), headers=key())
    assert scored.status_code == 200
    assert scored.json()["outputs"][0]["data"] == breast_cancer_model.estimator.predict(rows.astype(np.float32)).tolist()
    for path in ("/v2/", f"/v2/models/{MODEL}/", f"/v2/models/{MODEL}/versions/1/ready/", "/v1/models/"):
        got = httpx.get(url + path, headers=key())
        assert got.status_code == 200 and got.json() == httpx.get(url + path[:-1], headers=key()).json(), path
    unknown = httpx.get(f"{url}/v3/", headers=key())
    assert unknown.status_code == 404 and unknown.json()["error"].startswith("no endpoint GET /v3;")
    plain = {**key(), "Accept-Encoding": "identity"}
    head = httpx.head(f"{url}/v2/models/{MODEL}", headers=plain)
    metadata = httpx.get(f"{url}/v2/models/{MODEL}", headers=plain)
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == metadata.headers["content-length"] == str(len(metadata.content))


def test_metadata_describes_the_signature_on_both_paths(client: triton.InferenceServerClient, breast_cancer_model: BuiltModel) -> None:
    latest = client.get_model_metadata(MODEL, headers=key())
    pinned = client.get_model_metadata(MODEL, model_version="2", headers=key())

    assert latest["versions"] == ["1", "2"] and latest["platform"] == "onnxruntime_onnx"
    assert [i["name"] for i in latest["inputs"]] == breast_cancer_model.data.names
    assert {(i["datatype"], tuple(i["shape"])) for i in latest["inputs"]} == {("FP32", (-1,))}
    assert latest["outputs"] == pinned["outputs"] == [
        {"name": "label", "datatype": "INT64", "shape": [-1]},
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 2]},
    ]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("compression", [None, "gzip", "deflate"])
def test_tritonclient_scores_rows_like_scikit_learn(
    client: triton.InferenceServerClient, breast_cancer_model: BuiltModel, binary: bool, compression: str | None
) -> None:
    rows = breast_cancer_model.data.features[:40]
    outputs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("label", "probabilities")]
    result = client.infer(MODEL, v2_inputs(breast_cancer_model, rows, binary), outputs=outputs, headers=key(),
                          request_compression_algorithm=compression, request_id="req-7")

    labels, probabilities = breast_cancer_model.expected(pa.table({n: rows[:, j] for j, n in enumerate(breast_cancer_model.data.names)}))
    np.testing.assert_array_equal(result.as_numpy("label"), labels)
    np.testing.assert_allclose(result.as_numpy("probabilities").reshape(-1, 2), probabilities, atol=1e-5)
    response = result.get_response()
    assert (response["model_name"], response["model_version"], response["id"]) == (MODEL, "1", "req-7")


def test_the_model_configuration_is_tritons_for_tritonclient_and_perf_analyzer(
    client: triton.InferenceServerClient, breast_cancer_model: BuiltModel
) -> None:
    config = client.get_model_config(MODEL, headers=key())
    pinned = client.get_model_config(MODEL, model_version="2", headers=key())

    assert (config["name"], config["platform"], config["backend"]) == (MODEL, "onnxruntime_onnx", "onnxruntime")
    assert config["version_policy"] == {"specific": {"versions": [1]}} and pinned["version_policy"]["specific"] == {
        "versions": [2]}
    assert config["max_batch_size"] >= 1 and config["dynamic_batching"]["max_queue_delay_microseconds"] >= 0
    # a column of one value a row, as Triton writes the [N] input its metadata shows
    assert config["input"] == [{"name": n, "data_type": "TYPE_FP32", "dims": [1], "reshape": {"shape": []}}
                               for n in breast_cancer_model.data.names]
    assert config["output"] == [{"name": "label", "data_type": "TYPE_INT64", "dims": [1], "reshape": {"shape": []}},
                                {"name": "probabilities", "data_type": "TYPE_FP32", "dims": [2]}]
    with pytest.raises(InferenceServerException, match="not available to tenant 'globex'"):
        client.get_model_config(MODEL, headers=key(GLOBEX))


def test_the_repository_index_lists_the_tenants_models_and_their_state(client: triton.InferenceServerClient,
                                                                        url: str) -> None:
    assert client.get_model_repository_index(headers=key()) == [
        {"name": MODEL, "version": "1", "state": "READY", "reason": ""}]
    missing = client.get_model_repository_index(headers=key(GLOBEX))  # minilm@prod: not in this registry
    assert [(m["name"], m["state"]) for m in missing] == [("minilm", "UNAVAILABLE")]
    assert "minilm" in missing[0]["reason"]
    ready_only = httpx.post(f"{url}/v2/repository/index", json={"ready": True}, headers=key(GLOBEX))
    assert ready_only.status_code == 200 and ready_only.json() == []


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_the_classification_extension_answers_the_top_classes_as_triton_does(
    client: triton.InferenceServerClient, breast_cancer_model: BuiltModel, binary: bool
) -> None:
    rows = breast_cancer_model.data.features[:12]
    outputs = [triton.InferRequestedOutput("probabilities", binary_data=binary, class_count=2),
               triton.InferRequestedOutput("label", binary_data=binary, class_count=3)]  # one value a row: all of it
    result = client.infer(MODEL, v2_inputs(breast_cancer_model, rows, binary), outputs=outputs, headers=key())

    _, probabilities = breast_cancer_model.expected(pa.table({n: rows[:, j] for j, n in enumerate(breast_cancer_model.data.names)}))
    top = result.as_numpy("probabilities")
    assert top.shape == (12, 2) and result.get_output("probabilities")["datatype"] == "BYTES"
    for row, answered in zip(probabilities, top):
        first, second = (_text(a).split(":") for a in answered)
        best = int(np.argmax(row))
        assert (int(first[1]), int(second[1])) == (best, 1 - best)  # highest first, by class index
        np.testing.assert_allclose([float(first[0]), float(second[0])], [row[best], row[1 - best]], atol=1e-5)
        assert re.fullmatch(r"\d\.\d{6}", first[0])  # as C's %f writes it, as Triton does
    labels = result.as_numpy("label")
    assert labels.shape == (12, 1)
    assert [_text(v) for v in labels[:, 0]] == [f"{float(v):f}:0" for v in breast_cancer_model.estimator.predict(
        rows.astype(np.float32))]


def _text(value: bytes | str) -> str:
    """A BYTES element as tritonclient gives it: bytes from binary data, str from JSON."""
    return value.decode() if isinstance(value, bytes) else value


def test_a_classification_count_that_is_not_a_positive_number_is_a_400(url: str, breast_cancer_model: BuiltModel) -> None:
    for count in (0, "2", True):
        body = {**json_body(breast_cancer_model, breast_cancer_model.data.features[:2]),
                "outputs": [{"name": "probabilities", "parameters": {"classification": count}}]}
        answer = httpx.post(f"{url}/v2/models/{MODEL}/infer", json=body, headers=key())
        assert answer.status_code == 400 and answer.json()["error"].startswith(
            "output 'probabilities': 'classification' is "), answer.text


def test_the_versioned_path_scores_with_that_version(
    client: triton.InferenceServerClient, breast_cancer_model: BuiltModel, home: tuple[Path, Any]
) -> None:
    rows = breast_cancer_model.data.features[100:130]
    result = client.infer(MODEL, v2_inputs(breast_cancer_model, rows, True), model_version="2", headers=key())

    logreg = home[1]
    np.testing.assert_array_equal(result.as_numpy("label"), logreg.predict(rows.astype(np.float32)))
    assert result.get_response()["model_version"] == "2"
    assert client.is_model_ready(MODEL, "2", headers=key())


def test_batch_and_online_score_the_same_rows_identically(
    url: str, breast_cancer_model: BuiltModel, home: tuple[Path, Any], tmp_path: Path
) -> None:
    names = breast_cancer_model.data.names
    rows = breast_cancer_model.data.features[:200]
    shard = tmp_path / "in" / "part-0.parquet"
    shard.parent.mkdir()
    pq.write_table(pa.table({"id": np.arange(200), **{n: rows[:, j] for j, n in enumerate(names)}}), shard)
    resolved = ModelRegistry(str(home[0] / "registry")).resolve(f"{MODEL}@prod")
    job = ScoringJob(job_key(resolved.outputs_digest, None), resolved, str(tmp_path / "out"), None, 64,
                     str(tmp_path / "batch-cache"), runtime=RuntimeOptions("cpu", 1))
    record = score_shard(job, list_shards(str(shard))[0])
    assert record.part is not None
    batch = pq.read_table(record.part.removeprefix("file://"))

    online = httpx.post(f"{url}/v2/models/{MODEL}/infer", headers=key(), content=orjson.dumps(json_body(breast_cancer_model, rows)))
    assert online.status_code == 200
    outputs = {o["name"]: o for o in online.json()["outputs"]}

    assert outputs["label"]["data"] == batch.column("label").to_pylist()
    got = np.array(outputs["probabilities"]["data"], dtype=np.float32).reshape(200, 2)
    expected = np.array(batch.column("probabilities").to_pylist(), dtype=np.float32)
    np.testing.assert_array_equal(got, expected)  # bit for bit: same cache, same runtime, same rows

    for i in range(0, 200, 20):  # one row each: once measured, scored from a matrix (no Arrow), still bit for bit
        one = httpx.post(f"{url}/v2/models/{MODEL}/infer", headers=key(),
                         content=orjson.dumps(json_body(breast_cancer_model, rows[i:i + 1])))
        answer = {o["name"]: o for o in one.json()["outputs"]}
        assert answer["label"]["data"] == [outputs["label"]["data"][i]]
        assert answer["probabilities"]["shape"] == [1, 2]
        np.testing.assert_array_equal(np.array(answer["probabilities"]["data"], dtype=np.float32), expected[i])


# -- refusals -------------------------------------------------------------------------------------
def test_a_model_the_tenant_may_not_call_is_404_exactly_like_one_that_does_not_exist(
    client: triton.InferenceServerClient, url: str, breast_cancer_model: BuiltModel
) -> None:
    rows = breast_cancer_model.data.features[:2]
    body = orjson.dumps(json_body(breast_cancer_model, rows))
    forbidden = httpx.post(f"{url}/v2/models/{MODEL}/infer", headers=key(GLOBEX), content=body)
    missing = httpx.post(f"{url}/v2/models/no-such-model/infer", headers=key(GLOBEX), content=body)

    assert forbidden.status_code == missing.status_code == 404
    assert forbidden.json()["error"].replace(MODEL, "X") == missing.json()["error"].replace("no-such-model", "X")
    with pytest.raises(InferenceServerException) as refused:
        client.get_model_metadata(MODEL, headers=key(GLOBEX))
    assert refused.value.status() == "404"


def test_an_unknown_version_is_404_naming_the_versions_and_a_bad_one_is_400(url: str) -> None:
    unknown = httpx.get(f"{url}/v2/models/{MODEL}/versions/9", headers=key())
    assert unknown.status_code == 404
    assert unknown.json()["error"] == f"{MODEL}:9 does not exist; model '{MODEL}' has versions [1, 2]"
    bad = httpx.post(f"{url}/v2/models/{MODEL}/versions/latest/infer", headers=key(), content=b"{}")
    assert bad.status_code == 400 and "version 'latest'" in bad.json()["error"]
    nowhere = httpx.get(f"{url}/v3/models", headers=key())  # says what the server speaks: /v1 is more than embeddings
    assert nowhere.status_code == 404 and nowhere.json()["error"] == (
        "no endpoint GET /v3/models; this server speaks the Open Inference Protocol under /v2, KServe's V1 "
        "(/v1/models/{name}:predict) and OpenAI's under /v1 (models, embeddings, completions, chat/completions)")
    rerank = httpx.post(f"{url}/v1/rerank", headers=key(), json={"model": MODEL})  # a wrong URL, not a missing model
    assert rerank.status_code == 404 and rerank.json()["error"]["code"] is None
    assert rerank.json()["error"]["message"].startswith("no endpoint POST /v1/rerank;")


def bad_requests(model: BuiltModel) -> list[tuple[str, bytes, dict[str, str], int, str]]:
    rows = model.data.features[:3]
    good = json_body(model, rows)
    first = model.data.names[0]

    def changed(**change: Any) -> bytes:
        doc = orjson.loads(orjson.dumps(good))
        doc["inputs"][0].update(change)
        return orjson.dumps(doc)

    missing = orjson.loads(orjson.dumps(good))
    del missing["inputs"][5]
    bomb = gzip.compress(b" " * (BODY_LIMIT + 10))
    return [
        ("malformed JSON", b'{"inputs": [', {}, 400, "not valid JSON"),
        ("wrong shape", changed(shape=[4]), {}, 400, f"input '{first}' holds 3 values; its shape [4] holds 4"),
        ("wrong rank", changed(shape=[3, 2, 1]), {}, 400, f"input '{first}' has shape [3, 2, 1]"),
        ("wrong datatype", changed(datatype="BYTES", data=["a", "b", "c"]), {}, 400, f"input '{first}' is BYTES"),
        ("not numbers", changed(data=["a", "b", "c"]), {}, 400, f"input '{first}' is declared FP32 but its data holds string"),
        ("null values", changed(data=[1.0, None, 2.0]), {}, 400, f"input '{first}' is declared FP32 but its data holds null or mixed values"),
        ("missing input", orjson.dumps(missing), {}, 400, f"needs '{model.data.names[5]}' (FP32, shape [-1])"),
        ("oversized body", b"[" + b"0," * BODY_LIMIT + b"0]", {}, 413, f"over the limit of {BODY_LIMIT} bytes"),
        ("gzip bomb", bomb, {"Content-Encoding": "gzip"}, 413, "inflates to more than the limit"),
        ("broken gzip", b"\x1f\x8b not gzip", {"Content-Encoding": "gzip"}, 400, "not valid gzip data"),
        ("brotli", b"{}", {"Content-Encoding": "br"}, 415, "Content-Encoding 'br' is not supported"),
        ("bad header length", orjson.dumps(good), {"Inference-Header-Content-Length": "-3"}, 400,
         "Inference-Header-Content-Length is '-3'"),
    ]


def test_each_bad_request_is_a_4xx_that_names_the_field(url: str, breast_cancer_model: BuiltModel) -> None:
    with httpx.Client(base_url=url, headers=key()) as http:
        for kind, body, headers, status, message in bad_requests(breast_cancer_model):
            response = http.post(f"/v2/models/{MODEL}/infer", content=body, headers=headers)
            assert (kind, response.status_code) == (kind, status), response.text
            assert message in response.json()["error"], (kind, response.json())
        again = http.post(f"/v2/models/{MODEL}/infer", content=orjson.dumps(json_body(breast_cancer_model, breast_cancer_model.data.features[:1])))
        assert again.status_code == 200  # the server took all that and goes on


def test_deflate_and_gzip_bodies_decode_the_same(url: str, breast_cancer_model: BuiltModel) -> None:
    body = orjson.dumps(json_body(breast_cancer_model, breast_cancer_model.data.features[:5]))
    answers = [
        httpx.post(f"{url}/v2/models/{MODEL}/infer", headers={**key(), "Content-Encoding": enc}, content=data).json()["outputs"]
        for enc, data in (("identity", body), ("gzip", gzip.compress(body)), ("deflate", zlib.compress(body)))
    ]
    assert answers[0] == answers[1] == answers[2]


# -- request ids, logs, metrics ---------------------------------------------------------------------
def test_every_response_carries_a_request_id(url: str) -> None:
    mine = httpx.get(f"{url}/v2/models/{MODEL}", headers={**key(), "X-Request-ID": "trace-abc-123"})
    made = httpx.get(f"{url}/v2/models/nope", headers=key())
    assert mine.headers["x-request-id"] == "trace-abc-123"
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"]) and made.status_code == 404


def test_metrics_show_requests_batches_queues_and_loaded_models(served: Served, breast_cancer_model: BuiltModel) -> None:
    url = served.url
    body = orjson.dumps(json_body(breast_cancer_model, breast_cancer_model.data.features[:3]))
    assert httpx.post(f"{url}/v2/models/{MODEL}/infer", headers=key(), content=body).status_code == 200
    text = httpx.get(f"{served.metrics_url}/metrics").text

    assert re.search(r'shardline_requests_total\{code="200",model="breast-cancer",protocol="v2",tenant="acme",version="1"\} \d', text)
    assert 'shardline_request_seconds_bucket{le="0.005",model="breast-cancer",protocol="v2",tenant="acme",version="1"}' in text
    assert re.search(r'shardline_batch_rows_count\{model="breast-cancer",version="1"\} [1-9]', text)
    assert 'shardline_queue_depth{model="breast-cancer",priority="high",version="1"} 0.0' in text
    assert 'shardline_model_loaded{model="breast-cancer",version="1"} 1.0' in text
    assert re.search(r'shardline_model_idle_seconds\{model="breast-cancer",version="1"\} \d', text)
    assert re.search(r"shardline_loaded_models [12]\.0", text)
    assert re.search(r'shardline_requests_total\{code="401",model="",protocol="v2",tenant="",version=""\}', text)
