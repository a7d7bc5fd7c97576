"""What a batch run shows in the Prefect UI: keys stable per job, and a summary a person reads first."""

from __future__ import annotations

import re

import pytest

from shardline.storage.job_identity import JobSummary
from shardline.tasks.artifacts import batch_artifact_key, batch_job_name, summary_markdown, totals_table
from shardline.tasks.sla_tracking import sla_table

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


def _planned(**changes: object) -> dict[str, object]:
    """The manifest's ``sla`` section (``planned_vs_actual``) of an 8-shard job given 2 h that took 2h10m."""
    planned: dict[str, object] = {
        "status": "breached", "started": "2026-12-01T04:00:00+00:00", "deadline": "2026-12-01T06:00:00+00:00",
        "finished": "2026-12-01T06:10:00+00:00", "budget_seconds": 7200.0, "actual_seconds": 7800.0,
        "shards": 8, "rows": 200_000, "planned_shards_per_second": 0.001111, "actual_shards_per_second": 0.001026,
    }
    planned.update(changes)
    return planned


def test_the_summary_says_rows_quarantined_shards_throughput_sla_and_where() -> None:
    text = summary_markdown(_summary(), _planned())
    assert text.startswith("## Batch job `3f2a9c01d4e5`: 2 of 8 shards quarantined")
    assert "| rows in | 20,000 |" in text and "| rows out | 15,000 |" in text
    assert "| rows quarantined | 5,000 rows |" in text
    assert "- `a/nulls.parquet`: NullValues: 'age'" in text and "- `b/corrupt.parquet`: CorruptShard" in text
    # rates in units a person reads: rows per second while scoring, shards per hour over a 2h10m run
    assert "**Throughput:** 5,000 rows/s scoring (12,500 rows in 2.5 s); 3.7 shards/h over the whole run." in text
    assert ("**SLA:** **breached**: finished 2026-12-01 06:10:00 UTC for a deadline of 2026-12-01 06:00:00 UTC "
            "(2h10m of the 2h00m allowed)") in text
    assert "**Output:** `s3://lake/acme/scored` (manifest `s3://lake/acme/scored/_manifest.json`)" in text


def test_a_shard_that_could_not_be_read_is_reported_unreadable_not_as_zero_rows() -> None:
    summary = _summary(shards_unreadable=1)
    assert "| rows quarantined | 5,000 rows + 1 unreadable shard, rows unknown |" in summary_markdown(summary)
    only = _summary(shards_quarantined=1, shards_unreadable=1, rows_quarantined=0, rows_in=15_000,
                    quarantined={"b/corrupt.parquet": "CorruptShard: not a Parquet file"})
    assert "| rows quarantined | 1 unreadable shard, rows unknown |" in summary_markdown(only)
    table = {row["measure"]: row["value"] for row in totals_table(only)}
    assert table["rows quarantined"] == "1 unreadable shard, rows unknown"
    assert table["shards unreadable (rows unknown)"] == "1"


def test_the_totals_table_names_and_formats_every_figure() -> None:
    table = {row["measure"]: row["value"] for row in totals_table(_summary(rows_in=200_000, rows_out=195_000))}
    assert table["rows in"] == "200,000" and table["rows out"] == "195,000" and table["shards"] == "8"
    assert table["scoring time"] == "2.5 s" and table["scoring throughput"] == "5,000 rows/s"
    assert table["shards settled by an earlier run"] == "1" and table["rows scored in this run"] == "12,500"
    assert table["quarantined a/nulls.parquet"] == "NullValues: 'age'"
    assert not [key for key in table if "_" in key]  # "rows in", not "rows_in"
    nothing = {row["measure"]: row["value"] for row in totals_table(_summary(rows_scored=0, steady_seconds=0.0))}
    assert nothing["scoring throughput"] == "-" and nothing["rows scored in this run"] == "0"


def test_the_sla_tables_columns_say_what_their_headers_say() -> None:
    rows = {row["measure"]: (row["planned"], row["actual"]) for row in sla_table(_planned())}
    assert list(rows) == ["finish", "time taken", "throughput", "SLA"]
    assert rows["finish"] == ("by 2026-12-01 06:00:00 UTC", "2026-12-01 06:10:00 UTC")
    assert rows["time taken"] == ("at most 2h00m", "2h10m")
    assert rows["throughput"] == ("at least 4 shards/h (8 shards)", "3.7 shards/h, 25.6 rows/s")
    assert rows["SLA"] == ("met: finished by the deadline", "breached, 10m00s late")  # not "met" as the plan
    day = {row["measure"]: (row["planned"], row["actual"]) for row in sla_table(_planned(
        status="met", budget_seconds=86_400.0, actual_seconds=41.0, finished="2026-12-01T04:00:41+00:00",
        deadline="2026-12-02T04:00:00+00:00"))}
    assert day["throughput"] == ("at least 0.33 shards/h (8 shards)", "11.7 shards/min, 4,878 rows/s")  # not 0.0001/s
    assert day["SLA"] == ("met: finished by the deadline", "met, 23h59m to spare")


def test_a_clean_run_and_a_long_quarantine_list() -> None:
    clean = summary_markdown(_summary(shards_quarantined=0, rows_quarantined=0, rows_out=20_000, quarantined={}))
    assert "20,000 rows scored" in clean and "Quarantined shards" not in clean and "**SLA:** not tracked" in clean
    many = {f"s{i:03}.parquet": "CorruptShard: bad" for i in range(25)}
    text = summary_markdown(_summary(shards_quarantined=25, quarantined=many))
    assert text.count("CorruptShard: bad") == 20 and "and 5 more: every one is in the manifest" in text


def test_input_columns_an_output_kept_out_are_told_in_the_summary_and_by_the_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from shardline.cli.batch_jobs import JobOutcome, present

    note = ("input columns ['label'] have the names of model outputs: the parts hold the model's, not the input's "
            "(rename them in the input to keep them)")
    told = _summary(shadowed_columns=["label"])
    assert f"**Note:** {note}." in summary_markdown(told) and "Note" not in summary_markdown(_summary())

    assert present(JobOutcome(0, told.as_dict()), json_out=False) == 0
    assert f"note: {note}\n" in capsys.readouterr().out
    present(JobOutcome(0, _summary().as_dict()), json_out=False)
    assert "note:" not in capsys.readouterr().out
