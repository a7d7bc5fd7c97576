"""Build bundles from trained models: an ONNX file, or a scikit-learn estimator.

skl2onnx and onnx are imported inside the builders that need them.
"""

from __future__ import annotations

import platform
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

from shardline.bundle import Lineage, Manifest, describe_artifact, write_manifest
from shardline.errors import InvalidSetting, RuntimeUnavailable
from shardline.signature import ColumnSpec, Signature

_RECORDED_PACKAGES = ("onnxruntime", "onnxruntime-gpu", "onnx", "scikit-learn", "skl2onnx", "pyarrow")


def current_environment() -> dict[str, str]:
    """Python and the versions of the packages that shape a model's outputs."""
    env = {"python": platform.python_version()}
    for package in _RECORDED_PACKAGES:
        try:
            env[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return env


def _empty_dir(path: Path) -> Path:
    if path.exists() and any(path.iterdir()):
        raise InvalidSetting(f"{path} is not empty; give a new folder for the bundle")
    path.mkdir(parents=True, exist_ok=True)
    return path


def package_onnx(
    onnx_file: str | Path,
    out_dir: str | Path,
    *,
    name: str,
    signature: Signature,
    runtime_config: dict[str, Any] | None = None,
    lineage: Lineage | None = None,
) -> Manifest:
    """Copy an ONNX file into a new bundle folder and write its manifest."""
    out = _empty_dir(Path(out_dir))
    shutil.copyfile(onnx_file, out / "model.onnx")
    manifest = Manifest(
        name=name,
        runtime="onnx",
        artifacts=[describe_artifact(out, "model.onnx")],
        signature=signature,
        runtime_config=runtime_config or {},
        environment=current_environment(),
        lineage=lineage or Lineage(),
    )
    write_manifest(out, manifest)
    return manifest


def package_sklearn(
    estimator: Any,
    out_dir: str | Path,
    *,
    name: str,
    feature_names: Sequence[str],
    lineage: Lineage | None = None,
) -> Manifest:
    """Convert a fitted scikit-learn classifier or regressor to ONNX and bundle it.

    Classifiers yield ``label`` (int64) and ``probabilities`` (one float32 per class);
    regressors yield ``prediction`` (float32). Features are float32 columns.
    """
    try:
        from skl2onnx import to_onnx
        from skl2onnx.common.data_types import FloatTensorType
    except ImportError as e:
        raise RuntimeUnavailable(
            "packaging a scikit-learn model needs skl2onnx; pip install 'shardline[package]'"
        ) from e
    features = list(feature_names)
    is_classifier = hasattr(estimator, "classes_")
    options = {"zipmap": False} if is_classifier else None
    onx = to_onnx(
        estimator,
        initial_types=[("X", FloatTensorType([None, len(features)]))],
        options={id(estimator): options} if options else None,
        target_opset=18,
    )
    inputs = [ColumnSpec(name=f, type="float32") for f in features]
    if is_classifier:
        n_classes = len(estimator.classes_)
        outputs = [
            ColumnSpec(name="label", type="int64"),
            ColumnSpec(name="probabilities", type=f"fixed_size_list<float32>[{n_classes}]"),
        ]
        rename = {"label": "label", "probabilities": "probabilities"}
    else:
        outputs = [ColumnSpec(name="prediction", type="float32")]
        rename = {onx.graph.output[0].name: "prediction"}
    staging = _empty_dir(Path(out_dir))
    onnx_path = staging / "model.onnx"
    onnx_path.write_bytes(onx.SerializeToString())
    manifest = Manifest(
        name=name,
        runtime="onnx",
        artifacts=[describe_artifact(staging, "model.onnx")],
        signature=Signature(inputs=inputs, outputs=outputs),
        runtime_config={
            "tensor_inputs": [{"name": "X", "columns": features, "dtype": "float32"}],
            "tensor_outputs": rename,
        },
        environment=current_environment(),
        lineage=lineage or Lineage(),
        tags={"framework": "scikit-learn", "estimator": type(estimator).__name__},
    )
    write_manifest(staging, manifest)
    return manifest
