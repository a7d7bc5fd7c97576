"""Build bundles from trained models: an ONNX file, or a scikit-learn estimator (XGBoost, LightGBM and
PyTorch models: ``shardline.build.frameworks``).

A bundle carries the model, its signature (checked against sample data), the
environment that made it, lineage, and optionally a golden data set with the score
promotion demands and a reference data profile for drift checks. Bundles never hold
pickles. onnx, onnxruntime and skl2onnx are imported inside the builders.

Sample rows are taken as users hold them (``SampleRows``): a pyarrow Table, a pandas DataFrame or a
Parquet file's path; ``sample_table`` makes a Table of each (pandas is never imported here).
"""

from __future__ import annotations

import contextlib
import functools
import json
import platform
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Sequence, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardline.bundle import Evaluation, Lineage, Manifest, describe_artifact, write_manifest
from shardline.errors import InvalidBundle, InvalidInput, InvalidSetting, RuntimeUnavailable, first_line
from shardline.signature import (
    ColumnSpec,
    Signature,
    is_compatible,
    leaf_type,
    named_columns,
    row_shape,
    schema_problems,
    tensor_type_name,
    type_name,
    with_missing_values,
)

if TYPE_CHECKING:
    import pandas as pd

SampleRows: TypeAlias = "pa.Table | pd.DataFrame | str | Path"  # rows as users hold them: see sample_table

_RECORDED_PACKAGES = ("onnxruntime", "onnxruntime-gpu", "onnx", "scikit-learn", "skl2onnx", "pyarrow", "tokenizers",
                      "xgboost", "xgboost-cpu", "lightgbm", "onnxmltools", "torch")
GOLDEN_FILE = "golden.parquet"
RESCALE_ADVICE = ("subtract a constant from that column (e.g. its minimum) or rescale it before the model, fit again and "
                  "package that")
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


def sample_table(rows: SampleRows, what: str = "the sample") -> pa.Table:
    """Rows as a pyarrow Table, from what users hold: a pyarrow Table (as it is), a pandas DataFrame (its
    columns, not its index) or the path of a Parquet file (str or Path).

    Args:
        rows: the rows.
        what: how an error names them (``the sample``, ``--signature-from``).

    Raises:
        InvalidInput: anything else (naming the type got), a file Parquet cannot read, or a DataFrame
            column Arrow cannot hold.
    """
    if isinstance(rows, pa.Table):
        return rows
    if isinstance(rows, (str, Path)):
        try:
            return pq.read_table(rows)
        except FileNotFoundError as e:
            raise InvalidInput(f"{what}: there is no file {rows}; give the path of a Parquet file of the rows") from e
        except (OSError, ValueError) as e:  # pyarrow's errors are OSErrors or ValueErrors (ArrowInvalid: not Parquet)
            raise InvalidInput(f"{what} {rows} cannot be read as Parquet ({first_line(e)}); give the path of a "
                               "Parquet file of the rows") from e
    pandas = sys.modules.get("pandas")  # a DataFrame exists only once pandas is imported: never import it here
    if pandas is not None and isinstance(rows, pandas.DataFrame):
        try:
            return pa.Table.from_pandas(rows, preserve_index=False)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            why = "; ".join(str(a) for a in e.args)  # pyarrow adds the column's name as a second argument
            raise InvalidInput(f"{what}, a pandas DataFrame, has a column Arrow cannot hold ({why}); give each "
                               "column one type: numbers or strings") from e
    got = type(rows)
    shown_type = got.__qualname__ if got.__module__ == "builtins" else f"{got.__module__}.{got.__qualname__}"
    hint = (" (a numpy array has no column names: give pandas.DataFrame(X, columns=names))"
            if got.__module__ == "numpy" else "")
    raise InvalidInput(f"{what} is a {shown_type}; give a pandas DataFrame, a pyarrow Table or the path of a "
                       f"Parquet file (str or pathlib.Path){hint}")


def feature_columns(sample: pa.Table, exclude: Sequence[str]) -> list[str]:
    """The sample's columns less ``exclude`` (its label and id columns), in order.

    Raises:
        InvalidInput: ``exclude`` names a column the sample does not have (a typo would leave the label in).
    """
    unknown = [name for name in dict.fromkeys(exclude) if name not in sample.column_names]
    if unknown:
        from difflib import get_close_matches

        verb = "is not a column" if len(unknown) == 1 else "are not columns"
        close = [m for name in unknown for m in get_close_matches(name, sample.column_names, n=1)]
        meant = f"did you mean {named_columns(close)}? " if close else ""
        raise InvalidInput(f"--exclude {named_columns(unknown)} {verb} of the sample ({meant}columns: "
                           f"{named_columns(sample.column_names, 10)}); name the label and id columns as the "
                           "sample spells them")
    skipped = set(exclude)
    return [c for c in sample.column_names if c not in skipped]


