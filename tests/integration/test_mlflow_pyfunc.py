"""A pyfunc logged from code by MLflow's own client (a weighted sum of the breast-cancer features over a
threshold, its weights an artifact JSON file), registered, and imported by `models:/NAME/1` as a custom-code
bundle: it answers as the class itself does, carries its run, and is scored by the batch flow on the
session's Dask cluster and over HTTP through `serve` for a tenant with ``custom_code: true`` only (another
gets 403). A pyfunc logged from code whose folder holds a pickle is refused, naming the flavor, with nothing
written (a pickled pyfunc is refused in test_mlflow_import.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pytest
import yaml

from shardline.errors import AccessDenied, InvalidInput, RuntimeUnavailable
from shardline.build.examples import breast_cancer, shard_table
from shardline.build.mlflow_import import ImportedModel, import_mlflow_model
from shardline.runtimes import RuntimeOptions, create_runtime

from tests.conftest import write_shards
from tests.framework_models import training_rows
from tests.mlflow_models import COMMIT, _tracking, frame

NAME, WITH_PICKLE = "Weighted Threshold", "threshold-with-pickle"
TRUSTED, OTHER = "sk-pyfunc-trusted-key", "sk-pyfunc-other-key"

MODEL_CODE = '''
"""Malignant when a weighted sum of the features passes zero; the weights are an artifact JSON file."""
import json

import mlflow
import numpy as np
import pandas as pd


class WeightedThreshold(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        with open(context.artifacts["weights"]) as f:
            spec = json.load(f)
        self.names = list(spec["weights"])
        self.weights = np.array([spec["weights"][n] for n in self.names])
        self.bias = spec["bias"]

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        score = model_input[self.names].to_numpy(dtype=np.float64) @ self.weights + self.bias
        return pd.DataFrame({"score": score, "malignant": score > 0})


mlflow.models.set_model(WeightedThreshold())
'''


@dataclass
class LoggedPyfunc:
    """The store, the logged model's run, and the class itself (loaded from the same file and weights)."""

    tracking_uri: str
    run_id: str
    model: Any

    def own_answers(self, rows: pa.Table) -> Any:
        """The class's answers computed directly (no MLflow, no Shardline) on float32 features."""
        names = training_rows()[2]
        features = rows.select(names).cast(pa.schema([(n, pa.float32()) for n in names]))
        return self.model.predict(None, features.to_pandas())


