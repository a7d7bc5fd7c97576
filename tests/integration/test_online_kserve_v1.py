"""KServe's V1 protocol (``POST /v1/models/{name}:predict``, ``{"instances": [...]}``) over real HTTP, as KServe's
``InferenceRESTClient(RESTConfig(protocol="v1"))`` sends it (that client posts this JSON to this path): the real
breast-cancer classifiers and the MiniLM embedding model, every instance form, the answers against scikit-learn and
against the V2 path, the refusals, and the tenant's quota on this path as on the others."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pytest

from shardline.build.examples import package_breast_cancer
from shardline.build.packaging import package_onnx
from shardline.online.app import create_app
from shardline.online.metrics import metrics_app
from shardline.online.server import build_plane
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.online.testing import serve_listeners_in_thread
from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings
from shardline.storage.registry import ModelRegistry

from tests.conftest import BuiltModel

KEY, TIGHT = "sk-v1-acme-key", "sk-v1-tight-key"
MODEL = "breast-cancer"


@pytest.fixture(scope="module")
def served(breast_cancer_model: BuiltModel, minilm_bundle: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, Any, str]]:
    """breast-cancer:1 (gbt, prod), breast-cancer:2 (logistic regression), minilm:1 (prod) and breast-cancer-nk:1
    (prod: the gbt's ONNX file packaged alone, one [N, 30] input), served; yields the URL, the logistic regression and
    the metrics' URL."""
    home = tmp_path_factory.mktemp("v1-home")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias(MODEL, "prod", registry.push(breast_cancer_model.bundle_dir).version or 1)
    _, logreg = package_breast_cancer(home / "logreg-bundle", kind="logreg")
    registry.push(home / "logreg-bundle")
    registry.set_alias("minilm", "prod", registry.push(minilm_bundle).version or 1)
    package_onnx(breast_cancer_model.bundle_dir / "model.onnx", home / "nk-bundle", name=f"{MODEL}-nk")
    registry.set_alias(f"{MODEL}-nk", "prod", registry.push(home / "nk-bundle").version or 1)
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key(KEY)],
         "models": [f"{MODEL}@prod", "minilm@prod", f"{MODEL}-nk@prod"]},
        {"name": "tight", "api_keys_sha256": [hash_api_key(TIGHT)], "models": [f"{MODEL}@prod"],
         "rate": {"requests_per_second": 0.5, "burst": 2}},
    ]})
    plane = build_plane(OnlineSettings(alias_refresh_s=0), StorageSettings(home=str(home)),
                        RuntimeSettings(device="cpu", intra_op_threads=1), tenants)
    with serve_listeners_in_thread(create_app(plane), metrics_app=metrics_app(plane.metrics.exposition)) as listening:
        yield listening.url, logreg, f"{listening.metrics_url}/metrics"


def _predict(url: str, body: Any, path: str = f"/v1/models/{MODEL}:predict", token: str = KEY) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def test_instances_as_lists_and_as_objects_score_like_scikit_learn(served: tuple[str, Any, str],
                                                                    breast_cancer_model: BuiltModel) -> None:
    url, logreg, _ = served
    rows = breast_cancer_model.data.features[:25]
    names = breast_cancer_model.data.names
    labels = breast_cancer_model.estimator.predict(rows.astype(np.float32))
    probabilities = breast_cancer_model.estimator.predict_proba(rows.astype(np.float32))

    as_lists = _predict(url, {"instances": rows.tolist()})
    as_objects = _predict(url, {"instances": [dict(zip(names, row)) for row in rows.tolist()]})

    assert as_lists.status_code == 200 and as_lists.headers["content-type"] == "application/json", as_lists.text
    predictions = as_lists.json()["predictions"]
    assert list(as_lists.json()) == ["predictions"] and len(predictions) == 25
    assert [p["label"] for p in predictions] == labels.tolist()  # several outputs: an object of them a row
    np.testing.assert_allclose([p["probabilities"] for p in predictions], probabilities, atol=1e-5)
    assert as_objects.json() == as_lists.json()
    # integers are numbers too, as JSON writers send whole values
    whole = _predict(url, {"instances": np.round(rows[:3]).astype(int).tolist()})
    assert [p["label"] for p in whole.json()["predictions"]] == breast_cancer_model.estimator.predict(
        np.round(rows[:3]).astype(np.float32)).tolist()
    # the versioned path scores with that version; the answer is the V2 path's
    pinned = _predict(url, {"instances": rows.tolist()}, f"/v1/models/{MODEL}/versions/2:predict")
    assert [p["label"] for p in pinned.json()["predictions"]] == logreg.predict(rows.astype(np.float32)).tolist()
    v2 = httpx.post(f"{url}/v2/models/{MODEL}/versions/2/infer", headers={"Authorization": f"Bearer {KEY}"}, json={
        "inputs": [{"name": n, "datatype": "FP32", "shape": [25], "data": rows[:, j].tolist()}
                   for j, n in enumerate(names)]}).json()
    by_name = {o["name"]: o["data"] for o in v2["outputs"]}
    assert [p["label"] for p in pinned.json()["predictions"]] == by_name["label"]
    assert [x for p in pinned.json()["predictions"] for x in p["probabilities"]] == by_name["probabilities"]


