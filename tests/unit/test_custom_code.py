"""Custom model code (runtime 'python'): the runtime contract on a real bundle, packaging, and the tenant flag.

The bundle is ``tests/custom_models.py``'s: pre- and post-processing code around a logistic regression
exported to ONNX, answering diagnosis names and a confidence, compared here with scikit-learn's answers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from shardline.bundle import Manifest
from shardline.build.code_bundles import package_python
from shardline.errors import AccessDenied, InferenceFailed, InvalidBundle, InvalidInput, InvalidSetting, RuntimeUnavailable
from shardline.build.examples import breast_cancer, shard_table
from shardline.runtimes import create_runtime
from shardline.tenants import check_custom_code, parse_tenants_file

from tests.custom_models import CustomModel, build_custom_model
from tests.runtime_conformance import OPTIONS, RuntimeConformance


@pytest.fixture(scope="module")
def custom(tmp_path_factory: pytest.TempPathFactory) -> CustomModel:
    return build_custom_model(tmp_path_factory.mktemp("custom-code"))


@pytest.fixture(scope="module")
def shard() -> pa.Table:
    return shard_table(breast_cancer(), 300, 0, 7)


class TestCustomCode(RuntimeConformance):
    required_packages = ("onnxruntime",)  # the code loads its ONNX graph through context.onnx_session

    @pytest.fixture
    def bundle(self, custom: CustomModel) -> tuple[Path, Manifest]:
        return custom.bundle_dir, custom.manifest

    @pytest.fixture
    def rows(self, custom: CustomModel, shard: pa.Table) -> pa.Table:
        return pa.table({c.name: shard.column(c.name).cast(c.arrow_type).slice(0, 24)
                         for c in custom.manifest.signature.inputs})


def test_the_bundle_answers_as_scikit_learn_does_through_its_pre_and_post_processing(custom: CustomModel,
                                                                                   shard: pa.Table) -> None:
    runtime = create_runtime(custom.bundle_dir, custom.manifest, OPTIONS)
    runtime.load()

    answer = runtime.predict(shard)  # float64 shard columns and an id: cast and ignored by the one row check

    want = custom.expected(shard)
    assert answer.column("diagnosis").to_pylist() == want["diagnosis"].tolist()
    np.testing.assert_allclose(answer.column("confidence").to_numpy(), want["confidence"], rtol=1e-5, atol=1e-6)
    assert set(answer.column("diagnosis").to_pylist()) == {"malignant", "benign"}


def test_packaging_records_code_files_requirements_and_the_learnt_outputs(custom: CustomModel) -> None:
    manifest = custom.manifest
    assert manifest.runtime == "python"
    assert manifest.runtime_config == {"entry": "model:Model", "requirements": ["numpy>=1.26", "onnxruntime"]}
    roles = {a.path: a.role for a in manifest.artifacts}
    assert roles == {"code/model.py": "code", "code/scaling.py": "code", "classifier.onnx": "model",
                     "labels.json": "model"}
    assert [(c.name, c.type) for c in manifest.signature.outputs] == [("diagnosis", "string"), ("confidence", "float32")]
    assert "target" not in manifest.signature.input_names and len(manifest.signature.inputs) == 30


def _copy(custom: CustomModel, tmp_path: Path) -> Path:
    folder = tmp_path / "bundle"
    shutil.copytree(custom.bundle_dir, folder)
    return folder


def test_an_unmet_requirement_stops_the_load_naming_the_package_and_the_pip_line(custom: CustomModel,
                                                                                tmp_path: Path) -> None:
    config = {**custom.manifest.runtime_config, "requirements": ["numpy>=1.26", "no-such-package-xyz>=2",
                                                                 "onnxruntime<1.0"]}
    manifest = custom.manifest.model_copy(update={"runtime_config": config})

    with pytest.raises(RuntimeUnavailable) as caught:
        create_runtime(custom.bundle_dir, manifest, OPTIONS).load()

    message = str(caught.value)
    assert "no-such-package-xyz>=2 (not installed)" in message and "onnxruntime<1.0 (installed: " in message
    assert "pip install 'no-such-package-xyz>=2' 'onnxruntime<1.0'" in message
    assert "numpy" not in message.split("needs")[1].split(";")[0]  # the requirement that is met is not named


def _with_code(custom: CustomModel, tmp_path: Path, code: str) -> tuple[Path, Manifest]:
    """The bundle with another model.py (its manifest's digest is not checked by the runtime itself)."""
    folder = _copy(custom, tmp_path)
    (folder / "code" / "model.py").write_text(code)
    return folder, custom.manifest


@pytest.mark.parametrize("code, message", [
    ("class Model:\n    def predict(self, rows):\n        return {'diagnosis': ['x'] * (rows.num_rows - 1), "
     "'confidence': [0.5] * (rows.num_rows - 1)}\n", "answered 7 rows of 'diagnosis' for 8 rows"),
    ("class Model:\n    def predict(self, rows):\n        return {'diagnosis': ['x'] * rows.num_rows}\n",
     "without the signature's output 'confidence'"),
    ("class Model:\n    def predict(self, rows):\n        raise KeyError('radius')\n",
     "failed on 8 rows that passed its signature check: KeyError: 'radius'"),
    ("class Model:\n    def predict(self, rows):\n        return {'diagnosis': [1.5] * rows.num_rows, "
     "'confidence': ['high'] * rows.num_rows}\n", "answered 'confidence' as string"),
])
def test_code_that_answers_wrongly_fails_as_the_models_fault_saying_how(custom: CustomModel, shard: pa.Table,
                                                                        tmp_path: Path, code: str, message: str) -> None:
    folder, manifest = _with_code(custom, tmp_path, code)
    runtime = create_runtime(folder, manifest, OPTIONS)
    runtime.load()

    with pytest.raises(InferenceFailed) as caught:
        runtime.predict(shard.slice(0, 8))

    assert message in str(caught.value)


def test_code_whose_import_fails_is_an_invalid_bundle_naming_the_error(custom: CustomModel, tmp_path: Path) -> None:
    folder, manifest = _with_code(custom, tmp_path, "raise ValueError('bad constant')\n")

    with pytest.raises(InvalidBundle, match="importing its code \\(model\\) failed: ValueError: bad constant"):
        create_runtime(folder, manifest, OPTIONS).load()


def test_code_that_asks_for_a_file_the_bundle_lacks_is_told_the_option_that_adds_it(custom: CustomModel,
                                                                                     tmp_path: Path) -> None:
    folder, manifest = _with_code(custom, tmp_path, "class Model:\n    def load(self, context):\n"
                                  "        context.path('w.json')\n\n    def predict(self, rows):\n        pass\n")

    with pytest.raises(InvalidBundle) as caught:
        create_runtime(folder, manifest, OPTIONS).load()

    assert "code asks for file 'w.json', which the bundle does not list" in str(caught.value)
    assert "package it with --file w.json (`model package --framework python`)" in str(caught.value)


def test_two_bundles_with_modules_of_the_same_name_keep_their_own_code(custom: CustomModel, shard: pa.Table,
                                                                       tmp_path: Path) -> None:
    other = custom.manifest.model_copy(update={"name": "other"})
    folder, _ = _with_code(custom, tmp_path, "class Model:\n    def predict(self, rows):\n        return "
                           "{'diagnosis': ['other'] * rows.num_rows, 'confidence': [1.0] * rows.num_rows}\n")
    first = create_runtime(custom.bundle_dir, custom.manifest, OPTIONS)
    second = create_runtime(folder, other.model_copy(update={"runtime_config": {"entry": "model:Model"}}), OPTIONS)
    first.load()
    second.load()

    assert set(second.predict(shard).column("diagnosis").to_pylist()) == {"other"}
    assert set(first.predict(shard).column("diagnosis").to_pylist()) == {"malignant", "benign"}


def test_packaging_refuses_a_pickle_and_code_that_fails_leaving_no_folder(custom: CustomModel, tmp_path: Path) -> None:
    table = shard_table(breast_cancer(), 50, 0, 1)
    code = tmp_path / "model.py"
    code.write_text("class Model:\n    def predict(self, rows):\n        return {'score': rows.column(0)}\n")
    pickle = tmp_path / "weights.pkl"
    pickle.write_bytes(b"\x80\x04N.")

    with pytest.raises(InvalidSetting, match="weights.pkl is a pickle, which Shardline never loads"):
        package_python(code, tmp_path / "a", name="a", sample=table, files=[pickle])
    # whatever its name: a pickle (a renamed one, torch.save's zip of one), not a file that merely begins 80 02
    import pickle as pickles
    import struct
    import zipfile

    renamed = tmp_path / "weights.dat"
    renamed.write_bytes(pickles.dumps({"w": [0.5] * 8}, protocol=4))
    torch_like = tmp_path / "weights.pt"
    with zipfile.ZipFile(torch_like, "w") as archive:
        archive.writestr("weights/data.pkl", pickles.dumps([1.0], protocol=2))
    for disguised in (renamed, torch_like):
        with pytest.raises(InvalidSetting, match=f"{disguised.name} is a pickle, which Shardline never loads"):
            package_python(code, tmp_path / "a", name="a", sample=table, files=[disguised])
    header = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'.ljust(640)
    tensors = tmp_path / "weights.safetensors"  # its header's length, 640, begins 80 02 as a pickle of protocol 2
    tensors.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    assert tensors.read_bytes()[:2] == b"\x80\x02"
    package_python(code, tmp_path / "tensors", name="a", sample=table, files=[tensors])
    assert (tmp_path / "tensors" / "weights.safetensors").exists()
    code.write_text("class Model:\n    def predict(self, rows):\n        return {'score': rows.column('no-such')}\n")
    with pytest.raises(InvalidInput, match="code failed on the sample's first 16 rows: KeyError"):
        package_python(code, tmp_path / "b", name="b", sample=table)

    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_one_file_model_is_packaged_with_its_class_found_by_the_files_name(tmp_path: Path) -> None:
    table = shard_table(breast_cancer(), 40, 0, 2)
    code = tmp_path / "radius.py"
    code.write_text("import pyarrow.compute as pc\n\nclass Model:\n    thread_safe = True\n\n    def predict(self, rows):\n"
                    "        return pa_table(rows)\n\ndef pa_table(rows):\n    import pyarrow as pa\n"
                    "    return pa.table({'large': pc.greater(rows.column('mean radius'), 15.0)})\n")

    manifest = package_python(code, tmp_path / "bundle", name="radius", sample=table, exclude=["id"])
    runtime = create_runtime(tmp_path / "bundle", manifest, OPTIONS)
    runtime.load()

    assert manifest.runtime_config["entry"] == "radius:Model"
    assert [(c.name, c.type) for c in manifest.signature.outputs] == [("large", "bool")]
    answer = runtime.predict(table)
    assert answer.column("large").to_pylist() == [r > 15.0 for r in table.column("mean radius").to_pylist()]


def test_only_tenants_the_file_allows_may_run_custom_code() -> None:
    parsed = parse_tenants_file({"tenants": [
        {"name": "acme", "batch": {"storage_prefixes": ["/data/acme"]}, "custom_code": True},
        {"name": "globex", "batch": {"storage_prefixes": ["/data/globex"]}},
    ]}, "tenants.yaml")
    batch = parsed.batch_tenants()

    assert batch["acme"] is not None and batch["acme"].custom_code
    assert batch["globex"] is not None and not batch["globex"].custom_code  # off by default
    check_custom_code("python", "diagnosis:1", "acme", True)
    check_custom_code("onnx", "churn:1", "globex", False)  # models without code: no flag needed
    check_custom_code("python", "diagnosis:1", None, False)  # single-tenant development: no tenants file
    with pytest.raises(AccessDenied) as caught:
        check_custom_code("python", "diagnosis:1", "globex", False)
    assert "tenant 'globex' may not run" in str(caught.value) and "custom_code: true" in str(caught.value)


def test_a_model_folder_is_copied_whole_under_its_name_and_a_pickle_inside_is_refused(tmp_path: Path) -> None:
    table = shard_table(breast_cancer(), 40, 0, 4)
    code = tmp_path / "cutoff.py"
    code.write_text("import json\n\nclass Model:\n    def load(self, context):\n"
                    "        self.cutoff = json.loads(context.path('weights/radius/cutoff.json').read_text())\n"
                    "    def predict(self, rows):\n        return {'large': [r > self.cutoff for r in "
                    "rows.column('mean radius').to_pylist()]}\n")
    weights = tmp_path / "weights"
    (weights / "radius").mkdir(parents=True)
    (weights / "radius" / "cutoff.json").write_text("15.0")
    (weights / "README.md").write_text("the cutoff of the mean radius")
    (weights / "__pycache__").mkdir()
    (weights / "__pycache__" / "stale.cpython-311.pyc").write_bytes(b"\x00")

    manifest = package_python(code, tmp_path / "bundle", name="cutoff", sample=table, exclude=["id"], files=[weights])
    runtime = create_runtime(tmp_path / "bundle", manifest, OPTIONS)
    runtime.load()

    assert {a.path: a.role for a in manifest.artifacts} == {
        "code/cutoff.py": "code", "weights/README.md": "model", "weights/radius/cutoff.json": "model"}
    assert runtime.predict(table).column("large").to_pylist() == [r > 15.0 for r in table.column("mean radius").to_pylist()]
    (weights / "radius" / "scaler.pkl.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(InvalidSetting, match=r"model folder .*weights holds pickles \(radius/scaler.pkl.gz\), which "
                                             "Shardline never loads"):
        package_python(code, tmp_path / "refused", name="cutoff", sample=table, exclude=["id"], files=[weights])
    assert not (tmp_path / "refused").exists()
