"""ONNX models whose inputs are tensors of rank 2 or more, built here, and rows that feed them.

- ``list_classifier``: scikit-learn's logistic regression on the breast-cancer data, converted with
  one input ``input`` FP32 ``[-1, 30]`` (as a user's own model usually comes).
- ``two_tensor_model``: a hand-made graph (onnx.helper) with inputs ``a`` ``[-1, 3]`` and
  ``b`` ``[-1, 2]``; outputs ``total`` (the sum of each row's five values) and ``joined``
  (the row's values side by side, ``[-1, 5]``).
- ``cube_model``: one input ``x`` ``[-1, 2, 3]``; output ``total`` (each row's sum).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa


def feature_column(values: np.ndarray) -> pa.FixedSizeListArray:
    """Rows of k values as the one ``fixed_size_list<float32>[k]`` column Arrow holds a feature vector in."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(values.ravel()), values.shape[1])


def list_classifier(folder: Path) -> tuple[Path, Any, np.ndarray]:
    """(model.onnx, the fitted estimator, the 569 feature rows) for one [-1, 30] input named ``input``."""
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.datasets import load_breast_cancer
    from sklearn.linear_model import LogisticRegression

    features, target = load_breast_cancer(return_X_y=True)
    features = features.astype(np.float32)
    estimator = LogisticRegression(max_iter=5000).fit(features, target)
    onx = to_onnx(estimator, initial_types=[("input", FloatTensorType([None, 30]))],
                  options={id(estimator): {"zipmap": False}}, target_opset=18)
    path = folder / "classifier.onnx"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_bytes(onx.SerializeToString())
    return path, estimator, features


def _save(graph: Any, path: Path) -> Path:
    from onnx import checker, helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


def two_tensor_model(path: Path) -> Path:
    """Inputs a [-1, 3] and b [-1, 2] (FP32); outputs total [-1] and joined [-1, 5]."""
    from onnx import TensorProto, helper

    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    graph = helper.make_graph(
        [helper.make_node("Concat", ["a", "b"], ["joined"], axis=1),
         helper.make_node("ReduceSum", ["joined", "axes"], ["total"], keepdims=0)],
        "two_tensors",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, ["batch"]),
         helper.make_tensor_value_info("joined", TensorProto.FLOAT, ["batch", 5])],
        initializer=[axes],
    )
    return _save(graph, path)


def cube_model(path: Path) -> Path:
    """Input x [-1, 2, 3] (FP32); output total [-1], each row's six values summed."""
    from onnx import TensorProto, helper

    axes = helper.make_tensor("axes", TensorProto.INT64, [2], [1, 2])
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["total"], keepdims=0)],
        "cube",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 3])],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, ["batch"])],
        initializer=[axes],
    )
    return _save(graph, path)


def fixed_batch_model(path: Path) -> Path:
    """Input x [1, 4]: a graph exported for exactly one row."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    return _save(graph, path)
