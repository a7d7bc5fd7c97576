"""A scikit-learn pipeline over numbers and text categories, as tabular models are usually trained (a
``ColumnTransformer``: ``StandardScaler`` on the numbers, ``OneHotEncoder`` on the categories): packaged with
``package_sklearn`` (and so imported from MLflow) into one input a column, float32 and string, checked against
scikit-learn on the rows as given; then served over real HTTP (tritonclient, BYTES and FP32 tensors, JSON and
binary) and scored by a batch job whose shards hold a category as pandas writes it (a dictionary), each answering
as scikit-learn does. Text vectorizer pipelines too (TF-IDF alone, or in a ColumnTransformer beside a number), and
the one-line refusal where their ONNX form reads the sample's words otherwise."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import tritonclient.http as triton

from shardline.build.frameworks import ATOL, RTOL
from shardline.build.packaging import package_sklearn
from shardline.errors import InvalidSetting
from shardline.flows.batch_inference import batch_inference
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.quality.profile import profile_table
from shardline.storage.registry import ModelRegistry

from tests.framework_models import bundle_answers
from tests.support.serving import serve_home

KEY = "sk-passengers-test-key"
FEATURES = ["age", "fare", "sex", "port"]
TEXTS = ["sex", "port"]


def passengers(rows: int = 600, seed: int = 0) -> Any:
    """Two number and two text columns, and a label that depends on both kinds."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({"age": rng.integers(1, 80, rows).astype(np.float64), "fare": rng.gamma(2.0, 20.0, rows),
                          "sex": rng.choice(["female", "male"], rows), "port": rng.choice(["C", "Q", "S"], rows)})
    odds = 1.5 * (frame["sex"] == "female") - 0.02 * frame["age"] + 0.01 * frame["fare"] + 0.4 * (frame["port"] == "C")
    return frame, (odds + rng.normal(0, 0.5, rows) > 0.3).astype(np.int64).to_numpy()


def pipeline(last: Any, scaled: bool = True) -> Any:
    """The numbers scaled for a linear model, passed through for trees (a scaler computed in float32 before a tree's
    thresholds moves a few rows across them: skl2onnx's graph computes in float32, the check refuses it)."""
    from sklearn.compose import ColumnTransformer
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    numbers = StandardScaler() if scaled else "passthrough"
    return make_pipeline(ColumnTransformer([("numbers", numbers, ["age", "fare"]),
                                            ("categories", OneHotEncoder(handle_unknown="ignore"), TEXTS)]), last)


def _model(kind: str) -> Any:
    from sklearn.ensemble import RandomForestRegressor
    from sklearn.linear_model import LogisticRegression
    from sklearn.svm import LinearSVC

    frame, labels = passengers()
    last = {"classifier": LogisticRegression(), "regressor": RandomForestRegressor(n_estimators=20, random_state=0),
            "linear-svc": LinearSVC()}[kind]
    return pipeline(last, scaled=kind != "regressor").fit(frame, labels * 10.0 if kind == "regressor" else labels)


def _sklearn(model: Any, frame: Any, output: str) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        method = {"label": "predict", "prediction": "predict", "probabilities": "predict_proba",
                  "scores": "decision_function"}[output]
        return np.asarray(getattr(model, method)(frame))


@pytest.mark.parametrize("kind, sample_layout", [
    ("classifier", "str"), ("classifier", "category"), ("regressor", "str"), ("linear-svc", "str"),
])
def test_a_pipeline_of_numbers_and_text_categories_is_packaged_and_answers_as_scikit_learn(
        kind: str, sample_layout: str, tmp_path: Path) -> None:
    model = _model(kind)
    frame, _ = passengers(300, seed=1)  # rows the model has not seen
    sample = frame.astype({c: "category" for c in TEXTS}) if sample_layout == "category" else frame

    manifest = package_sklearn(model, tmp_path / "bundle", name="passengers", feature_names=FEATURES, sample=sample)

    assert [(c.name, c.type) for c in manifest.signature.inputs] == [
        ("age", "float32"), ("fare", "float32"), ("sex", "string"), ("port", "string")]
    outputs = [c.name for c in manifest.signature.outputs]
    assert outputs == {"classifier": ["label", "probabilities"], "regressor": ["prediction"],
                       "linear-svc": ["label", "scores"]}[kind]
    got = bundle_answers(tmp_path / "bundle", manifest, pa.Table.from_pandas(frame, preserve_index=False))
    for output in outputs:
        want = _sklearn(model, frame, output)
        if output == "label":
            assert np.array_equal(got[output], want)
        else:
            assert np.allclose(got[output].reshape(want.shape), want, atol=ATOL, rtol=RTOL), output


