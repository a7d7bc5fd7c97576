"""Models of other frameworks, fitted here on scikit-learn's bundled breast-cancer data: an XGBoost and
a LightGBM classifier and regressor, and a small PyTorch MLP classifier; the rows they were fitted on,
as the sample table the builders take, or as the pandas DataFrame most users fit on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from shardline.build.examples import breast_cancer
from shardline.bundle import Manifest


def training_rows() -> tuple[np.ndarray, np.ndarray, list[str], pa.Table]:
    """(features float32, labels, feature names, the features as a table of one column each)."""
    data = breast_cancer()
    features = data.features.astype(np.float32)
    return features, data.labels, list(data.names), pa.table({n: features[:, i] for i, n in enumerate(data.names)})


def training_frame(rows: int | None = None, dtype: Any = np.float64) -> Any:
    """The training rows as a pandas DataFrame, as scikit-learn gives them (``as_frame=True``): one column
    per feature, named as scikit-learn names them (``mean radius``, ...), float64 unless ``dtype``."""
    import pandas as pd

    data = breast_cancer()
    return pd.DataFrame(data.features[:rows].astype(dtype), columns=data.names)


def fitted(kind: str, on_frame: bool = False) -> Any:
    """A model fitted on the training rows: xgboost-classifier, xgboost-regressor, lightgbm-classifier,
    lightgbm-regressor or torch-mlp (a 30-16-2 MLP ending in softmax, trained a few hundred steps).
    ``on_frame``: fitted on ``training_frame()``, so that the trees keep its column names (the MLP, which
    keeps none, is trained on the same values either way)."""
    features, labels, _, _ = training_rows()
    rows: Any = training_frame() if on_frame else features
    if kind.startswith("xgboost"):
        import xgboost

        cls = xgboost.XGBClassifier if kind.endswith("classifier") else xgboost.XGBRegressor
        return cls(n_estimators=40, max_depth=3, n_jobs=1).fit(rows, labels)
    if kind.startswith("lightgbm"):
        import lightgbm

        cls = lightgbm.LGBMClassifier if kind.endswith("classifier") else lightgbm.LGBMRegressor
        return cls(n_estimators=40, num_leaves=15, n_jobs=1, verbose=-1).fit(rows, labels)
    assert kind == "torch-mlp", kind
    import torch

    torch.manual_seed(0)
    scale = torch.from_numpy(features.std(axis=0) + 1e-6)
    shift = torch.from_numpy(features.mean(axis=0))

    class Standardized(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(torch.nn.Linear(30, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.layers((x - shift) / scale), dim=1)

    net = Standardized()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    x, y = torch.from_numpy(features), torch.from_numpy(labels.astype(np.int64))
    for _ in range(300):
        optimizer.zero_grad()
        loss = torch.nn.functional.nll_loss(torch.log(net(x) + 1e-9), y)
        loss.backward()
        optimizer.step()
    return net.eval()


def predictions(kind: str, model: Any, rows: Any) -> dict[str, np.ndarray]:
    """The framework's own answers for ``rows`` (a matrix, or a DataFrame as the trees were fitted on), named
    as the bundle's outputs."""
    if kind == "torch-mlp":
        import torch

        with torch.no_grad():
            probabilities = model(torch.from_numpy(np.asarray(rows, dtype=np.float32))).numpy()
        return {"probabilities": probabilities}
    if kind.endswith("classifier"):
        return {"label": model.predict(rows), "probabilities": model.predict_proba(rows)}
    return {"prediction": model.predict(rows)}


def bundle_answers(folder: Path, manifest: Manifest, rows: pa.Table) -> dict[str, np.ndarray]:
    """A bundle's answers for ``rows``, scored by the runtime both tiers load it with, per output."""
    from shardline.build.frameworks import score_bundle

    answer = score_bundle(folder, manifest, rows)
    return {name: np.asarray(answer.column(name).to_pylist()) for name in answer.column_names}
