"""Drift metrics and reports on the real breast-cancer model: shifted data is caught, fresh data is not."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardline.bundle import ColumnDriftThresholds, DriftPolicy, Manifest
from shardline.errors import InvalidInput
from shardline.build.examples import breast_cancer, golden_table, shard_table, shifted_table, split, with_site
from shardline.quality import drift as drift_module
from shardline.quality.drift import DriftReport, drift_report, js_divergence, ks_critical, ks_pvalue, psi
from shardline.quality.profile import profile_table, reference_profile
from shardline.quality.report import render_html, render_markdown, trend_score
from shardline.runtimes import RuntimeOptions, create_runtime

INPUT_SHIFTS = {"mean radius", "worst area", "site"}


@pytest.fixture(scope="module")
def reference(breast_cancer_model: Any) -> dict[str, Any]:
    """The profile of the training rows (with a site column) and of the model's outputs on them."""
    train, _ = split(breast_cancer())
    return reference_profile(breast_cancer_model.bundle_dir, with_site(golden_table(train), seed=1))


@pytest.fixture(scope="module")
def capture(breast_cancer_model: Any) -> Any:
    """Rows as capture stores them: the inputs, then the model's outputs."""
    runtime = create_runtime(breast_cancer_model.bundle_dir, breast_cancer_model.manifest, RuntimeOptions(device="cpu"))
    runtime.load()

    def run(table: pa.Table) -> pa.Table:
        outputs = runtime.predict(table.select(breast_cancer_model.manifest.signature.input_names))
        for name in outputs.schema.names:
            table = table.append_column(name, outputs.column(name))
        return table

    yield run
    runtime.close()


def _fresh(capture: Any, seed: int, rows: int = 5_000) -> pa.Table:
    return capture(with_site(shard_table(breast_cancer(), rows, 0, seed), seed=seed + 1))


def _shifted(capture: Any, rows: int = 5_000) -> pa.Table:
    table = with_site(shard_table(breast_cancer(), rows, 0, 8), seed=9, sites=("north", "south", "mars"))
    return capture(shifted_table(table, scale={"mean radius": 1.5}, nulls={"worst area": 0.3}, seed=3))


@pytest.mark.parametrize("seed", [11, 23])
def test_a_fresh_sample_of_the_same_distribution_raises_no_alarm(reference: dict, capture: Any, seed: int) -> None:
    report = drift_report(reference, _fresh(capture, seed), model="breast-cancer:1")
    assert not report.drifted, [c.reason for c in report.columns if c.drifted]
    assert report.score < 0.75  # margin: the worst column is well inside its threshold
    assert {c.role for c in report.columns} == {"input", "output"}
    assert report.rows_current == 5_000 and report.rows_reference == 455


def test_a_shifted_shard_names_the_shifted_columns_and_why(reference: dict, capture: Any) -> None:
    report = drift_report(reference, _shifted(capture), model="breast-cancer:1")
    by_name = {c.column: c for c in report.columns}
    drifted_inputs = {c.column for c in report.columns if c.drifted and c.role == "input"}
    assert drifted_inputs == INPUT_SHIFTS
    assert by_name["mean radius"].metric in ("psi", "ks") and by_name["mean radius"].metrics["psi"] > 1.0
    assert by_name["mean radius"].metrics["mean_current"] == pytest.approx(1.5 * by_name["mean radius"].metrics["mean_reference"], rel=0.1)
    assert by_name["worst area"].metric == "null_rate"
    assert by_name["worst area"].metrics["null_rate_current"] == pytest.approx(0.3, abs=0.03)
    assert by_name["site"].metric == "new_categories" and by_name["site"].new_categories == ["mars"]
    assert "'mars'" in by_name["site"].reason and "psi" in by_name["mean radius"].reason
    payload = report.event_payload()
    json.dumps(payload)
    assert payload["name"] == "breast-cancer" and payload["version"] == 1
    assert INPUT_SHIFTS <= {c["column"] for c in payload["columns"]}


def test_output_drift_is_judged_on_the_model_outputs(reference: dict, capture: Any) -> None:
    table = _fresh(capture, 31)
    labels = pa.array(np.zeros(table.num_rows, dtype=np.int64))
    table = table.set_column(table.schema.get_field_index("label"), "label", labels)
    report = drift_report(reference, table, model="breast-cancer:1")
    label = next(c for c in report.columns if c.column == "label")
    assert label.role == "output" and label.kind == "categorical" and label.drifted
    assert report.drifted_columns == ["label"]


