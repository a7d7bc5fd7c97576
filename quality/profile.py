"""Reference data profiles: a compact summary of a table, for drift checks, contracts and gates.

Per column: its type, ``kind`` (numeric or categorical), null rate (NaN counts as
null) and, for numbers, min/max/mean/std, quantiles, a 99-point quantile sketch
(``sketch``: edges at the 1st..99th percentiles and the reference CDF at each) and
PSI bins (``bins``: edges at the deciles and the reference share in each of the 11
bins, the outer two open-ended); for strings, booleans and integers with few
values, the category shares (``top``, the rest in ``other``); for free text (a
string column whose values are mostly distinct), ``kind`` "text" and the numeric
profile of its lengths in characters (``length``). An integer column whose values
are all distinct is ``kind`` "id" (row ids: not judged for drift). Edges are rounded to
6 significant digits and the shares counted against the rounded edges, so current
data binned on the same edges compares exactly. A profile is a few KB whatever the
table's size.

``reference_profile`` also runs the bundle's model on the data and profiles each
output (``outputs``; an element of a short fixed-size list, such as a class
probability, is its own column ``name[i]``). ``attach_reference_profile`` stores it
in a bundle folder that is not pushed yet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardline.bundle import Manifest, read_manifest
from shardline.errors import InvalidInput
from shardline.signature import type_name

PROFILE_FORMAT = 2
QUANTILES = [0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0]
SKETCH_POINTS = np.round(np.arange(1, 100) / 100, 2)  # 0.01 .. 0.99; the deciles are every 10th
TOP_VALUES = 50
# Integer columns with at most this many distinct values are profiled as categories (labels, codes).
MAX_INTEGER_CATEGORIES = 20
# A string column with more distinct values than this (and than this share of its rows)
# is free text, not categories: its profile is the distribution of its lengths.
TEXT_MIN_DISTINCT = 5
TEXT_DISTINCT_SHARE = 0.5
# Fixed-size list outputs up to this length are profiled per element (class probabilities);
# longer ones (embeddings) are not profiled.
MAX_LIST_ELEMENTS = 8
PROFILE_BATCH_ROWS = 4096


def _round(values: np.ndarray) -> np.ndarray:
    return np.array([float(f"{v:.6g}") for v in values], dtype=np.float64)


def numeric_values(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A numeric column as float64 with nulls as NaN."""
    return np.asarray(pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64)


def _numeric(values: np.ndarray) -> dict[str, Any]:
    valid = np.sort(values[~np.isnan(values)])
    if len(valid) == 0:
        return {"kind": "numeric"}
    points = _round(np.quantile(valid, SKETCH_POINTS))
    sketch = np.unique(points)
    deciles = np.unique(points[9::10])  # a subset of the sketch's edges, by construction
    cdf = np.searchsorted(valid, sketch, side="right") / len(valid)
    below = np.searchsorted(valid, deciles, side="right") / len(valid)
    fractions = np.diff(np.concatenate([[0.0], below, [1.0]]))
    return {
        "kind": "numeric",
        "min": float(valid[0]),
        "max": float(valid[-1]),
        "mean": float(valid.mean()),
        "std": float(valid.std(ddof=1)) if len(valid) > 1 else 0.0,
        "quantiles": dict(zip([str(q) for q in QUANTILES], _round(np.quantile(valid, QUANTILES)).tolist())),
        "bins": {"edges": deciles.tolist(), "fractions": np.round(fractions, 5).tolist()},
        "sketch": {"edges": sketch.tolist(), "cdf": np.round(cdf, 4).tolist()},
    }


def _categorical(column: pa.ChunkedArray | pa.Array) -> dict[str, Any]:
    counts = pc.value_counts(pc.drop_null(column))
    pairs = sorted(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()), key=lambda p: -p[1])
    total = sum(c for _, c in pairs) or 1
    top = {str(v): round(c / total, 6) for v, c in pairs[:TOP_VALUES]}
    other = sum(c for _, c in pairs[TOP_VALUES:]) / total
    return {"kind": "categorical", "distinct": len(pairs), "top": top, "other": round(other, 6)}


