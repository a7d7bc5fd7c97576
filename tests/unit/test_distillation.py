"""Distillation of a real teacher (an MLP on the breast-cancer data, through skl2onnx) into small students.

The students learn from the teacher's answers on generated rows (drawn from a Gaussian with the data's
mean and covariance, unlabeled), and are scored and gated on the teacher's golden set.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from shardline.build.distill import StudentSize
from shardline.build.examples import breast_cancer, golden_table
from shardline.build.packaging import GoldenSet, package_sklearn
from shardline.cli import app
from shardline.capacity.prices import load_prices
from shardline.cost.prices import cost_per_1k_rows
from shardline.errors import GateFailed, InvalidBundle, InvalidInput, InvalidSetting, ModelNotFound
from shardline.quality.distillation import distill
from shardline.runtimes import RuntimeOptions
from shardline.storage.ledger import Holding, LedgerStore
from shardline.storage.model_cache import ModelCache
from shardline.storage.registry import ModelRegistry

MAX_DELTA = 0.02


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The teacher's bundle: an MLP (one hidden layer of 32) with the whole data set as its golden set."""
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    data = breast_cancer()
    mlp = make_pipeline(StandardScaler(), MLPClassifier((32,), max_iter=1000, random_state=0))
    folder = tmp_path_factory.mktemp("teacher") / "mlp"
    package_sklearn(mlp.fit(data.features, data.labels), folder, name="mlp", feature_names=data.names,
                    golden=GoldenSet(golden_table(data), "target", "accuracy", "label", 0.9, MAX_DELTA))
    return folder


@pytest.fixture(scope="module")
def generated() -> pa.Table:
    """3,000 unlabeled rows with the data's mean and covariance (the teacher labels them)."""
    data = breast_cancer()
    rows = np.random.default_rng(0).multivariate_normal(data.features.mean(0), np.cov(data.features.T), 3_000)
    return pa.table({n: rows[:, j] for j, n in enumerate(data.names)})


def registry_with(bundle: Path, url: str | None = None) -> ModelRegistry:
    registry = ModelRegistry(url or f"memory://registry-{uuid.uuid4().hex}")
    registry.push(bundle)
    return registry


def test_a_linear_student_passes_the_gate_and_is_pushed_with_the_teacher_as_parent(
    teacher: Path, generated: pa.Table, tmp_path: Path,
) -> None:
    registry = registry_with(teacher)
    done = distill(registry, "mlp:1", generated, kind="linear", data_source="generated.parquet")

    assert done.teacher == "mlp:1" and done.student.reference == "mlp-student:1" and done.new
    assert abs(done.score - done.baseline) <= MAX_DELTA and done.baseline > 0.95
    assert done.agreement > 0.95 and done.rows == 3_000
    assert done.teacher_rows_per_s > 0 and done.student_rows_per_s > 0
    student = registry.resolve("mlp-student:1")
    assert student.manifest.lineage.parent == "mlp:1"
    assert student.manifest.lineage.training_data == "generated.parquet"
    assert student.manifest.lineage.metrics == {"distillation_rows": 3_000.0}
    assert student.manifest.evaluation is not None and student.manifest.evaluation.max_variant_delta == MAX_DELTA
    assert student.manifest.tags["estimator"] == "Pipeline"
    # the pushed student loads through the cache like any version and answers the golden rows
    cache = ModelCache(tmp_path / "cache", capacity=1)
    model = cache.get(student, RuntimeOptions(device="cpu"))
    answer = model.predict(generated.slice(0, 5).cast(pa.schema([(n, pa.float32()) for n in generated.column_names])))
    assert answer.column("label").to_pylist() and set(answer.column("label").to_pylist()) <= {0, 1}
    cache.clear()


