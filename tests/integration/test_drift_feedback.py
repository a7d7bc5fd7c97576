"""Drift feedback with real parts: capture -> drift-watch -> event -> prefect.yaml automation -> answering flow.

The automations are the ones prefect.yaml declares, deployed with the real
`prefect deploy` into the session's Prefect test harness (whose triggers service
fires them); the flow runs they create are executed here, in this process.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from shardline.build.examples import breast_cancer, golden_table, package_breast_cancer, split
from shardline.settings import StorageSettings
from shardline.storage.capture import capture_root
from shardline.storage.registry import ModelRegistry

from tests.conftest import BuiltModel
from tests.drift_data import capture, fresh_rows, profiled_bundle, scaled
from tests.integration.automations import deploy_with_triggers, run_flow_run_here, wait_for_flow_run

pytestmark = pytest.mark.usefixtures("prefect_harness")
MODEL = "breast-cancer"


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    assert url, "the Prefect test harness sets PREFECT_API_URL"
    return str(url)


def _runs_of(api_url: str, deployment_id: str) -> list[str]:
    import httpx

    body = {"deployments": {"id": {"any_": [deployment_id]}}}
    return [r["id"] for r in httpx.post(f"{api_url}/flow_runs/filter", json=body, timeout=30).json()]


def _events(api_url: str, name: str, after: Any, timeout: float = 30) -> list[dict[str, Any]]:
    """Events of one name about this model that reached the server after ``after`` (they persist asynchronously)."""
    import time

    import httpx

    body = {"filter": {"event": {"name": [name]}, "resource": {"id": [f"shardline.model.{MODEL}"]},
                       "occurred": {"since": after.isoformat()}}}
    deadline = time.monotonic() + timeout
    while True:
        found: list[dict[str, Any]] = httpx.post(f"{api_url}/events/filter", json=body, timeout=30).json()["events"]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.fixture
def served(shardline_home: Path, breast_cancer_model: BuiltModel, tmp_path: Path) -> dict[str, Any]:
    """breast-cancer:1 (gradient boosting) then :2 (logistic regression) served as prod; both fully profiled."""
    registry = ModelRegistry(str(shardline_home / "registry"))
    first = profiled_bundle(breast_cancer_model.bundle_dir, tmp_path / "v1")
    registry.push(tmp_path / "v1")
    package_breast_cancer(tmp_path / "v2-src", kind="logreg")
    second = profiled_bundle(tmp_path / "v2-src", tmp_path / "v2")
    registry.push(tmp_path / "v2")
    registry.set_alias(MODEL, "prod", 1, by="ana", reason="first")
    registry.set_alias(MODEL, "prod", 2, by="bo", reason="logreg is simpler")
    return {"registry": registry, "bundles": {1: (tmp_path / "v1", first), 2: (tmp_path / "v2", second)}}


def test_a_shifted_shard_rolls_prod_back_through_the_declared_automations(
    served: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardline.flows.drift_watch import drift_watch

    registry: ModelRegistry = served["registry"]
    bundle, manifest = served["bundles"][2]
    root = capture_root(StorageSettings())
    # what prod saw: a fresh sample online, and a batch shard whose 'mean radius' arrived in other units
    capture(root, bundle, manifest, 2, fresh_rows(600, seed=11), "online", "req-1")
    capture(root, bundle, manifest, 2, scaled(fresh_rows(2_000, seed=12)), "batch", "job-7")
    # fresh labels disagree with the model (the world changed): re-validation must fail
    _, held_out = split(breast_cancer())
    labelled = golden_table(held_out)
    flipped = labelled.set_column(labelled.schema.get_field_index("target"), "target",
                                  [[1 - v for v in labelled.column("target").to_pylist()]])
    (tmp_path / "labelled" / MODEL).mkdir(parents=True)
    pq.write_table(flipped, tmp_path / "labelled" / MODEL / "fresh.parquet")
    monkeypatch.setenv("SHARDLINE_DRIFT_LABELLED_URL", str(tmp_path / "labelled"))

    api_url = _api_url()
    deployments = deploy_with_triggers(api_url, ["drift-watch", "revalidate", "rollback"])
    revalidate_id, rollback_id = deployments["revalidate"]["id"], deployments["rollback"]["id"]
    seen = _runs_of(api_url, revalidate_id) + _runs_of(api_url, rollback_id)

    started = datetime.now(timezone.utc)
    watched = drift_watch(model=f"{MODEL}@prod", window_hours=1, return_state=True)

    summary = watched.result()
    assert watched.name == "Drifted" and summary["model"] == f"{MODEL}:2"
    assert summary["drifted_columns"][0] == "mean radius"
    assert summary["events"] == ["shardline.drift.detected", "shardline.quality.failed"]
    assert any("column 'mean radius'" in f for f in summary["contract_failures"])
    assert summary["rows_by_tier"] == {"online": 600, "batch": 2_000}
    assert Path(summary["report"].removeprefix("file://")).is_file()
    failed = _events(api_url, "shardline.quality.failed", after=started)
    assert failed and failed[0]["resource"]["shardline.alias"] == "prod"
    assert failed[0]["payload"]["version"] == 2 and failed[0]["payload"]["check"] == "contract"

    revalidation = wait_for_flow_run(api_url, revalidate_id, timeout=60, exclude=seen)
    assert revalidation["parameters"]["model"] == f"{MODEL}:2" and revalidation["parameters"]["alias"] == "prod"
    state = run_flow_run_here(revalidation["id"])
    assert state.is_failed() and "misses its threshold" in (state.message or "")

    rollback = wait_for_flow_run(api_url, rollback_id, timeout=60, exclude=seen)
    assert rollback["parameters"]["expected_version"] == 2
    state = run_flow_run_here(rollback["id"])
    assert state.is_completed() and state.name == "Completed"

    assert registry.resolve(f"{MODEL}@prod").version == 1
    move = registry.current_move(MODEL, "prod")
    assert move is not None and (move.action, move.version, move.previous) == ("rollback", 1, 2)
    assert move.by == "automation rollback-on-failed-revalidation"
    assert move.reason.startswith("shardline.model.revalidation-failed (event ")
    assert f"{MODEL}:2 scores accuracy" in move.reason and "misses its threshold" in move.reason


def test_answers_that_have_nothing_to_do_say_so_and_change_nothing(served: dict[str, Any]) -> None:
    from shardline.flows.drift_watch import drift_watch
    from shardline.flows.remediation import rollback_alias

    registry: ModelRegistry = served["registry"]
    # nothing of version 1 was captured: no verdict, no event
    quiet = drift_watch(model=f"{MODEL}:1", window_hours=1, return_state=True)
    assert quiet.is_completed() and quiet.name == "NoData"
    # a late event about version 1 must not move prod, which serves version 2 now
    stale = rollback_alias(model=MODEL, alias="prod", expected_version=1, by="automation x", reason="late",
                           return_state=True)
    assert stale.is_completed() and stale.name == "Skipped"
    assert registry.resolve(f"{MODEL}@prod").version == 2 and len(registry.alias_history(MODEL, "prod")) == 2


@pytest.mark.usefixtures("on_cluster")
def test_rescore_scores_a_finished_jobs_input_again_with_another_version(
    served: dict[str, Any], tmp_path: Path
) -> None:
    import json

    import pyarrow.dataset as ds

    from shardline.build.examples import write_shards
    from shardline.flows.batch_inference import batch_inference
    from shardline.flows.remediation import rescore_output

    input_shards = tmp_path / "input"
    write_shards(input_shards, 2, 1_000)

    nightly = tmp_path / "nightly"
    first = batch_inference(model=f"{MODEL}@prod", input_uri=str(input_shards), output_uri=str(nightly),
                            tenant="acme", passthrough=["id"], return_state=True)
    assert first.is_completed()

    state = rescore_output(job_output_uri=str(nightly), model=f"{MODEL}:1", return_state=True)

    assert state.is_completed(), state.message
    again = Path(f"{nightly}-rescored-{MODEL}-v1")
    result = state.result()
    assert result["previous_model"] == f"{MODEL}:2" and result["rows_out"] == 2_000
    assert result["output"] == str(again)
    manifest = json.loads((again / "_manifest.json").read_text())
    assert manifest["model"]["pinned"] == f"{MODEL}:1" and manifest["tenant"] == "acme"
    assert manifest["input"] == str(input_shards) and manifest["passthrough"] == ["id"]
    rescored = ds.dataset(again, format="parquet").to_table().sort_by("id")
    original = ds.dataset(nightly, format="parquet").to_table().sort_by("id")
    assert rescored.num_rows == original.num_rows == 2_000
    assert rescored.column("id").equals(original.column("id"))
    assert json.loads((nightly / "_manifest.json").read_text())["model"]["pinned"] == f"{MODEL}:2"  # untouched

    missing = rescore_output(job_output_uri=str(tmp_path / "nowhere"), model=f"{MODEL}:1", return_state=True)
    assert missing.is_failed() and "holds no committed batch job" in (missing.message or "")


def test_capture_round_trips_through_a_real_s3_server(s3_server: Any, s3_prefix: str) -> None:
    import pyarrow as pa

    from shardline.storage.capture import CaptureBuffer, scan_capture, write_capture

    root = s3_server.url(s3_prefix, "capture")
    options = s3_server.storage_options
    inputs = pa.table({"x": [1.0, 2.0, 3.0]})
    outputs = pa.table({"y": [0, 1, 0]})
    url = write_capture(root, MODEL, 1, "batch", inputs, outputs, tenant="acme", source="job-1", storage_options=options)
    assert url is not None and url.startswith(f"s3://{s3_server.bucket}/{s3_prefix}/capture/{MODEL}/v1/batch/date=")
    with CaptureBuffer(root, MODEL, 1, "online", options, flush_seconds=3600) as buffer:
        assert buffer.add(inputs, outputs, tenant="zeta", source="req-1")
    assert buffer.written_rows == 3

    frame = scan_capture(root, MODEL, version=1, storage_options=options).collect().sort("_tier")
    assert frame.height == 6 and frame["_tier"].to_list() == ["batch"] * 3 + ["online"] * 3
    assert frame["x"].to_list() == [1.0, 2.0, 3.0] * 2
    listed = s3_server.filesystem().find(f"{s3_server.bucket}/{s3_prefix}/capture")
    assert all(path.endswith(".parquet") for path in listed)  # nothing left in _staging
