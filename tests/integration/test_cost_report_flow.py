"""The monthly cost-report flow on the session's real Prefect API, over a ledger a real batch job wrote."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from shardline.flows.batch_inference import batch_inference
from shardline.flows.cost_report import cost_report
from shardline.storage.ledger import LedgerStore, month_of, previous_month


def _artifact(key: str) -> Any:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert len(found) == 1, f"{len(found)} artifacts under {key}"
    return found[0]


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_the_months_chargeback_is_an_artifact_and_a_page_that_add_up(input_shards: Path, tmp_path: Path,
                                                                     shardline_home: Path) -> None:
    from datetime import datetime, timezone

    job = batch_inference(model="breast-cancer@prod", input_uri=str(input_shards), output_uri=str(tmp_path / "out"),
                          tenant="acme", return_state=True)
    assert job.is_completed(), job
    month = month_of(datetime.now(timezone.utc))
    assert LedgerStore(str(shardline_home)).read(month).num_rows == 2  # the run's use and what it held

    state = cost_report(month=month, return_state=True)

    assert state.is_completed() and state.name == "Completed", state
    summary = state.result()
    assert set(summary["tenants"]) == {"acme"} and summary["tenants"]["acme"] > 0
    assert summary["charged"] + summary["idle"] == pytest.approx(summary["priced_capacity"], rel=1e-3)
    markdown = _artifact(f"cost-report-{month}").data
    assert f"# Cost report {month}" in markdown
    [line] = [row for row in markdown.splitlines() if row.startswith("| acme |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "breast-cancer" and cells[2] == "batch" and cells[6] == "12,000"  # 6 shards x 2,000 rows
    page = Path(summary["page"])
    assert page == shardline_home / "reports" / "cost" / f"{month}.html" and "<svg" in page.read_text()


@pytest.mark.usefixtures("prefect_harness", "shardline_home")
def test_a_month_with_nothing_metered_completes_as_no_data_and_a_bad_month_fails_saying_so() -> None:
    empty = cost_report(month="2001-01", return_state=True)
    assert empty.is_completed() and empty.name == "NoData"
    assert empty.message == "the metering ledger holds nothing for 2001-01"
    bad = cost_report(month="2026-13", return_state=True)
    assert bad.is_failed()
    assert re.search(r"'2026-13' is not a month; give it as YYYY-MM", str(bad.message))
    assert re.fullmatch(r"\d{4}-\d{2}", previous_month())  # what a run without a month reports
