"""Profile a registered version (or a variant) on this machine and store it in the registry."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa

from shardline.bundle import Manifest
from shardline.errors import InvalidSetting
from shardline.build.profiling import DEFAULT_BATCH_SIZES, profile_model
from shardline.machines import profile_key
from shardline.quality.evaluation import read_golden
from shardline.runtimes.base import RuntimeOptions
from shardline.storage.model_cache import ModelCache
from shardline.storage.registry import ModelRegistry


def profile_version(
    registry: ModelRegistry,
    reference: str,
    variant: str | None = None,
    *,
    sample_table: pa.Table | None = None,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    seconds_per_size: float = 0.5,
    options: RuntimeOptions = RuntimeOptions(),
    cache_dir: str | Path | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Profile a registered version (or one of its variants) here and store it in the registry.

    The profile is stored under ``profile_key(machine_kind, variant)`` and also
    records the model, the variant and the precision it ran in.

    Args:
        registry: where the version lives.
        reference: ``name:version`` or ``name@alias``.
        variant: a precision variant's name ('int8', 'fp16'); the fp32 model when left out.
        sample_table: input rows to time; the bundle's golden set (its input columns) when left out.
        batch_sizes, seconds_per_size: as for ``profile_model``.
        options: device and threads to load the model with.
        cache_dir: the model cache folder; a private temporary one when left out.
        storage_options: fsspec options for the registry's URL.

    Returns:
        The stored profile, with ``key`` (the registry key) added.

    Raises:
        ModelNotFound: the reference or the variant is not registered.
        InvalidSetting: no sample was given and the bundle has no golden set, or the variant is made for GPUs
            (fp16) and this machine runs it on a CPU.
    """
    resolved = registry.resolve(reference)
    model = resolved.variant(variant) if variant else resolved
    with tempfile.TemporaryDirectory(prefix="shardline-profile-") as scratch:
        cache = ModelCache(cache_dir or scratch, capacity=1)
        try:
            runtime = cache.get(model, options, storage_options)
            made_for = resolved.variants[variant].device if variant else "cpu"
            if made_for == "cuda" and runtime.device != "cuda":
                raise InvalidSetting(
                    f"the variant {variant} of {resolved.pinned} is made for GPUs, and this machine runs it on "
                    f"{runtime.device}, where placement never picks it; profile it on a GPU machine "
                    "(SHARDLINE_RUNTIME_DEVICE=cuda)")
            sample = sample_table if sample_table is not None else _golden_inputs(cache.local_dir(model), model.manifest)
            profile = profile_model(runtime, sample, batch_sizes, seconds_per_size)
        finally:
            cache.clear()
    key = profile_key(profile["machine"], variant)
    precision = resolved.variants[variant].precision if variant else "fp32"
    profile.update({"key": key, "model": resolved.pinned, "variant": variant, "precision": precision})
    registry.put_profile(resolved.name, resolved.version, key, profile)
    return profile


def _golden_inputs(bundle_dir: Path, manifest: Manifest) -> pa.Table:
    if manifest.evaluation is None:
        raise InvalidSetting(
            f"{manifest.reference} has no golden set to take sample rows from; give real input rows, e.g. one "
            "Parquet shard (`shardline model profile --sample ROWS.parquet`; sample_table= in Python)"
        )
    return read_golden(bundle_dir, manifest).select(manifest.signature.input_names)
