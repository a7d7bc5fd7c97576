"""Whether a scikit-learn model's ONNX conversion answers as scikit-learn does (``packaging.package_sklearn``
given a sample, and so every scikit-learn model ``shardline model import`` brings in from MLflow).

scikit-learn computes in float64 on the rows as given; a bundle fed float32 features sees them rounded to
about 7 significant digits. For most features that changes nothing, but a column large next to its spread
(a Unix timestamp: 1.7e9 + a few seconds) loses what the model reads, and a float32 model then answers
otherwise on rows scikit-learn gets right. So:

- ``float32_loss`` says, before converting, whether rounding the sample's first ``CHECK_ROWS`` rows to
  float32 changes scikit-learn's own answers (beyond the tolerance), naming the column that loses the most;
  the builder then converts with float64 inputs;
- ``check_sklearn`` scores those rows with the bundle as both tiers load it and compares every output with
  scikit-learn's answers on the rows as given (``frameworks._check``: within ``ATOL + RTOL * |expected|``,
  labels equal but at ties).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from shardline.build.frameworks import ATOL, CHECK_ROWS, RTOL, _check, _features, _matrix, _tie_rows
from shardline.bundle import Manifest


def sklearn_answers(estimator: Any, rows: np.ndarray) -> dict[str, np.ndarray]:
    """scikit-learn's answers on ``rows`` under the bundle's output names (``label`` and ``probabilities``
    for a classifier, ``prediction`` for a regressor)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "X does not have valid feature names": fitted on a DataFrame
        if hasattr(estimator, "classes_"):
            return {"label": np.asarray(estimator.predict(rows)), "probabilities": np.asarray(estimator.predict_proba(rows))}
        return {"prediction": np.asarray(estimator.predict(rows))}


def float32_loss(estimator: Any, sample: pa.Table, features: Sequence[str]) -> str | None:
    """Why float32 features lose scikit-learn's answers on the sample, in words naming the column (its
    magnitude and spread); None where rounding the rows to float32 changes no answer beyond the tolerance.

    Raises:
        InvalidInput: the sample lacks a feature, or a feature column is not numbers.
    """
    _features(None, sample, features)  # every feature is there, or InvalidInput naming the missing ones
    given = _matrix(sample, features, CHECK_ROWS, np.float64)
    rounded = given.astype(np.float32).astype(np.float64)
    if np.array_equal(given, rounded, equal_nan=True) or _same(sklearn_answers(estimator, given),
                                                               sklearn_answers(estimator, rounded)):
        return None
    spread = np.nanstd(given, axis=0)
    lost = np.nanmax(np.abs(given - rounded), axis=0) / np.where(spread > 0, spread, 1.0)
    worst = int(np.nanargmax(lost))
    magnitude = float(np.nanmax(np.abs(given[:, worst])))
    return (f"float32 inputs lose precision for column {features[worst]!r} (values up to {magnitude:.3g}, spread "
            f"{float(spread[worst]):.3g}): scikit-learn answers otherwise on the sample rounded to float32")


def _same(want: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> bool:
    tie = _tie_rows(want["probabilities"]) if "probabilities" in want else None
    for output, expected in want.items():
        if output == "label":
            if ((got[output] != expected) & ~(tie if tie is not None else False)).any():
                return False
        elif (np.abs(got[output].astype(np.float64) - expected) > ATOL + RTOL * np.abs(expected)).any():
            return False
    return True


def check_sklearn(folder: Path, manifest: Manifest, estimator: Any, sample: pa.Table, features: Sequence[str]) -> None:
    """Score the sample's first ``CHECK_ROWS`` rows with the bundle; refuse answers that differ from
    scikit-learn's on those rows as given (float64).

    Raises:
        InvalidInput: an output differs (naming it, the largest difference and the rows).
    """
    names = list(features)
    expected = sklearn_answers(estimator, _matrix(sample, names, CHECK_ROWS, np.float64))
    tie = _tie_rows(expected["probabilities"]) if "probabilities" in expected else None
    head = sample.select(names).slice(0, min(CHECK_ROWS, sample.num_rows))
    _check(folder, manifest, head, expected, tie, "scikit-learn")
