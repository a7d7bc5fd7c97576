"""The XGBoost, LightGBM and PyTorch builders: outputs named as scikit-learn's builder names them, the
bundle's answers checked against the framework's before anything is written, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardline.bundle import read_manifest
from shardline.errors import InvalidInput
from shardline.build.frameworks import (
    load_model_file,
    package_lightgbm,
    package_torch,
    package_xgboost,
    saved_feature_names,
)

from tests.framework_models import fitted, training_rows


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