def current_environment(image: str | None = None, packages: Sequence[str] = ()) -> dict[str, str]:
    """Python and the versions of the packages that shape a model's outputs, and of ``packages`` (and the
    image, if any)."""
    env = {"python": platform.python_version()}
    for package in (*_RECORDED_PACKAGES, *packages):
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
            meant = matching_output(golden, manifest.signature.outputs)
            raise InvalidInput(
                f"the golden set compares output {golden.prediction_column!r}, which the model does not have (its "
                f"outputs: {named_columns(manifest.signature.output_names)}); "
                + (f"pass --prediction {meant}, the output that holds its answers" if meant else
                   f"pass --prediction with the output that holds the answers {golden.label_column!r} is compared with")
            )
        if golden.table.num_rows == 0:
            raise InvalidInput("the golden set has no rows; a score needs at least one")
        # promotion scores the model on it (quality/evaluation.py checks the same): refused here, not at the gate
        problems = schema_problems(golden.table.schema, manifest.signature.inputs, manifest.reference)
        if problems:
            raise InvalidInput(f"the golden set cannot feed the model: {'; '.join(problems)} (a golden set holds "
                               "the model's input columns, as its signature names them, and the label)")
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


def matching_output(golden: GoldenSet, outputs: Sequence[ColumnSpec]) -> str | None:
    """The model output a golden set means when the model has no ``prediction_column``: the one output named like
    it (skl2onnx's ``output_label`` for ``label``), else the one of the metric's kind (a scalar label for accuracy,
    a scalar float for rmse, a vector for cosine_min), else the model's only output; None when no one output is."""
    asked = golden.prediction_column.lower()
    for found in ([o for o in outputs if asked in o.name.lower()],
                  [o for o in outputs if _answers_like(o, golden.metric)], list(outputs)):
        if len(found) == 1:
            return found[0].name
    return None


def _answers_like(output: ColumnSpec, metric: str) -> bool:
    dtype = output.arrow_type
    if metric == "cosine_min":
        return bool(row_shape(dtype))
    if row_shape(dtype):
        return False
    return pa.types.is_floating(dtype) == (metric == "rmse")


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
    "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int16)": "int16", "tensor(int8)": "int8",
    "tensor(uint64)": "uint64", "tensor(uint32)": "uint32", "tensor(uint16)": "uint16", "tensor(uint8)": "uint8",
    "tensor(bool)": "bool", "tensor(string)": "string",
}
_SAMPLE_ROWS = 16  # rows of the sample the model is run on to learn (and check) its outputs


def _output_type(name: str, values: Any) -> str:
    array = np.asarray(values)
    if array.dtype.kind in "OU" and array.size and all(isinstance(v, str) for v in array.flat):
        if array.ndim == 1 or (array.ndim == 2 and array.shape[1] == 1):
            return "string"  # a classifier's labels, when it was trained on strings
        raise InvalidInput(f"ONNX output {name!r} holds several strings a row; bundles hold one string per row")
    if array.dtype == object:
        raise InvalidInput(
            f"ONNX output {name!r} is not a tensor (a map or sequence); export it as a tensor of one value or one "
            "vector a row (scikit-learn's ZipMap is unwrapped when onnx is installed: pip install "
            "'shardline[package]'; or convert the model with options={'zipmap': False})"
        )
    base = _NUMPY_TO_TYPE.get(array.dtype)
    if base is None:
        raise InvalidInput(f"ONNX output {name!r} has dtype {array.dtype}, which bundles do not support; "
                           "cast it in the graph to float32, float64, int32, int64 or bool")
    if array.ndim == 1 or (array.ndim == 2 and array.shape[1] == 1):
        return base
    if array.ndim == 2:
        return f"fixed_size_list<{base}>[{array.shape[1]}]"
    raise InvalidInput(f"ONNX output {name!r} has {array.ndim} dimensions; bundles hold one value or one vector "
                       "per row: reshape it to [N, k] in the graph")


