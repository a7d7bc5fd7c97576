"""`shardline cost simulate JOB_ID` replays a real finished job: its shards, their recorded seconds and ranges."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardline.capacity.replay import job_work, load_finished_job
from shardline.cli import app
from shardline.flows.batch_inference import batch_inference
from shardline.storage.output import OutputLayout


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_a_finished_job_is_replayed_by_its_id(
    input_shards: Path, tmp_path: Path, shardline_home: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SHARDLINE_BATCH_CHECKPOINT_BYTES", "1")  # every row group its own checkpointed range
    out = tmp_path / "out"
    state = batch_inference(model="breast-cancer@prod", input_uri=str(input_shards), output_uri=str(out),
                            tenant="acme", return_state=True)
    assert state.is_completed()
    job_id = state.result()["job_id"]

    # what is replayed is what the job recorded: every shard, its seconds, rows and ranges
    ledger = OutputLayout(str(out), job_id=job_id).read_ledger()
    work = job_work(load_finished_job(str(shardline_home), job_id), deadline_s=60.0)
    recorded = sorted(ledger.values(), key=lambda p: p.relative)
    assert [(s.name, s.seconds, s.rows, s.ranges) for s in work.shards] == [
        (p.relative, max(p.seconds, 1e-3), p.rows_in, p.ranges) for p in recorded]
    assert len(work.shards) == 6 and {s.ranges for s in work.shards} == {4} and work.hardware_class == "cpu-8c"

    report = tmp_path / "spot.html"
    result = CliRunner().invoke(app, ["cost", "simulate", job_id, "--slack", "0.4", "--rate-per-hour", "3600",
                                      "--notice-s", "0", "--replace-s", "0.5", "--runs", "20", "-o", str(report)])
    assert result.exit_code == 0, result.output
    assert f"job {job_id}: 6 shards, 12,000 rows" in result.output
    assert "spot pays off" in result.output and "20 seeded runs" in result.output
    assert report.read_text().count("<svg") == 2
    # a report into a folder that does not exist: one line before anything is simulated, not a traceback
    missing = tmp_path / "no" / "s.html"
    nowhere = CliRunner().invoke(app, ["cost", "simulate", job_id, "--runs", "2", "-o", str(missing)])
    assert nowhere.exit_code == 2 and nowhere.stdout == "", nowhere.output
    assert nowhere.stderr.splitlines() == [
        f"error: cannot write '{missing}': the folder {missing.parent} does not exist; make it or pass another path "
        "to -o"]
