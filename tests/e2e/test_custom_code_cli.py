"""`shardline model package CODE --framework python` as a user runs it: a folder of model code, its files and
requirements become a bundle that pushes like any other; wrong uses get one line and exit code 2."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardline.build.examples import breast_cancer
from shardline.signature import Signature

from tests.custom_models import build_custom_model, write_code

Shardline = Callable[..., subprocess.CompletedProcess[str]]


def test_a_code_folder_is_packaged_with_its_files_and_requirements_then_pushed(shardline: Shardline,
                                                                              tmp_path: Path) -> None:
    built = build_custom_model(tmp_path / "reference")  # the ONNX graph and labels the code loads
    code = write_code(tmp_path / "my-model")
    data = breast_cancer()
    pq.write_table(pa.table({**{n: data.features[:, i].astype(np.float32) for i, n in enumerate(data.names)},
                             "target": data.labels}), tmp_path / "train.parquet")

    packaged = shardline(
        "model", "package", str(code), "--framework", "python", "--name", "diagnosis",
        "--signature-from", str(tmp_path / "train.parquet"), "--exclude", "target",
        "--file", str(tmp_path / "reference" / "classifier.onnx"), "--file", str(tmp_path / "reference" / "labels.json"),
        "--requirement", "onnxruntime>=1.20", "--out", str(tmp_path / "bundle"),
    )
    assert packaged.returncode == 0, packaged.stderr[-3000:]
    assert "out: diagnosis:string, confidence:float32" in packaged.stdout

    pushed = shardline("model", "push", str(tmp_path / "bundle"))
    assert pushed.returncode == 0, pushed.stderr[-3000:]
    assert "pushed diagnosis:1" in pushed.stdout
    shown = json.loads(shardline("model", "show", "diagnosis:1").stdout)
    assert shown["runtime"] == "python"
    assert shown["runtime_config"] == {"entry": "model:Model", "requirements": ["onnxruntime>=1.20"]}
    assert {a["path"]: a["role"] for a in shown["artifacts"]}["code/scaling.py"] == "code"
    assert Signature.model_validate(shown["signature"]) == built.manifest.signature  # as the Python builder made it


def test_wrong_uses_of_the_python_framework_get_one_line_and_exit_2(shardline: Shardline, tmp_path: Path) -> None:
    code = write_code(tmp_path / "code")
    onnx_file = tmp_path / "model.onnx"
    onnx_file.write_bytes(b"not used")

    no_sample = shardline("model", "package", str(code), "--framework", "python", "--name", "x")
    file_for_onnx = shardline("model", "package", str(onnx_file), "--name", "x", "--file", str(onnx_file))

    for done, message in ((no_sample, "--framework python needs --signature-from"),
                          (file_for_onnx, "--entry, --file and --requirement are for custom model code")):
        assert done.returncode == 2
        assert message in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