def _weights() -> dict[str, Any]:
    """A discriminant over the training rows: class-mean difference over variance, the bias at the midpoint."""
    features, labels, names, _ = training_rows()
    x = features.astype(np.float64)
    malignant, benign = x[labels == 0].mean(axis=0), x[labels == 1].mean(axis=0)
    weights = (malignant - benign) / x.var(axis=0)
    return {"weights": dict(zip(names, weights.tolist())), "bias": float(-weights @ (malignant + benign) / 2)}


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> LoggedPyfunc:
    import mlflow

    folder = tmp_path_factory.mktemp("mlflow-pyfunc")
    (folder / "model.py").write_text(MODEL_CODE)
    (folder / "weights.json").write_text(json.dumps(_weights()))
    (folder / "scaler.pkl").write_bytes(pickle.dumps({"scale": 1.0}))
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    common: dict[str, Any] = {"name": "model", "python_model": str(folder / "model.py"), "input_example": frame(5),
                              "pip_requirements": []}
    with _tracking(uri), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MLflow's notes on integer columns and the like
        experiment = mlflow.create_experiment("pyfunc", artifact_location=(folder / "artifacts").as_uri())
        with mlflow.start_run(experiment_id=experiment) as run:
            mlflow.set_tag("mlflow.source.git.commit", COMMIT)
            mlflow.log_metric("accuracy", 0.94)
            mlflow.pyfunc.log_model(artifacts={"weights": str(folder / "weights.json")}, registered_model_name=NAME,
                                    **common)
        with mlflow.start_run(experiment_id=experiment):
            mlflow.pyfunc.log_model(artifacts={"weights": str(folder / "weights.json"),
                                               "scaler": str(folder / "scaler.pkl")},
                                    registered_model_name=WITH_PICKLE, **common)
    spec = importlib.util.spec_from_file_location("weighted_threshold_direct", folder / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.WeightedThreshold()
    model.load_context(SimpleNamespace(artifacts={"weights": str(folder / "weights.json")}))
    return LoggedPyfunc(uri, run.info.run_id, model)


@pytest.fixture(scope="module")
def imported(logged: LoggedPyfunc, tmp_path_factory: pytest.TempPathFactory) -> ImportedModel:
    return import_mlflow_model(f"models:/{NAME}/1", tmp_path_factory.mktemp("pyfunc-bundle") / "bundle",
                               tracking_uri=logged.tracking_uri)


def test_a_pyfunc_from_code_becomes_a_custom_code_bundle_that_answers_as_its_class(
        logged: LoggedPyfunc, imported: ImportedModel) -> None:
    _, _, names, sample = training_rows()
    manifest = imported.manifest

    runtime = create_runtime(imported.folder, manifest, RuntimeOptions("cpu", 1))
    runtime.load()
    try:
        answer = runtime.predict(sample)
    finally:
        runtime.close()

    assert manifest.runtime == "python" and manifest.runtime_config["entry"] == "mlflow_pyfunc:Model"
    assert imported.flavor == "python_function" and imported.sample_from_example
    assert manifest.signature.input_names == names
    assert [(c.name, c.type) for c in manifest.signature.outputs] == [("score", "float64"), ("malignant", "bool")]
    want = logged.own_answers(sample)
    assert answer.column("malignant").to_pylist() == want["malignant"].tolist()
    np.testing.assert_allclose(answer.column("score").to_numpy(), want["score"].to_numpy(), rtol=1e-12)
    assert 0.8 < np.mean(want["malignant"].to_numpy() == (training_rows()[1] == 0)) < 1  # a real computation
    tags = manifest.tags
    assert tags["mlflow.flavor"] == "python_function" and tags["mlflow.run_id"] == logged.run_id
    assert tags["mlflow.source"] == f"models:/{NAME}/1" and tags["mlflow.model_version"] == "1"
    assert manifest.lineage.metrics == {"accuracy": 0.94} and manifest.lineage.source_commit == COMMIT
    paths = {a.path: a.role for a in manifest.artifacts}
    assert paths["code/mlflow_pyfunc.py"] == "code"
    assert paths["mlflow_model/model.py"] == paths["mlflow_model/artifacts/weights.json"] == "model"


def test_without_mlflow_the_bundle_does_not_load_and_says_what_to_install(
        imported: ImportedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` now fails as if it were not installed
    runtime = create_runtime(imported.folder, imported.manifest, RuntimeOptions("cpu", 1))

    with pytest.raises(RuntimeUnavailable, match=r"weighted-threshold:.* MLflow's client; pip install "
                                                 r"'shardline\[mlflow\]'"):
        runtime.load()


def test_a_pyfunc_from_code_holding_a_pickle_is_refused_naming_the_flavor_and_nothing_is_written(
        logged: LoggedPyfunc, tmp_path: Path) -> None:
    out = tmp_path / "refused"

    with pytest.raises(InvalidInput) as refused:
        import_mlflow_model(f"models:/{WITH_PICKLE}/1", out, tracking_uri=logged.tracking_uri)

    said = str(refused.value)
    assert f"MLflow model models:/{WITH_PICKLE}/1 (flavor python_function, it holds pickles: " in said
    assert "scaler.pkl" in said and "log its weights as files" in said
    assert not out.exists()


@pytest.fixture(scope="module")
def home(imported: ImportedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A registry holding the imported bundle as weighted-threshold@prod."""
    from shardline.storage.registry import ModelRegistry

    home = tmp_path_factory.mktemp("pyfunc-home")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias(imported.manifest.name, "prod", registry.push(imported.folder).version or 1)
    return home


@pytest.mark.usefixtures("on_cluster")
def test_the_batch_flow_scores_the_pyfunc_for_a_trusted_tenant_and_refuses_another(
        logged: LoggedPyfunc, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardline.flows.batch_inference import batch_inference

    monkeypatch.setenv("SHARDLINE_STORAGE_HOME", str(home))
    lake = Path(os.path.realpath(tmp_path / "lake"))
    for tenant in ("trusted", "other"):
        write_shards(lake / tenant / "in", 2, 150)
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump({"tenants": [
        {"name": "trusted", "custom_code": True, "batch": {"storage_prefixes": [str(lake / "trusted")]}},
        {"name": "other", "batch": {"storage_prefixes": [str(lake / "other")]}},
    ]}))
    monkeypatch.setenv("SHARDLINE_TENANTS_FILE", str(tmp_path / "tenants.yaml"))

    runs = {tenant: batch_inference(model="weighted-threshold@prod", input_uri=str(lake / tenant / "in"),
                                    output_uri=str(lake / tenant / "out"), tenant=tenant, return_state=True)
            for tenant in ("trusted", "other")}

    assert runs["trusted"].is_completed(), runs["trusted"].message
    rows = ds.dataset(lake / "trusted" / "in").to_table().sort_by("id")
    scored = ds.dataset(lake / "trusted" / "out").to_table().sort_by("id")
    assert scored.column("id").to_pylist() == rows.column("id").to_pylist()  # every row once
    want = logged.own_answers(rows)
    assert scored.column("malignant").to_pylist() == want["malignant"].tolist()
    np.testing.assert_allclose(scored.column("score").to_numpy(), want["score"].to_numpy(), rtol=1e-12)
    assert runs["other"].is_failed()
    with pytest.raises(AccessDenied, match="tenant 'other' may not run"):
        runs["other"].result()
    assert not (lake / "other" / "out").exists()


@pytest.fixture(scope="module")
def url(home: Path) -> Iterator[str]:
    from shardline.online.app import create_app
    from shardline.online.server import build_plane
    from shardline.online.tenants import TenantDirectory, hash_api_key
    from shardline.online.testing import serve_listeners_in_thread
    from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings

    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "trusted", "api_keys_sha256": [hash_api_key(TRUSTED)], "models": ["weighted-threshold@prod"],
         "custom_code": True},
        {"name": "other", "api_keys_sha256": [hash_api_key(OTHER)], "models": ["weighted-threshold@prod"]},
    ]})
    plane = build_plane(OnlineSettings(), StorageSettings(home=str(home)),
                        RuntimeSettings(device="cpu", intra_op_threads=1), tenants)
    with serve_listeners_in_thread(create_app(plane)) as served:
        yield served.url


def test_serve_answers_a_trusted_tenant_as_the_class_does_and_refuses_another_with_403(
        logged: LoggedPyfunc, url: str) -> None:
    rows = shard_table(breast_cancer(), 40, 0, 3)
    body = {"inputs": [{"name": n, "shape": [rows.num_rows], "datatype": "FP32", "data": rows.column(n).to_pylist()}
                       for n in breast_cancer().names]}

    answer = httpx.post(f"{url}/v2/models/weighted-threshold/infer", json=body,
                        headers={"Authorization": f"Bearer {TRUSTED}"}, timeout=60)
    refused = httpx.post(f"{url}/v2/models/weighted-threshold/infer", json=body,
                         headers={"Authorization": f"Bearer {OTHER}"}, timeout=60)

    assert answer.status_code == 200, answer.text
    outputs = {o["name"]: o for o in answer.json()["outputs"]}
    want = logged.own_answers(rows)
    assert outputs["malignant"]["datatype"] == "BOOL"
    assert outputs["malignant"]["data"] == want["malignant"].tolist()
    np.testing.assert_allclose(outputs["score"]["data"], want["score"].to_numpy(), rtol=1e-12)
    assert refused.status_code == 403
    assert "tenant 'other' may not run" in refused.json()["error"]
