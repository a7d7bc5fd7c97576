"""The mlflow-watch decisions without MLflow or Prefect: what to import given what was seen and what MLflow lists,
the watch's targets, its state on a file system, its summary, and its deployment in prefect.yaml."""

from __future__ import annotations

import inspect
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardline.errors import InvalidSetting
from shardline.build.mlflow_import import RegisteredVersions
from shardline.build.mlflow_watch import (
    AliasMove,
    SeenVersion,
    WatchOutcome,
    WatchState,
    WatchSummary,
    WatchTarget,
    plan_outcomes,
    plan_watch,
    state_file_name,
    tracking_key,
    watch_targets,
)
from shardline.tasks.mlflow_watch_state import WatchStates
from shardline.tasks.mlflow_watch import render_watch_markdown

REPO = Path(__file__).resolve().parents[2]
NOW = datetime(2026, 1, 2, 3, 4, tzinfo=timezone.utc)
CHURN, CHAMPION = WatchTarget("Churn", None, "churn"), WatchTarget("Churn", "champion", "churn")


def _listed(*versions: str | tuple[str, str], aliases: dict[str, str] | None = None) -> RegisteredVersions:
    pairs = tuple(v if isinstance(v, tuple) else (v, "READY") for v in versions)
    return RegisteredVersions("Churn", pairs, aliases or {})


def _state(imported: tuple[str, ...] = (), refused: tuple[str, ...] = (), aliases: dict[str, str] | None = None
           ) -> WatchState:
    state = WatchState(tracking_uri="sqlite:///mlflow.db", model="Churn", aliases=aliases or {})
    for version in imported:
        state = state.with_version(version, SeenVersion(status="imported", at=NOW, reference=f"churn:{version}"))
    for version in refused:
        state = state.with_version(version, SeenVersion(status="refused", at=NOW, reason="a pickle"))
    return state


# what to import


def test_a_first_run_imports_every_ready_version_oldest_first_and_leaves_the_unready_for_later() -> None:
    listed = _listed("10", "2", "9", ("11", "PENDING_REGISTRATION"), ("12", "FAILED_REGISTRATION"))

    plan = plan_watch(CHURN, listed, _state())

    assert plan.to_import == ("2", "9", "10") and plan.pending == ("11", "12") and plan.unchanged == ()


def test_a_version_seen_before_is_not_imported_again_imported_or_refused() -> None:
    plan = plan_watch(CHURN, _listed("1", "2", "3", "4"), _state(imported=("1", "3"), refused=("2",)))

    assert plan.to_import == ("4",) and plan.unchanged == ("1", "2", "3") and plan.refused_before == ("2",)


def test_nothing_new_is_nothing_to_do() -> None:
    plan = plan_watch(CHURN, _listed("1", "2"), _state(imported=("1", "2")))

    assert plan.to_import == () and plan.pending == () and plan.alias_moves == ()


def test_an_alias_imports_only_the_version_it_points_at() -> None:
    plan = plan_watch(CHAMPION, _listed("1", "2", "3", aliases={"champion": "2", "staging": "3"}), _state())

    assert plan.to_import == ("2",) and plan.alias_moves == (AliasMove("champion", None, "2"),)


def test_an_alias_moved_to_a_new_version_imports_it() -> None:
    state = _state(imported=("1",), aliases={"champion": "1"})

    plan = plan_watch(CHAMPION, _listed("1", "2", aliases={"champion": "2"}), state)

    assert plan.to_import == ("2",) and plan.alias_moves == (AliasMove("champion", "1", "2"),)


def test_an_alias_moved_to_a_version_seen_before_imports_nothing_and_says_so() -> None:
    state = _state(imported=("1", "2"), aliases={"champion": "2"})

    plan = plan_watch(CHAMPION, _listed("1", "2", aliases={"champion": "1"}), state)

    assert plan.to_import == () and plan.alias_moves == (AliasMove("champion", "2", "1"),)
    [line] = plan_outcomes(plan)
    assert line.action == "unchanged" and line.version == "1"
    assert line.detail == "alias champion moved from version 2 to a version seen before: nothing new"


def test_an_alias_watched_for_the_first_time_on_a_version_imported_before_imports_nothing() -> None:
    plan = plan_watch(CHAMPION, _listed("1", "2", aliases={"champion": "2"}), _state(imported=("1", "2")))

    assert plan.to_import == () and plan.alias_moves == (AliasMove("champion", None, "2"),)
    assert [line.detail for line in plan_outcomes(plan)] == ["alias champion points at a version seen before: nothing new"]


def test_an_alias_that_still_points_at_a_refused_version_does_not_retry_it() -> None:
    plan = plan_watch(CHAMPION, _listed("1", aliases={"champion": "1"}), _state(refused=("1",), aliases={"champion": "1"}))

    assert plan.to_import == () and plan.alias_moves == ()
    [line] = plan_outcomes(plan)
    assert line.line() == "Churn@champion version 1: unchanged (alias champion still points at it, seen before, " \
                          "refused and not retried)"


def test_an_alias_mlflow_does_not_have_yet_is_nothing_to_do() -> None:
    plan = plan_watch(CHAMPION, _listed("1"), _state())

    assert plan.to_import == () and plan.alias_unset
    [line] = plan_outcomes(plan)
    assert line.detail == "MLflow has no alias champion on it yet" and line.versions == 0


# the watch's targets


def test_targets_read_name_or_name_at_alias_with_their_shardline_names() -> None:
    targets = watch_targets(["Churn Model", "Churn Model@champion", " fraud ", "team@eu@prod", "Churn Model"],
                            {"fraud": "fraud-v2"})

    assert targets == [WatchTarget("Churn Model", None, "churn-model"), WatchTarget("Churn Model", "champion", "churn-model"),
                       WatchTarget("fraud", None, "fraud-v2"), WatchTarget("team@eu", "prod", "team-eu")]
    assert [t.label for t in targets] == ["Churn Model", "Churn Model@champion", "fraud", "team@eu@prod"]
    assert targets[0].uri("3") == "models:/Churn Model/3"


