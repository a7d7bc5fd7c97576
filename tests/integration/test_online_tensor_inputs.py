"""A model with [-1, k] tensor inputs over real HTTP, as tritonclient sends to Triton or KServe (one [N, k]
input, FP32, JSON and binary), scored in batch from a Parquet list column through the real flow; and the
declared V2 datatype and rank required, through tritonclient and raw JSON.

One real server (uvicorn on a free loopback port, in a thread) serves, for the whole module: ``vec`` (logistic
regression on the breast-cancer data, one input ``input`` [-1, 30], packaged from a list column), ``two``
(a hand-made graph with inputs a [-1, 3] and b [-1, 2], packaged from the ONNX file alone) and the
breast-cancer classifier packaged from 30 columns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from shardline.online.app import create_app
from shardline.online.server import build_plane
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.online.testing import serve_listeners_in_thread
from shardline.build.packaging import package_onnx
from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings
from shardline.storage.registry import ModelRegistry

from tests.conftest import BuiltModel
from tests.tensor_models import feature_column, list_classifier, two_tensor_model

KEY = "sk-tensor-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The bundles, the estimator behind ``vec`` and its feature rows."""
    folder = tmp_path_factory.mktemp("tensor-models")
    onnx_file, estimator, features = list_classifier(folder / "onnx")
    package_onnx(onnx_file, folder / "vec", name="vec", sample=pa.table({"input": feature_column(features)}))
    package_onnx(two_tensor_model(folder / "onnx" / "two.onnx"), folder / "two", name="two")
    return {"vec": folder / "vec", "two": folder / "two", "estimator": estimator, "features": features}


def push_all(registry: ModelRegistry, bundles: list[Path]) -> None:
    for bundle in bundles:
        pushed = registry.push(bundle)
        registry.set_alias(pushed.name, "prod", pushed.version or 1)


@pytest.fixture(scope="module")
def url(models: dict[str, Any], breast_cancer_model: BuiltModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("tensor-home")
    push_all(ModelRegistry(str(home / "registry")), [models["vec"], models["two"], breast_cancer_model.bundle_dir])
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key(KEY)], "models": ["vec@prod", "two@prod", "breast-cancer@prod"]},
    ]})
    plane = build_plane(OnlineSettings(alias_refresh_s=0), StorageSettings(home=str(home)),
                        RuntimeSettings(device="cpu", intra_op_threads=1), tenants)
    with serve_listeners_in_thread(create_app(plane)) as served:
        yield served.url


@pytest.fixture
def client(url: str) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(url.removeprefix("http://"))
    yield c
    c.close()


def tensor(name: str, values: np.ndarray, datatype: str = "FP32", binary: bool = True) -> triton.InferInput:
    t = triton.InferInput(name, list(values.shape), datatype)
    t.set_data_from_numpy(values, binary_data=binary)
    return t


def test_the_metadata_describes_one_input_of_shape_minus_one_k(client: triton.InferenceServerClient) -> None:
    assert client.get_model_metadata("vec", headers=dict(HEADERS))["inputs"] == [
        {"name": "input", "datatype": "FP32", "shape": [-1, 30]}]
    assert client.get_model_metadata("two", headers=dict(HEADERS))["inputs"] == [
        {"name": "a", "datatype": "FP32", "shape": [-1, 3]}, {"name": "b", "datatype": "FP32", "shape": [-1, 2]}]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("rows", [1, 40])
def test_tritonclient_sends_one_n_by_k_tensor_and_gets_scikit_learns_answers(
        client: triton.InferenceServerClient, models: dict[str, Any], binary: bool, rows: int) -> None:
    features = models["features"][100:100 + rows]
    outputs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("label", "probabilities")]

    result = client.infer("vec", [tensor("input", features, binary=binary)], outputs=outputs, headers=dict(HEADERS))

    np.testing.assert_array_equal(result.as_numpy("label"), models["estimator"].predict(features))
    np.testing.assert_allclose(result.as_numpy("probabilities").reshape(-1, 2),
                               models["estimator"].predict_proba(features), atol=1e-5)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_two_2d_inputs_are_two_tensors(client: triton.InferenceServerClient, binary: bool) -> None:
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    b = -np.arange(8, dtype=np.float32).reshape(4, 2)

    result = client.infer("two", [tensor("a", a, binary=binary), tensor("b", b, binary=binary)], headers=dict(HEADERS))

    np.testing.assert_allclose(result.as_numpy("total"), a.sum(1) + b.sum(1))
    np.testing.assert_array_equal(result.as_numpy("joined").reshape(4, 5), np.hstack([a, b]))


