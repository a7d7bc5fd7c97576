"""Models logged to a local MLflow store by MLflow's own client, as a user logs them: fitted here on
scikit-learn's breast-cancer data, each in its own run with a metric, registered as version 1 of a model.

The store is SQLite (MLflow's default kind of store; its file store is deprecated and refuses to open
without MLFLOW_ALLOW_FILE_STORE), with the artifacts beside it. Nothing reaches the network: telemetry
is off (MLFLOW_DISABLE_TELEMETRY, tests/conftest.py), pip requirements are given (none), so MLflow
neither infers them nor runs `pip install --dry-run` on them (MLFLOW_SKIP_PIP_REQUIREMENTS_CHECK).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from tests.framework_models import fitted, training_frame, training_rows

KINDS = ("xgboost", "xgboost-bare", "onnx", "sklearn-skops", "sklearn-pickle", "lightgbm-booster", "lightgbm-sklearn",
         "pyfunc")
REGISTERED = {"xgboost": "BreastCancer-XGB", "xgboost-bare": "xgb-no-example", "onnx": "breast-cancer-onnx",
              "sklearn-skops": "BreastCancer Pipeline", "sklearn-pickle": "sk-pickle", "lightgbm-booster": "lgbm-booster",
              "lightgbm-sklearn": "lgbm-classifier", "pyfunc": "pyfunc-only", "sklearn-ts": "ts-example",
              "sklearn-bare": "sk-no-example", "sklearn-imputer": "sk-imputer", "sklearn-svc": "sk-linear-svc",
              "sklearn-function": "sk-function"}
ALIAS = "champion"  # set on BreastCancer-XGB version 1
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class LoggedModels:
    """A local MLflow store and what was logged to it: per kind, the fitted model, its run id and metrics."""

    tracking_uri: str
    models: dict[str, Any] = field(default_factory=dict)
    run_ids: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    experiment_id: str = ""

    def uri(self, kind: str) -> str:
        """``models:/NAME/1`` of a kind."""
        return f"models:/{REGISTERED[kind]}/1"


@contextlib.contextmanager
def _tracking(uri: str) -> Iterator[None]:
    """MLflow's fluent API pointed at ``uri``, and the environment back as it was after (MLflow's
    ``set_tracking_uri`` sets MLFLOW_TRACKING_URI itself)."""
    import mlflow

    before = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_SKIP_PIP_REQUIREMENTS_CHECK")}
    os.environ["MLFLOW_SKIP_PIP_REQUIREMENTS_CHECK"] = "true"
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(None)
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def log_models(folder: Path, kinds: tuple[str, ...] = KINDS) -> LoggedModels:
    """Log each of ``kinds`` to a new SQLite store in ``folder`` (``xgboost`` also gets the alias ``ALIAS``);
    returns where and what."""
    import mlflow

    folder.mkdir(parents=True, exist_ok=True)
    logged = LoggedModels(f"sqlite:///{folder / 'mlflow.db'}")
    with _tracking(logged.tracking_uri), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MLflow's hints on integer outputs, type hints and pickles
        logged.experiment_id = mlflow.create_experiment("breast-cancer", artifact_location=(folder / "artifacts").as_uri())
        for kind in kinds:
            with mlflow.start_run(experiment_id=logged.experiment_id) as run:
                mlflow.set_tag("mlflow.source.git.commit", COMMIT)
                logged.models[kind] = _log(kind)
                logged.metrics[kind] = {"accuracy": 0.96, "auc": 0.99 if kind != "onnx" else 0.98}
                mlflow.log_metrics(logged.metrics[kind])
                logged.run_ids[kind] = run.info.run_id
        if "xgboost" in kinds:
            mlflow.MlflowClient().set_registered_model_alias(REGISTERED["xgboost"], ALIAS, "1")
    return logged


def log_xgboost_version(logged: LoggedModels, n_estimators: int = 20) -> str:
    """Log another XGBoost model (fitted with ``n_estimators`` trees: other bytes) as the next version of
    ``REGISTERED["xgboost"]``; returns that version's number."""
    import mlflow
    import xgboost
    from mlflow.models import infer_signature

    features, labels, _, _ = training_rows()
    with _tracking(logged.tracking_uri), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with mlflow.start_run(experiment_id=logged.experiment_id):
            model = xgboost.XGBClassifier(n_estimators=n_estimators, max_depth=3, n_jobs=1).fit(frame(), labels)
            example = frame(5)
            info = mlflow.xgboost.log_model(
                model, name="model", registered_model_name=REGISTERED["xgboost"], pip_requirements=[],
                input_example=example, signature=infer_signature(example, model.predict(features[:5])))
    return str(info.registered_model_version)


def frame(rows: int | None = None) -> Any:
    """The training rows as a pandas DataFrame (float32 features named as scikit-learn names them)."""
    return training_frame(rows, np.float32)


