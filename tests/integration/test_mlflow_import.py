"""Models logged by MLflow's own client to a local store, imported as bundles: each answers as its framework
does on every training row (as both tiers load it), carries its run, experiment, metrics and source, is
served over real HTTP; what cannot map (a pickle, a pickled pyfunc, no sample rows) is refused, naming the
flavor, and nothing is written. A pyfunc logged from code: test_mlflow_pyfunc.py."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pyarrow as pa
import pytest

from shardline.build.frameworks import ATOL, RTOL
from shardline.build.mlflow_import import ImportedModel, import_mlflow_model, parse_model_uri, shardline_name
from shardline.errors import InvalidInput, InvalidSetting, ModelNotFound
from tests.framework_models import bundle_answers, training_frame, training_rows
from tests.mlflow_models import ALIAS, COMMIT, REGISTERED, LoggedModels, feature_table, log_models, ts_frame
from tests.tensor_models import feature_column

KEY = "sk-mlflow-import-test-key"


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> LoggedModels:
    return log_models(tmp_path_factory.mktemp("mlflow"))


def _answers(imported: ImportedModel, rows: pa.Table) -> dict[str, np.ndarray]:
    return bundle_answers(imported.folder, imported.manifest, rows)


def _expected(kind: str, model: Any, features: np.ndarray) -> dict[str, np.ndarray]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fitted on a DataFrame, asked about a matrix
        if kind == "lightgbm-booster":
            positive = np.asarray(model.predict(features))
            return {"label": (positive > 0.5).astype(np.int64), "probabilities": np.column_stack([1 - positive, positive])}
        return {"label": model.predict(features), "probabilities": model.predict_proba(features)}


@pytest.mark.parametrize("kind", ["xgboost", "lightgbm-booster", "lightgbm-sklearn", "sklearn-skops", "onnx"])
def test_an_imported_model_answers_as_its_framework_and_carries_its_run(kind: str, logged: LoggedModels,
                                                                        tmp_path: Path) -> None:
    features, _, names, sample = training_rows()

    imported = import_mlflow_model(logged.uri(kind), tmp_path / "bundle", tracking_uri=logged.tracking_uri)

    manifest = imported.manifest
    assert manifest.name == shardline_name(REGISTERED[kind]) and imported.source == logged.uri(kind)
    rows = pa.table({"X": feature_column(features)}) if kind == "onnx" else sample
    if kind != "onnx":  # the feature columns are the signature's (the input example's DataFrame columns)
        assert manifest.signature.input_names == names
    got, want = _answers(imported, rows), _expected(kind, logged.models[kind], features)
    assert (got["label"] == want["label"]).mean() >= 0.999
    assert np.allclose(got["probabilities"], want["probabilities"], atol=ATOL, rtol=RTOL)
    assert manifest.lineage.metrics == logged.metrics[kind]
    assert manifest.lineage.source_commit == COMMIT and manifest.lineage.parent == logged.uri(kind)
    tags = manifest.tags
    assert tags["mlflow.run_id"] == logged.run_ids[kind] and tags["mlflow.experiment_id"] == logged.experiment_id
    assert tags["mlflow.source"] == logged.uri(kind) and tags["mlflow.model_version"] == "1"
    assert tags["mlflow.flavor"] == kind.split("-")[0] and tags["mlflow.model_id"].startswith("m-")
    assert sorted(p.name for p in imported.folder.iterdir()) == ["manifest.json", "model.onnx"]


def test_an_alias_a_run_and_shardlines_own_uri_resolve_to_the_same_model(logged: LoggedModels, tmp_path: Path) -> None:
    name, run_id = REGISTERED["xgboost"], logged.run_ids["xgboost"]
    uris = [f"models:/{name}@{ALIAS}", f"mlflow:/models/{name}/1", f"runs:/{run_id}/model"]

    imported = [import_mlflow_model(uri, tmp_path / str(i), tracking_uri=logged.tracking_uri, name="churn")
                for i, uri in enumerate(uris)]

    assert [i.source for i in imported] == [f"models:/{name}/1", f"models:/{name}/1", f"runs:/{run_id}/model"]
    assert [i.manifest.tags["mlflow.source"] for i in imported] == uris
    assert {i.manifest.tags["mlflow.run_id"] for i in imported} == {run_id}
    first = _answers(imported[0], feature_table(50))
    for other in imported[1:]:
        assert all(np.array_equal(first[k], v) for k, v in _answers(other, feature_table(50)).items())


def test_a_tree_model_logged_without_an_example_needs_sample_rows(logged: LoggedModels, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput) as refused:
        import_mlflow_model(logged.uri("xgboost-bare"), tmp_path / "bare", tracking_uri=logged.tracking_uri)
    assert "(flavor xgboost) has no input example" in str(refused.value)
    assert "--signature-from ROWS.parquet" in str(refused.value) and not (tmp_path / "bare").exists()

    sample = feature_table().append_column("target", pa.array(training_rows()[1]))
    imported = import_mlflow_model(logged.uri("xgboost-bare"), tmp_path / "bare", tracking_uri=logged.tracking_uri,
                                   sample=sample, exclude=["target"])
    assert imported.manifest.signature.input_names == training_rows()[2] and not imported.sample_from_example


def test_a_model_fitted_on_a_dataframe_is_imported_with_that_dataframe_as_its_sample(logged: LoggedModels,
                                                                                   tmp_path: Path) -> None:
    frame = training_frame()  # what the XGBoost model was fitted on (its file keeps the column names)
    sample = frame[list(reversed(frame.columns))].assign(target=training_rows()[1])  # the label, columns shuffled
    model = logged.models["xgboost"]

    imported = import_mlflow_model(logged.uri("xgboost"), tmp_path / "bundle", tracking_uri=logged.tracking_uri,
                                   sample=sample)

    assert imported.manifest.signature.input_names == list(frame.columns)  # the model's features, in its order
    assert not imported.sample_from_example
    got = _answers(imported, pa.Table.from_pandas(sample))
    assert np.array_equal(got["label"], model.predict(frame))
    assert np.allclose(got["probabilities"], model.predict_proba(frame), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("kind", "says"), [
    ("sklearn-pickle", "(flavor sklearn, serialization_format cloudpickle) is a scikit-learn model saved as a pickle, "
                       "which Shardline never loads"),
    ("pyfunc", "has flavor python_function only, a pyfunc whose class MLflow saved as a pickle (python_model), which "
               "Shardline never loads (unpickling runs any code the file holds): log it from code instead: "
               "mlflow.pyfunc.log_model(python_model='model.py'"),
])
def test_what_cannot_map_is_refused_naming_the_flavor_and_nothing_is_written(
        kind: str, says: str, logged: LoggedModels, tmp_path: Path) -> None:
    out = tmp_path / "refused"

    with pytest.raises(InvalidInput) as refused:
        import_mlflow_model(logged.uri(kind), out, tracking_uri=logged.tracking_uri)

    assert says in str(refused.value) and logged.uri(kind) in str(refused.value)
    assert "log" in str(refused.value).split(":", 1)[1]  # and what to do
    assert not out.exists()


def test_a_missing_model_store_or_uri_is_refused(logged: LoggedModels, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="has no models:/BreastCancer-XGB/7"):
        import_mlflow_model("models:/BreastCancer-XGB/7", tmp_path / "a", tracking_uri=logged.tracking_uri)
    with pytest.raises(InvalidSetting, match="there is no MLflow tracking store at sqlite:///"):
        import_mlflow_model(logged.uri("xgboost"), tmp_path / "b", tracking_uri=f"sqlite:///{tmp_path / 'none.db'}")
    with pytest.raises(InvalidSetting, match="is not an MLflow model URI"):
        parse_model_uri("s3://bucket/model")
    assert not list(tmp_path.iterdir())  # no bundle folder, and no empty MLflow database made


@pytest.fixture(scope="module")
def served(logged: LoggedModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The imported XGBoost model pushed to a registry (alias prod) and served by `shardline serve`'s app."""
    from shardline.online.app import create_app
    from shardline.online.server import build_plane
    from shardline.online.tenants import TenantDirectory, hash_api_key
    from shardline.online.testing import serve_listeners_in_thread
    from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings
    from shardline.storage.registry import ModelRegistry

    home = tmp_path_factory.mktemp("mlflow-home")
    imported = import_mlflow_model(logged.uri("xgboost"), home / "bundle", tracking_uri=logged.tracking_uri)
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias(imported.manifest.name, "prod", registry.push(imported.folder).version or 1)
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key(KEY)], "models": [f"{imported.manifest.name}@prod"]}]})
    plane = build_plane(OnlineSettings(), StorageSettings(home=str(home)), RuntimeSettings(device="cpu", intra_op_threads=1),
                        tenants)
    with serve_listeners_in_thread(create_app(plane)) as server:
        yield server.url


