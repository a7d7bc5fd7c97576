"""Whether two versions' answers agree, row by row (a shadow's against the primary's; a rollout's replay).

How two answers are judged, per row (one row = one answer a caller would read):

- An answer with label-like outputs (integers, booleans, strings: a classifier's ``label``): a
  row disagrees when any label differs. Its float outputs (probabilities) are measured (the
  largest difference) but not judged: a new version is expected to move them.
- Otherwise, rows of float vectors (embeddings, width 2 or more): a row disagrees when the
  cosine of the two vectors is under ``MIN_COSINE``.
- Otherwise, float scalars (a regressor): a row disagrees when the values differ by more than
  ``REL_TOLERANCE`` of the primary's (``ABS_TOLERANCE`` near 0).

Different output names or shapes make every row disagree. Pure: numpy arrays in, a
``Comparison`` out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_COSINE = 0.99
REL_TOLERANCE = 0.01
ABS_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Comparison:
    """How one shadow answer compared with the primary's."""

    rows: int
    disagree: int  # rows judged to disagree (see the module docstring)
    label_rows: int = 0  # rows that carried labels
    label_agree: int = 0
    max_delta: float = 0.0  # largest absolute difference of any float output
    min_cosine: float | None = None  # lowest cosine of two float vectors, where answers hold vectors


def _rows(array: np.ndarray) -> np.ndarray:
    return array.reshape(len(array), -1) if array.ndim else array.reshape(1, 1)


def compare(primary: dict[str, np.ndarray], shadow: dict[str, np.ndarray]) -> Comparison:
    """Judge a shadow answer against the primary's (see the module docstring)."""
    first = next(iter(primary.values()), None)
    rows = len(first) if first is not None and first.ndim else 1
    if set(primary) != set(shadow) or any(primary[n].shape != shadow[n].shape for n in primary):
        return Comparison(rows, rows)
    labels = [n for n, a in primary.items() if a.dtype.kind in "biuOSU"]
    floats = [n for n, a in primary.items() if a.dtype.kind in "fc"]
    label_ok = np.ones(rows, bool)
    for name in labels:
        label_ok &= (_rows(primary[name]) == _rows(shadow[name])).all(axis=1)
    max_delta, min_cosine = 0.0, None
    float_ok = np.ones(rows, bool)
    for name in floats:
        a, b = _rows(primary[name]).astype(np.float64), _rows(shadow[name]).astype(np.float64)
        if a.size:
            max_delta = max(max_delta, float(np.abs(a - b).max()))
        if a.shape[1] >= 2:
            norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
            cosine = np.where(norms > 0, (a * b).sum(axis=1) / np.where(norms > 0, norms, 1), 1.0)
            if len(cosine):
                min_cosine = float(cosine.min()) if min_cosine is None else min(min_cosine, float(cosine.min()))
            float_ok &= cosine >= MIN_COSINE
        else:
            float_ok &= np.isclose(b, a, rtol=REL_TOLERANCE, atol=ABS_TOLERANCE).all(axis=1)
    judged = label_ok if labels else float_ok
    return Comparison(rows, int((~judged).sum()), rows if labels else 0, int(label_ok.sum()) if labels else 0,
                      max_delta, min_cosine)
