"""Distillation: a smaller student trained on a registered teacher's answers, gated like a precision variant.

``distill`` resolves the teacher, runs it (through the model cache and the runtime, as serving does) over the
rows the user gives, fits a student on its answers (``shardline.build.distill``), packages it with the
teacher as its lineage parent and the teacher's golden set and evaluation, scores both on that golden set,
refuses a student whose score moves more than the teacher's ``max_variant_delta`` from the teacher's (the
'variant-accuracy' gate of ``shardline.quality.variants``), and pushes the one that passes as a version of its
own. Both models' throughput is measured on one CPU thread, for the cost comparison.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from shardline.bundle import DISTILLATION_ROWS, Lineage, Manifest
from shardline.build.distill import StudentSize, fit_student
from shardline.build.packaging import GoldenSet, package_sklearn
from shardline.build.profiling import profile_model
from shardline.errors import InvalidBundle, InvalidInput, InvalidSetting
from shardline.quality.evaluation import (
    column_values, evaluation_of, golden_predictions, metric_value, predicted_column, read_golden,
)
from shardline.quality.variants import check_delta
from shardline.runtimes import Runtime, RuntimeOptions, create_runtime
from shardline.signature import parse_type, schema_problems
from shardline.storage.model_cache import ModelCache
from shardline.storage.registry import ModelRegistry

# Throughput is measured on one CPU thread, so that it prices as one core; at this batch size.
MEASURE_OPTIONS = RuntimeOptions(device="cpu", intra_op_threads=1)
MEASURE_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Distilled:
    """A student that passed its gate and was pushed (``new``: as a new version), its figures beside the teacher's."""

    teacher: str
    student: Manifest
    kind: str
    size: str
    rows: int
    metric: str
    score: float
    baseline: float
    agreement: float
    max_variant_delta: float
    teacher_rows_per_s: float
    student_rows_per_s: float
    new: bool


def _student_outputs(metric: str, teacher: str) -> tuple[bool, str]:
    """Whether the student is a classifier, and the output its golden set compares (package_sklearn's names)."""
    if metric == "accuracy":
        return True, "label"
    if metric == "rmse":
        return False, "prediction"
    raise InvalidBundle(
        f"{teacher} is scored by {metric}, and a distilled student is a classifier (accuracy) or a regressor "
        "(rmse); distil a model whose evaluation uses one of those")


def _feature_names(manifest: Manifest) -> list[str]:
    """The teacher's inputs, which must be numeric scalar columns (a student's features)."""
    odd = [c.name for c in manifest.signature.inputs
           if not (pa.types.is_integer(parse_type(c.type)) or pa.types.is_floating(parse_type(c.type)))]
    if odd:
        raise InvalidBundle(
            f"{manifest.reference} takes inputs {odd} that are not numbers; a distilled student takes numeric "
            "columns only: distil a tabular model")
    return manifest.signature.input_names


def _features(table: pa.Table, names: list[str]) -> np.ndarray:
    return np.column_stack([column_values(table.column(n)).astype(np.float32) for n in names])


def _rows_per_s(model: Runtime, sample: pa.Table, seconds: float) -> float:
    profile = profile_model(model, sample.slice(0, MEASURE_BATCH_ROWS), (min(MEASURE_BATCH_ROWS, sample.num_rows),),
                            seconds)
    return float(profile["batches"][0]["rows_per_s"])