def test_an_imported_model_is_served_with_xgboosts_answers(logged: LoggedModels, served: str) -> None:
    features, _, names, _ = training_rows()
    rows = features[::7][:40]
    body = {"inputs": [{"name": n, "shape": [len(rows)], "datatype": "FP32", "data": rows[:, i].tolist()}
                       for i, n in enumerate(names)]}

    answer = httpx.post(f"{served}/v2/models/breastcancer-xgb/infer", json=body,
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=30)

    assert answer.status_code == 200, answer.text
    outputs = {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in answer.json()["outputs"]}
    want = _expected("xgboost", logged.models["xgboost"], rows)
    assert np.array_equal(outputs["label"], want["label"])
    assert np.allclose(outputs["probabilities"], want["probabilities"], atol=ATOL, rtol=RTOL)


@pytest.fixture(scope="module")
def logged_sklearn(tmp_path_factory: pytest.TempPathFactory) -> LoggedModels:
    return log_models(tmp_path_factory.mktemp("mlflow-sklearn"), kinds=("sklearn-ts", "sklearn-bare", "sklearn-imputer",
                                                                         "sklearn-svc", "sklearn-function"))


def test_a_timestamp_column_float32_rounds_away_is_imported_with_float64_inputs_and_answers_as_scikit_learn(
        logged_sklearn: LoggedModels, tmp_path: Path) -> None:
    ts, labels = ts_frame()
    model = logged_sklearn.models["sklearn-ts"]
    assert (model.predict(ts) == labels).mean() > 0.98  # scikit-learn gets it right on the rows as given

    imported = import_mlflow_model(logged_sklearn.uri("sklearn-ts"), tmp_path / "ts",
                                   tracking_uri=logged_sklearn.tracking_uri)

    assert [c.type for c in imported.manifest.signature.inputs] == ["float64", "float64"]
    got = _answers(imported, pa.Table.from_pandas(ts))
    assert (got["label"] == model.predict(ts)).mean() >= 0.999
    assert np.allclose(got["probabilities"], model.predict_proba(ts), atol=ATOL, rtol=RTOL)