def test_the_tensor_layout_of_text_features_is_refused_in_one_line(tmp_path: Path) -> None:
    frame, _ = passengers(50)
    with pytest.raises(InvalidSetting) as refused:
        package_sklearn(_model("classifier"), tmp_path / "bundle", name="passengers", feature_names=FEATURES,
                        sample=frame, input_layout="tensor")
    assert str(refused.value) == ("input_layout 'tensor' stacks float features into one [N, k] input; columns 'sex', "
                                  "'port' hold text: leave input_layout at 'columns'")
    assert not (tmp_path / "bundle").exists()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The classifier, packaged with its training rows' profile (so batch jobs check a data contract)."""
    model = _model("classifier")
    frame, _ = passengers()
    folder = tmp_path_factory.mktemp("passengers") / "bundle"
    package_sklearn(model, folder, name="passengers", feature_names=FEATURES, sample=frame,
                    reference_profile=profile_table(pa.Table.from_pandas(frame, preserve_index=False)))
    return folder, model


@pytest.fixture(scope="module")
def url(bundle: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("passengers-home")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias("passengers", "prod", registry.push(bundle[0]).version or 1)
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key(KEY)], "models": ["passengers@prod"]}]})
    with serve_home(home, tenants) as (served, _):
        yield served


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_sends_text_and_number_tensors_and_gets_scikit_learns_answers(
        url: str, bundle: tuple[Path, Any], binary: bool) -> None:
    frame, _ = passengers(40, seed=2)
    client = triton.InferenceServerClient(url.removeprefix("http://"))
    inputs = []
    for name in FEATURES:
        text = name in TEXTS
        tensor = triton.InferInput(name, [len(frame)], "BYTES" if text else "FP32")
        values = frame[name].to_numpy(dtype=object if text else np.float32)
        tensor.set_data_from_numpy(values, binary_data=binary)
        inputs.append(tensor)
    outputs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("label", "probabilities")]

    answer = client.infer("passengers", inputs, outputs=outputs, headers={"Authorization": f"Bearer {KEY}"})

    model = bundle[1]
    assert answer.as_numpy("label").tolist() == _sklearn(model, frame, "label").tolist()
    np.testing.assert_allclose(answer.as_numpy("probabilities"), _sklearn(model, frame, "probabilities"),
                               atol=ATOL, rtol=RTOL)


@pytest.mark.usefixtures("on_cluster")
def test_a_batch_job_scores_text_categories_written_as_pandas_writes_a_category(
        bundle: tuple[Path, Any], shardline_home: Path, tmp_path: Path) -> None:
    registry = ModelRegistry(str(shardline_home / "registry"))
    registry.set_alias("passengers", "prod", registry.push(bundle[0]).version or 1)
    frame, _ = passengers(900, seed=3)
    shards = tmp_path / "in"
    shards.mkdir()
    for i, part in enumerate(np.array_split(np.arange(len(frame)), 3)):
        rows = frame.iloc[part].astype({"sex": "category"})  # a dictionary column; 'port' plain strings
        pq.write_table(pa.Table.from_pandas(rows.assign(id=part), preserve_index=False), shards / f"part-{i}.parquet")
    out = tmp_path / "out"

    state = batch_inference(model="passengers@prod", input_uri=str(shards), output_uri=str(out), return_state=True)

    assert state.is_completed(), state.message
    summary = state.result()
    assert (summary["rows_in"], summary["rows_out"], summary["shards_quarantined"]) == (900, 900, 0)
    scored = ds.dataset(out, format="parquet").to_table().sort_by("id")
    assert scored.column("id").to_pylist() == list(range(900))
    assert scored.column("label").to_pylist() == _sklearn(bundle[1], frame, "label").tolist()
    probabilities = np.array(scored.column("probabilities").to_pylist())
    np.testing.assert_allclose(probabilities, _sklearn(bundle[1], frame, "probabilities"), atol=ATOL, rtol=RTOL)


