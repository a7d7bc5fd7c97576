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

from shardline.build.examples import breast_cancer, write_shards
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


def test_a_requirement_not_installed_where_the_job_runs_ends_it_with_one_line_and_exit_2(
    shardline: Shardline, tmp_path: Path,
) -> None:
    """Packaged on a machine that has the package its code requires, run where it is not installed: the job ends at
    the first shard that meets it (every other would fail the same way) with one line saying what to install, exit
    2: running again helps only once it is installed (it said "run the same command again to resume", exit 1)."""
    build_custom_model(tmp_path / "reference")
    code = write_code(tmp_path / "my-model")
    data = breast_cancer()
    pq.write_table(pa.table({n: data.features[:, i].astype(np.float32) for i, n in enumerate(data.names)}),
                   tmp_path / "train.parquet")
    packaging_machine = tmp_path / "site-packages"  # a distribution installed there, and only there
    dist_info = packaging_machine / "shardline_test_scaler-1.2.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: shardline-test-scaler\nVersion: 1.2\n")
    packaged = shardline(
        "model", "package", str(code), "--framework", "python", "--name", "diagnosis",
        "--signature-from", str(tmp_path / "train.parquet"),
        "--file", str(tmp_path / "reference" / "classifier.onnx"), "--file", str(tmp_path / "reference" / "labels.json"),
        "--requirement", "shardline-test-scaler>=1", "--out", str(tmp_path / "bundle"), PYTHONPATH=str(packaging_machine),
    )
    assert packaged.returncode == 0, packaged.stderr[-3000:]
    assert shardline("model", "push", str(tmp_path / "bundle")).returncode == 0
    shards, out = tmp_path / "input", tmp_path / "out"
    write_shards(shards, 6, 50)

    for env in ({"SHARDLINE_BATCH_RUNNER_IDLE_S": "0"}, {}):  # the cold path, then a warm runner
        failed = shardline("batch", "run", "--model", "diagnosis:1", "--input", str(shards), "--output", str(out),
                           **env)
        assert failed.returncode == 2, failed.stderr[-3000:]
        assert "Traceback" not in failed.stderr
        errors = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
        assert errors == [failed.stderr.strip().splitlines()[-1]] == [
            "error: diagnosis:1's code needs shardline-test-scaler>=1 (not installed); pip install "
            "'shardline-test-scaler>=1' where the model runs (batch workers and replicas); then run the same command "
            "again: the 0 of 6 shards settled are kept, the rest is scored"], failed.stderr[-3000:]
        assert not list(out.glob("part-*.parquet"))