def distill(
    registry: ModelRegistry,
    teacher_ref: str,
    data: pa.Table,
    *,
    kind: str = "linear",
    size: StudentSize = StudentSize(),
    name: str | None = None,
    data_source: str | None = None,
    cache_dir: str | Path | None = None,
    storage_options: dict[str, Any] | None = None,
    seconds_per_measure: float = 0.3,
) -> Distilled:
    """Distil the version ``teacher_ref`` names into a ``kind`` student trained on its answers over ``data``.

    Args:
        registry: where the teacher lives and the student is pushed.
        teacher_ref: ``name:version`` or ``name@alias``; the student's lineage names the pinned version.
        data: rows holding the teacher's input columns (others are ignored); their labels are not needed.
        kind: 'linear', 'gbt' or 'mlp' (``shardline.build.distill.STUDENT_KINDS``).
        size: trees and depth (gbt) or hidden units (mlp).
        name: the student's model name; ``<teacher>-student`` when left out.
        data_source: where ``data`` came from, for the lineage.
        cache_dir: the model cache folder to load the teacher through; a private one when left out.
        storage_options: fsspec options for the registry's URL.
        seconds_per_measure: how long each model's throughput is measured.

    Raises:
        ModelNotFound: the teacher is not registered.
        InvalidBundle: the teacher has no golden set, is scored by a metric a student cannot meet, or takes
            non-numeric inputs.
        InvalidInput: the data lacks the teacher's inputs, or the teacher gives one answer for all of it.
        InvalidSetting: an unknown student kind, a size below 1, or ``name`` the teacher's own.
        GateFailed: (gate 'variant-accuracy') the student scores too far from the teacher; nothing is pushed.
    """
    resolved = registry.resolve(teacher_ref)
    if name == resolved.name:
        raise InvalidSetting(f"the student would be a version of its teacher {resolved.name!r}; give it a name of its "
                             f"own (--name), e.g. {resolved.name}-student")
    teacher_manifest = resolved.manifest
    evaluation = evaluation_of(teacher_manifest)
    classifier, student_output = _student_outputs(evaluation.metric, resolved.pinned)
    names = _feature_names(teacher_manifest)
    problems = schema_problems(data.schema, teacher_manifest.signature.inputs, resolved.pinned)
    if problems:
        raise InvalidInput(f"the data cannot feed the teacher: {'; '.join(problems)}; give rows with its inputs")
    if data.num_rows == 0:
        raise InvalidInput("the data has no rows; give rows for the teacher to answer")
    data = data.select(names)
    with tempfile.TemporaryDirectory(prefix="shardline-distill-") as scratch:
        work = Path(scratch)
        cache = ModelCache(cache_dir or work / "cache", capacity=1)
        try:
            teacher = cache.get(resolved, MEASURE_OPTIONS, storage_options)
            golden = read_golden(cache.local_dir(resolved), teacher_manifest)
            answers = predicted_column(teacher, data, evaluation.prediction_column)
            teacher_on_golden = golden_predictions(teacher, teacher_manifest, golden)
            teacher_rows_per_s = _rows_per_s(teacher, data, seconds_per_measure)
        finally:
            cache.clear()
        labels = column_values(golden.column(evaluation.label_column))
        baseline = metric_value(evaluation.metric, teacher_on_golden, labels)
        estimator = fit_student(kind, _features(data, names), answers, classifier=classifier, size=size)
        student_golden = golden
        for n in names:  # the student's inputs are float32 columns (package_sklearn)
            student_golden = student_golden.set_column(student_golden.schema.get_field_index(n), n,
                                                       student_golden.column(n).cast(pa.float32()))
        folder = work / "student"
        manifest = package_sklearn(
            estimator, folder, name=name or f"{resolved.name}-student", feature_names=names,
            lineage=Lineage(parent=resolved.pinned, training_data=data_source,
                            metrics={DISTILLATION_ROWS: float(data.num_rows)}),
            golden=GoldenSet(student_golden, evaluation.label_column, evaluation.metric, student_output,
                             evaluation.threshold, evaluation.max_variant_delta),
        )
        student = create_runtime(folder, manifest, MEASURE_OPTIONS)
        student.load()
        try:
            student_on_golden = golden_predictions(student, manifest, student_golden)
            student_rows_per_s = _rows_per_s(student, data.cast(pa.schema([(n, pa.float32()) for n in names])),
                                             seconds_per_measure)
        finally:
            student.close()
        score = metric_value(evaluation.metric, student_on_golden, labels)
        agreement = metric_value(evaluation.metric, student_on_golden, teacher_on_golden)
        described = size.describe(kind)
        check_delta(
            f"the {kind} student ({described}) of {resolved.pinned}", "the teacher", evaluation, baseline, score,
            f"Its {evaluation.metric} against the teacher's own answers on the golden set is {agreement:.4f}. "
            "Keep serving the teacher, or distil a bigger student (more --trees, --max-depth or --hidden, another "
            "--student) or on more data")
        known = {m.content_digest for m in registry.list_versions(manifest.name)}
        pushed = registry.push(folder)
    return Distilled(
        teacher=resolved.pinned, student=pushed, kind=kind, size=described, rows=data.num_rows,
        metric=evaluation.metric, score=score, baseline=baseline, agreement=agreement,
        max_variant_delta=evaluation.max_variant_delta, teacher_rows_per_s=teacher_rows_per_s,
        student_rows_per_s=student_rows_per_s, new=pushed.content_digest not in known,
    )