def test_the_pipeline_logged_to_mlflow_is_imported_with_its_text_categories(tmp_path: Path) -> None:
    """As MLflow logs it by default (skops), its input example the sample: imported into the same columns."""
    import mlflow

    from shardline.build.mlflow_import import import_mlflow_model
    from tests.mlflow_models import _tracking

    model = _model("classifier")
    frame, _ = passengers(200, seed=4)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with _tracking(uri), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        experiment = mlflow.create_experiment("passengers", artifact_location=(tmp_path / "artifacts").as_uri())
        with mlflow.start_run(experiment_id=experiment):
            mlflow.sklearn.log_model(model, name="model", registered_model_name="passengers", input_example=frame.head(50),
                                     pip_requirements=[], serialization_format="skops")

    imported = import_mlflow_model("models:/passengers/1", tmp_path / "bundle", tracking_uri=uri)

    assert [(c.name, c.type) for c in imported.manifest.signature.inputs] == [
        ("age", "float32"), ("fare", "float32"), ("sex", "string"), ("port", "string")]
    got = bundle_answers(imported.folder, imported.manifest, pa.Table.from_pandas(frame, preserve_index=False))
    assert np.array_equal(got["label"], _sklearn(model, frame, "label"))
    assert np.allclose(got["probabilities"], _sklearn(model, frame, "probabilities"), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("shape", ["text-alone", "text-and-a-number"])
def test_a_text_vectorizer_pipeline_is_packaged_in_the_c_locale_and_answers_as_scikit_learn(
        shape: str, tmp_path: Path) -> None:
    """TF-IDF first (its estimator fitted on texts, not named columns: given the texts alone), or inside a
    ColumnTransformer beside a number. skl2onnx's text normalizer defaults to en_US.UTF-8, a locale this machine
    (and many images) lacks, where onnxruntime cannot load it: the builder converts in the C locale."""
    import pandas as pd
    from sklearn.compose import ColumnTransformer
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(5)
    words = ["good", "bad", "great", "awful", "Movie", "PLOT", "acting", "fun"]  # ASCII: see the test below
    texts = [" ".join(rng.choice(words, 5)) for _ in range(300)]
    frame = pd.DataFrame({"review": texts, "stars": rng.integers(1, 6, 300).astype(np.float64)})
    labels = np.array([("good" in t) + ("great" in t) - ("bad" in t) > 0 for t in texts], dtype=np.int64)
    if shape == "text-alone":
        model, features = make_pipeline(TfidfVectorizer(), LogisticRegression()).fit(texts, labels), ["review"]
        given: Any = np.array(texts, dtype=object)
    else:
        model = make_pipeline(ColumnTransformer([("words", TfidfVectorizer(), "review"), ("n", StandardScaler(), ["stars"])]),
                              LogisticRegression()).fit(frame, labels)
        features, given = ["review", "stars"], frame

    manifest = package_sklearn(model, tmp_path / "bundle", name="reviews", feature_names=features, sample=frame)

    assert [(c.name, c.type) for c in manifest.signature.inputs] == [
        ("review", "string"), ("stars", "float32")][:len(features)]
    got = bundle_answers(tmp_path / "bundle", manifest, pa.Table.from_pandas(frame[features], preserve_index=False))
    assert np.array_equal(got["label"], _sklearn(model, given, "label"))
    assert np.allclose(got["probabilities"], _sklearn(model, given, "probabilities"), atol=ATOL, rtol=RTOL)


def test_a_text_onnxruntime_reads_otherwise_is_refused_by_the_check_in_one_line(tmp_path: Path) -> None:
    """skl2onnx's text vectorizers read ASCII words as scikit-learn does, not others: a word with one non-ASCII
    letter ('école', 'café') is read otherwise (in the C locale and C.UTF-8 alike), and a model fitted on such
    words answers otherwise. The check against scikit-learn on the sample catches it; nothing is written."""
    import pandas as pd
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    from shardline.errors import InvalidInput

    texts = ["école good", "café bad", "good movie", "bad movie"] * 10
    model = make_pipeline(TfidfVectorizer(), LogisticRegression()).fit(texts, [1, 0, 1, 0] * 10)

    with pytest.raises(InvalidInput) as refused:
        package_sklearn(model, tmp_path / "bundle", name="reviews", feature_names=["text"],
                        sample=pd.DataFrame({"text": texts}))

    said = str(refused.value)
    assert said.startswith("the ONNX conversion does not match scikit-learn's own predictions: 'probabilities' off by "
                           "up to ")
    assert said.endswith("Its text column 'text' holds letters outside ASCII (accents), which skl2onnx's text "
                         "vectorizers read otherwise than scikit-learn does: package the pipeline as custom model code "
                         "instead, which runs scikit-learn itself (docs/custom-models.md)")
    assert "\n" not in said and not (tmp_path / "bundle").exists()


def test_the_model_metadata_tells_a_client_to_send_fp32_numbers_and_bytes_texts(url: str) -> None:
    client = triton.InferenceServerClient(url.removeprefix("http://"))
    metadata = client.get_model_metadata("passengers", headers={"Authorization": f"Bearer {KEY}"})
    assert [(i["name"], i["datatype"], i["shape"]) for i in metadata["inputs"]] == [
        ("age", "FP32", [-1]), ("fare", "FP32", [-1]), ("sex", "BYTES", [-1]), ("port", "BYTES", [-1])]
    assert [(o["name"], o["datatype"]) for o in metadata["outputs"]] == [("label", "INT64"), ("probabilities", "FP32")]