def test_a_model_of_one_input_and_one_output_takes_values_and_answers_values(served: tuple[str, Any, str]) -> None:
    url, _, _ = served
    texts = ["the router pins minilm@prod", "a second sentence"]

    answer = _predict(url, {"instances": texts}, "/v1/models/minilm:predict")

    assert answer.status_code == 200, answer.text
    vectors = np.array(answer.json()["predictions"])
    assert vectors.shape == (2, 384)  # one output: its value a row, not an object
    embedded = httpx.post(f"{url}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "minilm", "input": texts}).json()
    np.testing.assert_allclose(vectors, [d["embedding"] for d in embedded["data"]], atol=1e-6)
    as_lists = _predict(url, {"instances": [[t] for t in texts]}, "/v1/models/minilm:predict")  # [value], one input
    assert as_lists.json() == answer.json()
    blank = _predict(url, {"instances": ["fine", "  "]}, "/v1/models/minilm:predict")
    assert blank.status_code == 400 and blank.json()["error"].startswith("input 'text': element 1 is ")


def test_a_model_of_one_vector_input_takes_the_vector_or_the_list_of_it(served: tuple[str, Any, str],
                                                                         breast_cancer_model: BuiltModel) -> None:
    url, _, _ = served
    rows = breast_cancer_model.data.features[:10]
    expected = breast_cancer_model.estimator.predict(rows.astype(np.float32)).tolist()
    path = f"/v1/models/{MODEL}-nk:predict"

    vectors = _predict(url, {"instances": rows.tolist()}, path)  # the [30] value of its one [N, 30] input
    wrapped = _predict(url, {"instances": [[row] for row in rows.tolist()]}, path)  # the list of that one value
    named = _predict(url, {"instances": [{"X": row} for row in rows.tolist()]}, path)

    assert vectors.status_code == 200, vectors.text
    assert [p["label"] for p in vectors.json()["predictions"]] == expected
    assert wrapped.json() == named.json() == vectors.json()
    short = _predict(url, {"instances": [[0.5] * 29]}, path)
    assert short.status_code == 400 and short.json()["error"].startswith("input 'X': its values are not all "), short.text


@pytest.mark.parametrize("body, status, words", [
    ({"instances": [[1.0, 2.0, 3.0]]}, 400, "instances[0] is a list of 3 values; the model 'breast-cancer:1' takes 30 "
                                            "inputs, so send each instance as a list of 30 values in this order:"),
    ({"instances": [{"mean radius": 1.0}]}, 400, "instances[0] lacks 'mean texture'"),
    ({"instances": [[0.5] * 30, {"a": 1}]}, 400, "instances[1] is a JSON object; the model"),
    ({"instances": [[0.5] * 30, "x"]}, 400, "instances[1] is a JSON string"),
    ({"instances": []}, 400, "field 'instances' is missing, empty or not a list"),
    ({"inputs": [[0.5] * 30]}, 400, "TensorFlow Serving's columnar 'inputs' is not read: send the rows as 'instances'"),
    ([[0.5] * 30], 400, "the request body is a JSON list, not an object with 'instances'"),
    (b'{"instances": [[0.5,', 400, "the request body is not valid JSON"),
    ({"instances": [["x"] * 30]}, 400, "input 'mean radius': its values are not all float32"),
    (b'{"instances": [[NaN' + b", 0.5" * 29 + b"]]}", 400, "columns ['mean radius'] hold NaN or infinite values"),
    ({"instances": [[None] + [0.5] * 29]}, 400, "columns ['mean radius'] hold nulls"),
])
def test_each_bad_request_is_a_400_naming_what_is_wrong(served: tuple[str, Any, str], body: Any, status: int,
                                                        words: str) -> None:
    url, _, _ = served
    answer = _predict(url, body)
    assert answer.status_code == status and list(answer.json()) == ["error"], answer.text  # V2's form, not OpenAI's
    assert words in answer.json()["error"], answer.json()["error"]


def test_keys_models_and_quotas_hold_on_this_path_as_on_the_others(served: tuple[str, Any, str]) -> None:
    url, _, _ = served
    row = {"instances": [[0.5] * 30]}
    wrong = _predict(url, row, token="sk-wrong")
    assert wrong.status_code == 401 and "the API key is not valid" in wrong.json()["error"]
    hidden = _predict(url, row, "/v1/models/gpt-4:predict")
    assert hidden.status_code == 404 and hidden.json() == {
        "error": "model 'gpt-4' is not available to tenant 'acme'; it may call ['breast-cancer', 'breast-cancer-nk', "
                 "'minilm']"}
    statuses = [_predict(url, row, token=TIGHT).status_code for _ in range(4)]  # burst 2, then one every 2 s
    assert statuses[:2] == [200, 200] and 429 in statuses[2:], statuses
    refused = _predict(url, row, token=TIGHT)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"].startswith("tenant 'tight' is over its rate")
    # V1's readiness is OpenAI's model path, its answer both (KServe's is_model_ready reads name and ready)
    listed = httpx.get(f"{url}/v1/models/{MODEL}", headers={"Authorization": f"Bearer {KEY}"})
    assert listed.status_code == 200 and listed.json() == {
        "id": MODEL, "object": "model", "created": 0, "owned_by": "shardline", "name": MODEL, "ready": True}
    assert httpx.get(url + "/").json() == {"status": "alive"}  # V1's liveness (is_server_live): no key
    wrong_method = httpx.get(f"{url}/v1/models/{MODEL}:predict", headers={"Authorization": f"Bearer {KEY}"})
    assert wrong_method.status_code == 404  # OpenAI's model path, naming no model the tenant may call
    # counted as every request is, under this protocol's name
    metrics = httpx.get(served[2]).text
    assert re.search(r'shardline_requests_total\{code="429",model="",protocol="v1",tenant="tight",version=""\} '
                     r'[1-9]', metrics), metrics[:2000]  # refused before the model is looked up, as on V2
    assert re.search(r'shardline_requests_total\{code="200",model="breast-cancer",protocol="v1",tenant="tight",'
                     r'version="1"\} 2\.0', metrics)
