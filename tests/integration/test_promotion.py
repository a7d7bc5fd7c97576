"""Promotion through the gates (a real Prefect flow under the test harness) and rollback."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from shardline.errors import AliasConflict, GateFailed
from shardline.build.examples import golden_table, package_breast_cancer, split, breast_cancer
from shardline.flows.promotion import promote_model
from shardline.quality.profile import profile_table
from shardline.storage.registry import ModelRegistry

from tests.conftest import BuiltModel

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _profile() -> dict:
    train, _ = split(breast_cancer())
    return profile_table(golden_table(train))


def _promote(reference: str, alias: str, **kwargs):  # type: ignore[no-untyped-def]
    return promote_model(reference=reference, to_alias=alias, return_state=True, **kwargs)


@pytest.fixture
def registry(shardline_home: Path, breast_cancer_model: BuiltModel, tmp_path: Path) -> ModelRegistry:
    """breast-cancer:1 (gradient boosting) and :2 (logistic regression), no aliases yet."""
    registry = ModelRegistry(str(shardline_home / "registry"))
    registry.push(breast_cancer_model.bundle_dir)
    package_breast_cancer(tmp_path / "v2", kind="logreg", reference_profile=_profile())
    registry.push(tmp_path / "v2")
    return registry


def test_promotion_passes_every_gate_and_moves_the_alias(registry: ModelRegistry) -> None:
    first = _promote("breast-cancer:1", "staging", by="ana", reason="first")
    second = _promote("breast-cancer:2", "staging", by="bo", reason="logreg is simpler")

    assert first.is_completed() and second.is_completed()
    result = second.result()
    assert (result["version"], result["previous"]) == (2, 1)
    assert [g["gate"] for g in result["gates"]] == ["signature", "checksums", "evaluation", "reference-profile"]
    assert all(g["passed"] for g in result["gates"])
    assert "accuracy 0.9" in result["gates"][2]["detail"]
    assert registry.resolve("breast-cancer@staging").version == 2
    history = registry.alias_history("breast-cancer", "staging")
    assert [(m.action, m.version, m.by, m.reason) for m in history] == [
        ("promote", 1, "ana", "first"), ("promote", 2, "bo", "logreg is simpler")
    ]
    back = registry.rollback("breast-cancer", "staging", reason="oops")
    assert back.version == 1 and registry.resolve("breast-cancer@staging").version == 1


def test_a_version_below_its_threshold_is_refused(registry: ModelRegistry, tmp_path: Path) -> None:
    package_breast_cancer(tmp_path / "strict", kind="logreg", accuracy_threshold=0.9999, reference_profile=_profile())
    strict = registry.push(tmp_path / "strict")

    state = _promote(strict.reference, "prod")

    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, GateFailed) and error.gate == "evaluation"
    assert f"{strict.reference} was not promoted to prod: gate evaluation refused" in str(error)
    assert "the bundle asks at least 0.9999" in str(error)
    assert registry.current_move("breast-cancer", "prod") is None


def test_a_golden_set_that_cannot_feed_the_model_is_a_refused_evaluation_gate(registry: ModelRegistry,
                                                                             tmp_path: Path) -> None:
    """A bundle whose golden set lacks a column the model reads (packaging refuses one now; an older or hand-made
    bundle may hold one) is the evaluation gate's verdict, not a failed task's traceback."""
    import pyarrow.parquet as pq

    from shardline.bundle import describe_artifact, read_manifest, write_manifest

    folder = tmp_path / "unfit"
    package_breast_cancer(folder, kind="logreg", reference_profile=_profile())
    pq.write_table(pq.read_table(folder / "golden.parquet").drop(["mean radius"]), folder / "golden.parquet")
    manifest = read_manifest(folder)
    artifacts = [describe_artifact(folder, "golden.parquet", role="golden") if a.role == "golden" else a
                 for a in manifest.artifacts]
    write_manifest(folder, manifest.model_copy(update={"artifacts": artifacts}))
    unfit = registry.push(folder)

    state = _promote(unfit.reference, "staging")

    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, GateFailed) and error.gate == "evaluation"
    assert f"{unfit.reference}: golden set 'golden.parquet' cannot feed the model: column 'mean radius' is missing" in (
        str(error))
    assert registry.current_move("breast-cancer", "staging") is None


def test_a_breaking_signature_is_refused_unless_allowed(registry: ModelRegistry, tmp_path: Path) -> None:
    from sklearn.linear_model import Ridge

    from shardline.build.packaging import GoldenSet, package_sklearn

    train, held_out = split(breast_cancer())
    regressor = Ridge().fit(train.features, train.labels)
    package_sklearn(regressor, tmp_path / "reg", name="breast-cancer", feature_names=train.names,
                    golden=GoldenSet(golden_table(held_out), "target", "rmse", "prediction", 0.5),
                    reference_profile=_profile())
    candidate = registry.push(tmp_path / "reg")
    assert _promote("breast-cancer:1", "prod").is_completed()

    refused = _promote(candidate.reference, "prod")
    error = refused.result(raise_on_failure=False)
    assert isinstance(error, GateFailed) and error.gate == "signature"
    assert "output 'label' of breast-cancer:1 is gone" in str(error) and "--allow-breaking" in str(error)
    assert registry.resolve("breast-cancer@prod").version == 1

    allowed = _promote(candidate.reference, "prod", allow_breaking=True)
    assert allowed.is_completed() and registry.resolve("breast-cancer@prod").version == candidate.version
    assert "rmse" in allowed.result()["gates"][2]["detail"]


def test_missing_profile_and_tampered_bytes_are_refused(registry: ModelRegistry, tmp_path: Path) -> None:
    package_breast_cancer(tmp_path / "bare", kind="logreg", accuracy_threshold=0.8)
    bare = registry.push(tmp_path / "bare")  # same model bytes as :2 but no reference profile
    error = _promote(bare.reference, "prod").result(raise_on_failure=False)
    assert isinstance(error, GateFailed) and error.gate == "reference-profile"
    assert "has no reference data profile" in str(error)

    blob = Path(registry.blob_path("breast-cancer", registry.get_manifest("breast-cancer", 2).artifacts[0].sha256))
    blob.write_bytes(blob.read_bytes()[:-4] + b"XXXX")
    error = _promote("breast-cancer:2", "prod").result(raise_on_failure=False)
    assert isinstance(error, GateFailed) and error.gate == "checksums"
    assert "was changed after packaging" in str(error)


def test_promotion_into_another_registry_copies_and_verifies(registry: ModelRegistry, tmp_path: Path) -> None:
    prod_url = str(tmp_path / "prod-registry")

    state = _promote("breast-cancer:2", "prod", target_registry_url=prod_url)

    assert state.is_completed(), state.message
    prod = ModelRegistry(prod_url)
    assert [m.version for m in prod.list_versions("breast-cancer")] == [2]  # the version number travels
    assert prod.resolve("breast-cancer@prod").outputs_digest == registry.resolve("breast-cancer:2").outputs_digest
    assert registry.current_move("breast-cancer", "prod") is None  # the source registry's aliases are untouched


def test_an_alias_moved_during_the_gates_is_not_overwritten(registry: ModelRegistry) -> None:
    from shardline.settings import StorageSettings
    from shardline.tasks.promotion import move_alias, prepare_promotion, run_gates

    storage = StorageSettings()
    registry.set_alias("breast-cancer", "prod", 1)
    plan = prepare_promotion.fn("breast-cancer:2", "prod", storage, None)
    results = run_gates.fn(plan, False)
    # another operator moves prod meanwhile
    registry.set_alias("breast-cancer", "prod", 1, by="someone-else", reason="hotfix")

    with pytest.raises(AliasConflict, match="moved while you were deciding"):
        move_alias.fn(plan, "prod", results, None, "")
    assert [m.by for m in registry.alias_history("breast-cancer", "prod")][-1] == "someone-else"


def test_a_release_takes_a_first_version_through_the_gates_alone_and_refuses_what_is_not_name_version(
        registry: ModelRegistry) -> None:
    from shardline.flows.release import release_model

    first = release_model(candidate="breast-cancer:1", by="ci", reason="first release", return_state=True)
    again = release_model(candidate="breast-cancer:1", by="ci", return_state=True)
    unpinned = release_model(candidate="breast-cancer", return_state=True)

    assert first.is_completed() and first.result()["outcome"] == "first version"
    assert [(m.action, m.version, m.by) for m in registry.alias_history("breast-cancer", "staging")] == [
        ("promote", 1, "ci")]
    prod = registry.alias_history("breast-cancer", "prod")
    assert [(m.action, m.version) for m in prod] == [("promote", 1)]
    assert "the first version (no baseline to canary against)" in prod[0].reason
    assert again.is_completed() and again.result()["outcome"] == "already on prod"
    assert unpinned.is_failed() and "is not name:version" in (unpinned.message or "")


def test_a_pushed_version_is_announced_and_prefect_yamls_automation_promotes_it_to_staging(
    shardline_home: Path, breast_cancer_model: BuiltModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.settings import PREFECT_API_URL
    from typer.testing import CliRunner

    from shardline.cli.commands import app
    from tests.integration.automations import deploy_with_triggers, model_events, run_flow_run_here, wait_for_flow_run

    api_url = str(PREFECT_API_URL.value())
    deployment = deploy_with_triggers(api_url, ["promote"])["promote"]
    monkeypatch.setenv("PREFECT_API_URL", api_url)
    before = datetime.now(timezone.utc)

    pushed = CliRunner().invoke(app, ["model", "push", str(breast_cancer_model.bundle_dir)])
    again = CliRunner().invoke(app, ["model", "push", str(breast_cancer_model.bundle_dir)])

    assert pushed.exit_code == 0 and "pushed breast-cancer:1" in pushed.stdout
    assert f"announced as shardline.model.pushed to the Prefect API at {api_url}" in pushed.stderr
    assert again.exit_code == 0 and "announced" not in again.stderr  # the same bytes: no new version, no event
    # docs/drift.md's contract for every model event: the version labelled, the payload names the model four ways
    event = model_events(api_url, "shardline.model.pushed", "breast-cancer", before)[-1]
    assert event["resource"] == {"prefect.resource.id": "shardline.model.breast-cancer",
                                 "shardline.model": "breast-cancer", "shardline.version": "1"}
    payload = event["payload"]
    assert {k: payload[k] for k in ("name", "version", "alias", "reference")} == {
        "name": "breast-cancer", "version": 1, "alias": None, "reference": "breast-cancer:1"}
    assert payload["digest"] and payload["source"]
    # (the session's harness may hold runs of this deployment that other tests' pushes started)
    run = wait_for_flow_run(api_url, deployment["id"], timeout=30,
                            where=lambda r: r["parameters"].get("reference") == "breast-cancer:1")
    assert run["parameters"]["to_alias"] == "staging"
    assert run["parameters"]["reason"].startswith("shardline.model.pushed (event ")
    assert run_flow_run_here(run["id"]).is_completed()
    registry = ModelRegistry(str(shardline_home / "registry"))
    assert registry.resolve("breast-cancer@staging").version == 1
    promoted = model_events(api_url, "shardline.model.promoted", "breast-cancer", before)[-1]
    assert promoted["resource"] == {"prefect.resource.id": "shardline.model.breast-cancer",
                                    "shardline.model": "breast-cancer", "shardline.version": "1",
                                    "shardline.alias": "staging"}
    assert {k: promoted["payload"][k] for k in ("name", "version", "alias", "reference")} == {
        "name": "breast-cancer", "version": 1, "alias": "staging", "reference": "breast-cancer@staging"}
    [move] = registry.alias_history("breast-cancer", "staging")
    assert move.by == "automation promote-on-push" and "model push" in move.reason
