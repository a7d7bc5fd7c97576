"""A batch job's artifacts on the session's real Prefect API: one key per job, one version per run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardline.flows.batch_inference import batch_inference
from shardline.tasks.artifacts import batch_artifact_key

KINDS = ("summary", "totals", "sla", "progress")


def _versions(key: str) -> list[Any]:
    """Every artifact stored under ``key``, oldest first, read with the Prefect client."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        return list(client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                                          sort=ArtifactSort.CREATED_DESC))[::-1]


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_two_runs_of_a_job_form_a_history_and_the_summary_holds_the_figures(input_shards: Path, tmp_path: Path) -> None:
    (input_shards / "broken.parquet").write_bytes(b"not parquet")  # one shard quarantined, with its reason
    out = tmp_path / "scored"
    progress: list[list[tuple[int, int, int]]] = [[], []]
    runs = [batch_inference(model="breast-cancer@prod", input_uri=str(input_shards), output_uri=str(out),
                            tenant="acme", sla="2h", watchers=[lambda *seen, i=i: progress[i].append(seen)],
                            return_state=True) for i in range(2)]
    assert [r.name for r in runs] == ["Quarantined", "Quarantined"]
    first, second = (r.result() for r in runs)
    assert first["job_id"] == second["job_id"] and second["shards_skipped"] == 7  # the re-run settled nothing anew
    # the progress counts the job's 7 shards, the quarantined one among them (it was 6/6 before): the first run
    # ends at 7 of 7 with every row, the re-run (nothing to do) says once that all 7 are settled
    assert {total for _, total, _ in progress[0]} == {7} and progress[0][-1] == (7, 7, 12_000)
    assert [settled for settled, _, _ in progress[0]] == sorted(settled for settled, _, _ in progress[0])
    assert progress[1] == [(7, 7, 0)]

    keys = {kind: batch_artifact_key(kind, "breast-cancer:1", first["output"], None) for kind in KINDS}
    assert keys["summary"].startswith("batch-breast-cancer-scored-") and "job" not in keys["summary"]
    versions = {kind: _versions(key) for kind, key in keys.items()}
    # a progress bar only for a run with shards to score; every run publishes its summary, totals and SLA
    assert [len(versions[k]) for k in KINDS] == [2, 2, 2, 1], {k: len(v) for k, v in versions.items()}
    assert {a.type for a in versions["summary"]} == {"markdown"} and {a.type for a in versions["sla"]} == {"table"}
    assert len({a.flow_run_id for a in versions["summary"]}) == 2  # one version from each run

    markdown = versions["summary"][0].data
    assert "1 of 7 shards quarantined" in markdown
    assert f"| rows in | {first['rows_in']:,} |" in markdown and "| rows out | 12,000 |" in markdown
    assert "- `broken.parquet`: CorruptShard:" in markdown
    assert "rows/s scoring (12,000 rows in" in markdown
    assert "**SLA:** **met**" in markdown
    assert f"**Output:** `{first['output']}` (manifest `{first['manifest']}`)" in markdown
    # the re-run says what it did: nothing scored anew, the job's outcome and output unchanged
    again = versions["summary"][1].data
    assert "nothing scored in this run" in again and "| rows out | 12,000 |" in again

    assert "| rows quarantined | 1 unreadable shard, rows unknown |" in markdown  # not "0 rows"
    sla_rows = {row["measure"]: row for row in json.loads(versions["sla"][0].data)}
    assert sla_rows["SLA"]["planned"] == "met: finished by the deadline"
    assert sla_rows["SLA"]["actual"].startswith("met, ") and sla_rows["SLA"]["actual"].endswith(" to spare")
    assert sla_rows["time taken"]["planned"] == "at most 2h00m"
    totals = {row["measure"]: row["value"] for row in json.loads(versions["totals"][1].data)}
    assert totals["rows out"] == "12,000" and totals["shards settled by an earlier run"] == "7"
    assert totals["shards unreadable (rows unknown)"] == "1"