def _session(onnx_file: str | Path) -> Any:
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise RuntimeUnavailable("inferring a signature runs the model: pip install 'shardline[cpu]'") from e
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a model it cannot load is said below, in one line: not also in its own log
    try:
        return ort.InferenceSession(str(onnx_file), sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types for an unreadable file
        from shardline.runtimes.onnx import locale_hint

        hint = locale_hint(e)
        if hint is not None:
            raise InvalidInput(f"onnxruntime cannot load {onnx_file}: {hint}") from e
        raise InvalidInput(f"{onnx_file} is not an ONNX model onnxruntime loads ({e}); give the .onnx file") from e


def _value_type(info: Any) -> str:
    """The signature type of one value of an ONNX input."""
    base = _ONNX_TO_TYPE.get(info.type)
    if base is None:
        raise InvalidInput(f"ONNX input {info.name!r} is {info.type}, which bundles do not support; "
                           f"export it as one of {sorted(set(_ONNX_TO_TYPE.values()))}")
    return base


def _shape(info: Any) -> list[int]:
    """An ONNX input's shape as V2 metadata writes it: -1 where the graph names or omits a dimension."""
    return [d if isinstance(d, int) and d >= 0 else -1 for d in info.shape or []]


def _row_dims(info: Any) -> list[int | None]:
    """An ONNX input's dimensions after the batch one (None where the graph names or omits it).

    Raises:
        InvalidInput: the graph declares no rank, or a fixed batch dimension.
    """
    shape = list(info.shape or [])
    if not shape:
        raise InvalidInput(f"ONNX input {info.name!r} declares no shape; give sample rows (--signature-from) "
                           "or export the model with input shapes")
    _check_dynamic_batch(info)
    return [d if isinstance(d, int) and d >= 0 else None for d in shape[1:]]


def _check_dynamic_batch(info: Any) -> None:
    """Refuse an ONNX input whose first dimension is a fixed number (a graph exported for that many rows): checked
    before the model is run on sample rows, whose own error would not say so.

    Raises:
        InvalidInput: saying how to export it with a dynamic first dimension.
    """
    shape = list(info.shape or [])
    if shape and isinstance(shape[0], int) and shape[0] > 0:
        raise InvalidInput(
            f"ONNX input {info.name!r} has shape {shape}, a fixed batch of {shape[0]}; both tiers feed a model "
            "any number of rows: export it with a dynamic first dimension (skl2onnx: [None, k]; torch.onnx.export: "
            "dynamic_axes={'" + str(info.name) + "': {0: 'batch'}})"
        )


def _declared_input(info: Any) -> ColumnSpec:
    """The column an ONNX input is fed from, from the graph's own type and shape (no sample)."""
    base, dims = _value_type(info), _row_dims(info)
    if dims == [1]:
        return ColumnSpec(name=info.name, type=base)
    if any(d is None for d in dims[:-1]):
        raise InvalidInput(f"ONNX input {info.name!r} has shape {_shape(info)}, with a varying dimension before the "
                           "last; give sample rows (--signature-from) with the column as the model reads it")
    return ColumnSpec(name=info.name, type=tensor_type_name(base, [-1 if d is None else d for d in dims]))


def _sample_input(info: Any, got: pa.DataType) -> ColumnSpec:
    """The column an ONNX input is fed from, by the sample's same-named column; refused if it cannot feed it."""
    rows = row_shape(got)
    base, dims = _value_type(info), _row_dims(info) if info.shape else [None] * len(rows)
    if dims == [1] and not rows:
        dims = []
    if len(rows) != len(dims):
        if dims:
            want = tensor_type_name(base, [-1 if d is None else d for d in dims])
            raise InvalidInput(
                f"sample column {info.name!r} is {type_name(got)}, the model's input {info.name!r} has shape "
                f"{_shape(info)} ({'x'.join(str(d or 'k') for d in dims)} {base} values per row): give it as one "
                f"{want} column, a list per row (pyarrow: pa.FixedSizeListArray.from_arrays(values, "
                f"{dims[-1] or 'k'}))"
            )
        raise InvalidInput(f"sample column {info.name!r} is {type_name(got)}, the model's input {info.name!r} takes "
                           f"one {base} value per row (shape {_shape(info)}): give a {base} column")
    for d, r in zip(dims, rows):
        if d is not None and r != d:
            raise InvalidInput(
                f"sample column {info.name!r} is {type_name(got)}, the model's input {info.name!r} has shape "
                f"{_shape(info)}: give rows of {d} values ({tensor_type_name(base, [x or -1 for x in dims])})"
            )
    spec = ColumnSpec(name=info.name, type=tensor_type_name(base, [d if d is not None else r for d, r in zip(dims, rows)]))
    if not is_compatible(got, spec.arrow_type):
        raise InvalidInput(f"sample column {info.name!r} is {type_name(got)}, the model's input {info.name!r} is "
                           f"{spec.type}: cast the column to {spec.type}")
    return spec


def _stacked_inputs(only: Any, sample: pa.Table, columns: list[str], exclude: Sequence[str]) -> tuple[list[ColumnSpec], dict[str, Any]]:
    """One 2-D ONNX input fed by every feature column of the sample, stacked in order."""
    width = only.shape[1]
    if isinstance(width, int) and width != len(columns):
        raise InvalidInput(
            f"the ONNX input {only.name!r} takes {width} features per row, the sample has {len(columns)} "
            f"columns besides {list(exclude)} ({columns[:5]}...); exclude the label and id columns with "
            f"--exclude, give data with exactly those features, or give them as one fixed_size_list column "
            f"named {only.name!r}"
        )
    dtype = _value_type(only)
    inputs = [ColumnSpec(name=c, type=dtype) for c in columns]
    for spec in inputs:
        got = sample.schema.field(spec.name).type
        if not is_compatible(got, spec.arrow_type):
            raise InvalidInput(f"sample column {spec.name!r} is {type_name(got)}, the model's input {only.name!r} "
                               f"stacks {dtype} features: cast it to {dtype}, or exclude it with --exclude")
    return inputs, {"tensor_inputs": [{"name": only.name, "columns": columns, "dtype": dtype}]}


def _numpy_type(spec: ColumnSpec) -> np.dtype:
    leaf = leaf_type(spec.arrow_type)
    return np.dtype(object) if pa.types.is_string(leaf) or pa.types.is_large_string(leaf) else np.dtype(leaf.to_pandas_dtype())


def _run_outputs(session: Any, feeds: dict[str, np.ndarray], where: str) -> list[ColumnSpec]:
    """Run the model once and read its output columns from what it gives."""
    try:
        results = session.run(None, feeds)
    except Exception as e:  # onnxruntime's own exception types
        raise InvalidInput(f"the model does not run on {where} ({e}); check the rows against its inputs "
                           f"{[(i.name, i.type, i.shape) for i in session.get_inputs()]}") from e
    return [ColumnSpec(name=o.name, type=_output_type(o.name, r)) for o, r in zip(session.get_outputs(), results)]


InputLayout = Literal["columns", "tensor"]
"""How V2 clients send a model of one ``[N, k]`` input packaged from k feature columns: one ``[N]`` tensor per
column (``columns``, the default), or the model's own ``[N, k]`` tensor (``tensor``, as Triton shows the ONNX
file). Either way the bundle's rows are the k columns: batch shards, capture and profiles hold those."""
INPUT_LAYOUTS: tuple[InputLayout, ...] = ("columns", "tensor")


def infer_onnx_signature(
    onnx_file: str | Path, sample: pa.Table, exclude: Sequence[str] = (), input_layout: InputLayout = "columns"
) -> tuple[Signature, dict[str, Any]]:
    """Work out an ONNX model's signature and tensor bindings from sample data, and check them.

    Each ONNX input is fed from the sample's column of the same name (a
    ``fixed_size_list<T>[k]`` column for an input ``[N, k]``, nested for more
    dimensions); or, for one 2-D input that no column is named after, from every sample
    column not in ``exclude``, stacked in order (with ``input_layout="tensor"``, V2 clients
    then send that input itself, ``[N, k]``: the signature's ``input_tensor``). The model
    is then run on the first rows; their outputs give the output columns.

    Raises:
        InvalidInput: the sample cannot feed the model (saying how to make it), or an output is not a tensor.
        InvalidSetting: ``input_layout`` is not one of ``INPUT_LAYOUTS``, or "tensor" for features not all floats.
    """
    check_input_layout(input_layout)
    session = _session(onnx_file)
    onnx_inputs = session.get_inputs()
    for info in onnx_inputs:
        _check_dynamic_batch(info)
    columns = feature_columns(sample, exclude)
    head = sample.slice(0, min(_SAMPLE_ROWS, sample.num_rows))
    config: dict[str, Any] = {}
    if all(i.name in columns for i in onnx_inputs):
        inputs = [_sample_input(i, sample.schema.field(i.name).type) for i in onnx_inputs]
    elif len(onnx_inputs) == 1 and len(onnx_inputs[0].shape or []) == 2:
        inputs, config = _stacked_inputs(onnx_inputs[0], sample, columns, exclude)
    else:
        missing = [i.name for i in onnx_inputs if i.name not in columns]
        raise InvalidInput(
            f"the model's inputs are {[(i.name, _shape(i)) for i in onnx_inputs]}; the sample has no column "
            f"{missing}: name one column after each input (a fixed_size_list<T>[k] column for an input [N, k]), "
            "or package from the ONNX file alone (leave out --signature-from)"
        )
    # A sample that holds NaN, infinity or nulls in a float column is data the model is meant to take (a tree
    # model's missing values): the column declares it, so neither tier refuses them.
    inputs = with_missing_values(sample, inputs)
    from shardline.runtimes.onnx import column_tensor

    feeds = {}
    for binding in config.get("tensor_inputs", []):
        feeds[binding["name"]] = np.column_stack([head.column(c).to_numpy() for c in binding["columns"]]).astype(binding["dtype"])
    for info, spec in zip(onnx_inputs, inputs) if not feeds else []:
        feeds[info.name] = column_tensor(head.column(spec.name), _numpy_type(spec), len(info.shape or []))
    outputs = _run_outputs(session, feeds, f"the sample's first {head.num_rows} rows")
    stacked = config.get("tensor_inputs", [{}])[0].get("name") if input_layout == "tensor" else None
    return _signature(inputs, outputs, stacked), config


def check_input_layout(layout: str) -> None:
    """Raises InvalidSetting unless ``layout`` is one of ``INPUT_LAYOUTS``."""
    if layout not in INPUT_LAYOUTS:
        raise InvalidSetting(f"input layout {layout!r} is not one of {', '.join(INPUT_LAYOUTS)}: 'columns' (one V2 "
                             "input per feature column) or 'tensor' (the model's own [N, k] input)")


def _signature(inputs: Sequence[ColumnSpec], outputs: Sequence[ColumnSpec], input_tensor: str | None) -> Signature:
    """The signature; with ``input_tensor``, the stacked inputs taken as that one tensor (refused unless floats).

    Raises:
        InvalidSetting: the signature's own check refused ``input_tensor``, with its message.
    """
    from pydantic import ValidationError

    if input_tensor is None:
        return Signature(inputs=tuple(inputs), outputs=tuple(outputs))
    try:
        return Signature(inputs=tuple(inputs), outputs=tuple(outputs), input_tensor=input_tensor)
    except ValidationError as e:
        why = "; ".join(str(error["msg"]).removeprefix("Value error, ") for error in e.errors())
        raise InvalidSetting(f"the input layout 'tensor' does not apply: {why}; leave the layout at 'columns'") from e


def onnx_signature(onnx_file: str | Path) -> Signature:
    """An ONNX model's signature from the file alone, as Triton's auto-complete makes it: each input a column
    of its name, typed from the graph's input type and shape (``[N]``: a primitive column, ``[N, k]``:
    ``fixed_size_list<T>[k]``, ``[N, k]`` with k unnamed: ``list<T>``); the outputs from running the model on
    two rows of zeros (so they are checked to be tensors, as from sample data).

    Raises:
        InvalidInput: an input's type or shape cannot be a column (saying what to do), or the model does not run.
    """
    session = _session(onnx_file)
    inputs = [_declared_input(i) for i in session.get_inputs()]
    feeds = {}
    for info, spec in zip(session.get_inputs(), inputs):
        dims = [2, *[max(d, 1) for d in row_shape(spec.arrow_type)]]
        if len(info.shape) == 2 and not row_shape(spec.arrow_type):
            dims.append(1)  # an input [N, 1] fed by a primitive column
        dtype = _numpy_type(spec)
        feeds[info.name] = np.full(dims, "", dtype=object) if dtype == np.dtype(object) else np.zeros(dims, dtype)
    return Signature(inputs=tuple(inputs), outputs=tuple(_run_outputs(session, feeds, "two rows of zeros")))


def unwrap_zipmaps(onnx_file: str | Path) -> tuple[bytes, list[str]] | None:
    """The model with each ZipMap that makes a graph output taken out, and a line for each saying what became of it;
    None when it has none, or when onnx (``shardline[package]``) is not installed to rewrite it.

    A classifier converted by skl2onnx with its defaults answers its probabilities through a ZipMap: a map of class
    to probability a row, which is neither a column nor a V2 tensor. The map's own input, the ``[N, classes]``
    probability tensor in the order of the ZipMap's class labels, becomes the output under the same name, as
    ``options={'zipmap': False}`` would have converted it (there it is named ``probabilities``).
    """
    try:
        import onnx
        from onnx import helper
    except ImportError:
        return None
    try:  # its weights stay where they are until it is rewritten
        model = onnx.load(str(onnx_file), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError, or onnx's own for a file it cannot read
        raise InvalidInput(f"{onnx_file} is not an ONNX model ({first_line(e)}); give the .onnx file the "
                           "framework's ONNX export wrote") from e
    graph = model.graph
    outputs = {output.name: output for output in graph.output}
    if not any(n.op_type == "ZipMap" and n.domain == "ai.onnx.ml" and n.output[0] in outputs for n in graph.node):
        return None
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer):
        return None  # weights in files beside it, which a rewritten copy would lose (converted classifiers have none)
    notes = []
    for index, node in enumerate(list(graph.node)):
        if node.op_type != "ZipMap" or node.domain != "ai.onnx.ml" or node.output[0] not in outputs:
            continue
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        labels = [v.decode() if isinstance(v, bytes) else v for v in
                  attributes.get("classlabels_strings") or attributes.get("classlabels_int64s") or []]
        graph.node.remove(node)
        graph.node.insert(index, helper.make_node("Identity", [node.input[0]], [node.output[0]],
                                                  name=f"{node.name or node.output[0]}_unwrapped"))
        output = outputs[node.output[0]]
        output.type.CopyFrom(helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, [None, len(labels) or None]))
        shown_labels = ", ".join(map(str, labels[:10])) + (f" and {len(labels) - 10} more" if len(labels) > 10 else "")
        notes.append(f"output {output.name!r} was a ZipMap (a map a row): packaged as its probability tensor, "
                     f"a column a class in the order {shown_labels}")
    return (model.SerializeToString(), notes) if notes else None


