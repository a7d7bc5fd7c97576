"""The batch path's quality hooks over real shards: the data contract quarantines a shifted or
nulled shard before scoring, and each scored shard leaves a capture sample for drift checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardline.flows.batch_inference import batch_inference
from shardline.runtimes import RuntimeOptions
from shardline.storage.capture import CAPTURE_META, scan_capture
from shardline.storage.job_identity import job_key
from shardline.storage.registry import ModelRegistry
from shardline.storage.scoring import ScoringJob, ShardCapture, score_shard
from shardline.storage.shards import list_shards

from tests.conftest import BuiltModel

CAPTURED = 300


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_contract_quarantines_bad_shards_and_capture_keeps_a_sample_of_good_ones(
    input_shards: Path, tmp_path: Path, shardline_home: Path, breast_cancer_model: BuiltModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SHARDLINE_BATCH_CAPTURE_ROWS_PER_SHARD", str(CAPTURED))
    good = pq.read_table(input_shards / "part-00000.parquet")
    radius = good.schema.get_field_index("mean radius")
    pq.write_table(good.set_column(radius, "mean radius", pa.compute.multiply(good.column("mean radius"), 40.0)),
                   input_shards / "shifted.parquet")
    texture = good.schema.get_field_index("mean texture")
    pq.write_table(good.set_column(texture, "mean texture", pa.nulls(good.num_rows, pa.float64())),
                   input_shards / "nulled.parquet")
    out = tmp_path / "out"

    state = batch_inference(model="breast-cancer@prod", input_uri=str(input_shards), output_uri=str(out),
                            tenant="acme", return_state=True)

    assert state.is_completed() and state.name == "Quarantined", state.message
    summary = state.result()
    assert (summary["shards_committed"], summary["shards_quarantined"]) == (6, 2)
    assert summary["rows_out"] == 12_000 and summary["rows_quarantined"] == 4_000
    reasons = {Path(q["shard"]).name: q["reason"] for q in json.loads((out / "_manifest.json").read_text())["quarantined"]}
    assert reasons["shifted.parquet"].startswith("DataContract: ")
    assert "'mean radius'" in reasons["shifted.parquet"] and "expect_column_values_to_be_between" in reasons["shifted.parquet"]
    assert reasons["nulled.parquet"].startswith("DataContract: ")
    assert "'mean texture'" in reasons["nulled.parquet"] and "expect_column_values_to_not_be_null" in reasons["nulled.parquet"]
    assert not (out / "shifted.parquet").exists() and not (out / "nulled.parquet").exists()

    captured = scan_capture(str(shardline_home / "capture"), "breast-cancer", tier="batch").collect()
    assert captured.height == 6 * CAPTURED  # the good shards' first rows; nothing of the quarantined ones
    assert set(captured["_source"]) == {summary["job_id"]} and set(captured["_tenant"]) == {"acme"}
    assert set(captured["_tier"]) == {"batch"}
    names = breast_cancer_model.manifest.signature.input_names
    assert captured.columns[: len(names)] == names and captured.columns[-len(CAPTURE_META):] == list(CAPTURE_META)
    heads = pa.concat_tables(pq.read_table(p).slice(0, CAPTURED) for p in sorted(input_shards.glob("part-*.parquet")))
    got = captured.sort(names[:3])
    want_inputs = np.column_stack([heads.column(n).to_numpy() for n in names])
    labels, _ = breast_cancer_model.expected(heads)
    order = np.lexsort([want_inputs[:, 2], want_inputs[:, 1], want_inputs[:, 0]])
    np.testing.assert_allclose(got.select(names).to_numpy(), want_inputs[order], rtol=1e-6)
    assert np.array_equal(got["label"].to_numpy(), labels[order])  # the model's own outputs, row by row


def test_a_capture_failure_never_fails_the_shard(
    breast_cancer_model: BuiltModel, input_shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    registry = ModelRegistry(str(tmp_path / "registry"))
    registry.push(breast_cancer_model.bundle_dir)
    model = registry.resolve("breast-cancer:1")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the capture folder should be")
    job = ScoringJob(
        job_key=job_key(model.outputs_digest, None), model=model, output_uri=str(tmp_path / "out"), passthrough=None,
        batch_rows=700, cache_dir=str(tmp_path / "cache"), runtime=RuntimeOptions("cpu", 1),
        capture=ShardCapture(str(blocker / "capture"), 100, "acme", "job-1"),
    )

    record = score_shard(job, list_shards(str(input_shards / "part-00001.parquet"))[0])

    assert record.status == "committed" and record.rows_out == 2_000
    assert pq.read_metadata(record.part.removeprefix("file://")).num_rows == 2_000
    assert "capture of shard part-00001.parquet failed" in caplog.text  # logged, not raised