def test_parquet_is_streamed_slice_by_slice_with_the_same_result(
    reference: dict, capture: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = _shifted(capture, rows=6_000)
    for i in range(3):
        pq.write_table(table.slice(i * 2_000, 2_000), tmp_path / f"part-{i}.parquet", row_group_size=500)
    whole = drift_report(reference, table, model="breast-cancer:1")
    monkeypatch.setattr(drift_module, "BATCH_ROWS", 1_000)  # six slices over three files
    streamed = drift_report(reference, pl.scan_parquet(tmp_path / "*.parquet"), model="breast-cancer:1")
    assert streamed.rows_current == 6_000
    assert streamed.drifted_columns == whole.drifted_columns
    for a, b in zip(whole.columns, streamed.columns):
        assert a.column == b.column and a.metrics == pytest.approx(b.metrics, rel=1e-9, abs=1e-12)


def test_the_policy_sets_thresholds_per_column(reference: dict, capture: Any, breast_cancer_model: Any) -> None:
    policy = DriftPolicy(columns={"mean radius": ColumnDriftThresholds(psi=10.0, ks=0.9), "site": ColumnDriftThresholds(ignore=True)})
    report = drift_report(reference, _shifted(capture), model="breast-cancer:1", policy=policy)
    names = {c.column for c in report.columns}
    assert "site" not in names
    assert "mean radius" not in report.drifted_columns and "worst area" in report.drifted_columns
    manifest = breast_cancer_model.manifest.model_copy(update={"drift": policy})
    again = Manifest.from_json(manifest.to_json(), "test")
    assert again.drift == policy and again.content_digest != breast_cancer_model.manifest.content_digest
    assert again.outputs_digest == breast_cancer_model.manifest.outputs_digest  # a policy does not change what the model computes


def test_too_few_rows_are_reported_not_judged(reference: dict, capture: Any) -> None:
    report = drift_report(reference, _shifted(capture, rows=50), model="breast-cancer:1")
    assert not report.drifted and {c.metric for c in report.columns} == {"rows"}
    assert "50 current rows" in report.columns[0].reason
    # no verdict either way: never "no drift", in any of the places a person reads it
    assert not report.judged and not any(c.judged for c in report.columns)
    assert report.verdict == "not judged: only 50 current rows; the policy judges from 100 (min_rows)"
    assert "no drift" not in render_markdown(report) and report.verdict in render_markdown(report)
    assert "| rows | - | 100 | not judged |" in render_markdown(report)  # no score, not a 0 that reads as calm
    assert math.isnan(trend_score(report))  # a gap in the history plot, where it was drawn at 0
    assert DriftReport.model_validate_json(report.model_dump_json()).not_judged == report.not_judged
    judged = drift_report(reference, _shifted(capture, rows=100), model="breast-cancer:1")
    assert judged.judged and judged.not_judged is None and judged.verdict.startswith("drift in ")


def test_nothing_captured_is_an_empty_report_and_a_bad_reference_an_error(reference: dict) -> None:
    empty = pl.LazyFrame(schema={"mean radius": pl.Float64, "label": pl.Int64})
    report = drift_report(reference, empty, model="breast-cancer:1")
    assert report.rows_current == 0 and not report.drifted
    with pytest.raises(InvalidInput, match="reference profile"):
        drift_report({"rows": 3}, empty, model="breast-cancer:1")


def test_the_metrics_agree_with_their_definitions() -> None:
    same = np.array([0.25, 0.25, 0.5])
    assert psi(same, same) == pytest.approx(0.0) and js_divergence(same, same) == pytest.approx(0.0)
    assert js_divergence(np.array([1.0, 0.0]), np.array([0.0, 1.0])) == pytest.approx(1.0)
    assert psi(np.array([0.5, 0.5]), np.array([0.9, 0.1])) == pytest.approx(0.4 * np.log(1.8) - 0.4 * np.log(0.2), rel=1e-6)
    assert ks_pvalue(ks_critical(0.01, 1_000, 1_000), 1_000, 1_000) == pytest.approx(0.01, rel=0.15)


def test_the_html_report_shows_distributions_and_the_trend(reference: dict, capture: Any) -> None:
    history = [drift_report(reference, _fresh(capture, 40 + i, rows=1_000), model="breast-cancer:1") for i in range(2)]
    report = drift_report(reference, _shifted(capture), model="breast-cancer:1")
    page = render_html(report, reference, history=history)
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") >= 4
    for column in INPUT_SHIFTS:
        assert f'data-column="{column}"' in page
    assert "Drift score over time" in page and "drift in" in page
    assert "<script" not in page and "src=" not in page and "<link" not in page  # self-contained
    markdown = render_markdown(report)
    assert "**drifted**" in markdown and "| site |" in markdown and "'mars'" in markdown


def test_a_small_reference_raises_the_thresholds_to_what_it_can_tell() -> None:
    reference = profile_table(shard_table(breast_cancer(), 30, 0, 5))
    assert reference["columns"]["id"]["kind"] == "id"  # row ids are never judged
    fresh = shard_table(breast_cancer(), 2_000, 0, 6)
    assert not drift_report(reference, fresh, model="m:1").drifted
    # Without the sample-size floors (alpha near 1) the same data would be an alarm in most columns.
    assert len(drift_report(reference, fresh, model="m:1", policy=DriftPolicy(alpha=0.999)).drifted_columns) > 10


def test_free_text_is_judged_on_its_length() -> None:
    texts = [f"ticket {i}: the printer on floor {i % 7} is out of paper" for i in range(200)]
    reference = profile_table(pa.table({"text": texts}))
    assert reference["columns"]["text"]["kind"] == "text" and "top" not in reference["columns"]["text"]
    same = drift_report(reference, pa.table({"text": [t.replace("ticket", "issue ") for t in texts]}), model="m:1")
    longer = drift_report(reference, pa.table({"text": [t * 4 for t in texts]}), model="m:1")
    assert not same.drifted and longer.drifted_columns == ["text"]
    assert "mean" in longer.columns[0].reason
