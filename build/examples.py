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


def split(data: Dataset, golden_share: float = 0.2, seed: int = 0) -> tuple[Dataset, Dataset]:
    """A fixed split into training rows and held-out golden rows."""
    order = np.random.default_rng(seed).permutation(len(data.labels))
    cut = int(len(order) * (1 - golden_share))
    train, golden = order[:cut], order[cut:]
    return (
        Dataset(data.features[train], data.labels[train], data.names),
        Dataset(data.features[golden], data.labels[golden], data.names),
    )


def golden_table(data: Dataset) -> pa.Table:
    """Features and the ``target`` column, as a golden set is stored."""
    columns: dict[str, Any] = {n: data.features[:, j] for j, n in enumerate(data.names)}
    columns["target"] = data.labels.astype(np.int64)
    return pa.table(columns)


def package_breast_cancer(
    out_dir: str | Path,
    name: str = "breast-cancer",
    kind: str = "gbt",
    *,
    accuracy_threshold: float = 0.9,
    reference_profile: dict[str, Any] | None = None,
) -> tuple[Manifest, Any]:
    """Train the breast-cancer classifier on 80% of the rows and bundle it with the other 20%
    as its golden set; returns the manifest and the estimator.
    """
    from shardline.build.packaging import GoldenSet, package_sklearn

    train, held_out = split(breast_cancer())
    estimator = train_classifier(train, kind)
    accuracy = float((estimator.predict(held_out.features) == held_out.labels).mean())
    lineage = Lineage(
        training_data="sklearn.datasets.load_breast_cancer", metrics={"golden_accuracy": accuracy}
    )
    golden = GoldenSet(golden_table(held_out), "target", "accuracy", "label", accuracy_threshold)
    manifest = package_sklearn(
        estimator, out_dir, name=name, feature_names=train.names, lineage=lineage, golden=golden,
        reference_profile=reference_profile,
    )
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


SITES = ("north", "south", "east")
SITE_SHARES = (0.5, 0.3, 0.2)


def with_site(table: pa.Table, seed: int, sites: tuple[str, ...] = SITES,
              shares: tuple[float, ...] = SITE_SHARES) -> pa.Table:
    """The table with a categorical ``site`` column (which clinic sent the row), drawn at the given shares.

    The breast-cancer features are all numeric; drift checks and data contracts
    judge categories too, so examples and tests add this passthrough column.
    """
    rng = np.random.default_rng(seed)
    return table.append_column("site", pa.array(rng.choice(list(sites), table.num_rows, p=list(shares))))


def shifted_table(table: pa.Table, *, scale: dict[str, float] | None = None,
                  nulls: dict[str, float] | None = None, seed: int = 0) -> pa.Table:
    """A copy of the table shifted on purpose: columns multiplied by a factor, a share of rows made null."""
    rng = np.random.default_rng(seed)
    for name, factor in (scale or {}).items():
        i = table.schema.get_field_index(name)
        table = table.set_column(i, name, pa.array(table.column(name).to_numpy() * factor))
    for name, share in (nulls or {}).items():
        i = table.schema.get_field_index(name)
        values = table.column(name).to_numpy(zero_copy_only=False)
        table = table.set_column(i, name, pa.array(values, mask=rng.random(table.num_rows) < share))
    return table


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
