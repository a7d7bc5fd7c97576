"""The batch flow runs a precision variant when asked, and lets placement choose with 'auto'."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from shardline.capacity.prices import load_prices
from shardline.flows.batch_inference import batch_inference
from shardline.placement import BatchWorkload, candidates_from_profiles, choose_placement
from shardline.quality.model_profiles import profile_version
from shardline.quality.variants import make_variant
from shardline.runtimes import RuntimeOptions
from shardline.storage.model_cache import ModelCache
from shardline.storage.registry import ModelRegistry

from tests.tensor_models import mlp_bundle

pytestmark = pytest.mark.usefixtures("on_cluster")


@pytest.fixture
def mlp_registry(shardline_home: Path, tmp_path: Path) -> ModelRegistry:
    """mlp:1 (an MLP classifier, where int8 applies) with an int8 variant and profiles of both here."""
    bundle, _ = mlp_bundle(tmp_path)
    registry = ModelRegistry(str(shardline_home / "registry"))
    registry.push(bundle)
    registry.set_alias("mlp", "prod", 1)
    make_variant(registry, "mlp:1", "int8")
    for variant in (None, "int8"):
        profile_version(registry, "mlp:1", variant, batch_sizes=(512, 4096), seconds_per_size=0.2)
    return registry


def test_a_named_variant_scores_every_row_with_the_variant(
    mlp_registry: ModelRegistry, input_shards: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    state = batch_inference(model="mlp@prod", input_uri=str(input_shards), output_uri=str(out),
                            variant="int8", batch_rows=4096, return_state=True)

    assert state.is_completed(), state.message
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["model"]["variant"] == "int8" and manifest["model"]["pinned"] == "mlp:1"
    resolved = mlp_registry.resolve("mlp:1")
    assert manifest["model"]["digest"] == resolved.variant("int8").outputs_digest != resolved.outputs_digest
    inputs = ds.dataset(input_shards).to_table().sort_by("id")
    scored = ds.dataset(out).to_table().sort_by("id")
    int8 = ModelCache(tmp_path / "cache").get(resolved.variant("int8"), RuntimeOptions("cpu", 1))
    expected = int8.predict(inputs).column("label").to_numpy()
    # int8 scales activations per call, so a row's answer can shift with its batch: near-total agreement
    assert (scored.column("label").to_numpy() == expected).mean() > 0.99
    assert scored.num_rows == inputs.num_rows


def test_auto_takes_what_placement_chooses_from_the_stored_profiles(
    mlp_registry: ModelRegistry, input_shards: Path, tmp_path: Path
) -> None:
    resolved = mlp_registry.resolve("mlp:1")
    candidates = candidates_from_profiles(mlp_registry.profiles("mlp", 1),
                                          load_prices().per_machine_hour)  # the example's: no other in the home
    expected = choose_placement(BatchWorkload(), candidates).candidate.variant

    state = batch_inference(model="mlp@prod", input_uri=str(input_shards), output_uri=str(tmp_path / "out"),
                            variant="auto", return_state=True)

    assert state.is_completed(), state.message
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["model"]["variant"] == expected
    assert {c.variant for c in candidates} == {"fp32", "int8"} and resolved.variants.keys() == {"int8"}


def test_an_unknown_variant_fails_before_anything_is_written(
    mlp_registry: ModelRegistry, input_shards: Path, tmp_path: Path
) -> None:
    state = batch_inference(model="mlp@prod", input_uri=str(input_shards), output_uri=str(tmp_path / "out"),
                            variant="fp16", return_state=True)
    assert state.is_failed()
    assert "mlp:1 has no variant 'fp16' (it has: ['int8'])" in str(state.result(raise_on_failure=False))
    assert not (tmp_path / "out").exists()
