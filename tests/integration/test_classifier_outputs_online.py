"""The classifier of tests/classifier_models.py (string labels, skl2onnx's ZipMap) served over real HTTP: its labels
are V2 BYTES tensors, in JSON and in binary, to tritonclient as to Triton; and packaged where onnx cannot be
imported, its ZipMap is refused saying what to do."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton

from shardline.build.packaging import package_onnx, sample_table
from shardline.errors import InvalidInput
from shardline.online.app import create_app
from shardline.online.server import build_plane
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.online.testing import serve_listeners_in_thread
from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings
from shardline.storage.registry import ModelRegistry

from tests.classifier_models import SPECIES, DefaultConverted, species_classifier

KEY = "sk-species-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> DefaultConverted:
    return species_classifier(tmp_path_factory.mktemp("species"))


@pytest.fixture(scope="module")
def url(model: DefaultConverted, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("species-bundle")
    notes: list[str] = []
    package_onnx(model.onnx_file, folder / "bundle", name="species", notes=notes,
                 sample=sample_table(model.rows).drop_columns(["species"]))
    assert notes == ["output 'output_probability' was a ZipMap (a map a row): packaged as its probability tensor, "
                     "a column a class in the order setosa, versicolor, virginica"]
    home = tmp_path_factory.mktemp("species-home")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias("species", "prod", registry.push(folder / "bundle").version or 1)
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key(KEY)], "models": ["species@prod"]}]})
    plane = build_plane(OnlineSettings(alias_refresh_s=0), StorageSettings(home=str(home)),
                        RuntimeSettings(device="cpu", intra_op_threads=1), tenants)
    with serve_listeners_in_thread(create_app(plane)) as served:
        yield served.url


def _inputs(model: DefaultConverted, rows: np.ndarray, binary: bool) -> list[triton.InferInput]:
    inputs = []
    for j, name in enumerate(model.names):
        column = triton.InferInput(name, [len(rows)], "FP32")
        column.set_data_from_numpy(np.ascontiguousarray(rows[:, j]), binary_data=binary)
        inputs.append(column)
    return inputs


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("rows", [1, 40])
def test_tritonclient_gets_the_species_as_bytes_and_the_probabilities(
        url: str, model: DefaultConverted, binary: bool, rows: int) -> None:
    features = model.features[45:45 + rows]
    outputs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("output_label", "output_probability")]
    client = triton.InferenceServerClient(url.removeprefix("http://"))
    try:
        result = client.infer("species", _inputs(model, features, binary), outputs=outputs, headers=dict(HEADERS))
        metadata = client.get_model_metadata("species", headers=dict(HEADERS))
    finally:
        client.close()

    labels = [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy("output_label").ravel()]
    assert labels == model.estimator.predict(features).tolist()
    np.testing.assert_allclose(result.as_numpy("output_probability").reshape(-1, 3),
                               model.estimator.predict_proba(features), atol=1e-5)
    assert metadata["outputs"] == [{"name": "output_label", "datatype": "BYTES", "shape": [-1]},
                                   {"name": "output_probability", "datatype": "FP32", "shape": [-1, 3]}]


def test_raw_json_gets_the_species_as_strings(url: str, model: DefaultConverted) -> None:
    features = model.features[[0, 60, 120]]
    body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [3], "data": features[:, j].tolist()}
                       for j, n in enumerate(model.names)]}

    answer = httpx.post(f"{url}/v2/models/species/infer", content=orjson.dumps(body), headers=HEADERS)

    assert answer.status_code == 200, answer.text
    [label] = [o for o in answer.json()["outputs"] if o["name"] == "output_label"]
    assert (label["datatype"], label["shape"], label["data"]) == ("BYTES", [3], SPECIES)


def test_without_onnx_a_zipmap_is_refused_saying_what_to_do(
        model: DefaultConverted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx raises ImportError, as where it is not installed

    with pytest.raises(InvalidInput) as refused:
        package_onnx(model.onnx_file, tmp_path / "bundle", name="species",
                     sample=sample_table(model.rows).drop_columns(["species"]))

    assert str(refused.value) == (
        "ONNX output 'output_probability' is not a tensor (a map or sequence); export it as a tensor of one value or "
        "one vector a row (scikit-learn's ZipMap is unwrapped when onnx is installed: pip install "
        "'shardline[package]'; or convert the model with options={'zipmap': False})")
    assert not (tmp_path / "bundle").exists()  # nothing half made


