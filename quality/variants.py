"""Precision variants of a registered version: build, score against fp32, record.

``make_variant`` resolves a reference, builds the variant from the fetched bundle
(``shardline.build.optimize``), scores fp32 and the variant on the bundle's golden set,
refuses a variant whose score moves more than the manifest's ``max_variant_delta``
(gate 'variant-accuracy'), and records it in the registry.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa

from shardline.bundle import Artifact, Evaluation, Manifest
from shardline.errors import GateFailed, InvalidSetting, RuntimeUnavailable
from shardline.build.optimize import BUILDERS, VARIANT_KINDS, Precision
from shardline.quality.evaluation import evaluate, read_golden, variant_delta_allowed
from shardline.runtimes import Runtime, RuntimeOptions, create_runtime
from shardline.storage.model_cache import ModelCache
from shardline.storage.registry import ModelRegistry, ResolvedModel, Variant


def _candidate_bundle(bundle_dir: Path, manifest: Manifest, variant_file: Path, artifact: Artifact, dest: Path) -> Manifest:
    """A local bundle folder of the version with the variant's file in place of the model file."""
    dest.mkdir(parents=True, exist_ok=True)
    artifacts = [artifact if a.role == "model" else a for a in manifest.artifacts]
    for a in artifacts:
        source = variant_file if a is artifact else bundle_dir / a.path
        (dest / a.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest / a.path)
    return manifest.model_copy(update={"artifacts": artifacts})


def _evaluation_device(precision: str, device: str) -> RuntimeOptions:
    return RuntimeOptions(device=device if device != "auto" else ("cpu" if precision == "int8" else "auto"))


def make_variant(
    registry: ModelRegistry,
    reference: str,
    precision: Precision,
    *,
    cache_dir: str | Path | None = None,
    storage_options: dict[str, Any] | None = None,
    device: str = "auto",
) -> Variant:
    """Build, check and record the ``precision`` variant of the version ``reference`` names.

    The variant is named after its precision ('int8' runs on CPUs, 'fp16' on CUDA).
    When the manifest declares an ``evaluation``, fp32 and the variant are scored on
    the golden set, and the variant is refused if its score moves by more than
    ``max_variant_delta``; without one, it is recorded unscored. A version that
    already has the variant gets it back as it is (variants never change).

    Args:
        registry: where the version lives and the variant is recorded.
        reference: ``name:version`` or ``name@alias`` (pinned to its version now).
        precision: 'int8' or 'fp16'.
        cache_dir: the model cache folder to fetch and load through; a private
            temporary folder when left out.
        storage_options: fsspec options for the registry's URL.
        device: where to score ('auto': the CPU for int8, a GPU if present for fp16).

    Raises:
        InvalidSetting: the precision is not 'int8' or 'fp16'.
        ModelNotFound: the reference is not registered.
        InvalidBundle: the precision brings nothing for this model, or the golden set is unfit.
        GateFailed: (gate 'variant-accuracy') the variant scores too far from fp32.
        RuntimeUnavailable: the variant cannot run here (fp16 on a machine without float16 kernels).
    """
    if precision not in VARIANT_KINDS:
        raise InvalidSetting(f"precision {precision!r} is not one Shardline makes; use 'int8' (CPU) or 'fp16' (GPU)")
    resolved = registry.resolve(reference)
    if precision in resolved.variants:
        return resolved.variants[precision]
    target_device, file_name = VARIANT_KINDS[precision]
    with tempfile.TemporaryDirectory(prefix="shardline-variant-") as scratch:
        work = Path(scratch)
        cache = ModelCache(cache_dir or work / "cache", capacity=1)
        options = _evaluation_device(precision, device)
        out_file = work / file_name
        try:
            fp32 = cache.get(resolved, options, storage_options)
            bundle_dir = cache.local_dir(resolved)
            artifact = BUILDERS[precision](resolved.manifest, bundle_dir, out_file)
            scores = _score_against_fp32(resolved, precision, fp32, bundle_dir, (out_file, artifact), options, work)
        finally:
            cache.clear()
        variant = Variant(name=precision, precision=precision, device=target_device, artifact=artifact, **scores)
        return registry.add_variant(resolved.name, resolved.version, variant, out_file)


def _score_against_fp32(
    resolved: ResolvedModel, precision: str, fp32: Runtime, bundle_dir: Path, variant: tuple[Path, Artifact],
    options: RuntimeOptions, work: Path,
) -> dict[str, Any]:
    """``metric``, ``score`` and ``baseline`` of a variant (its file and artifact) on the golden set.

    Empty when the manifest declares no evaluation. The variant is loaded from a
    local bundle folder made under ``work``.

    Raises:
        GateFailed: the variant's score is more than ``max_variant_delta`` from fp32's.
    """
    evaluation = resolved.manifest.evaluation
    if evaluation is None:
        return {}
    golden = read_golden(bundle_dir, resolved.manifest)
    baseline = evaluate(fp32, resolved.manifest, golden)
    variant_file, artifact = variant
    candidate = _candidate_bundle(bundle_dir, resolved.manifest, variant_file, artifact, work / "candidate")
    score = _score_candidate(work / "candidate", candidate, options, golden, precision)
    _check_delta(resolved.pinned, precision, evaluation, baseline, score)
    return {"metric": evaluation.metric, "score": score, "baseline": baseline}


def _score_candidate(bundle_dir: Path, manifest: Manifest, options: RuntimeOptions, golden: pa.Table, precision: str) -> float:
    """Load the candidate variant from its local folder and score it on the golden set."""
    runtime = create_runtime(bundle_dir, manifest, options)
    try:
        runtime.load()
    except RuntimeUnavailable:
        raise
    except Exception as e:  # onnxruntime refuses a graph it has no kernel for with its own errors
        raise RuntimeUnavailable(
            f"the {precision} variant of {manifest.reference} cannot run on this machine's "
            f"{options.device} ({type(e).__name__}: {e}); make it on a machine with a GPU "
            "(onnxruntime-gpu) so that it can be scored"
        ) from e
    try:
        return evaluate(runtime, manifest, golden)
    finally:
        runtime.close()


def _check_delta(reference: str, precision: str, evaluation: Evaluation, baseline: float, score: float) -> None:
    check_delta(f"the {precision} variant of {reference}", "fp32", evaluation, baseline, score,
                "Serve fp32, or raise evaluation.max_variant_delta in a new version if the loss is acceptable")


def check_delta(candidate: str, baseline_name: str, evaluation: Evaluation, baseline: float, score: float,
                advice: str) -> None:
    """The 'variant-accuracy' gate: ``candidate`` (a precision variant, a distilled student) may score at most
    ``max_variant_delta`` from ``baseline_name``'s score on the golden set, either way.

    Raises:
        GateFailed: it scores further away; the message gives both figures and ``advice``.
    """
    if not variant_delta_allowed(evaluation, baseline, score):
        raise GateFailed(
            f"{candidate} scores {evaluation.metric} {score:.4f} on the golden "
            f"set, {baseline_name} scores {baseline:.4f}: a change of {score - baseline:+.4f}, more than the "
            f"max_variant_delta {evaluation.max_variant_delta} its manifest allows; it was not recorded. {advice}",
            gate="variant-accuracy",
        )
