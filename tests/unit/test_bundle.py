"""Bundles: references, manifests, digests and artifact verification."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardline.bundle import ModelRef, read_manifest, verify_artifacts
from shardline.errors import IntegrityError, InvalidBundle, InvalidSetting

from tests.conftest import BuiltModel


@pytest.mark.parametrize(
    "text, name, version, alias",
    [
        ("churn@prod", "churn", None, "prod"),
        ("churn:3", "churn", 3, None),
        ("churn", "churn", None, "prod"),
        (" breast-cancer@staging ", "breast-cancer", None, "staging"),
    ],
)
def test_references_parse(text: str, name: str, version: int | None, alias: str | None) -> None:
    ref = ModelRef.parse(text)
    assert (ref.name, ref.version, ref.alias) == (name, version, alias)


@pytest.mark.parametrize(
    "text, message",
    [
        ("churn:latest", "the version 'latest' is not a number"),
        ("churn@", "empty alias"),
        ("Churn Model", "model name 'Churn Model' is not allowed"),
    ],
)
def test_bad_references_say_how_to_write_them(text: str, message: str) -> None:
    with pytest.raises(InvalidSetting, match=message):
        ModelRef.parse(text)


@pytest.mark.parametrize("text, parts", [
    ("churn@prod", ("churn", "prod", None)), ("churn:3", ("churn", None, "3")), (" churn ", ("churn", None, None)),
    ("churn@", ("churn", "", None)), ("churn:", ("churn", None, "")), ("a:1@x", ("a:1", "x", None)),
])
def test_a_reference_splits_in_one_place_as_parse_reads_it(text: str, parts: tuple[str, str | None, str | None]) -> None:
    assert ModelRef.split(text) == parts  # the wire tier checks these parts in its own words (400, not 500)


def test_manifest_records_signature_artifacts_and_environment(breast_cancer_model: BuiltModel) -> None:
    manifest = read_manifest(breast_cancer_model.bundle_dir)
    assert manifest.runtime == "onnx" and manifest.version is None
    assert [(a.path, a.role) for a in manifest.artifacts] == [
        ("model.onnx", "model"), ("golden.parquet", "golden"), ("reference_profile.json", "profile")
    ]
    assert manifest.evaluation is not None and manifest.evaluation.metric == "accuracy"
    assert manifest.reference_profile == "reference_profile.json"
    assert len(manifest.signature.inputs) == 30 and manifest.signature.output_names == ["label", "probabilities"]
    assert manifest.signature.outputs[1].type == "fixed_size_list<float32>[2]"
    assert "python" in manifest.environment and "skl2onnx" in manifest.environment
    assert manifest.lineage.metrics["golden_accuracy"] > 0.9


def test_digest_ignores_version_time_and_golden_data_but_not_model_bytes(breast_cancer_model: BuiltModel) -> None:
    manifest = breast_cancer_model.manifest
    model, golden, profile = manifest.artifacts
    assert manifest.model_copy(update={"version": 7}).outputs_digest == manifest.outputs_digest
    other_golden = manifest.model_copy(update={"artifacts": [model, golden.model_copy(update={"sha256": "1" * 64}), profile]})
    assert other_golden.outputs_digest == manifest.outputs_digest
    changed = manifest.model_copy(update={"artifacts": [model.model_copy(update={"sha256": "0" * 64}), golden, profile]})
    assert changed.outputs_digest != manifest.outputs_digest


def test_tampered_artifact_is_refused(breast_cancer_model: BuiltModel, tmp_path: Path) -> None:
    copy = tmp_path / "bundle"
    shutil.copytree(breast_cancer_model.bundle_dir, copy)
    verify_artifacts(copy, breast_cancer_model.manifest)
    with open(copy / "model.onnx", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")

    with pytest.raises(IntegrityError, match="'model.onnx' .* was changed after packaging") as caught:
        verify_artifacts(copy, breast_cancer_model.manifest)
    assert caught.value.expected == breast_cancer_model.manifest.artifacts[0].sha256


def test_folder_without_manifest_is_not_a_bundle(tmp_path: Path) -> None:
    with pytest.raises(InvalidBundle, match="has no manifest.json"):
        read_manifest(tmp_path)


def test_a_sample_with_nan_makes_its_float_column_declare_non_finite(breast_cancer_model: BuiltModel) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardline.build.packaging import infer_onnx_signature

    sample = pq.read_table(breast_cancer_model.bundle_dir / "golden.parquet")
    radius = sample.column("mean radius").to_pylist()
    radius[3] = float("nan")
    with_nan = sample.set_column(sample.schema.get_field_index("mean radius"), "mean radius",
                                 pa.array(radius, pa.float32()))
    signature, _ = infer_onnx_signature(breast_cancer_model.bundle_dir / "model.onnx", with_nan, exclude=["target"])
    declared = {c.name for c in signature.inputs if c.non_finite}
    assert declared == {"mean radius"}
    plain, _ = infer_onnx_signature(breast_cancer_model.bundle_dir / "model.onnx", sample, exclude=["target"])
    assert not any(c.non_finite for c in plain.inputs)
