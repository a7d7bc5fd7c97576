"""Bad and heavy client input over real HTTP: 400s that name the field (no traceback logged), NaN
refused unless the model takes it, and every gzip member read.

One real server (uvicorn on a free loopback port, in a thread) with the default body limit
(16 MiB) serves the breast-cancer classifier, and a copy of it whose signature declares that
its inputs take NaN (``non_finite``), for the whole module.
"""

from __future__ import annotations

import gzip
import json
import logging
import shutil
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton

from shardline.online.app import create_app
from shardline.online.server import build_plane
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.online.testing import serve_in_thread
from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings
from shardline.storage.registry import ModelRegistry

from tests.conftest import BuiltModel

KEY = "sk-acme-hostile"
MODEL, TAKES_NAN = "breast-cancer", "bc-takes-nan"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def url(breast_cancer_model: BuiltModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("hostile-home")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias(MODEL, "prod", registry.push(breast_cancer_model.bundle_dir).version or 1)
    copy = home / "takes-nan"
    shutil.copytree(breast_cancer_model.bundle_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["name"] = TAKES_NAN
    for column in manifest["signature"]["inputs"]:
        column["non_finite"] = True  # gradient boosting in ONNX reads NaN as a missing value
    (copy / "manifest.json").write_text(json.dumps(manifest))
    registry.set_alias(TAKES_NAN, "prod", registry.push(copy).version or 1)
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key(KEY)], "models": [f"{MODEL}@prod", f"{TAKES_NAN}@prod"]},
    ]})
    plane = build_plane(OnlineSettings(alias_refresh_s=0), StorageSettings(home=str(home)),
                        RuntimeSettings(device="cpu", intra_op_threads=1), tenants)
    with serve_in_thread(create_app(plane)) as base:
        yield base


def body_for(model: BuiltModel, rows: np.ndarray) -> dict[str, object]:
    return {"inputs": [{"name": n, "datatype": "FP32", "shape": [len(rows)], "data": rows[:, j].tolist()}
                       for j, n in enumerate(model.data.names)]}


def binary_body(model: BuiltModel, rows: np.ndarray) -> tuple[bytes, dict[str, str]]:
    columns = [np.ascontiguousarray(rows[:, j], np.float32) for j in range(rows.shape[1])]
    header = orjson.dumps({"inputs": [
        {"name": n, "datatype": "FP32", "shape": [len(rows)], "parameters": {"binary_data_size": c.nbytes}}
        for n, c in zip(model.data.names, columns)]})
    return header + b"".join(c.tobytes() for c in columns), {"Inference-Header-Content-Length": str(len(header))}


# -- item 6: bad input is a 400 naming the field, and no traceback ---------------------------------
def test_each_hostile_request_is_a_4xx_naming_the_field_and_logs_no_traceback(
    url: str, breast_cancer_model: BuiltModel, caplog: pytest.LogCaptureFixture
) -> None:
    good = orjson.dumps(body_for(breast_cancer_model, breast_cancer_model.data.features[:2]))
    first = breast_cancer_model.data.names[0]
    deep = orjson.loads(good)
    deep["inputs"][0]["data"] = "X"
    nested = orjson.dumps(deep).replace(b'"X"', b"[" * 1000 + b"1.0" + b"]" * 1000)
    cases = [
        (f"/v2/models/{MODEL}/versions/%C2%B2/infer", good, {}, 400, "version '²' of model 'breast-cancer' is not a version number"),
        (f"/v2/models/{MODEL}/versions/{'9' * 5000}/infer", good, {}, 400, "is not a version number; send 1, 2, ..."),
        (f"/v2/models/{MODEL}/versions/%C2%B2", b"", {}, 400, "is not a version number"),
        (f"/v2/models/{MODEL}/infer", good, {"Inference-Header-Content-Length": b"\xb2"}, 400,
         "header Inference-Header-Content-Length is '²', not a number of bytes; send the length"),
        (f"/v2/models/{MODEL}/infer", nested, {}, 400, f"input '{first}': 'data' is nested deeper than its shape [2]"),
        (f"/v2/models/{MODEL}%0A/infer", good, {}, 404, "model 'breast-cancer\\n' is not available"),
        (f"/v2/models/{MODEL}/infer", orjson.dumps({"inputs": [{"name": "x" * 100_000, "datatype": "FP32",
                                                              "shape": [1], "data": [1.0]}]}), {}, 400, "is not an input"),
    ]
    with caplog.at_level(logging.ERROR, logger="shardline.online"), httpx.Client(base_url=url, headers=AUTH) as http:
        for path, body, headers, status, message in cases:  # type: ignore[assignment]
            response = (http.get(path, headers=headers) if not body else
                        http.post(path, content=body, headers=headers))
            assert (path[:60], response.status_code) == (path[:60], status), response.text[:300]
            assert message in response.json()["error"], (path[:60], response.json())
            assert len(response.text) < 2000  # the client's value is quoted cut short
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_embedding_requests_with_hostile_versions_are_400(url: str) -> None:
    for reference in (f"{MODEL}:²", f"{MODEL}:{'9' * 5000}"):
        response = httpx.post(f"{url}/v1/embeddings", headers=AUTH, json={"model": reference, "input": "hi"})
        assert response.status_code == 400 and "is not a version number" in response.json()["error"]["message"]