def test_a_student_too_small_is_refused_with_its_figures_and_not_pushed(teacher: Path, generated: pa.Table) -> None:
    registry = registry_with(teacher)
    with pytest.raises(GateFailed) as refused:
        distill(registry, "mlp:1", generated, kind="gbt", size=StudentSize(trees=1, max_depth=1))
    message = str(refused.value)
    assert refused.value.gate == "variant-accuracy"
    assert message.startswith("the gbt student (1 tree of depth 1) of mlp:1 scores accuracy 0.")
    assert "the teacher scores 0.99" in message and f"max_variant_delta {MAX_DELTA}" in message
    assert "against the teacher's own answers on the golden set is 0." in message and "not recorded" in message
    assert registry.list_models() == ["mlp"]


def test_a_regressor_teacher_gets_a_regressor_student_gated_on_rmse(tmp_path: Path) -> None:
    from sklearn.datasets import load_diabetes
    from sklearn.ensemble import GradientBoostingRegressor

    x, y = load_diabetes(return_X_y=True)
    names = [f"f{j}" for j in range(x.shape[1])]
    golden = pa.table({**{n: x[:, j] for j, n in enumerate(names)}, "target": y})
    gbt = GradientBoostingRegressor(n_estimators=50, max_depth=3, random_state=0).fit(x, y)
    package_sklearn(gbt, tmp_path / "gbt", name="sugar", feature_names=names,
                    golden=GoldenSet(golden, "target", "rmse", "prediction", 60.0, max_variant_delta=15.0))
    registry = registry_with(tmp_path / "gbt")
    done = distill(registry, "sugar:1", golden.drop_columns(["target"]), kind="gbt", name="sugar-small",
                   size=StudentSize(trees=20, max_depth=3))
    assert done.metric == "rmse" and done.student.reference == "sugar-small:1"
    assert abs(done.score - done.baseline) <= 15.0 and done.agreement < 25.0  # rmse against the teacher's answers
    assert registry.resolve("sugar-small:1").manifest.lineage.parent == "sugar:1"


@pytest.mark.parametrize(("change", "error", "words"), [
    ({"reference": "nope:1"}, ModelNotFound, "nope"),
    ({"kind": "forest"}, InvalidSetting, "student 'forest' is not one Shardline fits"),
    ({"name": "mlp"}, InvalidSetting, "would be a version of its teacher 'mlp'"),
    ({"drop": "mean radius"}, InvalidInput, "the data cannot feed the teacher"),
    ({"rows": 0}, InvalidInput, "the data has no rows"),
])
def test_wrong_requests_say_what_was_wrong(teacher: Path, generated: pa.Table, change: dict[str, Any],
                                           error: type[Exception], words: str) -> None:
    registry = registry_with(teacher)
    data = generated.drop_columns([change["drop"]]) if "drop" in change else generated.slice(0, change.get("rows"))
    with pytest.raises(error, match=words):
        distill(registry, change.get("reference", "mlp:1"), data, kind=change.get("kind", "linear"),
                name=change.get("name"))
    assert [m.reference for m in registry.list_versions("mlp")] == ["mlp:1"]
    assert registry.list_models() == ["mlp"]


def test_a_teacher_without_a_golden_set_cannot_be_gated(generated: pa.Table, tmp_path: Path) -> None:
    from sklearn.linear_model import LogisticRegression

    data = breast_cancer()
    package_sklearn(LogisticRegression(max_iter=5000).fit(data.features, data.labels), tmp_path / "lr", name="lr",
                    feature_names=data.names)
    with pytest.raises(InvalidBundle, match="declares no evaluation"):
        distill(registry_with(tmp_path / "lr"), "lr:1", generated)


def test_an_mlflow_import_without_a_golden_set_is_told_to_import_again_with_one(tmp_path: Path) -> None:
    from sklearn.linear_model import LogisticRegression

    from shardline.quality.evaluation import evaluation_of

    data = breast_cancer()
    manifest = package_sklearn(LogisticRegression(max_iter=5000).fit(data.features, data.labels), tmp_path / "lr",
                               name="iris-rf", feature_names=data.names)
    imported = manifest.model_copy(update={"tags": {**manifest.tags, "mlflow.source": "models:/iris-rf/2"}})

    with pytest.raises(InvalidBundle) as refused:
        evaluation_of(imported)
    assert str(refused.value).endswith("declares no evaluation, so there is no golden set to score it on; import it "
                                       "again with one: `shardline model import models:/iris-rf/2 --golden "
                                       "GOLDEN.parquet` (the rows, their label and, with --metric, how to score them)")
    with pytest.raises(InvalidBundle, match="to its manifest and package it again"):
        evaluation_of(manifest)


