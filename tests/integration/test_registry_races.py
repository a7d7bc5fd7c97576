"""Racing first sets of a protected alias (threads and processes, local disk and the moto S3 server),
and an alias record a dead writer left, as a tenant sees it over real HTTP."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from shardline.errors import ShardlineError
from shardline.settings import StorageSettings
from shardline.storage.registry import ModelRegistry

from tests.concurrency import at_once
from tests.conftest import BuiltModel
from tests.integration.conftest import S3Server

MODEL = "breast-cancer"
ROUNDS = 12
RACERS = 6


def _first_set(url: str, options: dict[str, Any], alias: str, by: str) -> str:
    """What `shardline model alias MODEL ALIAS 1` does, from its own registry client: 'won' or the error."""
    from shardline.cli.model_commands import _set_alias

    registry = ModelRegistry(url, options)
    try:
        _set_alias(registry, MODEL, alias, 1, f"race by {by}")
    except ShardlineError as e:
        return str(e)
    return "won"


def _protect(monkeypatch: pytest.MonkeyPatch, aliases: list[str]) -> None:
    monkeypatch.setenv("SHARDLINE_STORAGE_PROTECTED_ALIASES", json.dumps(aliases))
    assert StorageSettings().protected_aliases == tuple(aliases)


def _race_in_threads(url: str, options: dict[str, Any], alias: str) -> list[str]:
    return [str(o) for o in at_once(RACERS, lambda i: _first_set(url, options, alias, f"thread-{i}"))]


def _assert_one_winner(registry: ModelRegistry, alias: str, outcomes: list[str]) -> None:
    winners = [o for o in outcomes if o == "won"]
    assert len(winners) == 1, f"{alias}: {len(winners)} first sets won: {outcomes}"
    for lost in (o for o in outcomes if o != "won"):
        assert lost.startswith(f"{MODEL}@{alias} is protected and already set (it points at {MODEL}:1, set by ")
        assert "moves only through `shardline model promote" in lost
    history = registry.alias_history(MODEL, alias)
    assert [(m.seq, m.version, m.previous) for m in history] == [(1, 1, None)]


def test_racing_first_sets_on_local_disk_have_exactly_one_winner(
    local_registry: ModelRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    aliases = [f"prod-{r}" for r in range(ROUNDS)]
    _protect(monkeypatch, aliases)
    for alias in aliases:
        _assert_one_winner(local_registry, alias, _race_in_threads(local_registry.url, {}, alias))


def _process_racer(url: str, aliases: list[str], start: Any, by: str, results: Any) -> None:
    import os

    os.environ["SHARDLINE_STORAGE_PROTECTED_ALIASES"] = json.dumps(aliases)
    for alias in aliases:
        start.wait()
        results.put((alias, _first_set(url, {}, alias, by)))


def test_racing_first_sets_from_separate_processes_have_exactly_one_winner(local_registry: ModelRegistry) -> None:
    context = multiprocessing.get_context("spawn")
    aliases = [f"prod-p{r}" for r in range(ROUNDS)]
    start = context.Barrier(4)
    results = context.Queue()
    processes = [
        context.Process(target=_process_racer, args=(local_registry.url, aliases, start, f"process-{i}", results))
        for i in range(4)
    ]
    for p in processes:
        p.start()
    outcomes: dict[str, list[str]] = {a: [] for a in aliases}
    for _ in range(4 * ROUNDS):
        alias, outcome = results.get(timeout=300)
        outcomes[alias].append(outcome)
    for p in processes:
        p.join(timeout=60)
        assert p.exitcode == 0
    for alias in aliases:
        _assert_one_winner(local_registry, alias, outcomes[alias])


@pytest.mark.s3
def test_racing_first_sets_on_s3_have_exactly_one_winner(
    s3_server: S3Server, s3_prefix: str, breast_cancer_model: BuiltModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = ModelRegistry(s3_server.url(s3_prefix, "registry"), s3_server.storage_options)
    registry.push(breast_cancer_model.bundle_dir)
    aliases = [f"prod-{r}" for r in range(ROUNDS // 2)]
    _protect(monkeypatch, aliases)
    for alias in aliases:
        _assert_one_winner(registry, alias, _race_in_threads(registry.url, s3_server.storage_options, alias))


@pytest.mark.s3
def test_an_empty_alias_record_on_s3_is_superseded(
    s3_server: S3Server, s3_prefix: str, breast_cancer_model: BuiltModel
) -> None:
    registry = ModelRegistry(s3_server.url(s3_prefix, "registry"), s3_server.storage_options)
    registry.push(breast_cancer_model.bundle_dir)
    registry.set_alias(MODEL, "prod", 1)
    s3 = s3_server.filesystem()
    s3.pipe_file(f"{s3_server.bucket}/{s3_prefix}/registry/{MODEL}/aliases/prod/00000002.json", b"")

    reader = ModelRegistry(registry.url, s3_server.storage_options)
    assert reader.resolve(f"{MODEL}@prod").version == 1
    moved = reader.move_alias(MODEL, "prod", 1, action="promote", expected_seq=1, reason="after the dead writer")
    assert (moved.seq, moved.previous) == (3, 1)
    assert [m.seq for m in ModelRegistry(registry.url, s3_server.storage_options).alias_history(MODEL, "prod")] == [1, 3]


# -- what a tenant sees over HTTP ------------------------------------------------------------------
@pytest.fixture
def served(local_registry: ModelRegistry, shardline_home: Path) -> Iterator[str]:
    from shardline.online.app import create_app
    from shardline.online.server import build_plane
    from shardline.online.tenants import TenantDirectory, hash_api_key
    from shardline.online.testing import serve_in_thread
    from shardline.settings import OnlineSettings, RuntimeSettings

    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key("k")], "models": [f"{MODEL}@prod"]},
    ]})
    plane = build_plane(OnlineSettings(alias_refresh_s=0), StorageSettings(home=str(shardline_home)),
                        RuntimeSettings(device="cpu", intra_op_threads=1), tenants)
    with serve_in_thread(create_app(plane)) as base:
        yield base


def _infer_body(model: BuiltModel) -> dict[str, Any]:
    rows = model.data.features[:3]
    return {"inputs": [{"name": n, "datatype": "FP32", "shape": [3], "data": rows[:, j].tolist()}
                       for j, n in enumerate(model.data.names)]}


def test_a_dead_writers_record_does_not_break_unversioned_requests(
    local_registry: ModelRegistry, served: str, breast_cancer_model: BuiltModel
) -> None:
    prod = Path(local_registry.root) / MODEL / "aliases" / "prod"
    (prod / "00000002.json").write_bytes(b"")  # what a writer that died between create and write left

    answer = httpx.post(f"{served}/v2/models/{MODEL}/infer", json=_infer_body(breast_cancer_model),
                        headers={"Authorization": "Bearer k"}, timeout=60)

    assert answer.status_code == 200, answer.text
    assert answer.json()["model_version"] == "1"


def test_an_unreadable_alias_record_answers_without_the_registry_location(
    local_registry: ModelRegistry, served: str, breast_cancer_model: BuiltModel
) -> None:
    prod = Path(local_registry.root) / MODEL / "aliases" / "prod"
    (prod / "00000002.json").mkdir()  # the storage refuses to read it as a file

    answer = httpx.post(f"{served}/v2/models/{MODEL}/infer", json=_infer_body(breast_cancer_model),
                        headers={"Authorization": "Bearer k"}, timeout=60)

    assert answer.status_code == 503  # the storage, not the request, is at fault: the client may retry
    message = answer.json()["error"]
    assert f"{MODEL}@prod" in message and local_registry.root not in message and "/" not in message


@pytest.mark.usefixtures("prefect_harness")
def test_promotion_goes_on_past_a_dead_writers_record(
    shardline_home: Path, breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    from shardline.build.examples import breast_cancer, golden_table, package_breast_cancer, split
    from shardline.flows.promotion import promote_model
    from shardline.quality.profile import profile_table

    registry = ModelRegistry(str(shardline_home / "registry"))
    registry.push(breast_cancer_model.bundle_dir)
    train, _ = split(breast_cancer())
    package_breast_cancer(tmp_path / "v2", kind="logreg", reference_profile=profile_table(golden_table(train)))
    registry.push(tmp_path / "v2")
    assert promote_model(reference=f"{MODEL}:1", to_alias="staging", return_state=True).is_completed()
    (Path(registry.root) / MODEL / "aliases" / "staging" / "00000002.json").write_bytes(b"")

    state = promote_model(reference=f"{MODEL}:2", to_alias="staging", return_state=True)

    assert state.is_completed(), state.result(raise_on_failure=False)
    assert (state.result()["version"], state.result()["previous"]) == (2, 1)
    assert [(m.seq, m.version) for m in registry.alias_history(MODEL, "staging")] == [(1, 1), (3, 2)]
