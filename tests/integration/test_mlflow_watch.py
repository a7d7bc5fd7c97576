"""The mlflow-watch flow against a real MLflow registry (a local SQLite store, models logged and registered by
MLflow's own client) under the Prefect test harness: each new version imported once, pushed and announced as
shardline.model.pushed to the harness's API; a pickled version refused, recorded and not retried; an alias
that moves imports its version once; and `shardline model watch-mlflow`, one run from the CLI."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

# imported here, not in CliRunner.invoke: Prefect's log handlers bind to the stderr of their first import
from shardline.flows.mlflow_watch import mlflow_watch
from shardline.storage.registry import ModelRegistry

from tests.mlflow_models import ALIAS, REGISTERED, LoggedModels, log_models, log_xgboost_version

pytestmark = pytest.mark.usefixtures("prefect_harness")

XGB, PICKLE, ONNX = REGISTERED["xgboost"], REGISTERED["sklearn-pickle"], REGISTERED["onnx"]
XGB_SHARDLINE = "breastcancer-xgb"  # shardline_name(XGB)


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    assert url, "the Prefect test harness sets PREFECT_API_URL"
    return str(url)


def _pushed_events(model: str, after: datetime, expect: int, timeout: float = 30) -> list[dict[str, Any]]:
    """The shardline.model.pushed events about ``model`` the API holds since ``after`` (``model_events``)."""
    from tests.integration.automations import model_events

    return model_events(_api_url(), "shardline.model.pushed", model, after, expect, timeout)


def _task_names(state: Any) -> list[str]:
    """The names of the task runs a flow run ran (read back from the API)."""
    body = {"flow_runs": {"id": {"any_": [str(state.state_details.flow_run_id)]}}}
    runs = httpx.post(f"{_api_url()}/task_runs/filter", json=body, timeout=30).json()
    return sorted(r["name"].rsplit("-", 1)[0] for r in runs)


def _watch(models: list[str], logged: LoggedModels) -> tuple[Any, dict[str, Any]]:
    state = mlflow_watch(models=models, tracking_uri=logged.tracking_uri, return_state=True)
    assert state.is_completed(), state.message
    return state, state.result()


def _counts(summary: dict[str, Any]) -> tuple[int, int, int]:
    return summary["imported"], summary["refused"], summary["unchanged"]


def _set_alias(logged: LoggedModels, version: str) -> None:
    import mlflow

    mlflow.MlflowClient(tracking_uri=logged.tracking_uri).set_registered_model_alias(XGB, ALIAS, version)


def test_each_new_version_is_imported_once_and_announced_and_a_pickle_is_refused_once(
        shardline_home: Path, tmp_path: Path) -> None:
    logged = log_models(tmp_path / "mlflow", ("xgboost", "sklearn-pickle"))
    registry = ModelRegistry(str(shardline_home / "registry"))
    started = datetime.now(timezone.utc)

    first, summary = _watch([XGB, PICKLE], logged)

    assert _counts(summary) == (1, 1, 0) and first.message == "1 imported, 1 refused, 0 unchanged"
    [v1] = registry.list_versions(XGB_SHARDLINE)
    assert v1.version == 1 and v1.tags["mlflow.source"] == f"models:/{XGB}/1" and v1.tags["mlflow.flavor"] == "xgboost"
    [event] = _pushed_events(XGB_SHARDLINE, started, expect=1)
    assert event["payload"]["reference"] == f"{XGB_SHARDLINE}:1" and event["payload"]["digest"] == v1.outputs_digest
    assert event["payload"]["source"] == f"mlflow-watch models:/{XGB}/1"
    [refused] = [o for o in summary["outcomes"] if o["action"] == "refused"]
    assert refused["target"] == PICKLE and refused["version"] == "1" and "pickle" in refused["detail"]
    assert registry.list_versions("sk-pickle") == []
    state = json.loads(next((shardline_home / "mlflow-watch").glob(f"*/{PICKLE}.json")).read_text())
    assert state["versions"]["1"]["status"] == "refused" and "pickle" in state["versions"]["1"]["reason"]

    # again: nothing new, and the refused version is not tried again (no import task runs at all)
    again, summary = _watch([XGB, PICKLE], logged)

    assert _counts(summary) == (0, 0, 2) and "import-mlflow-version" not in _task_names(again)
    assert "refused and not retried: 1" in " ".join(o["detail"] for o in summary["outcomes"])
    assert [m.version for m in registry.list_versions(XGB_SHARDLINE)] == [1]

    # a second version, and the alias moved to it: imported once, whichever way the watch names the model
    version = log_xgboost_version(logged)
    _set_alias(logged, version)
    moved, summary = _watch([f"{XGB}@{ALIAS}"], logged)

    assert version == "2" and _counts(summary) == (1, 0, 0)
    [imported] = [o for o in summary["outcomes"] if o["action"] == "imported"]
    assert imported["version"] == "2" and imported["reference"] == f"{XGB_SHARDLINE}:2"
    assert [e["payload"]["reference"] for e in _pushed_events(XGB_SHARDLINE, started, expect=2)] == [
        f"{XGB_SHARDLINE}:1", f"{XGB_SHARDLINE}:2"]
    _, summary = _watch([XGB, f"{XGB}@{ALIAS}"], logged)
    assert _counts(summary) == (0, 0, 3)  # versions 1 and 2, and the alias's version 2

    # the alias moved back to a version imported before: nothing new, the move is reported
    _set_alias(logged, "1")
    back, summary = _watch([f"{XGB}@{ALIAS}"], logged)

    assert _counts(summary) == (0, 0, 1) and "import-mlflow-version" not in _task_names(back)
    assert "alias champion moved from version 2 to a version seen before: nothing new" in summary["outcomes"][0]["line"]
    assert [m.version for m in registry.list_versions(XGB_SHARDLINE)] == [1, 2]
    assert len(_pushed_events(XGB_SHARDLINE, started, expect=3, timeout=3)) == 2  # one event per version, ever

    # the run's summary is in the UI, one key per tracking store
    artifacts = httpx.post(f"{_api_url()}/artifacts/filter", json={"artifacts": {"type": {"any_": ["markdown"]}}},
                           timeout=30).json()
    watch = [a for a in artifacts if (a["key"] or "").startswith("mlflow-watch-")]
    assert any("MLflow watch: 1 imported, 1 refused, 0 unchanged" in a["data"] for a in watch)


def test_watch_mlflow_runs_the_flow_once_from_the_cli_and_refuses_a_wrong_request(
        shardline_home: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from shardline.cli.commands import app

    logged = log_models(tmp_path / "mlflow", ("onnx",))
    run = CliRunner().invoke

    first = run(app, ["model", "watch-mlflow", ONNX, "--tracking-uri", logged.tracking_uri, "--name", f"{ONNX}=bc-onnx"])
    again = run(app, ["model", "watch-mlflow", ONNX, "--tracking-uri", logged.tracking_uri, "--name", f"{ONNX}=bc-onnx"])

    assert first.exit_code == 0, first.output
    assert f"{ONNX} version 1: imported as bc-onnx:1 (flavor onnx; announced as shardline.model.pushed" in first.stdout
    assert "no golden set, so promotion's gate evaluation refuses it" in first.stdout
    assert first.stdout.rstrip().endswith("1 imported, 0 refused, 0 unchanged")
    assert again.exit_code == 0 and again.stdout.rstrip().endswith("0 imported, 0 refused, 1 unchanged")
    assert [m.version for m in ModelRegistry(str(shardline_home / "registry")).list_versions("bc-onnx")] == [1]

    missing = run(app, ["model", "watch-mlflow", "NoSuchModel", "--tracking-uri", logged.tracking_uri])
    assert missing.exit_code == 2 and "NoSuchModel: failed (MLflow at" in missing.stderr
    assert "has no models:/NoSuchModel" in missing.stderr
    for args, says in [
        (["churn@"], "'churn@' is not NAME or NAME@ALIAS"),
        (["churn", "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"], "there is no MLflow tracking store"),
        (["churn", "--name", "churn"], "--name 'churn' is not MLFLOW_NAME=SHARDLINE_NAME"),
        ([ONNX, "--name", "Other=other"], "name_map names 'Other', which the watch does not list"),
        ([ONNX, "--golden", "golden.parquet"], "--golden 'golden.parquet' is not MLFLOW_NAME=GOLDEN.parquet"),
        ([ONNX, "--golden", "Other=golden.parquet"], "golden names 'Other', which the watch does not list"),
        ([ONNX, "--golden", f"{ONNX}=golden.parquet", "--metric", "f1"],
         "--metric 'f1' is not one of accuracy, rmse, cosine_min"),
    ]:
        refused = run(app, ["model", "watch-mlflow", *args])
        assert refused.exit_code == 2 and says in refused.stderr, refused.output
        assert len(refused.stderr.strip().splitlines()) == 1  # one line, no traceback


def test_a_new_mlflow_version_with_its_golden_set_is_promoted_through_the_promote_on_push_automation(
        shardline_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.integration.automations import deploy_with_triggers, run_flow_run_here, wait_for_flow_run
    from tests.mlflow_models import training_rows

    deployment = deploy_with_triggers(_api_url(), ["promote"])["promote"]
    monkeypatch.setenv("PREFECT_API_URL", _api_url())
    logged = log_models(tmp_path / "mlflow", ("xgboost",))
    _, labels, _, rows = training_rows()
    pq.write_table(rows, tmp_path / "train.parquet")
    pq.write_table(rows.append_column("target", pa.array(labels)).slice(0, 200), tmp_path / "golden.parquet")

    # as a deployment's parameters give it (prefect.yaml): the golden set's defaults (label target, accuracy >= 0.9)
    state = mlflow_watch(models=[XGB], tracking_uri=logged.tracking_uri, samples={XGB: str(tmp_path / "train.parquet")},
                         golden={XGB: {"rows": str(tmp_path / "golden.parquet")}}, return_state=True)

    assert state.is_completed(), state.message
    registry = ModelRegistry(str(shardline_home / "registry"))
    [v1] = registry.list_versions(XGB_SHARDLINE)
    assert v1.reference_profile is not None  # from the sample rows: the promotion gate's reference-profile passes
    assert v1.evaluation is not None and (v1.evaluation.label_column, v1.evaluation.metric) == ("target", "accuracy")
    # (the session's harness may hold runs of this deployment that other tests' pushes started)
    run = wait_for_flow_run(_api_url(), deployment["id"], timeout=30,
                            where=lambda r: r["parameters"].get("reference") == f"{XGB_SHARDLINE}:1")
    assert run["parameters"]["to_alias"] == "staging"
    assert f"mlflow-watch models:/{XGB}/1" in run["parameters"]["reason"]
    promoted = run_flow_run_here(run["id"])
    # every gate passes (the golden set scored by the imported model, the sample's profile) and staging moves
    assert promoted.is_completed(), promoted.message
    assert registry.aliases(XGB_SHARDLINE)["staging"] == 1


def test_a_version_the_registry_already_held_is_not_announced_again_when_its_sample_adds_a_profile(
        shardline_home: Path, tmp_path: Path) -> None:
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from shardline.cli.commands import app
    from tests.mlflow_models import feature_table

    logged = log_models(tmp_path / "mlflow", ("xgboost",))
    pq.write_table(feature_table(200), tmp_path / "sample.parquet")
    args = ["model", "watch-mlflow", XGB, "--tracking-uri", logged.tracking_uri, "--sample",
            f"{XGB}={tmp_path / 'sample.parquet'}"]
    started = datetime.now(timezone.utc)

    first = CliRunner().invoke(app, args)
    for state in (shardline_home / "mlflow-watch").rglob("*.json"):  # the watch forgets; the registry does not
        state.unlink()
    again = CliRunner().invoke(app, args)

    assert first.exit_code == 0 and "announced as shardline.model.pushed" in first.stdout, first.output
    assert again.exit_code == 0, again.output
    assert f"imported as {XGB_SHARDLINE}:1 (flavor xgboost; the registry already held these bytes: no new version, " \
           "no event" in again.stdout
    assert "announced" not in again.stdout
    assert [m.version for m in ModelRegistry(str(shardline_home / "registry")).list_versions(XGB_SHARDLINE)] == [1]
    assert len(_pushed_events(XGB_SHARDLINE, started, expect=2, timeout=3)) == 1
