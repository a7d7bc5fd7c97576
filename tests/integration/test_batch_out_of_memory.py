"""Batch: a call the device has no memory for is split and retried, and the worker's later calls cut to what
fit: the shard commits every row, as a run with memory to spare writes it. The GPU's out-of-memory is the one
thing faked (onnxruntime's own message, raised by the real ONNX model's predict for calls over a size); the
shard, the model and the part written are real."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from shardline.build.examples import write_shards
from shardline.runtimes import RuntimeOptions
from shardline.runtimes.onnx import OnnxModel
from shardline.storage import scoring
from shardline.storage.job_identity import job_key
from shardline.storage.registry import ModelRegistry
from shardline.storage.scoring import ScoringJob, score_shard
from shardline.storage.shards import list_shards

from tests.conftest import BuiltModel

OOM = ("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running Gemm node. "
       "Status Message: Failed to allocate memory for requested buffer of size 2621440 (CUDA out of memory)")


@pytest.fixture
def job(breast_cancer_model: BuiltModel, tmp_path: Path) -> ScoringJob:
    registry = ModelRegistry(str(tmp_path / "registry"))
    registry.push(breast_cancer_model.bundle_dir)
    model = registry.resolve("breast-cancer:1")
    return ScoringJob(job_key=job_key(model.outputs_digest, None), model=model, output_uri=str(tmp_path / "out"),
                      passthrough=None, batch_rows=1_000, cache_dir=str(tmp_path / "cache"),
                      runtime=RuntimeOptions("cpu", 1))


def _device_holds(monkeypatch: pytest.MonkeyPatch, rows: int) -> list[int]:
    """Make the model's predict fail as a full GPU does for calls over ``rows``; returns the sizes of the calls."""
    real = OnnxModel.predict
    calls: list[int] = []

    def predict(self: OnnxModel, batch: Any) -> Any:
        calls.append(batch.num_rows)
        if batch.num_rows > rows:
            raise RuntimeError(OOM)
        return real(self, batch)

    monkeypatch.setattr(OnnxModel, "predict", predict)
    monkeypatch.setattr(scoring, "_FITS", {})
    return calls


def test_a_shard_out_of_device_memory_commits_every_row_as_with_memory_to_spare(
        job: ScoringJob, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    shard = list_shards(str(write_shards(tmp_path / "input", 1, 5_000, row_group_rows=1_000)[0]))[0]
    spare = score_shard(job, shard)
    calls = _device_holds(monkeypatch, 300)
    with caplog.at_level(logging.WARNING, logger="shardline.scoring"):
        record = score_shard(ScoringJob(**{**job.__dict__, "output_uri": str(tmp_path / "tight")}), shard)
    assert record.status == "committed" and record.rows_in == record.rows_out == 5_000
    assert pq.read_table(record.part.removeprefix("file://")).equals(pq.read_table(spare.part.removeprefix("file://")))
    # the first batch is split down to what fits (each half of it tried once) ...
    assert calls[:7] == [1_000, 500, 250, 250, 500, 250, 250]
    assert max(calls[7:]) <= 250 and sum(calls[7:]) == 4_000  # ... and every later call cut to it before it is tried
    assert "out of memory scoring 1000 rows of breast-cancer:1: split in two; this worker now scores at most 500" \
        in caplog.text


def test_a_single_row_the_device_cannot_hold_fails_the_shard_with_the_reason(
        job: ScoringJob, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shard = list_shards(str(write_shards(tmp_path / "input", 1, 100, row_group_rows=100)[0]))[0]
    _device_holds(monkeypatch, 0)
    with pytest.raises(Exception, match="Failed to allocate memory"):
        score_shard(job, shard)