_PICKLE_SUFFIXES = frozenset({".pkl", ".pickle", ".joblib"})


def is_pickle(path: Path, *, sniff: bool = False) -> bool:
    """Whether a file is named as a pickle (``.pkl``, ``.pickle``, ``.joblib``; compressed too: ``.pkl.gz``); with
    ``sniff``, also whether it is one whatever its name: it begins as a pickle does (protocol 2 to 5: ``0x80``, the
    protocol, then opcodes that parse: a safetensors file whose header is 640 bytes long begins ``80 02`` too, and
    its next byte is no opcode), or it is a zip archive holding one (``torch.save``'s ``.pt``, ``.pth``, ``.bin``:
    ``archive/data.pkl``)."""
    if any(suffix in _PICKLE_SUFFIXES for suffix in path.suffixes):
        return True
    if not sniff or not path.is_file():
        return False
    with open(path, "rb") as f:
        head = f.read(4096)
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return _opcodes_parse(head)
    if head[:4] == b"PK\x03\x04" and zipfile.is_zipfile(path):
        with contextlib.suppress(zipfile.BadZipFile, OSError):
            with zipfile.ZipFile(path) as archive:
                return any(any(n.endswith(s) for s in _PICKLE_SUFFIXES) for n in archive.namelist())
    return False


