"""XGBoost, LightGBM and PyTorch models, fitted here, packaged by their builders, pushed, and scored in both
tiers: the batch flow on a real Dask cluster and `serve` over real HTTP answer as the framework itself does
(within the converter's tolerance, ``shardline.build.frameworks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pyarrow.dataset as ds
import pytest

from shardline.flows.batch_inference import batch_inference
from shardline.build.frameworks import ATOL, RTOL, package_lightgbm, package_torch, package_xgboost
from shardline.online.app import create_app
from shardline.online.server import build_plane
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.online.testing import serve_listeners_in_thread
from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings
from shardline.storage.registry import ModelRegistry

from tests.framework_models import fitted, predictions, training_frame, training_rows

KINDS = ("xgboost-classifier", "lightgbm-classifier", "torch-mlp")
KEY = "sk-frameworks-test-key"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A registry home where each kind is pushed as a model of its name with the alias prod; the fitted models."""
    home = tmp_path_factory.mktemp("frameworks-home")
    registry = ModelRegistry(str(home / "registry"))
    _, _, names, sample = training_rows()
    built = {}
    for kind in KINDS:
        model = built[kind] = fitted(kind)
        folder = home / "bundles" / kind
        if kind == "torch-mlp":
            package_torch(model, folder, name=kind, sample=sample, feature_names=names, output_names=["probabilities"])
        else:
            builder = package_xgboost if kind.startswith("xgboost") else package_lightgbm
            builder(model, folder, name=kind, sample=sample, feature_names=names)
        registry.set_alias(kind, "prod", registry.push(folder).version or 1)
    return home, built


def _assert_close(kind: str, got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for output, expected in want.items():
        values = np.asarray(got[output])
        if output == "label":
            assert (values == expected).mean() >= 0.999, f"{kind}: labels differ from the framework's"
        else:
            assert np.allclose(values.reshape(expected.shape), expected, atol=ATOL, rtol=RTOL), f"{kind}: {output}"


@pytest.mark.usefixtures("on_cluster")
@pytest.mark.parametrize("kind", KINDS)
def test_the_batch_flow_scores_like_the_framework(kind: str, models: tuple[Path, dict[str, Any]],
                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, built = models
    monkeypatch.setenv("SHARDLINE_STORAGE_HOME", str(home))
    from shardline.build.examples import write_shards

    write_shards(tmp_path / "input", 2, 600)
    state = batch_inference(model=f"{kind}@prod", input_uri=str(tmp_path / "input"), output_uri=str(tmp_path / "out"),
                            return_state=True)

    assert state.is_completed(), state.message
    _, _, names, _ = training_rows()
    rows = ds.dataset(tmp_path / "input").to_table().sort_by("id")
    scored = ds.dataset(tmp_path / "out").to_table().sort_by("id")
    assert scored.column("id").to_pylist() == rows.column("id").to_pylist()  # every row once
    features = np.column_stack([rows.column(n).to_numpy() for n in names]).astype(np.float32)
    got = {c: np.asarray(scored.column(c).to_pylist()) for c in scored.column_names if c != "id"}
    _assert_close(kind, got, predictions(kind, built[kind], features))


@pytest.fixture(scope="module")
def url(models: tuple[Path, dict[str, Any]]) -> Iterator[str]:
    home, _ = models
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key(KEY)], "models": [f"{k}@prod" for k in KINDS]}]})
    plane = build_plane(OnlineSettings(), StorageSettings(home=str(home)), RuntimeSettings(device="cpu", intra_op_threads=1),
                        tenants)
    with serve_listeners_in_thread(create_app(plane)) as served:
        yield served.url


@pytest.mark.parametrize("kind", KINDS)
def test_serve_answers_like_the_framework(kind: str, models: tuple[Path, dict[str, Any]], url: str) -> None:
    _, built = models
    features, _, names, _ = training_rows()
    rows = features[::7][:40]
    body = {"inputs": [{"name": n, "shape": [len(rows)], "datatype": "FP32", "data": rows[:, i].tolist()}
                       for i, n in enumerate(names)]}

    answer = httpx.post(f"{url}/v2/models/{kind}/infer", json=body, headers={"Authorization": f"Bearer {KEY}"},
                        timeout=30)

    assert answer.status_code == 200, answer.text
    outputs = {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in answer.json()["outputs"]}
    _assert_close(kind, outputs, predictions(kind, built[kind], rows))


@pytest.mark.usefixtures("on_cluster")
@pytest.mark.parametrize("kind", ["xgboost-classifier", "lightgbm-classifier"])
def test_a_tree_model_fitted_with_missing_values_scores_them_as_pandas_and_pyarrow_write_them(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The sample's NaN (nulls once pandas made it a table) declared nothing: every shard holding a missing value,
    # the model's own training rows included, was quarantined as nulls, NaN, or by the contract's not-null rule.
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardline.bundle import read_manifest
    from shardline.quality.profile import attach_reference_profile

    _, labels, names, _ = training_rows()
    frame = training_frame(dtype=np.float32)
    frame = frame.mask(np.random.default_rng(7).random(frame.shape) < 0.05)  # ~5% missing, as NaN
    if kind.startswith("xgboost"):
        import xgboost

        model: Any = xgboost.XGBClassifier(n_estimators=20, max_depth=3, n_jobs=1).fit(frame, labels)
        package_xgboost(model, tmp_path / "bundle", name="missing", sample=frame)
    else:
        import lightgbm

        model = lightgbm.LGBMClassifier(n_estimators=20, num_leaves=15, n_jobs=1, verbose=-1).fit(frame, labels)
        package_lightgbm(model, tmp_path / "bundle", name="missing", sample=frame)
    attach_reference_profile(tmp_path / "bundle", pa.Table.from_pandas(frame))  # so the data contract runs too
    inputs = read_manifest(tmp_path / "bundle").signature.inputs
    assert all(spec.nullable and spec.non_finite for spec in inputs)  # every column of the sample misses values
    home = tmp_path / "home"
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias("missing", "prod", registry.push(tmp_path / "bundle").version or 1)
    (tmp_path / "input").mkdir()
    half = len(frame) // 2
    frame.iloc[:half].assign(id=np.arange(half)).to_parquet(tmp_path / "input" / "pandas.parquet")  # NaN as null
    rest = frame.iloc[half:]
    nan_table = pa.table({**{n: pa.array(rest[n].to_numpy()) for n in names}, "id": np.arange(half, len(frame))})
    assert nan_table.column(names[0]).null_count == 0 and rest[names[0]].isna().any()  # real NaN in the file
    pq.write_table(nan_table, tmp_path / "input" / "nan.parquet")
    monkeypatch.setenv("SHARDLINE_STORAGE_HOME", str(home))

    state = batch_inference(model="missing@prod", input_uri=str(tmp_path / "input"), output_uri=str(tmp_path / "out"),
                            return_state=True)

    assert state.is_completed(), state.message
    scored = ds.dataset(tmp_path / "out").to_table().sort_by("id")
    assert scored.column("id").to_pylist() == list(range(len(frame)))  # no shard quarantined, every row once
    got = {c: np.asarray(scored.column(c).to_pylist()) for c in ("label", "probabilities")}
    _assert_close(kind, got, predictions(kind, model, frame))