def test_package_sklearn_given_a_sample_checks_against_scikit_learn_on_the_rows_as_given(tmp_path: Path) -> None:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from shardline.build.packaging import package_sklearn

    ts, labels = ts_frame()
    model = make_pipeline(StandardScaler(), LogisticRegression()).fit(ts, labels)

    manifest = package_sklearn(model, tmp_path / "ts", name="ts", feature_names=["ts", "other"], sample=ts.head(50))
    unchecked = package_sklearn(model, tmp_path / "f32", name="ts", feature_names=["ts", "other"])

    rows = pa.Table.from_pandas(ts)
    assert (bundle_answers(tmp_path / "ts", manifest, rows)["label"] == model.predict(ts)).mean() >= 0.999
    assert (bundle_answers(tmp_path / "f32", unchecked, rows)["label"] == model.predict(ts)).mean() < 0.9  # float32


@pytest.mark.parametrize("kind", ["classifier", "regressor"])
def test_hist_gradient_boosting_is_packaged_and_answers_as_scikit_learn(kind: str, tmp_path: Path) -> None:
    """scikit-learn's recommended gradient boosting: skl2onnx 1.20's converter failed on every such model (a bool
    onnx refuses among its leaves' ints), mended in ``build/skl2onnx_mends.py``. Its answers on rows rounded to
    float32 move (so ``float32_loss`` speaks), but skl2onnx rounds its thresholds for float32 features, so the
    float32 bundle answers as scikit-learn does on the rows as given, and is kept."""
    from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor

    from shardline.build.packaging import package_sklearn
    from shardline.build.sklearn_check import float32_loss

    frame, labels = training_frame(), training_rows()[1]
    model = (HistGradientBoostingRegressor if kind == "regressor" else HistGradientBoostingClassifier)(
        max_iter=20, random_state=0).fit(frame, labels * 2.5 if kind == "regressor" else labels)
    sample = pa.Table.from_pandas(frame, preserve_index=False)
    assert float32_loss(model, sample, list(frame.columns)) is not None  # the proxy says float32 loses

    manifest = package_sklearn(model, tmp_path / kind, name="hist", feature_names=list(frame.columns), sample=frame)

    assert {c.type for c in manifest.signature.inputs} == {"float32"}
    got = bundle_answers(tmp_path / kind, manifest, sample)
    if kind == "regressor":
        assert np.allclose(got["prediction"], model.predict(frame), atol=ATOL, rtol=RTOL)
    else:
        assert np.array_equal(got["label"], model.predict(frame))
        assert np.allclose(got["probabilities"], model.predict_proba(frame), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind", ["soft", "soft-in-a-pipeline", "hard"])
def test_a_voting_classifier_is_packaged_and_answers_as_scikit_learn(kind: str, tmp_path: Path) -> None:
    """skl2onnx refuses a soft-voting VotingClassifier's default flatten_transform=True (which shapes transform()
    only): it converts a copy with it off (``skl2onnx_mends.convertible``), and the user's model is left as it is."""
    from sklearn.ensemble import RandomForestClassifier, VotingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from shardline.build.packaging import package_sklearn

    frame, labels = training_frame(), training_rows()[1]
    voting = VotingClassifier([("lr", make_pipeline(StandardScaler(), LogisticRegression())),
                               ("rf", RandomForestClassifier(n_estimators=20, random_state=0))],
                              voting="hard" if kind == "hard" else "soft")
    model = (make_pipeline(StandardScaler(), voting) if kind == "soft-in-a-pipeline" else voting).fit(frame, labels)

    manifest = package_sklearn(model, tmp_path / kind, name="vote", feature_names=list(frame.columns), sample=frame)

    got = bundle_answers(tmp_path / kind, manifest, pa.Table.from_pandas(frame, preserve_index=False))
    assert np.array_equal(got["label"], model.predict(frame))
    if kind != "hard":
        assert np.allclose(got["probabilities"], model.predict_proba(frame), atol=ATOL, rtol=RTOL)
    assert voting.flatten_transform is True  # the model given is unchanged


def test_hist_gradient_boosting_on_a_timestamp_column_float32_loses_is_refused_naming_it(tmp_path: Path) -> None:
    """Where float32 features really lose the answers (a Unix timestamp column), skl2onnx's float64 trees do not
    run in onnxruntime (their outputs typed double): refused in one line, saying what to do; nothing written."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    from shardline.build.packaging import package_sklearn

    ts, labels = ts_frame()
    model = HistGradientBoostingClassifier(max_iter=20, random_state=0).fit(ts, labels)

    with pytest.raises(InvalidInput) as refused:
        package_sklearn(model, tmp_path / "ts", name="ts", feature_names=["ts", "other"], sample=ts.head(200))

    said = str(refused.value)
    assert said.startswith("float32 inputs lose precision for column 'ts' (values up to 1.7e+09")
    assert "cannot run HistGradientBoostingClassifier converted with float64 inputs" in said
    assert said.endswith("fit again and package that") and not (tmp_path / "ts").exists()


def test_a_scikit_learn_model_logged_without_an_example_or_signature_is_refused(logged_sklearn: LoggedModels,
                                                                                  tmp_path: Path) -> None:
    with pytest.raises(InvalidInput) as refused:
        import_mlflow_model(logged_sklearn.uri("sklearn-bare"), tmp_path / "bare",
                            tracking_uri=logged_sklearn.tracking_uri)
    assert "(flavor sklearn) has no input example" in str(refused.value)
    assert "--signature-from ROWS.parquet" in str(refused.value) and not (tmp_path / "bare").exists()


def test_a_skops_model_holding_numpys_dtype_is_imported_and_answers_as_scikit_learn(logged_sklearn: LoggedModels,
                                                                                     tmp_path: Path) -> None:
    features, _, _, sample = training_rows()
    model = logged_sklearn.models["sklearn-imputer"]  # SimpleImputer keeps a numpy.dtype, which skops lists untrusted

    imported = import_mlflow_model(logged_sklearn.uri("sklearn-imputer"), tmp_path / "imputer",
                                   tracking_uri=logged_sklearn.tracking_uri)

    got, want = _answers(imported, sample), _expected("sklearn-imputer", model, features)
    assert (got["label"] == want["label"]).mean() >= 0.999
    assert np.allclose(got["probabilities"], want["probabilities"], atol=ATOL, rtol=RTOL)


def test_a_skops_model_holding_a_type_shardline_does_not_trust_is_not_told_to_log_it_with_skops(
        logged_sklearn: LoggedModels, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput) as refused:
        import_mlflow_model(logged_sklearn.uri("sklearn-function"), tmp_path / "function",
                            tracking_uri=logged_sklearn.tracking_uri)

    said = str(refused.value)
    assert ("(flavor sklearn, skops) holds types Shardline does not trust: tests.mlflow_models.shifted (it rebuilds "
            "scikit-learn's own classes and numpy's dtypes only)") in said
    assert said.endswith("convert the model to ONNX yourself (skl2onnx's to_onnx) and log it with mlflow.onnx")
    assert "serialization_format='skops'" not in said and not (tmp_path / "function").exists()


def test_a_linear_svc_is_imported_answering_labels_and_decision_scores_as_scikit_learn(logged_sklearn: LoggedModels,
                                                                                       tmp_path: Path) -> None:
    features, _, _, sample = training_rows()
    model = logged_sklearn.models["sklearn-svc"]  # LinearSVC has no predict_proba

    imported = import_mlflow_model(logged_sklearn.uri("sklearn-svc"), tmp_path / "svc",
                                   tracking_uri=logged_sklearn.tracking_uri)

    outputs = imported.manifest.signature.outputs
    assert [(c.name, c.type) for c in outputs] == [("label", "int64"), ("scores", "float32")]
    got = _answers(imported, sample)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fitted on a DataFrame, asked about a matrix
        assert np.array_equal(got["label"], model.predict(features))
        assert np.allclose(got["scores"], model.decision_function(features), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("kind", "sampled"), [("linear-svc-3-classes", True), ("svc", True), ("ridge", False),
                                              ("linear-svc-3-classes", False)])
def test_a_classifier_without_predict_proba_is_packaged_answering_its_decision_function(
        kind: str, sampled: bool, tmp_path: Path) -> None:
    from sklearn.datasets import load_iris
    from sklearn.linear_model import RidgeClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVC, LinearSVC

    from shardline.build.packaging import package_sklearn

    frame, labels = (load_iris(return_X_y=True, as_frame=True) if kind.endswith("3-classes") else
                     (training_frame(), training_rows()[1]))
    last = LinearSVC() if kind.startswith("linear-svc") else SVC() if kind == "svc" else RidgeClassifier()
    model = make_pipeline(StandardScaler(), last).fit(frame, labels)

    manifest = package_sklearn(model, tmp_path / kind, name="svc", feature_names=list(frame.columns),
                               sample=frame if sampled else None)

    classes = len(model.classes_)
    assert manifest.signature.outputs[1].type == ("float32" if classes == 2 else f"fixed_size_list<float32>[{classes}]")
    got = bundle_answers(tmp_path / kind, manifest, pa.Table.from_pandas(frame))
    assert np.array_equal(got["label"], model.predict(frame))
    assert np.allclose(got["scores"], model.decision_function(frame), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind", ["svr", "rbf-sampler"])
def test_where_float64_inputs_do_not_convert_or_run_float32s_loss_is_refused_naming_the_column(
        kind: str, tmp_path: Path) -> None:
    from sklearn.kernel_approximation import RBFSampler
    from sklearn.linear_model import Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVR

    from shardline.build.packaging import package_sklearn

    ts, _ = ts_frame()
    seconds = ts["ts"].to_numpy() - 1.7e9
    last = SVR() if kind == "svr" else make_pipeline(RBFSampler(random_state=0), Ridge())
    model = make_pipeline(StandardScaler(), last).fit(ts, seconds)

    with pytest.raises(InvalidInput) as refused:
        package_sklearn(model, tmp_path / kind, name="ts", feature_names=["ts", "other"], sample=ts.head(50))

    said = str(refused.value)
    assert said.startswith("float32 inputs lose precision for column 'ts' (values up to 1.7e+09")
    assert ("onnxruntime cannot run Pipeline converted with float64 inputs" if kind == "svr" else
            "skl2onnx cannot convert Pipeline with float64 inputs") in said
    assert said.endswith("subtract a constant from that column (e.g. its minimum) or rescale it before the model, fit "
                         "again and package that")
    assert not (tmp_path / kind).exists()