def refused(client: triton.InferenceServerClient, model: str, inputs: list[triton.InferInput]) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as error:
        client.infer(model, inputs, headers=dict(HEADERS))
    return str(error.value.status()), error.value.message()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_gets_400_saying_what_to_send_for_another_datatype_or_rank(
        client: triton.InferenceServerClient, models: dict[str, Any], breast_cancer_model: BuiltModel, binary: bool) -> None:
    features = models["features"][:3]
    assert refused(client, "vec", [tensor("input", features.astype(np.int32), "INT32", binary)]) == (
        "400", "input 'input' is INT32, the model takes FP32: send datatype FP32")
    assert refused(client, "vec", [tensor("input", features.astype(np.float64), "FP64", binary)]) == (
        "400", "input 'input' is FP64, the model takes FP32: send datatype FP32")
    assert refused(client, "vec", [tensor("input", features.reshape(-1), binary=binary)]) == (
        "400", "input 'input' has shape [90] (rank 1), the model takes [-1, 30] (rank 2): send shape [N, 30]")
    names, rows = breast_cancer_model.data.names, breast_cancer_model.data.features[:2].astype(np.float32)
    columns = [tensor(n, np.ascontiguousarray(rows[:, j:j + 1].T), binary=binary) for j, n in enumerate(names)]
    assert refused(client, "breast-cancer", columns) == (
        "400", f"input '{names[0]}' has shape [1, 2] (rank 2), the model takes [-1] (rank 1): send shape [N]")
    # [N, 1] each, an ONNX [N, 1] input's own shape: the same values as [N], scored as such
    as_rows = client.infer("breast-cancer", [tensor(n, np.ascontiguousarray(rows[:, j:j + 1]), binary=binary)
                                             for j, n in enumerate(names)], headers=dict(HEADERS))
    flat = client.infer("breast-cancer", [tensor(n, np.ascontiguousarray(rows[:, j]), binary=binary)
                                          for j, n in enumerate(names)], headers=dict(HEADERS))
    assert as_rows.as_numpy("label").tolist() == flat.as_numpy("label").tolist()


def test_raw_json_gets_the_same_400s_and_the_declared_layout_is_scored(
        url: str, models: dict[str, Any], breast_cancer_model: BuiltModel) -> None:
    names, rows = breast_cancer_model.data.names, breast_cancer_model.data.features[:2]

    def columns(datatype: str, shape: list[int]) -> bytes:
        return orjson.dumps({"inputs": [{"name": n, "datatype": datatype, "shape": shape, "data": rows[:, j].tolist()}
                                        for j, n in enumerate(names)]})

    with httpx.Client(base_url=url, headers=HEADERS) as http:
        int32 = http.post("/v2/models/breast-cancer/infer", content=orjson.dumps({"inputs": [
            {"name": n, "datatype": "INT32", "shape": [2], "data": [1, 2]} for n in names]}))
        fp64 = http.post("/v2/models/breast-cancer/infer", content=columns("FP64", [2]))
        n_by_1 = http.post("/v2/models/breast-cancer/infer", content=columns("FP32", [2, 1]))
        fine = http.post("/v2/models/breast-cancer/infer", content=columns("FP32", [2]))
        vec = http.post("/v2/models/vec/infer", content=orjson.dumps({"inputs": [
            {"name": "input", "datatype": "FP32", "shape": [2, 30], "data": models["features"][:2].ravel().tolist()}]}))

    assert (int32.status_code, int32.json()) == (400, {"error": f"input '{names[0]}' is INT32, the model takes FP32: send datatype FP32"})
    assert (fp64.status_code, fp64.json()) == (400, {"error": f"input '{names[0]}' is FP64, the model takes FP32: send datatype FP32"})
    assert n_by_1.status_code == 200 and n_by_1.json()["outputs"] == fine.json()["outputs"]  # [N, 1] read as [N]
    assert fine.status_code == 200 and vec.status_code == 200
    assert vec.json()["outputs"][0]["data"] == models["estimator"].predict(models["features"][:2]).tolist()


def _pandas_lists(values: np.ndarray) -> pa.Array:
    """Rows of k values as pandas writes a column of numpy arrays to Parquet (and Polars and Spark their lists):
    ``list<double>``, not a fixed-size list."""
    import pandas as pd

    frame = pd.DataFrame({"input": list(values.astype(np.float64))})
    return pa.Table.from_pandas(frame, preserve_index=False).column("input").combine_chunks()


@pytest.mark.usefixtures("on_cluster")
def test_the_batch_flow_scores_parquet_shards_holding_the_list_column_fixed_or_as_pandas_writes_it(
        models: dict[str, Any], shardline_home: Path, tmp_path: Path) -> None:
    from shardline.flows.batch_inference import batch_inference

    push_all(ModelRegistry(str(shardline_home / "registry")), [models["vec"]])
    features = models["features"]
    shards = tmp_path / "in"
    shards.mkdir()
    for i, part in enumerate(np.array_split(np.arange(len(features)), 2)):  # one shard each way, one job
        column = feature_column if i == 0 else _pandas_lists
        pq.write_table(pa.table({"id": part, "input": column(features[part])}), shards / f"part-{i}.parquet",
                       row_group_size=100)
    assert pq.read_schema(shards / "part-1.parquet").field("input").type == pa.list_(pa.float64())
    # a row one value short: its shard is quarantined, saying so; the others scored
    short = pa.array([list(features[0, :29].astype(np.float64))], pa.list_(pa.float64()))
    pq.write_table(pa.table({"id": [10_000], "input": short}), shards / "part-short.parquet")

    state = batch_inference(model="vec@prod", input_uri=str(shards), output_uri=str(tmp_path / "out"), return_state=True)

    assert state.is_completed(), state
    summary = state.result()
    assert (summary["shards_committed"], summary["rows_out"]) == (2, len(features))
    scored = ds.dataset(tmp_path / "out", format="parquet").to_table().sort_by("id")
    np.testing.assert_array_equal(scored.column("label").to_numpy(), models["estimator"].predict(features))
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    [quarantined] = manifest["quarantined"]
    assert Path(quarantined["shard"]).name == "part-short.parquet"
    assert "column 'input' holds 1 of 1 rows whose lists are not 30 values long (29)" in quarantined["reason"]
