"""`shardline model import` as a user runs it: a model logged by MLflow's own client to a local store is
imported and pushed (the new reference printed), and a refused import is one `error:` line with exit 2.

The command needs no Prefect server, so these runs use the user's environment without the session's one
(the `shardline` fixture would start it)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardline.build.frameworks import ATOL, RTOL
from shardline.bundle import read_manifest
from tests.e2e.conftest import SHARDLINE
from tests.framework_models import bundle_answers, training_frame, training_rows
from tests.mlflow_models import REGISTERED, LoggedModels, log_models

Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> LoggedModels:
    return log_models(tmp_path_factory.mktemp("mlflow"), kinds=("xgboost", "sklearn-pickle", "sklearn-bare"))


@pytest.fixture
def shardline_cli(shardline_home: Path, tmp_path: Path) -> Run:
    """Run `shardline ARGS...` in ``tmp_path`` with the user's environment: its own home, no MLflow URI set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDLINE_", "PREFECT_", "MLFLOW_"))}
    env.update(SHARDLINE_STORAGE_HOME=str(shardline_home), PREFECT_HOME=str(tmp_path / "prefect"))

    def run(*args: str, **more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*SHARDLINE, *args], env={**env, **more}, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)

    return run


def test_an_mlflow_model_is_imported_and_pushed(shardline_cli: Run, logged: LoggedModels, tmp_path: Path) -> None:
    _, labels, _, sample = training_rows()
    pq.write_table(sample.append_column("target", pa.array(labels)), tmp_path / "train.parquet")

    imported = shardline_cli("model", "import", f"mlflow:/models/{REGISTERED['xgboost']}/1", "--signature-from",
                             "train.parquet", "--exclude", "target", "--golden", "train.parquet", "--threshold", "0.95",
                             MLFLOW_TRACKING_URI=logged.tracking_uri)
    shown = shardline_cli("model", "show", "breastcancer-xgb:1")
    unfit = shardline_cli("model", "import", f"mlflow:/models/{REGISTERED['xgboost']}/1", "--golden", "train.parquet",
                          "--label", "churned", MLFLOW_TRACKING_URI=logged.tracking_uri)

    assert imported.returncode == 0, imported.stderr
    assert f"imported models:/{REGISTERED['xgboost']}/1 (flavor xgboost) as breastcancer-xgb" in imported.stdout
    assert imported.stdout.strip().splitlines()[-1].startswith("pushed breastcancer-xgb:1 (digest ")
    assert "no reference profile" not in imported.stdout
    manifest = json.loads(shown.stdout)
    assert manifest["tags"]["mlflow.run_id"] == logged.run_ids["xgboost"]
    assert manifest["lineage"]["metrics"] == logged.metrics["xgboost"] and manifest["reference_profile"]
    assert manifest["evaluation"] == {"golden": "golden.parquet", "label_column": "target", "metric": "accuracy",
                                      "prediction_column": "label", "threshold": 0.95, "max_variant_delta": 0.01}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "train.parquet"]  # the bundle folder was temporary
    # a golden set that does not fit the model: one line, exit 2, nothing pushed
    assert unfit.returncode == 2 and "Traceback" not in unfit.stderr and len(unfit.stderr.strip().splitlines()) == 1
    assert "the golden set does not fit breastcancer-xgb: the golden set has no column ['churned']" in unfit.stderr
    assert "breastcancer-xgb:2" not in shardline_cli("model", "list").stdout


def test_a_model_fitted_on_a_dataframe_is_imported_with_its_columns_from_its_training_parquet(
        shardline_cli: Run, logged: LoggedModels, tmp_path: Path) -> None:
    frame = training_frame()  # the DataFrame the model was fitted on, as a user keeps it: float64, named columns
    model = logged.models["xgboost"]  # XGBClassifier fitted on that DataFrame: its file keeps the names
    train = frame[list(reversed(frame.columns))].assign(target=training_rows()[1])  # the label, columns shuffled
    train.to_parquet(tmp_path / "train.parquet")

    imported = shardline_cli("model", "import", f"models:/{REGISTERED['xgboost']}/1", "--signature-from",
                             "train.parquet", "--no-push", "--out", "bundle", "--tracking-uri", logged.tracking_uri)

    assert imported.returncode == 0, imported.stderr
    assert "in: mean radius:float32, mean texture:float32" in imported.stdout  # the DataFrame's names, its order
    manifest = read_manifest(tmp_path / "bundle")
    assert manifest.signature.input_names == list(frame.columns)  # the model's features: no --exclude needed
    got = bundle_answers(tmp_path / "bundle", manifest, pa.Table.from_pandas(train))
    assert np.array_equal(got["label"], model.predict(frame))
    assert np.allclose(got["probabilities"], model.predict_proba(frame), atol=ATOL, rtol=RTOL)


def test_a_refused_import_prints_one_line_and_exits_2(shardline_cli: Run, logged: LoggedModels,
                                                      tmp_path: Path) -> None:
    pickled = shardline_cli("model", "import", f"models:/{REGISTERED['sklearn-pickle']}/1", "--no-push",
                            "--tracking-uri", logged.tracking_uri)
    no_store = shardline_cli("model", "import", f"models:/{REGISTERED['xgboost']}/1")  # MLflow's default: ./mlflow.db
    (tmp_path / "golden.parquet").write_text("id,target\n1,0\n")  # a CSV named .parquet
    not_parquet = shardline_cli("model", "import", f"models:/{REGISTERED['xgboost']}/1", "--golden", "golden.parquet",
                                "--tracking-uri", logged.tracking_uri)
    not_rows = shardline_cli("model", "import", f"models:/{REGISTERED['xgboost']}/1", "--signature-from",
                             "golden.parquet", "--tracking-uri", logged.tracking_uri)
    pq.write_table(pa.table({"a": [1.0], "b": [2.0]}), tmp_path / "wrong.parquet")
    wrong_rows = shardline_cli("model", "import", f"models:/{REGISTERED['xgboost']}/1", "--signature-from",
                               "wrong.parquet", "--tracking-uri", logged.tracking_uri)
    no_example = shardline_cli("model", "import", f"models:/{REGISTERED['sklearn-bare']}/1", "--tracking-uri",
                               logged.tracking_uri)

    for refused, says in ((pickled, "(flavor sklearn, serialization_format cloudpickle) is a scikit-learn model "
                                    "saved as a pickle, which Shardline never loads"),
                          (no_store, f"there is no MLflow tracking store at sqlite:///{tmp_path / 'mlflow.db'}"),
                          (not_parquet, "--golden golden.parquet cannot be read as Parquet"),
                          (not_rows, "--signature-from golden.parquet cannot be read as Parquet"),
                          (wrong_rows, "cannot be imported: the rows given with --signature-from have no column "
                                       "'mean radius', 'mean texture'"),
                          (wrong_rows, "give --signature-from rows (e.g. the training data) holding every one"),
                          (no_example, "(flavor sklearn) has no input example, and converting a scikit-learn model "
                                       "(checked against scikit-learn's predictions) needs sample rows")):
        assert refused.returncode == 2, refused.stderr
        assert "Traceback" not in refused.stderr
        assert refused.stderr.strip().splitlines() == [refused.stderr.strip()] and refused.stderr.startswith("error: ")
        assert says in refused.stderr and refused.stdout == ""
    # no bundle folder, no empty MLflow database, no registry
    assert sorted(p.name for p in tmp_path.iterdir()) == ["golden.parquet", "wrong.parquet"]
