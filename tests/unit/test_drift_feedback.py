"""The drift check without Prefect (what the CLI and drift-watch share) and the answering flows' pure parts."""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shardline.build.examples import breast_cancer, golden_table, split
from shardline.bundle import read_manifest, write_manifest
from shardline.errors import EmptyInput, InvalidBundle, InvalidInput, InvalidSetting, ModelNotFound
from shardline.event_catalog import model_resource
from shardline.quality.drift import ColumnDrift, DriftReport
from shardline.quality.drift_checks import (
    MAX_WINDOW,
    check_drift,
    load_target,
    parse_window,
    report_history,
    save_report,
    window_bounds,
)
from shardline.settings import DriftSettings, StorageSettings
from shardline.storage.capture import capture_root
from shardline.storage.registry import ModelRegistry
from shardline.tasks.drift import artifact_key
from shardline.tasks.remediation import labelled_location, read_labelled, revalidate_version
from tests.conftest import BuiltModel
from tests.drift_data import capture, fresh_rows, profiled_bundle, scaled

MODEL = "breast-cancer"


@pytest.fixture(scope="module")
def profiled(breast_cancer_model: BuiltModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's bundle with a reference profile of its inputs and outputs."""
    folder = tmp_path_factory.mktemp("profiled") / "bundle"
    profiled_bundle(breast_cancer_model.bundle_dir, folder)
    return folder


@pytest.fixture
def storage(tmp_path: Path, profiled: Path) -> StorageSettings:
    """A home whose registry holds the profiled bundle as breast-cancer:1, served as prod."""
    settings = StorageSettings(home=str(tmp_path / "home"))
    registry = ModelRegistry(settings.registry)
    registry.push(profiled)
    registry.set_alias(MODEL, "prod", 1)
    return settings


@pytest.mark.parametrize("text,expected", [("24h", timedelta(hours=24)), ("90s", timedelta(seconds=90)),
                                           ("1.5d", timedelta(hours=36)), (" 2w ", timedelta(weeks=2))])
def test_windows_read_as_people_write_them(text: str, expected: timedelta) -> None:
    assert parse_window(text) == expected


@pytest.mark.parametrize("text", ["24", "h", "-1h", "0m", "one day", ""])
def test_a_bad_window_says_how_to_write_one(text: str) -> None:
    with pytest.raises(InvalidSetting, match="24h"):
        parse_window(text)


@pytest.mark.parametrize("text", ["1000000d", "3651d", "99999999999d"])
def test_a_window_past_ten_years_says_the_longest_accepted(text: str) -> None:
    # now - 1000000d is before year 1: an OverflowError out of window_bounds before the bound
    with pytest.raises(InvalidSetting, match=f"window '{text}' is longer than the longest accepted, 3650d"):
        parse_window(text)
    assert parse_window("3650d") == MAX_WINDOW


def test_window_bounds_refuse_what_no_date_can_hold() -> None:
    """drift-watch's window_hours reaches window_bounds without parse_window."""
    with pytest.raises(InvalidSetting, match=r"a window of 2\.4e\+07 h is not in \(0, 3650d\]"):
        window_bounds(timedelta(days=1_000_000))


def test_window_bounds_end_now_or_at_until_in_utc() -> None:
    until = datetime(2026, 1, 2, 3, 0, tzinfo=timezone(timedelta(hours=2)))
    since, end = window_bounds(timedelta(hours=24), until)
    assert end == until and end.tzinfo == timezone.utc and since == end - timedelta(hours=24)


def test_check_names_the_shifted_column_and_stays_quiet_on_a_fresh_sample(storage: StorageSettings, profiled: Path) -> None:
    manifest = read_manifest(profiled)
    root = capture_root(storage)
    capture(root, profiled, manifest, 1, fresh_rows(1_500, seed=3), "batch", "job-1")
    calm = check_drift(storage, f"{MODEL}@prod", timedelta(hours=1))
    assert not calm.report.drifted and calm.rows_by_tier == {"batch": 1_500}
    assert calm.report.model == f"{MODEL}:1" and calm.reference == f"{MODEL}@prod"

    capture(root, profiled, manifest, 1, scaled(fresh_rows(1_500, seed=4)), "online", "req-9")
    online = check_drift(storage, f"{MODEL}@prod", timedelta(hours=1), tier="online")
    assert online.report.drifted and online.report.drifted_columns[0] == "mean radius"
    payload = online.event_payload()
    assert (payload["name"], payload["version"], payload["alias"], payload["reference"]) == (MODEL, 1, "prod", f"{MODEL}@prod")
    assert payload["columns"][0]["column"] == "mean radius" and payload["rows_by_tier"] == {"online": 1_500}


def test_check_errors_say_what_to_do(storage: StorageSettings, profiled: Path, tmp_path: Path) -> None:
    with pytest.raises(EmptyInput, match=r"nothing of breast-cancer:1 was captured .* widen the window"):
        check_drift(storage, f"{MODEL}@prod", timedelta(hours=1))
    with pytest.raises(ModelNotFound, match="not in the registry"):
        check_drift(storage, "churn@prod", timedelta(hours=1))
    bare = tmp_path / "bare"
    shutil.copytree(profiled, bare)
    manifest = read_manifest(bare)
    write_manifest(bare, manifest.model_copy(update={
        "reference_profile": None, "artifacts": [a for a in manifest.artifacts if a.role != "profile"]}))
    registry = ModelRegistry(storage.registry)
    pushed = registry.push(bare)
    with pytest.raises(InvalidBundle, match=f"{MODEL}:{pushed.version} has no reference profile"):
        load_target(registry, pushed.reference)


def test_reports_are_kept_as_their_history() -> None:
    root = "memory://drift-history"
    start = datetime(2026, 11, 1, tzinfo=timezone.utc)
    for hour, score in enumerate([0.05, 0.1, 3.0]):
        column = ColumnDrift(column="x", role="input", kind="numeric", metric="psi", score=score, threshold=0.2,
                             drifted=score > 0.2, reason="r")
        url = save_report(root, DriftReport(model=f"{MODEL}:3", rows_reference=10, rows_current=5,
                                            computed_at=start + timedelta(hours=hour), columns=[column]))
        assert url.startswith("memory://") and f"/{MODEL}/3/" in url
    history = report_history(root, MODEL, 3)
    assert [r.columns[0].score for r in history] == [0.05, 0.1, 3.0] and history[-1].drifted
    assert [r.columns[0].score for r in report_history(root, MODEL, 3, limit=2)] == [0.1, 3.0]
    assert report_history(root, MODEL, 4) == []


def test_revalidation_scores_fresh_labels_against_the_golden_threshold(
    storage: StorageSettings, tmp_path: Path
) -> None:
    model = ModelRegistry(storage.registry).resolve(f"{MODEL}@prod")
    _, held_out = split(breast_cancer())
    labelled = golden_table(held_out)
    (tmp_path / "same").mkdir()
    pq.write_table(labelled, tmp_path / "same" / "a.parquet")
    passed = revalidate_version(model, "prod", str(tmp_path / "same"), storage)
    assert passed.passed and passed.metric == "accuracy" and passed.rows == labelled.num_rows
    assert "meets its threshold (at least 0.9)" in passed.reason

    flipped = labelled.set_column(labelled.schema.get_field_index("target"), "target",
                                  [[1 - v for v in labelled.column("target").to_pylist()]])
    (tmp_path / "changed").mkdir()
    pq.write_table(flipped, tmp_path / "changed" / "a.parquet")
    failed = revalidate_version(model, "prod", str(tmp_path / "changed"), storage)
    assert not failed.passed and failed.score < 0.5 and "misses its threshold" in failed.as_dict()["reason"]

    pq.write_table(labelled.drop(["target"]), tmp_path / "same" / "b.parquet")
    with pytest.raises(InvalidInput, match=r"lacks columns \['target'\]"):
        read_labelled(str(tmp_path / "same"), ["mean radius", "target"], {})


def test_where_answers_read_and_write(tmp_path: Path) -> None:
    assert labelled_location(MODEL, "s3://b/x", DriftSettings()) == "s3://b/x"
    assert labelled_location(MODEL, None, DriftSettings(labelled_url="s3://b/labels/")) == f"s3://b/labels/{MODEL}"
    with pytest.raises(InvalidInput, match="SHARDLINE_DRIFT_LABELLED_URL"):
        labelled_location(MODEL, None, DriftSettings())
    assert model_resource(MODEL, "prod", 3) == {
        "prefect.resource.id": f"shardline.model.{MODEL}", "shardline.model": MODEL,
        "shardline.version": "3", "shardline.alias": "prod",
    }
    assert "shardline.alias" not in model_resource(MODEL, None, 3)
    assert artifact_key("Churn_v2.1") == "drift-churn-v2-1"
    assert json.dumps(model_resource(MODEL))  # JSON-able as events need


# prefect.yaml: the drift deployments and their automations


def _deployments() -> dict[str, dict]:  # type: ignore[type-arg]
    import yaml

    project = yaml.safe_load((Path(__file__).resolve().parents[2] / "prefect.yaml").read_text())
    return {d["name"]: d for d in project["deployments"]}


@pytest.mark.parametrize("name,flow_name", [("drift-watch", "drift-watch"), ("revalidate", "revalidate-model"),
                                            ("rollback", "rollback-alias"), ("rescore", "rescore-output")])
def test_drift_deployments_load_their_flows_and_fit_their_signatures(name: str, flow_name: str) -> None:
    import inspect
    import re

    from prefect.flows import load_flow_from_entrypoint

    deployment = _deployments()[name]
    flow = load_flow_from_entrypoint(str(Path(__file__).resolve().parents[2] / deployment["entrypoint"]))
    assert flow.name == flow_name
    signature = inspect.signature(flow.fn)
    assert set(deployment.get("parameters", {})) <= set(signature.parameters)
    for trigger in deployment.get("triggers", []):
        assert trigger["type"] == "event" and trigger["enabled"] and trigger["name"]
        assert trigger["match"]["prefect.resource.id"] == "shardline.model.*"
        assert set(trigger["parameters"]) <= set(signature.parameters)
        required = {n for n, p in signature.parameters.items() if p.default is inspect.Parameter.empty}
        assert required <= set(trigger["parameters"]), "an automation's run would lack a required parameter"
        for template in trigger["parameters"].values():  # only fields every payload carries
            assert set(re.findall(r"event\.payload\.(\w+)", template)) <= {"name", "version", "alias", "reason"}


def test_the_default_chain_is_drift_to_revalidate_to_rollback_and_the_watch_ships_inactive() -> None:
    deployments = _deployments()
    assert deployments["revalidate"]["triggers"][0]["expect"] == ["shardline.drift.detected"]
    assert deployments["rollback"]["triggers"][0]["expect"] == ["shardline.model.revalidation-failed"]
    assert "triggers" not in deployments["rescore"] and "triggers" not in deployments["drift-watch"]
    [schedule] = deployments["drift-watch"]["schedules"]
    assert schedule["active"] is False and schedule["cron"] == "15 * * * *"