def profile_column(column: pa.ChunkedArray | pa.Array) -> dict[str, Any]:
    """Profile one column (see the module docstring for the fields)."""
    rows = len(column)
    dtype = column.type
    entry: dict[str, Any] = {"type": type_name(dtype), "null_rate": column.null_count / rows if rows else 0.0}
    if pa.types.is_floating(dtype) or pa.types.is_integer(dtype) or pa.types.is_decimal(dtype):
        values = numeric_values(column)
        entry["null_rate"] = float(np.isnan(values).mean()) if rows else 0.0
        entry.update(_numeric(values))
        distinct = pc.count_distinct(column).as_py() if pa.types.is_integer(dtype) else 0
        if pa.types.is_integer(dtype) and distinct <= MAX_INTEGER_CATEGORIES:
            entry.update(_categorical(pc.cast(column, pa.string())))
        elif pa.types.is_integer(dtype) and distinct == rows - column.null_count:
            entry["kind"] = "id"  # every value distinct: row ids, not judged for drift
    elif pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        distinct, valid = pc.count_distinct(column).as_py(), rows - column.null_count
        if distinct > TEXT_MIN_DISTINCT and distinct > TEXT_DISTINCT_SHARE * valid:
            lengths = numeric_values(pc.utf8_length(column))
            entry.update({"kind": "text", "distinct": distinct, "length": _numeric(lengths)})
        else:
            entry.update(_categorical(pc.cast(column, pa.string())))
    elif pa.types.is_boolean(dtype):
        entry.update(_categorical(pc.cast(column, pa.string())))
    else:
        entry["kind"] = "other"
    return entry


def profile_table(table: pa.Table, columns: list[str] | None = None) -> dict[str, Any]:
    """Summarize the named columns (all by default) of a table."""
    summary: dict[str, Any] = {"format": PROFILE_FORMAT, "rows": table.num_rows, "columns": {}}
    for name in columns or table.column_names:
        summary["columns"][name] = profile_column(table.column(name))
    return summary


def expand_outputs(outputs: pa.Table) -> dict[str, tuple[pa.ChunkedArray, dict[str, Any]]]:
    """The output columns as profiled: short fixed-size lists split into ``name[i]``, long ones left out.

    Returns name -> (values, how to get them from the captured column: ``source``, ``index``).
    """
    expanded: dict[str, tuple[pa.ChunkedArray, dict[str, Any]]] = {}
    for name in outputs.column_names:
        column = outputs.column(name)
        if pa.types.is_fixed_size_list(column.type):
            if column.type.list_size > MAX_LIST_ELEMENTS:
                continue
            for i in range(column.type.list_size):
                values = pa.chunked_array([pc.list_element(chunk, i) for chunk in column.chunks], column.type.value_type)
                expanded[f"{name}[{i}]"] = (values, {"source": name, "index": i})
        elif pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            continue
        else:
            expanded[name] = (column, {"source": name})
    return expanded


def profile_outputs(outputs: pa.Table) -> dict[str, Any]:
    """Profile a model's output columns (as ``expand_outputs`` splits them)."""
    return {name: {**profile_column(values), **where} for name, (values, where) in expand_outputs(outputs).items()}


def _predict_all(bundle_dir: Path, manifest: Manifest, data: pa.Table) -> pa.Table:
    from shardline.runtimes import RuntimeOptions, create_runtime

    runtime = create_runtime(bundle_dir, manifest, RuntimeOptions(device="cpu"))
    runtime.load()
    try:
        inputs = data.select(manifest.signature.input_names)
        batches = [runtime.predict(b) for b in inputs.to_batches(max_chunksize=PROFILE_BATCH_ROWS)]
    finally:
        runtime.close()
    return pa.Table.from_batches(batches)


def reference_profile(bundle_dir: str | Path, data: pa.Table) -> dict[str, Any]:
    """Profile reference data (every column) and the outputs the bundle's model gives for it.

    Raises:
        InvalidInput: the data lacks a model input, or has no rows.
    """
    folder = Path(bundle_dir)
    manifest = read_manifest(folder)
    missing = [c for c in manifest.signature.input_names if c not in data.column_names]
    if missing or data.num_rows == 0:
        raise InvalidInput(
            f"the reference data for {manifest.reference} has {data.num_rows} rows and lacks inputs {missing}; "
            "give the training or golden rows, with every input column the model reads"
        )
    profile = profile_table(data)
    profile["outputs"] = profile_outputs(_predict_all(folder, manifest, data))
    return profile


def attach_reference_profile(bundle_dir: str | Path, data: pa.Table) -> Manifest:
    """Profile ``data`` and the model's outputs on it and store the profile in a bundle folder (before push).

    Replaces the bundle's profile artifact, if it had one, and rewrites its manifest.
    """
    from shardline.build.packaging import set_reference_profile

    profile = reference_profile(bundle_dir, data)
    return set_reference_profile(Path(bundle_dir), read_manifest(bundle_dir), profile)


def golden_reference_profile(bundle_dir: str | Path) -> dict[str, Any]:
    """The reference profile of a bundle's golden set and the model's outputs on it.

    For a version packaged without a profile: its golden rows are the best baseline
    it carries. Pushed versions are immutable, so the caller stores the result
    beside the version (or re-packages), this function only computes it.

    Raises:
        InvalidBundle: the bundle declares no golden set.
    """
    from shardline.quality.evaluation import read_golden

    manifest = read_manifest(bundle_dir)
    return reference_profile(bundle_dir, read_golden(bundle_dir, manifest))
