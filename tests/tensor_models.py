"""ONNX models whose inputs are tensors of rank 2 or more, built here, and rows that feed them.

- ``list_classifier``: scikit-learn's logistic regression on the breast-cancer data, converted with
  one input ``input`` FP32 ``[-1, 30]`` (as a user's own model usually comes).
- ``two_tensor_model``: a hand-made graph (onnx.helper) with inputs ``a`` ``[-1, 3]`` and
  ``b`` ``[-1, 2]``; outputs ``total`` (the sum of each row's five values) and ``joined``
  (the row's values side by side, ``[-1, 5]``).
- ``cube_model``: one input ``x`` ``[-1, 2, 3]``; output ``total`` (each row's sum).
- ``mlp_bundle``: an MLP classifier on the breast-cancer data, where int8 quantization applies (variants).
- ``breast_cancer_bundle``: the breast-cancer classifier as a bundle that passes the promotion gates,
  optionally one whose graph fails on some inputs (a rollout candidate that errors on live rows only).
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


def fixed_batch_model(path: Path, rows: int = 1) -> Path:
    """Input x [rows, 4]: a graph exported for exactly that many rows (one by default)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, 4])],
    )
    return _save(graph, path)


def breast_cancer_bundle(folder: Path, name: str, kind: str, fails_from: float | None = None) -> Path:
    """The breast-cancer classifier packaged as ``name`` (golden set and reference profile: it passes the
    gates); with ``fails_from``, its graph fails (onnxruntime: index out of bounds) on any row whose first
    feature is at least that, which no golden row is. Returns the bundle folder."""
    import onnx
    from onnx import TensorProto, helper

    from shardline.build.examples import breast_cancer, golden_table, package_breast_cancer, split
    from shardline.build.packaging import GoldenSet, package_onnx
    from shardline.quality.profile import profile_table

    train, held_out = split(breast_cancer())
    profile = profile_table(golden_table(train))
    manifest, _ = package_breast_cancer(folder / "plain", name=name, kind=kind, reference_profile=profile)
    if fails_from is None:
        return folder / "plain"
    model = onnx.load(str(folder / "plain" / "model.onnx"))
    graph = model.graph
    producer = next(n for n in graph.node if "probabilities" in n.output)
    producer.output[list(producer.output).index("probabilities")] = "probabilities_raw"
    graph.initializer.extend([
        helper.make_tensor("first", TensorProto.INT64, [], [0]),
        helper.make_tensor("step", TensorProto.FLOAT, [], [fails_from]),
        helper.make_tensor("table", TensorProto.FLOAT, [1], [0.0]),
        helper.make_tensor("one_axis", TensorProto.INT64, [1], [1]),
    ])
    graph.node.extend([
        helper.make_node("Gather", ["X", "first"], ["x0"], axis=1),
        helper.make_node("Div", ["x0", "step"], ["scaled"]),
        helper.make_node("Floor", ["scaled"], ["floored"]),
        helper.make_node("Cast", ["floored"], ["index"], to=TensorProto.INT64),
        helper.make_node("Gather", ["table", "index"], ["zero"], axis=0),  # out of bounds from fails_from on
        helper.make_node("Unsqueeze", ["zero", "one_axis"], ["zero_column"]),
        helper.make_node("Add", ["probabilities_raw", "zero_column"], ["probabilities"]),
    ])
    onnx.checker.check_model(model)
    (folder / "guarded.onnx").write_bytes(model.SerializeToString())
    golden = GoldenSet(golden_table(held_out), "target", "accuracy", "label", 0.9)
    package_onnx(folder / "guarded.onnx", folder / "bundle", name=name, signature=manifest.signature,
                 runtime_config=manifest.runtime_config, golden=golden, reference_profile=profile)
    return folder / "bundle"


def mlp_bundle(folder: Path, name: str = "mlp") -> tuple[Path, Any]:
    """(bundle folder, estimator): an MLP classifier on the breast-cancer data, where int8 quantization
    applies, with its golden set (accuracy 0.95, a variant may move it by 0.02)."""
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from shardline.build.examples import breast_cancer, golden_table
    from shardline.build.packaging import GoldenSet, package_sklearn

    data = breast_cancer()
    estimator = make_pipeline(StandardScaler(), MLPClassifier((32,), max_iter=1000, random_state=0))
    estimator.fit(data.features, data.labels)
    golden = GoldenSet(golden_table(data), "target", "accuracy", "label", 0.95, max_variant_delta=0.02)
    package_sklearn(estimator, folder / name, name=name, feature_names=data.names, golden=golden)
    return folder / name, estimator


def string_pair_model(path: Path) -> Path:
    """Input x [-1, 2] (FP32); output names [-1, 2]: each value cast to a string (two strings a row)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["names"], to=TensorProto.STRING)], "string_pair",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor_value_info("names", TensorProto.STRING, ["batch", 2])],
    )
    return _save(graph, path)
