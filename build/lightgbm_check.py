"""Whether a LightGBM model can answer as LightGBM does once converted: its ONNX trees (onnxmltools) take float32
features and compare them with float32 thresholds, where LightGBM compares float64 values with float64 ones.

- ``float32_refusal``: rounding the sample's rows to float32 changes LightGBM's own answers (a column large next
  to its spread, such as a Unix timestamp: ``sklearn_check.float32_loss``, the question asked of scikit-learn's
  models); a LightGBM bundle cannot take float64 features, so the model is refused naming the column, before it
  is converted (the conversion would agree with LightGBM on the rounded rows and answer otherwise on the rows);
- ``split_refusal``: after a conversion that does not agree, whether the cause is a split whose threshold lies
  between two float32 values and rounds up to the upper one, so that rows holding that value (representable in
  float32, and scored right by LightGBM) go the other way in the ONNX trees: said naming the column and value,
  rather than "the conversion does not match".
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa

from shardline.build.packaging import RESCALE_ADVICE

_FLOAT32 = ("a LightGBM bundle takes float32 features (onnxmltools converts its trees with float32 inputs and "
            "thresholds)")


def float32_refusal(model: Any, sample: pa.Table, features: Sequence[str]) -> str | None:
    """Why the model cannot be bundled where float32 features lose LightGBM's answers on the sample; None where
    they do not."""
    from shardline.build.sklearn_check import float32_loss

    lost = float32_loss(model, sample, features, "LightGBM")
    return f"{lost}, and {_FLOAT32}; {RESCALE_ADVICE}" if lost is not None else None


def split_refusal(model: Any, rows: np.ndarray, features: Sequence[str]) -> str | None:
    """Why the ONNX trees route some of ``rows`` (float32) otherwise than LightGBM: a split on a column at a
    threshold float32 rounds up to a value those rows hold; None where no row holds such a value."""
    booster = getattr(model, "booster", None) or getattr(model, "booster_", None)
    if booster is None or isinstance(booster, str):
        return None
    for feature, threshold in _numeric_splits(booster.dump_model()):
        rounded = np.float32(threshold)
        if float(rounded) <= threshold or feature >= rows.shape[1]:
            continue
        hit = int(np.count_nonzero(rows[:, feature] == rounded))
        if hit:
            below = np.nextafter(rounded, np.float32(-np.inf))
            return (f"LightGBM splits column {features[feature]!r} at {threshold!r}, between the float32 values "
                    f"{float(below)!r} and {float(rounded)!r}; {_FLOAT32}, so the {hit} sample rows holding "
                    f"{float(rounded)!r} there go the other way, and the bundle cannot answer as LightGBM does on "
                    f"them: {RESCALE_ADVICE}")
    return None


def _numeric_splits(dumped: dict[str, Any]) -> Iterator[tuple[int, float]]:
    """Every numerical split (feature index, threshold) of a LightGBM model's dump."""
    stack = [tree["tree_structure"] for tree in dumped.get("tree_info", [])]
    while stack:
        node = stack.pop()
        if "split_feature" not in node:
            continue
        if node.get("decision_type") == "<=" and isinstance(node.get("threshold"), (int, float)):
            yield int(node["split_feature"]), float(node["threshold"])
        stack += [node["left_child"], node["right_child"]]