def _opcodes_parse(head: bytes, enough: int = 3) -> bool:
    """Whether the bytes begin with ``enough`` pickle opcodes (or are a whole short pickle)."""
    import pickletools

    parsed = 0
    try:
        for _ in pickletools.genops(head):
            parsed += 1
            if parsed >= enough:
                return True
    except ValueError:  # an unknown opcode: not a pickle
        return False
    except Exception:  # the head ended inside an opcode's argument, after some parsed
        return parsed >= 2
    return parsed >= 2


def package_onnx(
    onnx_file: str | Path,
    out_dir: str | Path,
    *,
    name: str,
    signature: Signature | None = None,
    sample: SampleRows | None = None,
    exclude: Sequence[str] = (),
    runtime_config: dict[str, Any] | None = None,
    lineage: Lineage | None = None,
    golden: GoldenSet | None = None,
    reference_profile: dict[str, Any] | None = None,
    image: str | None = None,
    input_layout: InputLayout = "columns",
    notes: list[str] | None = None,
) -> Manifest:
    """Copy an ONNX file into a new bundle folder with its manifest.

    Give ``signature`` (and ``runtime_config``), or ``sample`` data to infer and check them
    from (a pyarrow Table, a pandas DataFrame or a Parquet file's path: ``sample_table``), or
    neither: the signature is then the model's own (``onnx_signature``, whose inputs V2 clients send as
    the model's own tensors). ``input_layout`` applies to a signature inferred from feature columns
    (``infer_onnx_signature``). A ZipMap output is unwrapped into its probability tensor (``unwrap_zipmaps``);
    ``notes`` gets a line for each such change to the file.
    """
    check_input_layout(input_layout)
    if is_pickle(Path(onnx_file), sniff=True):
        raise InvalidInput(f"{onnx_file} is a pickle, which bundles never hold (loading one runs its code); export "
                           "the model to ONNX (scikit-learn: skl2onnx's to_onnx; PyTorch: torch.onnx.export) and "
                           "package the .onnx file")
    with tempfile.TemporaryDirectory(prefix="shardline-package-") as scratch:
        unwrapped = unwrap_zipmaps(onnx_file)
        if unwrapped is not None:
            onnx_file = Path(scratch) / "model.onnx"
            onnx_file.write_bytes(unwrapped[0])
            if notes is not None:
                notes.extend(unwrapped[1])
        if signature is None:
            if sample is None:
                signature = onnx_signature(onnx_file)
            else:
                signature, inferred = infer_onnx_signature(onnx_file, sample_table(sample), exclude, input_layout)
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