# -- item 10: NaN and infinity --------------------------------------------------------------------
def test_nan_and_infinity_are_refused_naming_the_input(url: str, breast_cancer_model: BuiltModel) -> None:
    rows = breast_cancer_model.data.features[:3].copy()
    rows[1, 4] = np.nan
    rows[2, 4] = np.inf
    body, headers = binary_body(breast_cancer_model, rows)
    refused = httpx.post(f"{url}/v2/models/{MODEL}/infer", headers={**AUTH, **headers}, content=body)
    name = breast_cancer_model.data.names[4]
    assert refused.status_code == 400
    assert f"columns [{name!r}] hold NaN or infinite values ({{{name!r}: 2}} in 3 rows)" in refused.json()["error"]

    # tritonclient's JSON (json.dumps) writes NaN and Infinity bare: read as such, refused by the row check
    as_json = [triton.InferInput(n, [3], "FP32") for n in breast_cancer_model.data.names]
    for j, tensor in enumerate(as_json):
        tensor.set_data_from_numpy(rows[:, j].astype(np.float32), binary_data=False)
    json_body, _ = triton.InferenceServerClient.generate_request_body(as_json)
    assert b"NaN" in json_body and b"Infinity" in json_body
    refused = httpx.post(f"{url}/v2/models/{MODEL}/infer", headers=AUTH, content=json_body)
    assert refused.status_code == 400
    assert f"columns [{name!r}] hold NaN or infinite values ({{{name!r}: 2}} in 3 rows)" in refused.json()["error"]

    doc = body_for(breast_cancer_model, breast_cancer_model.data.features[:2])
    doc["inputs"][4]["data"][0] = 1e39  # past float32's range: infinite once cast
    doc["inputs"][4]["datatype"] = "FP32"
    overflow = httpx.post(f"{url}/v2/models/{MODEL}/infer", headers=AUTH, content=orjson.dumps(doc))
    assert overflow.status_code == 400
    assert f"columns [{name!r}] hold NaN or infinite values ({{{name!r}: 1}} in 2 rows)" in overflow.json()["error"]


@pytest.mark.parametrize("model", [MODEL, TAKES_NAN])
def test_a_number_past_a_doubles_range_is_out_of_range_for_the_inputs_datatype_not_invalid_json(
    url: str, breast_cancer_model: BuiltModel, model: str
) -> None:
    # 1e400 is valid JSON; it was refused as "not valid JSON" (the parser's words for a number no double holds)
    name = breast_cancer_model.data.names[4]
    good = orjson.dumps(body_for(breast_cancer_model, breast_cancer_model.data.features[:2]))
    for huge in (b"1e400", b"-2.5E+999"):
        doc = orjson.loads(good)
        doc["inputs"][4]["data"][1] = "HUGE"
        body = orjson.dumps(doc).replace(b'"HUGE"', huge)
        refused = httpx.post(f"{url}/v2/models/{model}/infer", headers=AUTH, content=body)
        assert refused.status_code == 400
        assert refused.json() == {"error": f"input {name!r}: the number '{huge.decode()}' is out of range for its "
                                           "datatype FP32 (at most ±3.4028235e+38); send values within it"}
    elsewhere = good.replace(b'"inputs"', b'"parameters": {"x": 1e400}, "inputs"', 1)
    refused = httpx.post(f"{url}/v2/models/{model}/infer", headers=AUTH, content=elsewhere)
    assert refused.status_code == 400
    assert refused.json()["error"].startswith("the request body holds a number past the range of a double, ±1.8e+308")
    assert httpx.post(f"{url}/v2/models/{model}/infer", headers=AUTH, content=good).status_code == 200
    embeddings = httpx.post(f"{url}/v1/embeddings", headers=AUTH,
                            content=b'{"model": "%s", "input": "hi", "dimensions": 1e400}' % model.encode())
    assert embeddings.status_code == 400 and embeddings.json()["error"]["message"].startswith(
        "the request body holds a number past the range of a double, ±1.8e+308 (number is infinity when parsed as "
        "double: line 1 column ")


