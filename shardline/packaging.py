"""Build bundles from trained models: an ONNX file, or a scikit-learn estimator.

A bundle carries the model, its signature (checked against sample data), the
environment that made it, lineage, and optionally a golden data set with the score
promotion demands and a reference data profile for drift checks. Bundles never hold
pickles. onnx, onnxruntime and skl2onnx are imported inside the builders.
"""

from __future__ import annotations

import json
import platform
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardline.bundle import Evaluation, Lineage, Manifest, describe_artifact, write_manifest
from shardline.errors import InvalidInput, InvalidSetting, RuntimeUnavailable
from shardline.signature import ColumnSpec, Signature, is_compatible, non_finite_counts, parse_type, type_name

_RECORDED_PACKAGES = ("onnxruntime", "onnxruntime-gpu", "onnx", "scikit-learn", "skl2onnx", "pyarrow", "tokenizers")
GOLDEN_FILE = "golden.parquet"
PROFILE_FILE = "reference_profile.json"


@dataclass
class GoldenSet:
    """Rows with known answers, and the score a version must reach on them to be promoted."""

    table: pa.Table
    label_column: str
    metric: str
    prediction_column: str
    threshold: float
    max_variant_delta: float = 0.01


def current_environment(image: str | None = None) -> dict[str, str]:
    """Python and the versions of the packages that shape a model's outputs (and the image, if any)."""
    env = {"python": platform.python_version()}
    for package in _RECORDED_PACKAGES:
        try:
            env[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    if image:
        env["image"] = image
    return env


def new_bundle_dir(path: str | Path) -> Path:
    """Create an empty folder for a bundle; refuse one that holds files."""
    folder = Path(path)
    if folder.exists() and any(folder.iterdir()):
        raise InvalidSetting(f"{folder} is not empty; give a new folder for the bundle")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def finish_bundle(
    folder: Path,
    manifest: Manifest,
    golden: GoldenSet | None = None,
    reference_profile: dict[str, Any] | None = None,
) -> Manifest:
    """Add the golden set and reference profile as artifacts, then write the manifest."""
    artifacts = list(manifest.artifacts)
    update: dict[str, Any] = {}
    if golden is not None:
        missing = {golden.label_column} - set(golden.table.column_names)
        if missing:
            raise InvalidInput(f"the golden set has no column {sorted(missing)}; it must hold the expected answers")
        if golden.prediction_column not in manifest.signature.output_names:
            raise InvalidInput(
                f"the golden set compares output {golden.prediction_column!r}, the model's outputs are "
                f"{manifest.signature.output_names}"
            )
        pq.write_table(golden.table, folder / GOLDEN_FILE)
        artifacts.append(describe_artifact(folder, GOLDEN_FILE, role="golden"))
        update["evaluation"] = Evaluation(
            golden=GOLDEN_FILE, label_column=golden.label_column, metric=golden.metric,  # type: ignore[arg-type]
            prediction_column=golden.prediction_column, threshold=golden.threshold,
            max_variant_delta=golden.max_variant_delta,
        )
    done = manifest.model_copy(update={"artifacts": artifacts, **update})
    if reference_profile is not None:
        return set_reference_profile(folder, done, reference_profile)
    write_manifest(folder, done)
    return done


def set_reference_profile(folder: Path, manifest: Manifest, reference_profile: dict[str, Any]) -> Manifest:
    """Write the reference profile into a bundle folder (replacing any it had) and rewrite the manifest.

    Only for a bundle not pushed yet: pushed versions are immutable. The profile is
    compact JSON (``shardline.quality.profile`` makes it), a few KB.
    """
    (folder / PROFILE_FILE).write_text(json.dumps(reference_profile, separators=(",", ":")))
    artifacts = [a for a in manifest.artifacts if a.path != PROFILE_FILE]
    artifacts.append(describe_artifact(folder, PROFILE_FILE, role="profile"))
    done = manifest.model_copy(update={"artifacts": artifacts, "reference_profile": PROFILE_FILE})
    write_manifest(folder, done)
    return done


_NUMPY_TO_TYPE = {
    np.dtype("float32"): "float32", np.dtype("float64"): "float64", np.dtype("float16"): "float16",
    np.dtype("int64"): "int64", np.dtype("int32"): "int32", np.dtype("bool"): "bool",
}
_ONNX_TO_TYPE = {
    "tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16",
    "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(bool)": "bool", "tensor(string)": "string",
}


def _output_type(name: str, values: Any) -> str:
    array = np.asarray(values)
    if array.dtype == object:
        raise InvalidInput(
            f"ONNX output {name!r} is not a tensor (a map or sequence, e.g. scikit-learn's ZipMap); "
            "convert the model with options={'zipmap': False}"
        )
    base = _NUMPY_TO_TYPE.get(array.dtype)
    if base is None:
        raise InvalidInput(f"ONNX output {name!r} has dtype {array.dtype}, which bundles do not support")
    if array.ndim == 1 or (array.ndim == 2 and array.shape[1] == 1):
        return base
    if array.ndim == 2:
        return f"fixed_size_list<{base}>[{array.shape[1]}]"
    raise InvalidInput(f"ONNX output {name!r} has {array.ndim} dimensions; bundles hold one row per example")


def infer_onnx_signature(
    onnx_file: str | Path, sample: pa.Table, exclude: Sequence[str] = ()
) -> tuple[Signature, dict[str, Any]]:
    """Work out an ONNX model's signature and tensor bindings from sample data, and check them.

    The ONNX inputs are fed from the sample's columns of the same names, or, for one
    2-D input, from every sample column not in ``exclude``, stacked in order. The
    model is then run on the first rows; their outputs give the output columns.

    Raises:
        InvalidInput: the sample cannot feed the model, or an output is not a tensor.
    """
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise RuntimeUnavailable("inferring a signature runs the model: pip install 'shardline[cpu]'") from e
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    onnx_inputs = session.get_inputs()
    columns = [c for c in sample.column_names if c not in set(exclude)]
    head = sample.slice(0, min(16, sample.num_rows))
    config: dict[str, Any] = {}
    if all(i.name in columns for i in onnx_inputs):
        inputs = [ColumnSpec(name=i.name, type=_ONNX_TO_TYPE.get(i.type, "float32")) for i in onnx_inputs]
    elif len(onnx_inputs) == 1 and len(onnx_inputs[0].shape) == 2:
        only = onnx_inputs[0]
        width = only.shape[1]
        if isinstance(width, int) and width != len(columns):
            raise InvalidInput(
                f"the ONNX input {only.name!r} takes {width} features per row, the sample has {len(columns)} "
                f"columns besides {list(exclude)} ({columns[:5]}...); exclude the label and id columns with "
                "--exclude, or give data with exactly those features"
            )
        dtype = _ONNX_TO_TYPE.get(only.type, "float32")
        inputs = [ColumnSpec(name=c, type=dtype) for c in columns]
        config["tensor_inputs"] = [{"name": only.name, "columns": columns, "dtype": dtype}]
    else:
        raise InvalidInput(
            f"the model's inputs are {[(i.name, i.shape) for i in onnx_inputs]}; name the sample's columns "
            "after them, or give one 2-D input fed by all feature columns"
        )
    for spec in inputs:
        got = sample.schema.field(spec.name).type
        if not is_compatible(got, parse_type(spec.type)):
            raise InvalidInput(f"sample column {spec.name!r} is {type_name(got)}, the model's input is {spec.type}")
    # A sample that holds NaN or infinity in a float column is data the model is meant to take
    # (a tree model's missing values): the column declares it, so neither tier refuses them.
    for name in non_finite_counts(sample, inputs):
        next(spec for spec in inputs if spec.name == name).non_finite = True
    feeds = {}
    for binding in config.get("tensor_inputs", []):
        feeds[binding["name"]] = np.column_stack([head.column(c).to_numpy() for c in binding["columns"]]).astype(binding["dtype"])
    for spec in inputs if not feeds else []:
        feeds[spec.name] = head.column(spec.name).to_numpy(zero_copy_only=False).astype(spec.type if spec.type != "string" else object)
    results = session.run(None, feeds)
    outputs = [ColumnSpec(name=o.name, type=_output_type(o.name, r)) for o, r in zip(session.get_outputs(), results)]
    return Signature(inputs=inputs, outputs=outputs), config


def package_onnx(
    onnx_file: str | Path,
    out_dir: str | Path,
    *,
    name: str,
    signature: Signature | None = None,
    sample: pa.Table | None = None,
    exclude: Sequence[str] = (),
    runtime_config: dict[str, Any] | None = None,
    lineage: Lineage | None = None,
    golden: GoldenSet | None = None,
    reference_profile: dict[str, Any] | None = None,
    image: str | None = None,
) -> Manifest:
    """Copy an ONNX file into a new bundle folder with its manifest.

    Give either ``signature`` (and ``runtime_config``) or ``sample`` data to infer
    and check them from.
    """
    if signature is None:
        if sample is None:
            raise InvalidSetting("give the model's signature or sample data to infer it from (--signature-from)")
        signature, inferred = infer_onnx_signature(onnx_file, sample, exclude)
        runtime_config = {**inferred, **(runtime_config or {})}
    out = new_bundle_dir(out_dir)
    shutil.copyfile(onnx_file, out / "model.onnx")
    manifest = Manifest(
        name=name,
        runtime="onnx",
        artifacts=[describe_artifact(out, "model.onnx")],
        signature=signature,
        runtime_config=runtime_config or {},
        environment=current_environment(image),
        lineage=lineage or Lineage(),
    )
    return finish_bundle(out, manifest, golden, reference_profile)


def package_sklearn(
    estimator: Any,
    out_dir: str | Path,
    *,
    name: str,
    feature_names: Sequence[str],
    lineage: Lineage | None = None,
    golden: GoldenSet | None = None,
    reference_profile: dict[str, Any] | None = None,
    image: str | None = None,
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
    onx = to_onnx(
        estimator,
        initial_types=[("X", FloatTensorType([None, len(features)]))],
        options={id(estimator): {"zipmap": False}} if is_classifier else None,
        target_opset=18,
    )
    inputs = [ColumnSpec(name=f, type="float32") for f in features]
    if is_classifier:
        outputs = [
            ColumnSpec(name="label", type="int64"),
            ColumnSpec(name="probabilities", type=f"fixed_size_list<float32>[{len(estimator.classes_)}]"),
        ]
        rename = {"label": "label", "probabilities": "probabilities"}
    else:
        outputs = [ColumnSpec(name="prediction", type="float32")]
        rename = {onx.graph.output[0].name: "prediction"}
    out = new_bundle_dir(out_dir)
    (out / "model.onnx").write_bytes(onx.SerializeToString())
    manifest = Manifest(
        name=name,
        runtime="onnx",
        artifacts=[describe_artifact(out, "model.onnx")],
        signature=Signature(inputs=inputs, outputs=outputs),
        runtime_config={
            "tensor_inputs": [{"name": "X", "columns": features, "dtype": "float32"}],
            "tensor_outputs": rename,
        },
        environment=current_environment(image),
        lineage=lineage or Lineage(),
        tags={"framework": "scikit-learn", "estimator": type(estimator).__name__},
    )
    return finish_bundle(out, manifest, golden, reference_profile)
