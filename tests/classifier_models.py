"""A scikit-learn classifier as users convert it: skl2onnx with its defaults (probabilities through a ZipMap), on
string class labels (the iris species), and its training rows as a Parquet file of named float32 columns."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SPECIES = ["setosa", "versicolor", "virginica"]


@dataclass(frozen=True)
class DefaultConverted:
    onnx_file: Path  # the ONNX file skl2onnx wrote with its defaults
    rows: Path  # the features, one named float32 column each, and the species (a golden set)
    estimator: Any  # the fitted LogisticRegression
    features: np.ndarray  # (150, 4) float32
    names: list[str]


def species_classifier(folder: Path) -> DefaultConverted:
    from skl2onnx import to_onnx
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    folder.mkdir(parents=True, exist_ok=True)
    iris = load_iris()
    features = iris.data.astype(np.float32)
    names = ["sepal_length", "sepal_width", "petal_length", "petal_width"]
    species = np.array(SPECIES)[iris.target]
    estimator = LogisticRegression(max_iter=1000).fit(features, species)
    onnx_file = folder / "species.onnx"
    onnx_file.write_bytes(to_onnx(estimator, features[:1], target_opset=18).SerializeToString())  # ZipMap included
    rows = folder / "species.parquet"
    pq.write_table(pa.table({**{n: features[:, i] for i, n in enumerate(names)}, "species": species}), rows)
    return DefaultConverted(onnx_file, rows, estimator, features, names)


REVIEWS = ["good movie great acting", "terrible plot bad acting", "great fun loved it", "awful boring waste",
           "wonderful film", "bad bad bad", "excellent story", "horrible ending"]


def review_classifier(folder: Path, name: str, profiled: bool) -> Path:
    """A text model as users convert one: TF-IDF and a LogisticRegression (skl2onnx, its text normalizer in the C
    locale), one ``string`` input ``text``; packaged as ``name`` with a reference profile of its training texts
    (so batch jobs check a data contract) or without one. Returns the bundle's folder."""
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import StringTensorType
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline

    from shardline.build.packaging import package_onnx
    from shardline.quality.profile import profile_table

    folder.mkdir(parents=True, exist_ok=True)
    texts = REVIEWS * 10
    pipeline = Pipeline([("tfidf", TfidfVectorizer()), ("lr", LogisticRegression())])
    pipeline.fit(texts, [1, 0] * (len(texts) // 2))
    onnx_file = folder / "reviews.onnx"
    onnx_file.write_bytes(convert_sklearn(pipeline, initial_types=[("text", StringTensorType([None, 1]))],
                                          target_opset=17, options={TfidfVectorizer: {"locale": "C"}}).SerializeToString())
    sample = pa.table({"text": texts})
    package_onnx(onnx_file, folder / name, name=name, sample=sample,
                 reference_profile=profile_table(sample) if profiled else None)
    return folder / name