def _log(kind: str) -> Any:
    import mlflow
    from mlflow.models import infer_signature

    features, labels, _, _ = training_rows()
    name, example = REGISTERED[kind], frame(5)
    common: dict[str, Any] = {"name": "model", "registered_model_name": name, "pip_requirements": []}
    if kind == "xgboost":  # fitted on a DataFrame, as a user's usually is: the model file keeps the feature names
        import xgboost

        model = xgboost.XGBClassifier(n_estimators=40, max_depth=3, n_jobs=1).fit(frame(), labels)
        mlflow.xgboost.log_model(model, input_example=example, signature=infer_signature(example, model.predict(features[:5])),
                                 **common)
    elif kind == "xgboost-bare":  # fitted on a matrix, logged with neither a signature nor an input example
        model = fitted("xgboost-classifier")
        mlflow.xgboost.log_model(model, model_format="json", **common)
    elif kind == "lightgbm-booster":
        import lightgbm

        model = lightgbm.train({"objective": "binary", "num_leaves": 15, "verbose": -1, "num_threads": 1},
                               lightgbm.Dataset(frame(), labels), num_boost_round=20)
        mlflow.lightgbm.log_model(model, input_example=example, **common)
    elif kind == "lightgbm-sklearn":  # saved by skops, MLflow's default for a scikit-learn-API model
        import lightgbm

        model = lightgbm.LGBMClassifier(n_estimators=20, num_leaves=15, n_jobs=1, verbose=-1).fit(frame(), labels)
        mlflow.lightgbm.log_model(model, input_example=example, **common)
    elif kind == "sklearn-ts":  # a Unix timestamp column: float32 rounds away the seconds the label depends on
        ts, ts_labels = ts_frame()
        model = _pipeline().fit(ts, ts_labels)
        mlflow.sklearn.log_model(model, input_example=ts.head(50), **common)
    elif kind == "sklearn-imputer":  # skops, holding numpy.dtype (SimpleImputer's), which scikit-learn does not define
        from sklearn.impute import SimpleImputer

        model = _pipeline()
        model.steps.insert(0, ("impute", SimpleImputer()))
        model.fit(frame(), labels)
        mlflow.sklearn.log_model(model, input_example=example, skops_trusted_types=["numpy.dtype"], **common)
    elif kind == "sklearn-function":  # skops, holding a function of the user's own (run when the model is)
        from sklearn.preprocessing import FunctionTransformer

        model = _pipeline()
        model.steps.insert(0, ("shift", FunctionTransformer(shifted)))
        model.fit(frame(), labels)
        mlflow.sklearn.log_model(model, input_example=example, skops_trusted_types=[f"{__name__}.shifted"], **common)
    elif kind == "sklearn-svc":  # LinearSVC: no predict_proba, a decision function
        from sklearn.svm import LinearSVC

        model = _pipeline()
        model.steps[-1] = ("linearsvc", LinearSVC())
        model.fit(frame(), labels)
        mlflow.sklearn.log_model(model, input_example=example, **common)
    elif kind.startswith("sklearn"):
        model = _pipeline().fit(frame(), labels)
        if kind == "sklearn-skops":
            mlflow.sklearn.log_model(model, input_example=example, **common)
        elif kind == "sklearn-bare":  # skops, with neither an input example nor a signature
            mlflow.sklearn.log_model(model, **common)
        else:
            mlflow.sklearn.log_model(model, serialization_format="cloudpickle", **common)
    elif kind == "onnx":
        from skl2onnx import to_onnx

        model = _pipeline().fit(features, labels)
        onx = to_onnx(model, features[:2], options={id(model.steps[-1][1]): {"zipmap": False}}, target_opset=18)
        mlflow.onnx.log_model(onx, **common)
    else:
        assert kind == "pyfunc", kind
        model = _pyfunc()
        mlflow.pyfunc.log_model(python_model=model, **common)
    return model


def ts_frame(rows: int = 2_000) -> tuple[Any, np.ndarray]:
    """float64 columns ``ts`` (1.7e9 + uniform(0, 10): seconds of a Unix timestamp) and ``other``, and the
    label ``x > 5`` (x: the seconds past 1.7e9)."""
    import pandas as pd

    rng = np.random.default_rng(7)
    x = rng.uniform(0, 10, rows)
    return pd.DataFrame({"ts": 1.7e9 + x, "other": rng.normal(size=rows)}), (x > 5).astype(np.int64)


def shifted(rows: Any) -> Any:
    """A user's own function in a pipeline (a FunctionTransformer's)."""
    return rows + 1.0


def _pipeline() -> Any:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(max_iter=500))


def _pyfunc() -> Any:
    """A pyfunc model: MLflow cloudpickles its class, which is exactly what Shardline refuses to load."""
    import mlflow.pyfunc

    class Constant(mlflow.pyfunc.PythonModel):
        def predict(self, context: Any, model_input: list[str], params: Any = None) -> list[float]:
            return [0.0] * len(model_input)

    return Constant()


def feature_table(rows: int | None = None) -> pa.Table:
    """The training rows as the bundles read them: one float32 column per feature."""
    _, _, _, sample = training_rows()
    return sample if rows is None else sample.slice(0, rows)
