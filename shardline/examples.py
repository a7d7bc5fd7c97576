"""A real model and a real data set made here, with no download: scikit-learn's
bundled breast-cancer data, a gradient-boosted classifier, and Parquet shards of
rows drawn from it. Used by ``shardline demo``, the tests and the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardline.bundle import Lineage, Manifest


@dataclass
class Dataset:
    """Features, labels and feature names."""

    features: np.ndarray
    labels: np.ndarray
    names: list[str]


def breast_cancer() -> Dataset:
    """scikit-learn's bundled breast-cancer data set (569 rows, 30 features)."""
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    return Dataset(data.data, data.target, [str(n) for n in data.feature_names])


def train_classifier(data: Dataset, kind: str = "gbt", seed: int = 0) -> Any:
    """Fit a classifier on the data: 'gbt' (100 trees) or 'logreg' (scaled logistic regression)."""
    if kind == "gbt":
        from sklearn.ensemble import GradientBoostingClassifier

        return GradientBoostingClassifier(n_estimators=100, random_state=seed).fit(data.features, data.labels)
    if kind == "logreg":
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        return make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)).fit(data.features, data.labels)
    raise ValueError(f"unknown classifier kind {kind!r}; use 'gbt' or 'logreg'")


def package_breast_cancer(out_dir: str | Path, name: str = "breast-cancer", kind: str = "gbt") -> tuple[Manifest, Any]:
    """Train and bundle the breast-cancer classifier; returns the manifest and the estimator."""
    from shardline.packaging import package_sklearn

    data = breast_cancer()
    estimator = train_classifier(data, kind)
    accuracy = float((estimator.predict(data.features) == data.labels).mean())
    lineage = Lineage(training_data="sklearn.datasets.load_breast_cancer", metrics={"train_accuracy": accuracy})
    manifest = package_sklearn(estimator, out_dir, name=name, feature_names=data.names, lineage=lineage)
    return manifest, estimator


def shard_table(data: Dataset, rows: int, first_id: int, seed: int) -> pa.Table:
    """``rows`` rows drawn from the data set with a little noise, with a unique ``id`` column."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(data.features), rows)
    values = data.features[picks] * rng.normal(1.0, 0.02, (rows, 1))
    columns: dict[str, Any] = {"id": np.arange(first_id, first_id + rows, dtype=np.int64)}
    for j, name in enumerate(data.names):
        columns[name] = values[:, j]
    return pa.table(columns)


def write_shards(
    folder: str | Path, shards: int, rows_per_shard: int, *, row_group_rows: int = 65_536, seed: int = 0
) -> list[Path]:
    """Write ``shards`` Parquet files of breast-cancer-like rows under a local folder."""
    data = breast_cancer()
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(shards):
        path = out / f"part-{i:05d}.parquet"
        pq.write_table(shard_table(data, rows_per_shard, i * rows_per_shard, seed + i), path, row_group_size=row_group_rows)
        paths.append(path)
    return paths