def test_cost_per_1k_rows_is_the_price_of_the_time_the_rows_take() -> None:
    assert cost_per_1k_rows(3.6, 1_000) == pytest.approx(0.001)  # 1 s of a 3.6/h unit
    with pytest.raises(InvalidSetting):
        cost_per_1k_rows(3.6, 0)


def test_the_command_pushes_a_student_and_prices_both_or_refuses_in_one_line(
    teacher: Path, generated: pa.Table, shardline_home: Path, tmp_path: Path,
) -> None:
    registry_with(teacher, str(shardline_home / "registry"))
    pq.write_table(generated, tmp_path / "rows.parquet")
    runner = CliRunner()

    ok = runner.invoke(app, ["model", "distill", "mlp:1", "--data", str(tmp_path / "rows.parquet"),
                             "--name", "mlp-lite"])
    assert ok.exit_code == 0, ok.output
    assert "distilled mlp:1 into mlp-lite:1: linear student" in ok.output and "lineage parent mlp:1" in ok.output
    assert "gate variant-accuracy pass" in ok.output and "agreement with the teacher on the golden set" in ok.output
    price = load_prices().per_unit_hour("cpu", "on-demand")
    assert f"at {price:g} USD/core-hour" in ok.output
    assert "teacher mlp:1" in ok.output and "student mlp-lite:1" in ok.output and ok.output.count("per 1k rows") == 3
    assert ModelRegistry(str(shardline_home / "registry")).resolve("mlp-lite:1").manifest.lineage.parent == "mlp:1"
    # the month's cost report sets the student beside its teacher: two metered jobs of 10,000 rows each, the
    # student's in half the teacher's CPU time
    started = datetime.now(timezone.utc)
    for model, seconds in (("mlp", 2.0), ("mlp-lite", 1.0)):
        LedgerStore(str(shardline_home)).record_batch(Holding("batch", "cpu", "on-demand", 1.0), "acme", model, "1",
                                                      f"job-{model}", started, {"device_seconds": seconds, "rows": 10_000},
                                                      seconds, seconds)
    report = runner.invoke(app, ["cost", "report", "--month", f"{started:%Y-%m}"])
    assert report.exit_code == 0, report.output
    beside = report.output.split("distilled students beside their teachers:\n", 1)[1].splitlines()[0]
    assert beside.startswith("- mlp-lite:1 ") and "per 1k rows; its teacher mlp:1 " in beside, beside
    assert beside.endswith(": 0.50x the teacher's"), beside

    refused = runner.invoke(app, ["model", "distill", "mlp:1", "--data", str(tmp_path / "rows.parquet"),
                                  "--student", "gbt", "--trees", "1", "--max-depth", "1", "--name", "mlp-stump"])
    assert refused.exit_code == 1 and len(refused.output.strip().splitlines()) == 1
    assert "error: the gbt student (1 tree of depth 1) of mlp:1 scores accuracy" in refused.output
    assert "mlp-stump" not in ModelRegistry(str(shardline_home / "registry")).list_models()

    for args, words in ((["mlp:1", "--data", str(tmp_path / "missing.parquet")], "does not exist"),
                        (["mlp:9", "--data", str(tmp_path / "rows.parquet")], "has no version 9"),
                        (["mlp:1", "--data", str(teacher / "manifest.json")], "cannot be read as Parquet")):
        wrong = runner.invoke(app, ["model", "distill", *args])
        assert wrong.exit_code == 2 and words in wrong.output and len(wrong.output.strip().splitlines()) == 1