@pytest.mark.parametrize("models,name_map,says", [
    ([], None, "the watch lists no model"),
    (["churn@"], None, "'churn@' is not NAME or NAME@ALIAS"),
    (["@champion"], None, "'@champion' is not NAME or NAME@ALIAS"),
    (["  "], None, "is not NAME or NAME@ALIAS"),
    (["churn@the champ"], None, "the alias 'the champ' of 'churn@the champ' is not an MLflow alias"),
    (["churn"], {"churn": "Not Valid"}, "model name 'Not Valid' is not allowed"),
    (["churn"], {"chrun": "churn"}, "name_map names 'chrun', which the watch does not list"),
    (["---"], None, "makes no Shardline model name"),
])
def test_a_wrong_watch_is_refused_before_anything_runs(models: list[str], name_map: dict[str, str] | None,
                                                      says: str) -> None:
    with pytest.raises(InvalidSetting) as refused:
        watch_targets(models, name_map)
    assert says in str(refused.value)


# its state


def test_state_files_are_per_tracking_store_and_model_and_round_trip(tmp_path: Path) -> None:
    states = WatchStates(f"memory://{tmp_path.name}/home")
    uri = "http://ana:s3cret@mlflow.example:5000"

    empty = states.read(uri, "Churn Model")
    assert empty.versions == {} and empty.tracking_uri == "http://mlflow.example:5000"  # no password kept
    states.write(uri, empty.with_version("3", SeenVersion(status="refused", at=NOW, reason="a pickle"))
                 .with_aliases({"champion": "3"}))

    again = states.read(uri, "Churn Model")
    assert again.versions["3"].status == "refused" and again.versions["3"].reason == "a pickle"
    assert again.aliases == {"champion": "3"}
    assert states.path(uri, "Churn Model").endswith(f"/mlflow-watch/{tracking_key(uri)}/Churn%20Model.json")
    assert states.read("sqlite:///other.db", "Churn Model").versions == {}  # another store: another state
    assert state_file_name("a/b?c#d") == "a%2Fb%3Fc%23d.json" and len(tracking_key(uri)) == 16


def test_a_state_file_that_is_not_one_says_how_to_start_over(tmp_path: Path) -> None:
    states = WatchStates(str(tmp_path / "home"))
    path = Path(states.path("sqlite:///mlflow.db", "churn"))
    path.parent.mkdir(parents=True)
    path.write_text("{not json")

    with pytest.raises(InvalidSetting, match="cannot be read .*; remove it to start over"):
        states.read("sqlite:///mlflow.db", "churn")


# the summary


def test_the_summary_counts_versions_and_the_artifact_lists_each_line() -> None:
    plan = plan_watch(CHURN, _listed("1", "2", "3"), _state(imported=("1",), refused=("2",)))
    outcomes = [WatchOutcome("Churn", "imported", "3", reference="churn:4", detail="flavor onnx"),
                WatchOutcome("fraud", "refused", "1", detail="a pickle | saved by cloudpickle"),
                WatchOutcome("gone", "failed", detail="MLflow has no models:/gone", user_error=True, versions=0),
                *plan_outcomes(plan)]

    summary = WatchSummary("sqlite:///mlflow.db", tuple(outcomes))

    assert summary.headline() == "1 imported, 1 refused, 2 unchanged, 1 failed"
    assert plan_outcomes(plan)[0].detail == "2 versions seen before, of them refused and not retried: 2"
    data: dict[str, Any] = summary.as_dict()
    assert (data["imported"], data["refused"], data["unchanged"], data["failed"]) == (1, 1, 2, 1)
    assert data["outcomes"][0]["line"] == "Churn version 3: imported as churn:4 (flavor onnx)"
    markdown = render_watch_markdown(summary)
    assert markdown.startswith("### MLflow watch: 1 imported, 1 refused, 2 unchanged, 1 failed")
    assert "| fraud | 1 | refused |  | a pickle \\| saved by cloudpickle |" in markdown


# prefect.yaml


def _deployment(name: str) -> dict[str, Any]:
    project = yaml.safe_load((REPO / "prefect.yaml").read_text())
    return {d["name"]: d for d in project["deployments"]}[name]


def test_the_mlflow_watch_deployment_runs_every_10_minutes_ships_inactive_and_fits_its_flow() -> None:
    from prefect.flows import load_flow_from_entrypoint

    deployment = _deployment("mlflow-watch")
    flow = load_flow_from_entrypoint(str(REPO / deployment["entrypoint"]))

    assert flow.name == "mlflow-watch" and "triggers" not in deployment
    [schedule] = deployment["schedules"]
    assert schedule["interval"] == 600 and schedule["active"] is False
    assert deployment["concurrency_limit"]["limit"] == 1  # one watcher at a time writes the state
    parameters = deployment["parameters"]
    assert set(parameters) <= set(inspect.signature(flow.fn).parameters)
    assert flow.validate_parameters(parameters)["models"] == parameters["models"]


def test_sample_rows_follow_their_model_and_one_for_a_model_not_watched_is_refused() -> None:
    targets = watch_targets(["churn", "fraud"], samples={"churn": "s3://lake/churn/train.parquet"})

    assert [t.sample for t in targets] == ["s3://lake/churn/train.parquet", None]
    with pytest.raises(InvalidSetting, match="samples names 'chrun', which the watch does not list"):
        watch_targets(["churn"], samples={"chrun": "train.parquet"})
