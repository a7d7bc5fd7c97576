"""What a batch run shows in the Prefect UI: keys stable per job, and a summary a person reads first."""

from __future__ import annotations

import re

import pytest

from shardline.storage.job_identity import JobSummary
from shardline.tasks.artifacts import batch_artifact_key, batch_job_name, summary_markdown

KEY = re.compile(r"^[a-z0-9-]+$")  # what Prefect accepts as an artifact key


def _summary(**changes: object) -> JobSummary:
    fields: dict[str, object] = dict(
        job_id="3f2a9c01d4e5b6a7", model="breast-cancer:3", tenant="acme", output="s3://lake/acme/scored",
        shards=8, shards_committed=6, shards_skipped=1, shards_quarantined=2, rows_in=20_000, rows_out=15_000,
        rows_quarantined=5_000, rows_scored=12_500, steady_seconds=2.5,
        quarantined={"b/corrupt.parquet": "CorruptShard: not a Parquet file", "a/nulls.parquet": "NullValues: 'age'"},
        manifest="s3://lake/acme/scored/_manifest.json",
    )
    fields.update(changes)
    return JobSummary(**fields)  # type: ignore[arg-type]


def test_a_deployments_runs_share_one_key_whatever_the_model_version() -> None:
    assert batch_artifact_key("summary", "breast-cancer:3", "s3://a/out", "nightly") == "batch-nightly-summary"
    assert batch_artifact_key("summary", "breast-cancer:4", "/other", "nightly") == "batch-nightly-summary"
    assert batch_job_name("Nightly Run_EU", "m:1", "/x") == "nightly-run-eu"


def test_a_run_without_a_deployment_is_named_by_model_and_output() -> None:
    key = batch_artifact_key("sla", "breast-cancer:3", "s3://lake/acme/Scored Out/", None)
    assert re.fullmatch(r"batch-breast-cancer-scored-out-[0-9a-f]{8}-sla", key), key
    # another version of the model into the same folder: the same job name (a history across versions)
    assert batch_artifact_key("sla", "breast-cancer:4", "s3://lake/acme/Scored Out", None) == key
    # two folders of the same name elsewhere stay apart
    assert batch_artifact_key("sla", "breast-cancer:3", "s3://lake/other/Scored Out", None) != key


@pytest.mark.parametrize("deployment,model,output", [
    (None, "Ünïcode_Model:1", "/data/ünï/ÖUT"), (None, "m" * 200 + ":1", "/" + "o" * 300), ("---", "m:1", "/"),
    ("a" * 300, "m:1", "/x"), (None, "@@@", ""),
])
def test_every_key_is_one_prefect_accepts(deployment: str | None, model: str, output: str) -> None:
    for kind in ("summary", "totals", "sla", "progress"):
        key = batch_artifact_key(kind, model, output, deployment)
        assert KEY.fullmatch(key) and "--" not in key and len(key) <= 100, key


def test_the_summary_says_rows_quarantined_shards_throughput_sla_and_where() -> None:
    planned = {"status": "breached", "deadline": "2026-12-01T06:00:00+00:00", "finished": "2026-12-01T06:10:00+00:00",
               "budget_seconds": 7200.0, "actual_seconds": 7800.0, "actual_shards_per_second": 0.001}
    text = summary_markdown(_summary(), planned)
    assert text.startswith("## Batch job `3f2a9c01d4e5`: 2 of 8 shards quarantined")
    assert "| rows in | 20,000 |" in text and "| rows out | 15,000 |" in text and "| rows quarantined | 5,000 |" in text
    assert "- `a/nulls.parquet`: NullValues: 'age'" in text and "- `b/corrupt.parquet`: CorruptShard" in text
    assert "5,000 rows/s scoring (12,500 rows in 2.5 s)" in text
    assert "**SLA:** **breached**: finished 2026-12-01 06:10:00 UTC for a deadline of 2026-12-01 06:00:00 UTC" in text
    assert "**Output:** `s3://lake/acme/scored` (manifest `s3://lake/acme/scored/_manifest.json`)" in text


def test_a_clean_run_and_a_long_quarantine_list() -> None:
    clean = summary_markdown(_summary(shards_quarantined=0, rows_quarantined=0, rows_out=20_000, quarantined={}))
    assert "20,000 rows scored" in clean and "Quarantined shards" not in clean and "**SLA:** not tracked" in clean
    many = {f"s{i:03}.parquet": "CorruptShard: bad" for i in range(25)}
    text = summary_markdown(_summary(shards_quarantined=25, quarantined=many))
    assert text.count("CorruptShard: bad") == 20 and "and 5 more: every one is in the manifest" in text
