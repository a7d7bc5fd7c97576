"""Mends for skl2onnx's converters where its release fails on a model it supports (applied before converting).

- **HistGradientBoosting** (``HistGradientBoostingClassifier`` and ``-Regressor``, scikit-learn's recommended
  gradient boosting): skl2onnx 1.20's converter gives each leaf a Python ``False`` for
  ``nodes_missing_value_tracks_true`` (its split nodes get scikit-learn's ``missing_go_to_left``, an integer),
  and onnx 1.23's ``make_attribute`` refuses a bool among ints ("Field onnx.AttributeProto.ints: Expected an
  int, got a boolean"), so every such model failed to convert. The flag is passed on as the int it stands for;
  the trees, their NaN routing included, are converted as skl2onnx means them (checked against scikit-learn in
  tests/integration/test_mlflow_import.py and test_mlflow_trees.py).

- **VotingClassifier** (soft or hard voting): skl2onnx refuses ``flatten_transform=True``, scikit-learn's default
  ("not implemented yet"), though that parameter shapes only ``transform``'s output, never ``predict`` or
  ``predict_proba``, which the bundle answers. ``convertible`` gives skl2onnx a shallow copy with it off (the
  model itself is left as it is; its answers are still checked against the original's).

Each mend of skl2onnx wraps its own function (no copy of its code) and is idempotent; where a release no longer
has the function, nothing is mended and the conversion runs as skl2onnx ships it.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

_MENDED = "__shardline_mended__"


def mend_skl2onnx() -> None:
    """Apply every mend above once (later calls do nothing)."""
    try:
        from skl2onnx.common import tree_ensemble
    except ImportError:
        return
    add_node = getattr(tree_ensemble, "add_node", None)
    if add_node is None or getattr(add_node, _MENDED, False):
        return
    tree_ensemble.add_node = _with_int_missing_flag(add_node)


def _with_int_missing_flag(add_node: Any) -> Any:
    @functools.wraps(add_node)
    def add(*args: Any, nodes_missing_value_tracks_true: Any = 0, **kwargs: Any) -> Any:
        return add_node(*args, nodes_missing_value_tracks_true=int(nodes_missing_value_tracks_true), **kwargs)

    setattr(add, _MENDED, True)
    return add


def convertible(estimator: Any) -> Any:
    """``estimator`` as skl2onnx converts it: a ``VotingClassifier`` (alone, or a pipeline's last step)
    as a shallow copy with ``flatten_transform`` off; anything else as it is."""
    if hasattr(estimator, "steps") and estimator.steps:
        last = convertible(estimator.steps[-1][1])
        if last is estimator.steps[-1][1]:
            return estimator
        mended = copy.copy(estimator)
        mended.steps = [*estimator.steps[:-1], (estimator.steps[-1][0], last)]
        return mended
    if type(estimator).__name__ == "VotingClassifier" and getattr(estimator, "flatten_transform", False):
        mended = copy.copy(estimator)
        mended.flatten_transform = False
        return mended
    return estimator