def _probe(estimator: Any, rows: pa.Table | None, features: Sequence[str], texts: Sequence[str], dtype: np.dtype
           ) -> tuple[dict[str, np.ndarray], Any]:
    """Rows a converted model is run on to learn the layout of its outputs (the sample's first, else random ones):
    the ONNX feeds, and the same rows as scikit-learn is given them (``sklearn_check.given_rows``)."""
    if rows is None:
        probe = np.random.default_rng(0).normal(size=(_SAMPLE_ROWS, len(features))).astype(dtype)
        return {"X": probe}, probe.astype(np.float64)
    from shardline.build.sklearn_check import given_rows

    head = rows.slice(0, min(_SAMPLE_ROWS, rows.num_rows))
    if not texts:
        probe = given_rows(head, features, _SAMPLE_ROWS, estimator)
        return {"X": probe.astype(dtype)}, probe
    from shardline.runtimes.onnx import column_tensor

    feeds = {f: column_tensor(head.column(f), np.dtype(object) if f in texts else dtype, 2) for f in features}
    return feeds, given_rows(head, features, _SAMPLE_ROWS, estimator)


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
    input_layout: InputLayout = "columns",
    sample: SampleRows | None = None,
) -> Manifest:
    """Convert a fitted scikit-learn classifier or regressor to ONNX and bundle it.

    Classifiers yield ``label`` (int64, or string for a classifier fitted on string classes) and
    ``probabilities`` (one float32 per class); a classifier without ``predict_proba`` (``LinearSVC``,
    ``RidgeClassifier``, ``SVC`` without ``probability=True``) yields ``label`` and ``scores``, its
    ``decision_function`` (float32 for two classes, one float32 per class for more; ``sklearn_check.decision_scores``);
    regressors yield ``prediction`` (float32). Features are float32 columns; with
    ``input_layout="tensor"`` V2 clients send them as the model's one input ``X``, ``[N, k]``.

    With ``sample`` (rows holding the feature columns: ``sample_table``), the bundle is checked as the
    framework builders' are (``shardline.build.sklearn_check``): its answers on the sample's first rows must
    match scikit-learn's on those rows as given (float64), else nothing is written. The float32 bundle is tried
    first; where its answers differ, the features are float64 columns instead, when skl2onnx converts the model
    so; else it is refused, naming the column where rounding the rows to float32 changes scikit-learn's own
    answers (a column such as a Unix timestamp, large next to its spread). Where the sample holds a feature as text
    (a pipeline's categories: a ``OneHotEncoder`` in a ``ColumnTransformer``), each feature is an input of its
    own, ``[N, 1]`` as skl2onnx maps a ``ColumnTransformer``'s columns, float32 (or float64) and ``string``
    columns. Without ``sample`` nothing is checked, and the features are numbers. skl2onnx's converters are
    mended first where its release fails on a model it supports (``skl2onnx_mends``).

    Raises:
        InvalidInput: the sample lacks a feature, float32 loses the answer and the model does not convert (skl2onnx)
            or run (onnxruntime) with float64 inputs, or the bundle's answers differ from scikit-learn's.
        InvalidSetting: ``input_layout="tensor"`` for features that include text.
    """
    check_input_layout(input_layout)
    try:
        import skl2onnx  # noqa: F401 - installed, or the one line saying how
    except ImportError as e:
        raise RuntimeUnavailable(
            "packaging a scikit-learn model needs skl2onnx; pip install 'shardline[package]'"
        ) from e
    from shardline.build.frameworks import _features
    from shardline.build.skl2onnx_mends import mend_skl2onnx
    from shardline.build.sklearn_check import float32_loss, plain_text, text_features

    mend_skl2onnx()
    features = list(feature_names)
    rows = sample_table(sample) if sample is not None else None

    texts = text_features(rows, features) if rows is not None else []
    if rows is not None and texts:
        rows = plain_text(rows, texts)
    if texts and input_layout == "tensor":
        raise InvalidSetting(f"input_layout 'tensor' stacks float features into one [N, k] input; columns "
                             f"{named_columns(texts)} hold text: leave input_layout at 'columns'")
    bundle = functools.partial(_sklearn_bundle, estimator, out_dir, features, rows, texts, name=name, lineage=lineage,
                               golden=golden, reference_profile=reference_profile, image=image,
                               input_layout=input_layout)
    if rows is None:
        return bundle(None)
    _features(None, rows, features)  # every feature is in the sample, or InvalidInput naming the missing ones
    # float32 first, checked against scikit-learn on the rows as given, then float64. float32_loss (scikit-learn's own
    # answers moving on rows rounded to float32) is a proxy both ways: skl2onnx rounds a tree's thresholds so that
    # float32 features split as the rows as given do (HistGradientBoosting's answers on rounded rows move, the float32
    # bundle's do not), and a graph computing in float32 can lose answers the rounding does not (a StandardScaler in
    # float32 before a forest's thresholds). So it is asked only where float32 failed, to name the column.
    try:
        return bundle(None)
    except Exception as e:  # noqa: BLE001 - a mismatch, or skl2onnx has no converter: float64's outcome decides
        float32_refusal = e
    lost = float32_loss(estimator, rows, features)
    try:
        return bundle(lost or "float32 features lose scikit-learn's answers on the sample")
    except Exception:
        if lost is None:  # float32 rows keep the answers: the float32 bundle's own refusal says what went wrong
            raise float32_refusal from None
        raise


