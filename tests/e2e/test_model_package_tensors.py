"""`shardline model package` for a model of one [-1, k] input: from a Parquet list column, from the ONNX file
alone (and what it then says is missing), from feature columns with the tensor layout (served to tritonclient
as one [N, 30] input, scored in batch from the columns), and its refusals, one line each."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import tritonclient.http as triton
from sklearn.datasets import load_breast_cancer

from tests.support.serve_process import serving
from tests.tensor_models import feature_column, list_classifier

Shardline = Callable[..., subprocess.CompletedProcess[str]]


def test_packaged_from_a_list_column_or_from_the_onnx_file_alone(shardline: Shardline, tmp_path: Path) -> None:
    onnx_file, _, features = list_classifier(tmp_path / "model")
    pq.write_table(pa.table({"input": feature_column(features), "target": pa.array(range(len(features)))}),
                   tmp_path / "train.parquet")

    sampled = shardline("model", "package", str(onnx_file), "--name", "vec", "--signature-from",
                        str(tmp_path / "train.parquet"), "--exclude", "target", "--out", str(tmp_path / "sampled"))
    alone = shardline("model", "package", str(onnx_file), "--name", "vec", "--out", str(tmp_path / "alone"))

    assert sampled.returncode == 0, sampled.stderr
    assert "in: input:fixed_size_list<float32>[30]" in sampled.stdout and "no reference profile" not in sampled.stdout
    assert alone.returncode == 0, alone.stderr
    assert "in: input:fixed_size_list<float32>[30]" in alone.stdout
    assert "out: label:int64, probabilities:fixed_size_list<float32>[2]" in alone.stdout
    assert "no reference profile: drift checks and the promotion gate 'reference-profile' need one" in alone.stdout
    assert "package again with --signature-from ROWS.parquet" in alone.stdout
    assert json.loads((tmp_path / "alone" / "manifest.json").read_text())["reference_profile"] is None
    assert json.loads((tmp_path / "sampled" / "manifest.json").read_text())["reference_profile"] is not None


def test_a_refusal_is_one_line_that_says_what_to_do(shardline: Shardline, tmp_path: Path) -> None:
    onnx_file, _, features = list_classifier(tmp_path / "model")
    pq.write_table(pa.table({"input": features[:, 0]}), tmp_path / "flat.parquet")

    flat = shardline("model", "package", str(onnx_file), "--name", "vec", "--signature-from", str(tmp_path / "flat.parquet"))
    stray = shardline("model", "package", str(onnx_file), "--name", "vec", "--exclude", "target")

    assert flat.returncode == 2 and len(flat.stderr.strip().splitlines()) == 1 and "Traceback" not in flat.stderr
    assert "give it as one fixed_size_list<float32>[30] column" in flat.stderr
    assert stray.returncode == 2 and "give the sample with --signature-from" in stray.stderr


def test_an_xgboost_model_file_is_packaged_checked_and_refusals_are_one_line(
        shardline: Shardline, tmp_path: Path) -> None:
    from tests.framework_models import fitted, training_rows

    _, labels, _, sample = training_rows()
    pq.write_table(sample.append_column("target", pa.array(labels)), tmp_path / "train.parquet")
    fitted("xgboost-classifier").save_model(tmp_path / "model.json")
    fitted("lightgbm-regressor").booster_.save_model(tmp_path / "model.txt")  # not an XGBoost model

    xgb = shardline("model", "package", str(tmp_path / "model.json"), "--framework", "xgboost", "--name", "churn",
                    "--signature-from", str(tmp_path / "train.parquet"), "--exclude", "target",
                    "--out", str(tmp_path / "xgb"))
    unsampled = shardline("model", "package", str(tmp_path / "model.json"), "--framework", "xgboost", "--name", "x")
    wrong = shardline("model", "package", str(tmp_path / "model.txt"), "--framework", "xgboost", "--name", "x",
                      "--signature-from", str(tmp_path / "train.parquet"), "--exclude", "target")

    assert xgb.returncode == 0, xgb.stderr
    assert "in: mean radius:float32" in xgb.stdout and "out: label:int64, probabilities:fixed_size_list<float32>[2]" in xgb.stdout
    assert json.loads((tmp_path / "xgb" / "manifest.json").read_text())["tags"]["framework"] == "xgboost"
    for refused, says in ((unsampled, "--framework xgboost needs --signature-from ROWS.parquet"),
                          (wrong, "is not a xgboost model file")):
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert says in refused.stderr and "Traceback" not in refused.stderr


def test_the_tensor_layout_takes_one_n_by_30_input_online_and_feature_columns_in_batch(
    shardline: Shardline, shardline_home: Path, tmp_path: Path
) -> None:
    onnx_file, estimator, features = list_classifier(tmp_path / "model")
    names = [str(n) for n in load_breast_cancer().feature_names]
    columns = {n: features[:, j] for j, n in enumerate(names)}
    pq.write_table(pa.table({**columns, "target": estimator.predict(features)}), tmp_path / "train.parquet")

    packaged = shardline("model", "package", str(onnx_file), "--name", "bc", "--signature-from",
                         str(tmp_path / "train.parquet"), "--exclude", "target", "--input-layout", "tensor",
                         "--out", str(tmp_path / "bundle"))
    assert packaged.returncode == 0, packaged.stderr
    assert "in: mean radius:float32" in packaged.stdout  # the rows stay columns
    assert "V2 input: input FP32 [-1, 30] (the 30 columns stacked; batch jobs read the columns)" in packaged.stdout
    pushed = shardline("model", "push", str(tmp_path / "bundle"), "--alias", "prod")
    assert pushed.returncode == 0, pushed.stderr
    added = shardline("tenant", "add", "acme", "--models", "bc@prod", "--file", str(tmp_path / "tenants.yaml"))
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()

    expected = estimator.predict(features).tolist()
    with serving(shardline_home, tmp_path / "tenants.yaml", tmp_path / "serve.log") as url:
        client = triton.InferenceServerClient(url.removeprefix("http://"))
        metadata = client.get_model_metadata("bc", headers={"Authorization": f"Bearer {key}"})
        assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 30]}]
        for binary in (True, False):
            tensor = triton.InferInput("input", list(features.shape), "FP32")
            tensor.set_data_from_numpy(features, binary_data=binary)
            answer = client.infer("bc", [tensor], headers={"Authorization": f"Bearer {key}"})
            assert answer.as_numpy("label").tolist() == expected
        nan = features[:2].copy()
        nan[1, 3] = np.nan
        tensor = triton.InferInput("input", [2, 30], "FP32")
        tensor.set_data_from_numpy(nan, binary_data=True)
        with pytest.raises(triton.InferenceServerException, match=r"columns \['mean area'\] hold NaN"):
            client.infer("bc", [tensor], headers={"Authorization": f"Bearer {key}"})

    shards = tmp_path / "shards"
    shards.mkdir()
    for part, rows in enumerate(np.array_split(np.arange(len(features)), 3)):
        pq.write_table(pa.table({"id": rows, **{n: v[rows] for n, v in columns.items()}}), shards / f"part-{part}.parquet")
    scored = shardline("batch", "run", "--model", "bc@prod", "--input", str(shards), "--output", str(tmp_path / "out"))
    assert scored.returncode == 0, scored.stderr[-2000:]
    out = ds.dataset(tmp_path / "out").to_table().sort_by("id")
    assert out.column("id").to_pylist() == list(range(len(features))) and out.column("label").to_pylist() == expected
