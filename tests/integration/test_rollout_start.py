"""Starting a rollout (a real Prefect flow under the test harness): the promotion gates, then the offline
replay of the golden set and the baseline's captured online requests, then the first record."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from prefect.settings import PREFECT_API_URL

from shardline.errors import GateFailed, RolloutConflict
from shardline.build.examples import breast_cancer
from shardline.flows.rollout import end_rollout, start_rollout
from shardline.storage.capture import write_capture
from shardline.storage.registry import ModelRegistry

from tests.integration.automations import model_events
from tests.tensor_models import breast_cancer_bundle

pytestmark = pytest.mark.usefixtures("prefect_harness")
MODEL = "breast-cancer"


@pytest.fixture
def registry(shardline_home: Path, tmp_path: Path) -> ModelRegistry:
    """breast-cancer:1 (gbt) on prod with 40 captured online rows (10 with a first feature of 5000);
    :2 (logreg); :3 (logreg that fails on a first feature of 1000 or more)."""
    registry = ModelRegistry(str(shardline_home / "registry"))
    for version, (kind, fails_from) in enumerate([("gbt", None), ("logreg", None), ("logreg", 1000.0)], start=1):
        registry.push(breast_cancer_bundle(tmp_path / f"v{version}", MODEL, kind, fails_from))
    registry.set_alias(MODEL, "prod", 1)
    data = breast_cancer()
    rows = data.features[:40].astype(np.float32)
    rows[30:, 0] = 5000.0
    inputs = pa.table({n: rows[:, j] for j, n in enumerate(data.names)})
    write_capture(str(shardline_home / "capture"), MODEL, 1, "online", inputs, pa.table({"label": np.zeros(40, np.int64)}),
                  tenant="acme", source="test")
    return registry


def test_a_candidate_failing_on_captured_requests_is_refused_before_any_traffic(registry: ModelRegistry) -> None:
    state = start_rollout(candidate=f"{MODEL}:3", mode="canary", steps=[5, 100], return_state=True)
    error = state.result(raise_on_failure=False)
    assert state.is_failed() and isinstance(error, GateFailed) and error.gate == "replay"
    assert "breast-cancer:3 failed on 10 of 40 captured rows that breast-cancer:1 answers" in str(error)
    assert [m.action for m in registry.alias_history(MODEL, "prod")] == ["set"]  # no rollout began


def test_a_rollout_starts_after_the_gates_and_the_replay_and_one_runs_at_a_time(registry: ModelRegistry) -> None:
    before = datetime.now(timezone.utc)
    state = start_rollout(candidate=f"{MODEL}:2", mode="canary", steps=[10, 50, 100], interval_s=600,
                          criteria={"min_requests": 30}, by="ana", return_state=True)
    result = state.result()
    assert [g["gate"] for g in result["gates"]] == ["signature", "checksums", "evaluation", "reference-profile"]
    golden, captured = result["replay"]["golden"], result["replay"]["captured"]
    assert golden["compared"] == golden["rows"] == 114 and golden["failed"] == 0
    assert captured["compared"] == captured["rows"] == 40 and 0 <= captured["disagreement"] <= 1
    move = registry.current_move(MODEL, "prod")
    assert move is not None and move.action == "canary" and move.version == 1 and move.by == "ana"
    assert move.rollout is not None and move.rollout.weight == 10 and move.rollout.criteria.min_requests == 30
    assert move.rollout.offline["captured"]["rows"] == 40

    second = start_rollout(candidate=f"{MODEL}:3", mode="shadow", shadow=0.1, return_state=True)
    refused = second.result(raise_on_failure=False)
    assert isinstance(refused, RolloutConflict) and "a rollout runs on breast-cancer already" in str(refused)

    ended = end_rollout(name=MODEL, action="promote", reason="looks good")
    assert ended.action == "promote" and ended.version == 2 and registry.resolve(f"{MODEL}@prod").version == 2
    assert [m.action for m in registry.alias_history(MODEL, "prod")] == ["set", "canary", "promote"]

    # the rollout's events keep docs/drift.md's contract for model events, and the notice's fields (model, alias)
    api_url = str(PREFECT_API_URL.value())
    [started] = model_events(api_url, "shardline.rollout.started", MODEL, before)
    [promoted] = model_events(api_url, "shardline.rollout.promoted", MODEL, before)
    for event, version in ((started, 1), (promoted, 2)):  # the version prod points at after the record
        assert event["resource"] == {"prefect.resource.id": f"shardline.model.{MODEL}", "shardline.model": MODEL,
                                     "shardline.version": str(version), "shardline.alias": "prod"}
        payload = event["payload"]
        assert {k: payload[k] for k in ("name", "version", "alias", "reference", "model")} == {
            "name": MODEL, "version": version, "alias": "prod", "reference": f"{MODEL}@prod", "model": MODEL}
        assert (payload["candidate"], payload["baseline"], payload["rollout"]) == (2, 1, move.rollout.id)


def test_a_routers_rollback_event_reaches_prefect_and_its_automation_tells_people(
    shardline_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from prefect.settings import PREFECT_API_URL

    from shardline.online.router.events import RouterEvents
    from tests.integration.automations import deploy_with_triggers, run_flow_run_here, wait_for_flow_run

    api_url = str(PREFECT_API_URL.value())
    deployment = deploy_with_triggers(api_url, ["rollout-notice"])["rollout-notice"]
    monkeypatch.setenv("PREFECT_API_URL", api_url)
    reason = "rollout 0123456789ab: rolled back by the router: candidate error rate 50.0% (20 of 40)"
    # what the router posts, as it posts it (plain HTTP to the API's /events; Prefect is not imported there)
    RouterEvents(str(shardline_home)).emit("shardline.rollout.rolled-back", "churn", "prod", {
        "model": "churn", "alias": "prod", "rollout": "0123456789ab", "candidate": 3, "baseline": 1,
        "reason": reason, "by": "router-test"})
    run = wait_for_flow_run(api_url, deployment["id"], timeout=30)
    assert run["parameters"]["model"] == "churn" and run["parameters"]["reason"] == reason
    assert run_flow_run_here(run["id"]).is_completed()
    [notice] = (shardline_home / "notifications" / "rollouts").glob("churn-rolled-back-*.json")
    recorded = json.loads(notice.read_text())
    assert recorded["reason"] == reason and recorded["alias"] == "prod" and str(recorded["baseline"]) == "1"
    assert "churn@prod is on version 1" in recorded["action"]



def test_a_release_follows_the_routers_verdict_in_the_alias_log(registry: ModelRegistry) -> None:
    """tasks/release.py reads prod's log for the release's rollout: still running when the wait runs out, rolled
    back by the routers (after a step, with its records), or prod moved by someone else meanwhile."""
    from shardline.settings import StorageSettings
    from shardline.storage import rollouts
    from shardline.tasks.release import await_verdict, release_candidate

    storage = StorageSettings()
    candidate = release_candidate(storage, f"{MODEL}:2")
    assert (candidate.name, candidate.version, candidate.on_prod_already) == (MODEL, 2, False)
    assert candidate.prod is not None and candidate.prod.version == 1
    rollout = rollouts.start(registry, MODEL, "prod", 2, mode="canary", steps=(50.0, 100.0), by="ci").rollout
    assert rollout is not None
    running = await_verdict(storage, candidate, rollout.id, 0, 0.01)
    assert running.outcome == "still running" and "still runs after 0 s" in running.message

    rollouts.advance(registry, MODEL, "prod", rollout_id=rollout.id, by="router")
    rollouts.roll_back(registry, MODEL, "prod", rollout_id=rollout.id, reason="errors 9%", by="router")
    verdict = await_verdict(storage, candidate, rollout.id, 60, 0.01)
    assert verdict.outcome == "rolled back"
    assert verdict.message == (f"{MODEL}@prod stays on 1: the canary of {MODEL}:2 was rolled back "
                               f"(rollout {rollout.id}: errors 9%)")
    assert [(r["action"], r["weight"]) for r in verdict.records] == [("canary", 50.0), ("canary", 100.0),
                                                                     ("rollback", 100.0)]

    again = rollouts.start(registry, MODEL, "prod", 2, mode="canary", steps=(50.0, 100.0), by="ci").rollout
    assert again is not None
    registry.set_alias(MODEL, "prod", 1, by="ops", reason="hotfix")
    moved = await_verdict(storage, candidate, again.id, 60, 0.01)
    assert moved.outcome == "moved"
    assert moved.message == f"{MODEL}@prod moved to 1 by ops (hotfix) while the canary of {MODEL}:2 ran"


@pytest.mark.parametrize("candidate", [MODEL, f"{MODEL}@prod", f"{MODEL}:two"])
def test_a_release_candidate_must_be_pinned(registry: ModelRegistry, candidate: str) -> None:
    from shardline.errors import InvalidInput
    from shardline.settings import StorageSettings
    from shardline.tasks.release import release_candidate

    with pytest.raises(InvalidInput, match="push the bundle first and give the version"):
        release_candidate(StorageSettings(), candidate)
