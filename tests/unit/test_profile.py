"""Reference profiles: compact, binned so current data compares exactly, and covering the model's outputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from shardline.bundle import read_manifest, sha256_file
from shardline.errors import InvalidInput
from shardline.build.examples import breast_cancer, golden_table, split, with_site
from shardline.quality.gates import evaluation_gate, reference_profile_gate
from shardline.quality.profile import (
    attach_reference_profile,
    golden_reference_profile,
    profile_table,
    reference_profile,
)


def _training() -> pa.Table:
    train, _ = split(breast_cancer())
    return with_site(golden_table(train), seed=1)


def test_numeric_columns_carry_bins_and_a_quantile_sketch() -> None:
    profile = profile_table(_training())
    entry = profile["columns"]["mean radius"]
    assert entry["kind"] == "numeric" and entry["null_rate"] == 0.0
    sketch, bins = entry["sketch"], entry["bins"]
    assert set(bins["edges"]) <= set(sketch["edges"])  # PSI bins can be read off the sketch
    assert len(bins["fractions"]) == len(bins["edges"]) + 1 and sum(bins["fractions"]) == pytest.approx(1.0, abs=1e-4)
    assert all(0.08 < f < 0.12 for f in bins["fractions"][:-1])  # deciles of a continuous column
    assert np.all(np.diff(sketch["cdf"]) >= 0) and sketch["cdf"][-1] == pytest.approx(0.99, abs=0.01)
    values = np.sort(_training().column("mean radius").to_numpy())
    assert sketch["cdf"][49] == pytest.approx(np.searchsorted(values, sketch["edges"][49], side="right") / len(values), abs=1e-4)
    assert entry["min"] == values[0] and entry["max"] == values[-1]


def test_categories_and_small_integer_columns_are_profiled_as_shares() -> None:
    profile = profile_table(_training())
    site, target = profile["columns"]["site"], profile["columns"]["target"]
    assert site["kind"] == "categorical" and set(site["top"]) == {"north", "south", "east"} and site["other"] == 0.0
    assert sum(site["top"].values()) == pytest.approx(1.0, abs=1e-5)
    assert target["kind"] == "categorical" and set(target["top"]) == {"0", "1"} and target["min"] == 0.0


def test_nulls_and_nan_count_as_missing() -> None:
    table = pa.table({"x": pa.array([1.0, None, float("nan"), 4.0]), "s": pa.array(["a", None, "b", "a"])})
    profile = profile_table(table)
    assert profile["columns"]["x"]["null_rate"] == 0.5 and profile["columns"]["s"]["null_rate"] == 0.25
    assert profile["columns"]["s"]["top"] == {"a": pytest.approx(2 / 3, abs=1e-5), "b": pytest.approx(1 / 3, abs=1e-5)}


def test_the_reference_profile_covers_the_model_outputs(breast_cancer_model: Any) -> None:
    data = _training()
    profile = reference_profile(breast_cancer_model.bundle_dir, data)
    outputs = profile["outputs"]
    assert set(outputs) == {"label", "probabilities[0]", "probabilities[1]"}
    assert outputs["probabilities[1]"]["source"] == "probabilities" and outputs["probabilities[1]"]["index"] == 1
    labels, _ = breast_cancer_model.expected(data)
    assert outputs["label"]["top"]["1"] == pytest.approx(float(np.mean(labels == 1)), abs=1e-5)
    assert len(json.dumps(profile)) < 100_000  # KB, not MB: 33 columns and 3 outputs


def test_attaching_a_profile_rewrites_the_bundle_and_passes_the_gate(breast_cancer_model: Any, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(breast_cancer_model.bundle_dir, bundle)
    manifest = attach_reference_profile(bundle, _training())
    assert read_manifest(bundle) == manifest
    artifact = next(a for a in manifest.artifacts if a.path == manifest.reference_profile)
    assert artifact.role == "profile" and artifact.sha256 == sha256_file(bundle / artifact.path)
    assert [a.path for a in manifest.artifacts].count(artifact.path) == 1
    assert manifest.outputs_digest == breast_cancer_model.manifest.outputs_digest  # the model itself did not change
    assert "outputs" in json.loads((bundle / artifact.path).read_text())
    gate = reference_profile_gate(bundle, manifest)
    # the label and the site are profiled too (drift compares them where current data has them), and said apart
    assert gate.passed and gate.detail == ("30 inputs and 3 output columns profiled over 455 rows, besides 2 columns "
                                           "the model does not read ('target', 'site')")


def test_a_version_without_a_golden_set_is_refused_by_the_evaluation_gate_saying_how_to_add_one(
        breast_cancer_model: Any) -> None:
    manifest = breast_cancer_model.manifest
    assert evaluation_gate(manifest, 0.95).passed
    refused = evaluation_gate(manifest.model_copy(update={"evaluation": None}), None)
    assert not refused.passed and "declares no golden data set" in refused.detail
    assert "`shardline model package|import --golden`, the mlflow-watch flow's golden" in refused.detail


def test_reference_data_without_the_model_inputs_is_refused(breast_cancer_model: Any) -> None:
    with pytest.raises(InvalidInput, match="lacks inputs"):
        reference_profile(breast_cancer_model.bundle_dir, pa.table({"site": ["north"]}))


def test_a_bundle_without_a_profile_can_be_profiled_from_its_golden_set(breast_cancer_model: Any) -> None:
    profile = golden_reference_profile(breast_cancer_model.bundle_dir)
    assert profile["rows"] == 114 and "mean radius" in profile["columns"] and "label" in profile["outputs"]
