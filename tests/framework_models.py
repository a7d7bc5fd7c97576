"""Models of other frameworks, fitted here on scikit-learn's bundled breast-cancer data: an XGBoost and
a LightGBM classifier and regressor, and a small PyTorch MLP classifier; the rows they were fitted on,
as the sample table the builders take."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from shardline.build.examples import breast_cancer


def training_rows() -> tuple[np.ndarray, np.ndarray, list[str], pa.Table]:
    """(features float32, labels, feature names, the features as a table of one column each)."""
    data = breast_cancer()
    features = data.features.astype(np.float32)
    return features, data.labels, list(data.names), pa.table({n: features[:, i] for i, n in enumerate(data.names)})


def fitted(kind: str) -> Any:
    """A model fitted on the training rows: xgboost-classifier, xgboost-regressor, lightgbm-classifier,
    lightgbm-regressor or torch-mlp (a 30-16-2 MLP ending in softmax, trained a few hundred steps)."""
    features, labels, _, _ = training_rows()
    if kind.startswith("xgboost"):
        import xgboost

        cls = xgboost.XGBClassifier if kind.endswith("classifier") else xgboost.XGBRegressor
        return cls(n_estimators=40, max_depth=3, n_jobs=1).fit(features, labels)
    if kind.startswith("lightgbm"):
        import lightgbm

        cls = lightgbm.LGBMClassifier if kind.endswith("classifier") else lightgbm.LGBMRegressor
        return cls(n_estimators=40, num_leaves=15, n_jobs=1, verbose=-1).fit(features, labels)
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


def predictions(kind: str, model: Any, rows: np.ndarray) -> dict[str, np.ndarray]:
    """The framework's own answers for ``rows``, named as the bundle's outputs."""
    if kind == "torch-mlp":
        import torch

        with torch.no_grad():
            probabilities = model(torch.from_numpy(rows.astype(np.float32))).numpy()
        return {"probabilities": probabilities}
    if kind.endswith("classifier"):
        return {"label": model.predict(rows), "probabilities": model.predict_proba(rows)}
    return {"prediction": model.predict(rows)}