def _sklearn_bundle(estimator: Any, out_dir: str | Path, features: list[str], rows: pa.Table | None,
                    texts: list[str], lost: str | None, *, name: str, lineage: Lineage | None, golden: GoldenSet | None,
                    reference_profile: dict[str, Any] | None, image: str | None, input_layout: InputLayout
                    ) -> Manifest:
    """``package_sklearn``'s bundle: float64 features where ``lost`` says why float32's lose the answers, else
    float32, and ``texts`` (the sample's text features) as strings; checked against scikit-learn on ``rows``
    where given (nothing is left on a refusal)."""
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import DoubleTensorType, FloatTensorType, StringTensorType

    from shardline.build.skl2onnx_mends import convertible
    from shardline.build.sklearn_check import check_sklearn, conversion_options, decision_scores

    dtype = "float64" if lost is not None else "float32"
    is_classifier = hasattr(estimator, "classes_")
    tensor_type = DoubleTensorType if lost is not None else FloatTensorType
    # Text features (a pipeline's categories, a ColumnTransformer selecting columns by name): one [N, 1] input a
    # column, named after it, as skl2onnx maps a ColumnTransformer's columns; else one [N, k] input X of floats.
    initial_types = ([(f, (StringTensorType if f in texts else tensor_type)([None, 1])) for f in features] if texts
                     else [("X", tensor_type([None, len(features)]))])
    converted = convertible(estimator)
    try:
        onx = to_onnx(
            converted,
            initial_types=initial_types,
            options=conversion_options(converted),
            target_opset=18,
        )
    except Exception as e:  # noqa: BLE001 - skl2onnx raises many kinds for an operator it has no double kernel for
        if lost is None:
            raise
        raise InvalidInput(f"{lost}, and skl2onnx cannot convert {type(estimator).__name__} with float64 inputs "
                           f"({type(e).__name__}: {first_line(e)}); {RESCALE_ADVICE}") from e
    inputs = [ColumnSpec(name=f, type="string" if f in texts else dtype) for f in features]
    if is_classifier:
        # skl2onnx gives the label the classes' type: text classes are a string tensor (an int64 label refused every
        # row: "Failed to parse string: 'virginica' as a scalar of type int64")
        label = "string" if np.asarray(estimator.classes_).dtype.kind in "OUS" else "int64"
        outputs = [ColumnSpec(name="label", type=label)]
        rename = {onx.graph.output[0].name: "label"}
        if hasattr(estimator, "predict_proba"):
            classes = len(estimator.classes_)
            outputs.append(ColumnSpec(name="probabilities", type=f"fixed_size_list<float32>[{classes}]"))
            rename[onx.graph.output[1].name] = "probabilities"
        else:  # LinearSVC, RidgeClassifier, ...: scikit-learn's decision_function, where the conversion gives it
            scores = decision_scores(onx, estimator, *_probe(estimator, rows, features, texts, np.dtype(dtype)))
            if scores is not None:
                outputs.append(ColumnSpec(name="scores", type=scores))
                rename["scores"] = "scores"
    else:
        outputs = [ColumnSpec(name="prediction", type="float32")]
        rename = {onx.graph.output[0].name: "prediction"}
    out = new_bundle_dir(out_dir)
    (out / "model.onnx").write_bytes(onx.SerializeToString())
    manifest = Manifest(
        name=name,
        runtime="onnx",
        artifacts=[describe_artifact(out, "model.onnx")],
        signature=_signature(inputs, outputs, "X" if input_layout == "tensor" else None),
        runtime_config={  # with text features, each input is fed from its column by name
            **({} if texts else {"tensor_inputs": [{"name": "X", "columns": features, "dtype": dtype}]}),
            "tensor_outputs": rename,
        },
        environment=current_environment(image),
        lineage=lineage or Lineage(),
        tags={"framework": "scikit-learn", "estimator": type(estimator).__name__},
    )
    if rows is None:
        return finish_bundle(out, manifest, golden, reference_profile)
    try:
        done = finish_bundle(out, manifest, golden, reference_profile)
        check_sklearn(out, done, estimator, rows, features)
    except InvalidBundle as e:  # onnxruntime has no float64 kernel for one of its ops (SVMRegressor)
        shutil.rmtree(out, ignore_errors=True)
        if lost is None:
            raise
        raise InvalidInput(f"{lost}, and onnxruntime cannot run {type(estimator).__name__} converted with float64 "
                           f"inputs ({first_line(e)}); {RESCALE_ADVICE}") from e
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return done
