"""Scoring a model on its bundle's golden set, as the manifest's ``evaluation`` declares.

``evaluate`` runs the model over the golden table and computes the declared metric
(accuracy, rmse or cosine_min); it touches nothing but ``model.predict``. The
promotion gates and the precision-variant check (``shardline.build.optimize``) both call
it, so a version and its variants are scored the same way. ``read_golden`` is the
one function here that reads a file (bundles get their golden set from
``shardline.build.packaging``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardline.bundle import Evaluation, Manifest
from shardline.errors import InvalidBundle
from shardline.runtimes.base import Runtime
from shardline.signature import schema_problems

EVALUATION_BATCH_ROWS = 4096


def evaluation_of(manifest: Manifest) -> Evaluation:
    """The manifest's evaluation, or InvalidBundle saying how to declare one."""
    if manifest.evaluation is None:
        source = manifest.tags.get("mlflow.source")
        do = (f"import it again with one: `shardline model import {source} --golden GOLDEN.parquet` (the rows, their "
              "label and, with --metric, how to score them)" if source else
              "add an 'evaluation' (golden Parquet artifact, metric, label and prediction columns) "
              "to its manifest and package it again")
        raise InvalidBundle(
            f"{manifest.reference} declares no evaluation, so there is no golden set to score it on; {do}"
        )
    return manifest.evaluation


def read_golden(bundle_dir: str | Path, manifest: Manifest) -> pa.Table:
    """Read the golden Parquet file of a local (already verified) bundle folder.

    Raises:
        InvalidBundle: the manifest declares no evaluation, or its golden file is not
            an artifact of the bundle or cannot be read as Parquet.
    """
    evaluation = evaluation_of(manifest)
    if evaluation.golden not in {a.path for a in manifest.artifacts}:
        raise InvalidBundle(
            f"{manifest.reference}: evaluation.golden is {evaluation.golden!r}, which is not an artifact "
            "of the bundle (only listed, sha256-checked files are read); add it with role 'golden'"
        )
    path = Path(bundle_dir) / evaluation.golden
    try:
        return pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise InvalidBundle(
            f"{manifest.reference}: the golden set {evaluation.golden!r} cannot be read as Parquet ({e}); "
            "write it with pyarrow.parquet.write_table and package the model again"
        ) from e


def _check_golden(manifest: Manifest, evaluation: Evaluation, golden: pa.Table) -> None:
    where = f"{manifest.reference}: golden set {evaluation.golden!r}"
    if golden.num_rows == 0:
        raise InvalidBundle(f"{where} has no rows; a score needs at least one")
    problems = schema_problems(golden.schema, manifest.signature.inputs, manifest.reference)
    if problems:
        raise InvalidBundle(f"{where} cannot feed the model: {'; '.join(problems)}")
    if evaluation.label_column not in golden.column_names:
        raise InvalidBundle(
            f"{where} has no label column {evaluation.label_column!r} (its columns: {golden.column_names}); "
            "make evaluation.label_column name the column holding the expected answers"
        )
    if golden.column(evaluation.label_column).null_count:
        raise InvalidBundle(f"{where}: label column {evaluation.label_column!r} holds nulls; every row needs an answer")
    if evaluation.prediction_column not in manifest.signature.output_names:
        raise InvalidBundle(
            f"{manifest.reference}: evaluation.prediction_column is {evaluation.prediction_column!r}, not one "
            f"of the signature's outputs {manifest.signature.output_names}; name the output to compare"
        )


def column_values(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A column as numbers: 1-D for scalars, 2-D (rows, width) for lists of numbers."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_fixed_size_list(column.type):
        flat = column.flatten().to_numpy(zero_copy_only=False)
        return np.asarray(flat, dtype=np.float64).reshape(len(column), column.type.list_size)
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        return np.asarray(column.to_pylist(), dtype=np.float64)
    return column.to_numpy(zero_copy_only=False)


def metric_value(metric: str, predictions: np.ndarray, labels: np.ndarray) -> float:
    """The metric of predictions against labels (pure).

    Args:
        metric: 'accuracy' (share of equal values), 'rmse' (root mean squared error)
            or 'cosine_min' (the least cosine similarity between two rows' vectors).

    Raises:
        InvalidBundle: the shapes do not fit the metric, or the metric is unknown.
    """
    if predictions.shape[0] != labels.shape[0]:
        raise InvalidBundle(f"{metric}: {predictions.shape[0]} predictions against {labels.shape[0]} labels")
    if metric == "accuracy":
        return float(np.mean(predictions == labels))
    if metric == "rmse":
        diff = predictions.astype(np.float64) - labels.astype(np.float64)
        return float(np.sqrt(np.mean(diff * diff)))
    if metric == "cosine_min":
        if predictions.ndim != 2 or predictions.shape != labels.shape:
            raise InvalidBundle(
                f"cosine_min compares vectors of equal length; got predictions of shape {predictions.shape} "
                f"and labels of shape {labels.shape}"
            )
        a, b = predictions.astype(np.float64), labels.astype(np.float64)
        norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
        dots = np.einsum("ij,ij->i", a, b)
        cosines = np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0), 0.0)
        return float(cosines.min())
    raise InvalidBundle(f"unknown metric {metric!r}; use 'accuracy', 'rmse' or 'cosine_min'")


def evaluate(model: Runtime, manifest: Manifest, golden_table: pa.Table) -> float:
    """Score a loaded model on a golden table with the metric its manifest declares.

    The table is scored in batches of ``EVALUATION_BATCH_ROWS`` rows; the only side
    effect is ``model.predict``.

    Raises:
        InvalidBundle: no evaluation is declared, or the golden table does not fit it
            (no rows, columns missing, nulls in the label, unknown output column).
    """
    evaluation = evaluation_of(manifest)
    predictions = golden_predictions(model, manifest, golden_table)
    labels = column_values(golden_table.column(evaluation.label_column))
    return metric_value(evaluation.metric, predictions, labels)


def golden_predictions(model: Runtime, manifest: Manifest, golden_table: pa.Table) -> np.ndarray:
    """The model's ``evaluation.prediction_column`` over a golden table, scored in batches (``column_values``).

    Raises:
        InvalidBundle: as ``evaluate``.
    """
    evaluation = evaluation_of(manifest)
    _check_golden(manifest, evaluation, golden_table)
    return predicted_column(model, golden_table, evaluation.prediction_column)


def predicted_column(model: Runtime, table: pa.Table, column: str) -> np.ndarray:
    """The model's output ``column`` for every row of ``table``, scored in batches of ``EVALUATION_BATCH_ROWS``."""
    parts = [model.predict(batch).column(column) for batch in table.to_batches(max_chunksize=EVALUATION_BATCH_ROWS)]
    return column_values(pa.chunked_array(parts))


def variant_delta_allowed(evaluation: Evaluation, baseline: float, score: float) -> bool:
    """Whether a variant's score is within ``max_variant_delta`` of the fp32 score, either way.

    A variant computes the same thing in another precision: a score far above the
    baseline means it computes something else just as much as one far below does.
    """
    return abs(score - baseline) <= evaluation.max_variant_delta
