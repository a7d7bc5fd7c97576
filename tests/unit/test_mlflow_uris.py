"""What `shardline model import` reads before it asks MLflow anything: the model URI, the name it makes, and the
flavor it builds from (or the refusal naming the flavors)."""

from __future__ import annotations

import pytest

from shardline.errors import InvalidInput, InvalidSetting
from shardline.build.mlflow_flavors import choose_flavor
from shardline.build.mlflow_import import MlflowModelUri, parse_model_uri, shardline_name


@pytest.mark.parametrize(("text", "want"), [
    ("mlflow:/models/Churn/3", MlflowModelUri("mlflow:/models/Churn/3", name="Churn", version="3")),
    ("models:/Churn/3", MlflowModelUri("models:/Churn/3", name="Churn", version="3")),
    ("models:/team.churn model@champion", MlflowModelUri("models:/team.churn model@champion", name="team.churn model",
                                                         alias="champion")),
    ("models:/m-0a1b2c", MlflowModelUri("models:/m-0a1b2c", model_id="m-0a1b2c")),
    ("runs:/abc123/model", MlflowModelUri("runs:/abc123/model", run_id="abc123", path="model")),
    ("mlflow:/runs/abc123/sub/model", MlflowModelUri("mlflow:/runs/abc123/sub/model", run_id="abc123", path="sub/model")),
])
def test_the_uri_forms_it_reads(text: str, want: MlflowModelUri) -> None:
    assert parse_model_uri(text) == want


@pytest.mark.parametrize("text", ["s3://bucket/model", "models:/Churn", "models:/Churn/Production", "models:/Churn/٣",
                                  "runs:/abc123", "mlflow:/experiments/1", "models:/@prod"])
def test_other_uris_are_refused_with_the_forms_it_reads(text: str) -> None:
    with pytest.raises(InvalidSetting, match="give mlflow:/models/NAME/VERSION, models:/NAME/VERSION, models:/NAME@ALIAS"):
        parse_model_uri(text)


def test_the_default_name_is_the_mlflow_name_made_valid() -> None:
    assert shardline_name("BreastCancer XGB") == "breastcancer-xgb"
    assert shardline_name("main.ml.Churn_Model") == "main.ml.churn_model"
    assert shardline_name("__Churn//v2") == "churn-v2"
    assert len(shardline_name("x" * 100)) == 64
    with pytest.raises(InvalidSetting, match="give one with --name"):
        shardline_name("模型")


def test_the_flavor_is_the_first_that_maps_and_the_others_are_named_when_none_does() -> None:
    assert choose_flavor("models:/a/1", ["python_function", "sklearn"]) == "sklearn"
    assert choose_flavor("models:/a/1", ["python_function", "sklearn", "onnx"]) == "onnx"
    with pytest.raises(InvalidInput, match=r"models:/a/1 has flavors python_function, pytorch; Shardline maps onnx, "
                                           r"xgboost, lightgbm, sklearn: export the model to ONNX"):
        choose_flavor("models:/a/1", ["python_function", "pytorch"])
    with pytest.raises(InvalidInput, match="has flavor python_function only"):
        choose_flavor("models:/a/1", ["python_function"])
