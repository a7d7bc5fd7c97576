"""A custom-code model built here, as a user writes one: pre- and post-processing around an ONNX graph.

The class (``MODEL_CODE``) takes the breast-cancer features, log-scales them (preprocess), runs a
logistic regression fitted on the log-scaled features (an ONNX file, loaded through
``context.onnx_session``), and answers a diagnosis name from a JSON file of label names and the
winning probability (postprocess). ``expected`` computes the same answers with scikit-learn alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from shardline.bundle import Manifest
from shardline.build.code_bundles import package_python
from shardline.build.examples import breast_cancer

MODEL_CODE = '''
"""Diagnosis from the breast-cancer features: log-scaled, a logistic regression, named labels."""
import json

import numpy as np

from .scaling import log_scale


class Model:
    def load(self, context):
        self.session = context.onnx_session("classifier.onnx")
        self.names = json.loads(context.path("labels.json").read_text())

    def preprocess(self, rows):
        return log_scale(rows)

    def predict(self, features):
        label, probabilities = self.session.run(None, {"X": features})
        return {"label": label, "probabilities": probabilities}

    def postprocess(self, answer, rows):
        return {"diagnosis": [self.names[int(i)] for i in answer["label"]],
                "confidence": answer["probabilities"].max(axis=1)}
'''

SCALING_CODE = '''
import numpy as np


def log_scale(rows):
    features = np.column_stack([rows.column(n).to_numpy() for n in rows.column_names]).astype(np.float32)
    return np.log1p(np.abs(features)).astype(np.float32)
'''

LABELS = ["malignant", "benign"]


@dataclass
class CustomModel:
    """A packaged custom-code bundle, the fitted estimator it wraps, and the features it reads."""

    bundle_dir: Path
    manifest: Manifest
    estimator: Any
    feature_names: list[str]

    def expected(self, rows: pa.Table) -> dict[str, np.ndarray]:
        """The answers scikit-learn gives for the same rows (diagnosis names, winning probability)."""
        features = np.column_stack([rows.column(n).to_numpy() for n in self.feature_names]).astype(np.float32)
        probabilities = self.estimator.predict_proba(np.log1p(np.abs(features)))
        return {"diagnosis": np.asarray([LABELS[i] for i in probabilities.argmax(axis=1)]),
                "confidence": probabilities.max(axis=1)}


def write_code(folder: Path) -> Path:
    """The model's code as a folder of two modules (model.py imports scaling.py relatively)."""
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(MODEL_CODE)
    (folder / "scaling.py").write_text(SCALING_CODE)
    return folder


def build_custom_model(folder: Path, name: str = "diagnosis") -> CustomModel:
    """Fit the logistic regression, export it, and package the code around it in ``folder / 'bundle'``."""
    from skl2onnx import to_onnx
    from sklearn.linear_model import LogisticRegression

    data = breast_cancer()
    feature_names = data.names
    features = data.features.astype(np.float32)
    estimator = LogisticRegression(max_iter=2000).fit(np.log1p(np.abs(features)), data.labels)
    table = pa.table({**{n: features[:, i] for i, n in enumerate(feature_names)}, "target": data.labels})
    onx = to_onnx(estimator, features[:1], options={id(estimator): {"zipmap": False}}, target_opset=18)
    folder.mkdir(parents=True, exist_ok=True)
    onnx_file = folder / "classifier.onnx"
    onnx_file.write_bytes(onx.SerializeToString())
    labels = folder / "labels.json"
    labels.write_text(json.dumps(LABELS))
    code = write_code(folder / "code")
    manifest = package_python(code, folder / "bundle", name=name, sample=table, exclude=["target"],
                              files=[onnx_file, labels], requirements=["numpy>=1.26", "onnxruntime"])
    return CustomModel(folder / "bundle", manifest, estimator, feature_names)
