"""Tree models MLflow saved with skops: scikit-learn's ``Tree`` and ``TreePredictor`` (which skops 0.16 leaves
untrusted: their node indices go unchecked into Cython) are checked before anything predicts
(``shardline.build.sklearn_trees``). A random forest, gradient boosting and histogram gradient boosting model
import and answer as scikit-learn does; a file whose tree points out of its nodes is refused in one line, exit 2,
by `shardline model import` run as a subprocess (on code without the check that process reads out of bounds)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from shardline.build.frameworks import ATOL, RTOL
from shardline.build.mlflow_import import import_mlflow_model
from tests.framework_models import bundle_answers, training_frame, training_rows
from tests.mlflow_models import _tracking

SHARDLINE = [sys.executable, "-m", "shardline.cli"]
DO = "log the model again from a trusted scikit-learn"
# What a user passes MLflow to log a tree model with skops (MLflow reloads the file with only these trusted).
TRUSTED_AT_LOGGING = ["sklearn.tree._tree.Tree", "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor"]


def _forest() -> Any:
    from sklearn.ensemble import RandomForestClassifier
    return RandomForestClassifier(n_estimators=8, max_depth=6, random_state=0, n_jobs=1)


def _boosting() -> Any:
    from sklearn.ensemble import GradientBoostingClassifier
    return GradientBoostingClassifier(n_estimators=10, max_depth=3, random_state=0)


def _hist() -> Any:
    from sklearn.ensemble import HistGradientBoostingClassifier
    return HistGradientBoostingClassifier(max_iter=10, random_state=0)


def _child_out_of_range(model: Any) -> None:
    model.estimators_[3].tree_.children_left[0] = 10**9  # a view on the tree's node array


def _predictor_out_of_range(model: Any) -> None:
    nodes = model._predictors[5][0].nodes
    nodes["right"][0] = 10**9 if not nodes["is_leaf"][0] else nodes["right"][0]


MODELS: dict[str, tuple[Callable[[], Any], Callable[[Any], None] | None]] = {
    "forest": (_forest, None), "boosting": (_boosting, None), "hist": (_hist, None),
    "forest-crafted": (_forest, _child_out_of_range), "hist-crafted": (_hist, _predictor_out_of_range),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """Each model logged by MLflow with skops; a crafted one's skops file then rewritten from the model with
    its tree's index pushed out of range (MLflow's own client runs the model when logging its example)."""
    import mlflow
    import skops.io

    folder = tmp_path_factory.mktemp("mlflow-trees")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    _, labels, _, _ = training_rows()
    frame = training_frame()
    fitted: dict[str, Any] = {}
    with _tracking(uri), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        experiment = mlflow.create_experiment("trees", artifact_location=(folder / "artifacts").as_uri())
        for name, (make, craft) in MODELS.items():
            with mlflow.start_run(experiment_id=experiment):
                model = fitted[name] = make().fit(frame, labels)
                info = mlflow.sklearn.log_model(model, name="model", registered_model_name=f"trees-{name}",
                                                input_example=frame.head(5), pip_requirements=[],
                                                skops_trusted_types=TRUSTED_AT_LOGGING)
            if craft is not None:
                craft(model)
                local = Path(mlflow.artifacts.download_artifacts(info.model_uri))
                written = list((folder / "artifacts").rglob("model.skops"))
                target = [p for p in written if p.read_bytes() == (local / "model.skops").read_bytes()]
                assert len(target) == 1, written
                skops.io.dump(model, target[0])
    return uri, fitted


@pytest.mark.parametrize("name", ["forest", "boosting", "hist"])  # hist: skl2onnx's converter mended (skl2onnx_mends)
def test_a_tree_model_saved_by_skops_is_imported_and_answers_as_scikit_learn(
        name: str, store: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    uri, fitted = store
    imported = import_mlflow_model(f"models:/trees-{name}/1", tmp_path / "bundle", tracking_uri=uri)

    frame = training_frame()
    _, _, _, sample = training_rows()
    got = bundle_answers(imported.folder, imported.manifest, sample)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want_label, want_proba = fitted[name].predict(frame), fitted[name].predict_proba(frame)
    assert (got["label"] == want_label).mean() >= 0.999
    assert np.allclose(got["probabilities"], want_proba, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("name", "says"), [
    ("forest-crafted", "model.estimators_[3].tree_.children_left[0] = 1000000000, outside (0, "),
    ("hist-crafted", "model._predictors[5][0].nodes.right[0] = 1000000000, outside (0, "),
])
def test_a_skops_file_whose_tree_points_out_of_its_nodes_is_refused_in_one_line_with_exit_2(
        name: str, says: str, store: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    uri, _ = store
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDLINE_", "MLFLOW_"))}
    env.update(SHARDLINE_STORAGE_HOME=str(tmp_path / "home"), PREFECT_HOME=str(tmp_path / "prefect"))

    done = subprocess.run([*SHARDLINE, "model", "import", f"models:/trees-{name}/1", "--no-push", "--tracking-uri",
                           uri], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)

    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert f"MLflow model models:/trees-{name}/1 (flavor sklearn, skops) holds a tree scikit-learn could not run " \
           "safely: " in lines[0]
    assert says in lines[0] and DO in lines[0]
    assert "Traceback" not in done.stderr and not (tmp_path / "home").exists() or \
        not any((tmp_path / "home").rglob("manifest.json"))