def test_the_same_bad_rows_get_the_same_message_from_both_tiers(
    url: str, breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    """One row check in the kernel: a shard the batch tier quarantines and a request the online tier
    refuses, holding the same rows, are refused with the same text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardline.runtimes import RuntimeOptions
    from shardline.storage.job_identity import job_key
    from shardline.storage.scoring import ScoringJob, score_shard
    from shardline.storage.shards import list_shards

    rows = breast_cancer_model.data.features[:3].astype(np.float32)
    rows[1, 4], rows[2, 4], rows[0, 7] = np.nan, np.inf, -np.inf
    body, headers = binary_body(breast_cancer_model, rows)
    online = httpx.post(f"{url}/v2/models/{MODEL}/infer", headers={**AUTH, **headers}, content=body)
    assert online.status_code == 400

    registry = ModelRegistry(str(tmp_path / "registry"))
    registry.push(breast_cancer_model.bundle_dir)
    model = registry.resolve(f"{MODEL}:1")
    shard_dir = tmp_path / "in"
    shard_dir.mkdir()
    names = breast_cancer_model.data.names
    pq.write_table(pa.table({n: rows[:, j] for j, n in enumerate(names)}), shard_dir / "bad.parquet")
    job = ScoringJob(job_key=job_key(model.outputs_digest, None), model=model, output_uri=str(tmp_path / "out"),
                     passthrough=None, batch_rows=1000, cache_dir=str(tmp_path / "cache"),
                     runtime=RuntimeOptions("cpu", 1))
    record = score_shard(job, list_shards(str(shard_dir))[0])

    assert record.status == "quarantined"
    assert record.reason == f"NonFiniteValues: {online.json()['error']}"
    assert f"columns {sorted([names[4], names[7]])!r} hold NaN or infinite values" in (record.reason or "")


def test_a_model_whose_signature_takes_nan_scores_it(url: str, breast_cancer_model: BuiltModel) -> None:
    rows = breast_cancer_model.data.features[:3].copy()
    rows[1, 4] = np.nan
    body, headers = binary_body(breast_cancer_model, rows)
    answer = httpx.post(f"{url}/v2/models/{TAKES_NAN}/infer", headers={**AUTH, **headers}, content=body)
    assert answer.status_code == 200, answer.text
    labels = {o["name"]: o for o in answer.json()["outputs"]}["label"]["data"]
    assert len(labels) == 3 and set(labels) <= {0, 1}
    doc = body_for(breast_cancer_model, rows)  # the same rows as JSON, NaN written bare as json.dumps writes it
    as_json = httpx.post(f"{url}/v2/models/{TAKES_NAN}/infer", headers=AUTH, content=json.dumps(doc).encode())
    assert as_json.status_code == 200, as_json.text
    assert {o["name"]: o for o in as_json.json()["outputs"]}["label"]["data"] == labels


# -- item 10: gzip members ------------------------------------------------------------------------
def test_a_body_of_two_gzip_members_is_read_whole(url: str, breast_cancer_model: BuiltModel) -> None:
    plain = orjson.dumps(body_for(breast_cancer_model, breast_cancer_model.data.features[:4]))
    cut = len(plain) // 2
    members = gzip.compress(plain[:cut]) + gzip.compress(plain[cut:])
    expected = httpx.post(f"{url}/v2/models/{MODEL}/infer", headers=AUTH, content=plain)
    got = httpx.post(f"{url}/v2/models/{MODEL}/infer", headers={**AUTH, "Content-Encoding": "gzip"}, content=members)
    assert got.status_code == expected.status_code == 200, got.text
    assert got.json()["outputs"] == expected.json()["outputs"]

    trailing = httpx.post(f"{url}/v2/models/{MODEL}/infer", headers={**AUTH, "Content-Encoding": "gzip"},
                          content=gzip.compress(plain) + b"garbage")
    assert trailing.status_code == 400 and "after its first member" in trailing.json()["error"]
    bomb = gzip.compress(b" " * (9 << 20)) * 2  # 18 MiB in all, past the 16 MiB limit
    refused = httpx.post(f"{url}/v2/models/{MODEL}/infer", headers={**AUTH, "Content-Encoding": "gzip"}, content=bomb)
    assert refused.status_code == 413 and "inflates to more than the limit" in refused.json()["error"]
