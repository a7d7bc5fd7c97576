"""The XGBoost, LightGBM and PyTorch builders: outputs named as scikit-learn's builder names them, the
bundle's answers checked against the framework's before anything is written, the samples users hold (a
pandas DataFrame, a pyarrow Table, a Parquet file), and the refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pytest

from shardline.build.frameworks import (
    ATOL,
    RTOL,
    load_model_file,
    package_lightgbm,
    package_torch,
    package_xgboost,
    saved_feature_names,
)
from shardline.bundle import read_manifest
from shardline.errors import InvalidInput
from tests.framework_models import bundle_answers, fitted, predictions, training_frame, training_rows

BUILDERS: dict[str, Callable[..., Any]] = {"xgboost": package_xgboost, "lightgbm": package_lightgbm,
                                           "torch": package_torch}


@pytest.mark.parametrize("kind", ["xgboost-regressor", "lightgbm-regressor", "lightgbm-classifier"])
def test_tree_models_are_bundled_with_their_outputs_named_and_their_framework_tagged(kind: str, tmp_path: Path) -> None:
    _, _, names, sample = training_rows()
    builder = package_xgboost if kind.startswith("xgboost") else package_lightgbm

    manifest = builder(fitted(kind), tmp_path / "bundle", name="m", sample=sample, feature_names=names)

    outputs = [(o.name, o.type) for o in manifest.signature.outputs]
    assert outputs == ([("prediction", "float32")] if kind.endswith("regressor")
                       else [("label", "int64"), ("probabilities", "fixed_size_list<float32>[2]")])
    assert [i.name for i in manifest.signature.inputs] == names  # read as plain columns, stacked into X
    assert manifest.tags["framework"] == kind.split("-")[0] and manifest.runtime == "onnx"
    assert read_manifest(tmp_path / "bundle").tags == manifest.tags
    assert not list((tmp_path / "bundle").glob("*.pkl"))


def test_a_module_whose_export_differs_from_its_own_answers_is_refused_and_leaves_no_bundle(tmp_path: Path) -> None:
    import torch

    class ByBatchSize(torch.nn.Module):  # traced on 2 rows: the export keeps only the small-batch branch
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 2:
                return x[:, :2] * 2.0
            return x[:, :2] * 3.0

    _, _, names, sample = training_rows()
    with pytest.raises(InvalidInput) as refused:
        package_torch(ByBatchSize(), tmp_path / "bundle", name="m", sample=sample, feature_names=names)

    message = str(refused.value)
    assert "does not match pytorch's own predictions: 'output' off by up to" in message and "\n" not in message
    assert "no bundle was written" in message and not (tmp_path / "bundle").exists()


def test_a_sample_without_the_features_is_refused_naming_them(tmp_path: Path) -> None:
    _, _, names, sample = training_rows()
    with pytest.raises(InvalidInput, match=r"the sample has no column 'mean radius', .* and 5 more; .*feature_names"):
        package_xgboost(fitted("xgboost-classifier"), tmp_path / "bundle", name="m",
                        sample=sample.drop_columns(names[:10]), feature_names=names)


def test_a_module_returning_more_tensors_than_names_is_refused(tmp_path: Path) -> None:
    import torch

    class Two(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x[:, :1], x[:, 1:2]

    _, _, names, sample = training_rows()
    with pytest.raises(InvalidInput, match="returns 2 tensors and output_names names 1"):
        package_torch(Two(), tmp_path / "bundle", name="m", sample=sample, feature_names=names)
    assert not (tmp_path / "bundle").exists()


def test_a_module_that_cannot_read_the_features_is_refused_in_one_line_naming_the_counts(tmp_path: Path) -> None:
    """torch's own error ("mat1 and mat2 shapes cannot be multiplied", a Float/Double mismatch) says nothing of the
    columns: the refusal names the count the module's first layer takes and the columns given."""
    import torch

    _, _, names, sample = training_rows()
    with_label = sample.append_column("target", pa.array(np.zeros(sample.num_rows, np.float32)))

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(len(names), 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    with pytest.raises(InvalidInput) as label_in:  # no feature_names: every column, the label too
        package_torch(mlp(), tmp_path / "bundle", name="m", sample=with_label.select([*names, "target"]))
    assert str(label_in.value).startswith(f"the module takes {len(names)} features a row (its first Linear layer), "
                                          f"and {len(names) + 1} columns were given")
    assert "give feature_names with the" in str(label_in.value) and "leaving out the label" in str(label_in.value)
    with pytest.raises(InvalidInput, match=rf"takes {len(names)} features a row .* and 3 columns were given "
                                           r"\('mean radius', .*; the sample's other columns: "):
        package_torch(mlp(), tmp_path / "bundle", name="m", sample=sample, feature_names=names[:3])
    with pytest.raises(InvalidInput, match=r"the module's weights are float64; .* convert it with module.float\(\)"):
        package_torch(mlp().double(), tmp_path / "bundle", name="m", sample=sample, feature_names=names)
    assert not (tmp_path / "bundle").exists()


@pytest.mark.parametrize("kind", ["lightgbm-classifier", "lightgbm-regressor", "xgboost-classifier", "xgboost-regressor"])
def test_a_saved_model_file_is_read_as_what_its_objective_says_and_packaged(kind: str, tmp_path: Path) -> None:
    _, _, names, sample = training_rows()
    model = fitted(kind)
    path = tmp_path / ("model.txt" if kind.startswith("lightgbm") else "model.ubj")
    (model.booster_ if kind.startswith("lightgbm") else model).save_model(path)

    loaded = load_model_file(path, kind.split("-")[0])
    builder = package_lightgbm if kind.startswith("lightgbm") else package_xgboost
    manifest = builder(loaded, tmp_path / "bundle", name="m", sample=sample, feature_names=names)

    assert [o.name for o in manifest.signature.outputs] == (
        ["prediction"] if kind.endswith("regressor") else ["label", "probabilities"])
    assert saved_feature_names(loaded) is None  # fitted on a matrix: the files keep no names


def test_a_ranking_model_is_refused_naming_its_objective(tmp_path: Path) -> None:
    import xgboost

    features, labels, _, _ = training_rows()
    xgboost.XGBRanker(n_estimators=2).fit(features, labels, qid=[0] * len(labels)).save_model(tmp_path / "rank.json")
    with pytest.raises(InvalidInput, match="objective is 'rank:ndcg': only classifiers and regressors are packaged"):
        load_model_file(tmp_path / "rank.json", "xgboost")


def _assert_answers_like(kind: str, got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for output, expected in want.items():
        values = got[output].reshape(np.shape(expected))
        if output == "label":
            assert np.array_equal(values, expected), f"{kind}: labels differ from the framework's"
        else:
            assert np.allclose(values, expected, atol=ATOL, rtol=RTOL), f"{kind}: {output} differs"


@pytest.mark.parametrize("kind", ["xgboost-classifier", "xgboost-regressor", "lightgbm-classifier", "torch-mlp"])
def test_a_model_fitted_on_a_dataframe_is_bundled_from_it_under_its_column_names(kind: str, tmp_path: Path) -> None:
    frame = training_frame()  # float64, columns named as scikit-learn names them ('mean radius', ...)
    model = fitted(kind, on_frame=True)
    extra = {"output_names": ["probabilities"]} if kind == "torch-mlp" else {}

    # no feature_names: the trees read the names they keep, the module every column
    manifest = BUILDERS[kind.split("-")[0]](model, tmp_path / "bundle", name="m", sample=frame, **extra)

    assert manifest.signature.input_names == list(frame.columns)
    if kind.startswith("lightgbm"):  # LightGBM keeps 'mean_radius': its column is the DataFrame's all the same
        assert list(model.feature_names_in_)[:1] == ["mean_radius"]
    got = bundle_answers(tmp_path / "bundle", manifest, pa.Table.from_pandas(frame))
    _assert_answers_like(kind, got, predictions(kind, model, frame))  # the framework on the DataFrame itself


@pytest.mark.parametrize(("kind", "as_path"), [("xgboost-classifier", str), ("lightgbm-regressor", Path)])
def test_a_parquet_file_is_a_sample_and_the_model_picks_its_features_from_it(
        kind: str, as_path: Callable[[Path], Any], tmp_path: Path) -> None:
    frame = training_frame()
    reordered = frame[list(reversed(frame.columns))].assign(target=training_rows()[1])  # a label, columns shuffled
    reordered.to_parquet(tmp_path / "train.parquet")
    model = fitted(kind, on_frame=True)

    manifest = BUILDERS[kind.split("-")[0]](model, tmp_path / "bundle", name="m",
                                            sample=as_path(tmp_path / "train.parquet"))

    assert manifest.signature.input_names == list(frame.columns)  # the model's order, without the label
    got = bundle_answers(tmp_path / "bundle", manifest, pa.Table.from_pandas(reordered))
    _assert_answers_like(kind, got, predictions(kind, model, frame))


@pytest.mark.parametrize("framework", ["xgboost", "lightgbm", "torch"])
@pytest.mark.parametrize(("sample", "named"), [
    pytest.param(np.zeros((4, 30), dtype=np.float32), "numpy.ndarray; give a pandas DataFrame, a pyarrow Table or the "
                 "path of a Parquet file (str or pathlib.Path) (a numpy array has no column names: give "
                 "pandas.DataFrame(X, columns=names))", id="numpy"),
    pytest.param([[0.0] * 30], "list; give a pandas DataFrame, a pyarrow Table or the path of a Parquet file",
                 id="list"),
])
def test_a_sample_of_another_type_is_refused_in_one_line_naming_what_was_got(
        framework: str, sample: Any, named: str, tmp_path: Path) -> None:
    model = fitted("torch-mlp") if framework == "torch" else fitted(f"{framework}-classifier")

    with pytest.raises(InvalidInput) as refused:
        BUILDERS[framework](model, tmp_path / "bundle", name="m", sample=sample)

    assert str(refused.value).startswith(f"the sample is a {named}")
    assert "\n" not in str(refused.value) and not (tmp_path / "bundle").exists()


def test_a_sample_path_that_is_not_parquet_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "train.csv").write_text("mean radius,target\n1.0,0\n")
    for path, says in ((tmp_path / "train.csv", f"the sample {tmp_path / 'train.csv'} cannot be read as Parquet ("),
                       (str(tmp_path / "none.parquet"), f"the sample: there is no file {tmp_path / 'none.parquet'}; ")):
        with pytest.raises(InvalidInput) as refused:
            package_xgboost(fitted("xgboost-classifier"), tmp_path / "bundle", name="m", sample=path)
        assert str(refused.value).startswith(says) and "give the path of a Parquet file" in str(refused.value)
        assert "\n" not in str(refused.value) and not (tmp_path / "bundle").exists()


def test_feature_names_out_of_the_order_the_model_was_fitted_in_are_refused(tmp_path: Path) -> None:
    frame = training_frame()
    names = list(frame.columns)

    with pytest.raises(InvalidInput, match=r"^feature_names 'worst fractal dimension', .* and 25 more are not the "
                                           r"features the model was fitted on, in its order \('mean radius', .*; leave "
                                           "feature_names out"):
        package_xgboost(fitted("xgboost-classifier", on_frame=True), tmp_path / "bundle", name="m", sample=frame,
                        feature_names=names[::-1])
    assert not (tmp_path / "bundle").exists()


def test_a_lightgbm_model_whose_column_float32_rounds_away_is_refused_naming_it(tmp_path: Path) -> None:
    import lightgbm
    import pandas as pd

    rng = np.random.default_rng(7)
    seconds = rng.uniform(0, 10, 2_000)
    rows = pd.DataFrame({"ts": 1.7e9 + seconds, "other": rng.normal(size=2_000)})  # a Unix timestamp's seconds
    model = lightgbm.LGBMClassifier(n_estimators=20, verbose=-1, n_jobs=1).fit(rows, (seconds > 5).astype(int))

    with pytest.raises(InvalidInput) as refused:  # float32 rows all hold 1.7e9: the bundle would agree with nothing
        package_lightgbm(model, tmp_path / "ts", name="ts", sample=rows)

    said = str(refused.value)
    assert said.startswith("float32 inputs lose precision for column 'ts' (values up to 1.7e+09, spread ")
    assert "LightGBM answers otherwise on the sample rounded to float32, and a LightGBM bundle takes float32 " in said
    assert said.endswith("subtract a constant from that column (e.g. its minimum) or rescale it before the model, fit "
                         "again and package that")
    assert not (tmp_path / "ts").exists()


def test_a_lightgbm_split_between_two_float32_values_is_refused_naming_the_column_not_as_a_mismatch(
        tmp_path: Path) -> None:
    import lightgbm
    import pandas as pd

    low = np.nextafter(np.float32(1), np.float32(2))  # an odd last bit: the float64 midpoint rounds up to `high`
    high = np.nextafter(low, np.float32(2))
    rng = np.random.default_rng(0)
    x = np.where(rng.random(2_000) < 0.5, low, high)
    rows = pd.DataFrame({"x": x.astype(np.float64), "noise": rng.normal(size=2_000)})  # every value is a float32
    model = lightgbm.LGBMClassifier(n_estimators=5, verbose=-1, n_jobs=1).fit(rows, (x == high).astype(int))

    with pytest.raises(InvalidInput) as refused:
        package_lightgbm(model, tmp_path / "split", name="split", sample=rows)

    said = str(refused.value)
    assert said.startswith("LightGBM splits column 'x' at 1.00000017")  # LightGBM's midpoint, a float64
    assert f"between the float32 values {float(low)!r} and {float(high)!r}" in said
    assert f"rows holding {float(high)!r} there go the other way" in said and "does not match" not in said
    assert said.endswith("fit again and package that") and not (tmp_path / "split").exists()
