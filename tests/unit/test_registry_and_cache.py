"""The registry on fsspec (memory:// and local files) and the per-process model cache."""

from __future__ import annotations

import os
import pickle
import shutil
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from shardline.bundle import DriftPolicy, read_manifest, write_manifest
from shardline.errors import IntegrityError, InvalidSetting, ModelNotFound
from shardline.runtimes import RuntimeOptions
from shardline.storage.model_cache import ModelCache, get_model_cache
from shardline.storage.registry import ModelRegistry, ResolvedModel
from shardline.storage.registry_integrity import check_stored

from tests.conftest import BuiltModel


@pytest.fixture
def memory_registry() -> ModelRegistry:
    return ModelRegistry(f"memory://registry-{uuid.uuid4().hex}")


def test_push_numbers_versions_and_same_bytes_return_the_same_version(
    memory_registry: ModelRegistry, breast_cancer_model: BuiltModel
) -> None:
    first = memory_registry.push(breast_cancer_model.bundle_dir)
    again = memory_registry.push(breast_cancer_model.bundle_dir)

    assert first.version == again.version == 1
    assert [m.version for m in memory_registry.list_versions("breast-cancer")] == [1]
    assert memory_registry.list_models() == ["breast-cancer"]


def test_aliases_resolve_and_pin_a_version(memory_registry: ModelRegistry, breast_cancer_model: BuiltModel, tmp_path: Path) -> None:
    memory_registry.push(breast_cancer_model.bundle_dir)
    other = tmp_path / "v2"
    from shardline.build.examples import package_breast_cancer

    package_breast_cancer(other, kind="logreg")
    v2 = memory_registry.push(other)
    memory_registry.set_alias("breast-cancer", "prod", 1, reason="first")
    memory_registry.set_alias("breast-cancer", "staging", 2)

    assert v2.version == 2
    assert memory_registry.aliases("breast-cancer") == {"prod": 1, "staging": 2}
    prod = memory_registry.resolve("breast-cancer@prod")
    assert (prod.version, prod.pinned, prod.reference) == (1, "breast-cancer:1", "breast-cancer@prod")
    assert memory_registry.resolve("breast-cancer:2").outputs_digest == v2.outputs_digest
    assert memory_registry.resolve("breast-cancer").version == 1  # a bare name means @prod


def test_outputs_digest_and_content_digest_say_what_they_cover(
    memory_registry: ModelRegistry, breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    memory_registry.push(breast_cancer_model.bundle_dir)
    repackaged = tmp_path / "bundle"
    shutil.copytree(breast_cancer_model.bundle_dir, repackaged)
    manifest = read_manifest(repackaged)
    write_manifest(repackaged, manifest.model_copy(update={"drift": DriftPolicy(min_rows=10)}))
    memory_registry.push(repackaged)  # a new policy: a new bundle, the same model outputs

    first, second = memory_registry.resolve("breast-cancer:1"), memory_registry.resolve("breast-cancer:2")
    assert first.outputs_digest == second.outputs_digest == manifest.outputs_digest  # batch output stays valid
    assert first.content_digest != second.content_digest  # the registry and the model cache tell them apart
    assert (second.outputs_digest, second.content_digest) == (second.manifest.outputs_digest, second.manifest.content_digest)
    assert "digest" not in type(first).model_fields and not hasattr(manifest, "digest")  # no name that says nothing


def test_missing_names_say_what_exists_and_what_to_do(memory_registry: ModelRegistry, breast_cancer_model: BuiltModel) -> None:
    with pytest.raises(ModelNotFound, match="'churn' is not in the registry .*nothing yet.*shardline model push"):
        memory_registry.resolve("churn@prod")
    memory_registry.push(breast_cancer_model.bundle_dir)
    with pytest.raises(ModelNotFound, match="'churn' is not in the registry .*\\['breast-cancer'\\]"):
        memory_registry.resolve("churn:1")
    with pytest.raises(ModelNotFound, match="'churn' is not in the registry .*\\['breast-cancer'\\]"):
        memory_registry.require_model("churn")  # what `rollout status/abort/promote NAME` check first
    assert memory_registry.require_model("breast-cancer") == [1]
    with pytest.raises(ModelNotFound, match="has no alias 'prod' .*shardline model alias breast-cancer prod VERSION"):
        memory_registry.resolve("breast-cancer@prod")
    with pytest.raises(ModelNotFound, match="has no version 9 \\(it has versions \\[1\\]\\)"):
        memory_registry.resolve("breast-cancer:9")
    with pytest.raises(ModelNotFound):
        memory_registry.set_alias("breast-cancer", "prod", 9)
    with pytest.raises(InvalidSetting, match="alias 'Prod!' is not allowed"):
        memory_registry.set_alias("breast-cancer", "Prod!", 1)


def test_versions_are_immutable(memory_registry: ModelRegistry, breast_cancer_model: BuiltModel, tmp_path: Path) -> None:
    from shardline.bundle import read_manifest, write_manifest
    from shardline.errors import ImmutableVersion
    from shardline.build.examples import package_breast_cancer

    memory_registry.push(breast_cancer_model.bundle_dir)
    other = tmp_path / "other"
    package_breast_cancer(other, kind="logreg")
    write_manifest(other, read_manifest(other).model_copy(update={"version": 1}))

    with pytest.raises(ImmutableVersion, match="breast-cancer:1 already exists .* with other bytes"):
        memory_registry.push(other, keep_version=True)
    assert memory_registry.push(other).version == 2  # without keeping the number: the next one
    assert memory_registry.get_manifest("breast-cancer", 1).outputs_digest == breast_cancer_model.manifest.outputs_digest


def test_alias_moves_are_audited_and_rollback_goes_back(
    memory_registry: ModelRegistry, breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    from shardline.build.examples import package_breast_cancer

    memory_registry.push(breast_cancer_model.bundle_dir)
    package_breast_cancer(tmp_path / "v2", kind="logreg")
    memory_registry.push(tmp_path / "v2")
    memory_registry.set_alias("breast-cancer", "prod", 1, by="ana", reason="first release")
    memory_registry.move_alias("breast-cancer", "prod", 2, action="promote", expected_seq=1, by="bo", reason="better")

    back = memory_registry.rollback("breast-cancer", "prod", by="cy", reason="latency regression")

    assert (back.version, back.previous, back.action) == (1, 2, "rollback")
    history = memory_registry.alias_history("breast-cancer", "prod")
    assert [(m.seq, m.version, m.action, m.by, m.reason) for m in history] == [
        (1, 1, "set", "ana", "first release"),
        (2, 2, "promote", "bo", "better"),
        (3, 1, "rollback", "cy", "latency regression"),
    ]
    assert memory_registry.resolve("breast-cancer@prod").version == 1
    memory_registry.set_alias("breast-cancer", "staging", 1)
    with pytest.raises(ModelNotFound, match="has only ever pointed at breast-cancer:1"):
        memory_registry.rollback("breast-cancer", "staging")
    with pytest.raises(ModelNotFound, match="breast-cancer@dev was never set"):
        memory_registry.rollback("breast-cancer", "dev")


def test_a_stale_move_loses_the_compare_and_swap(memory_registry: ModelRegistry, breast_cancer_model: BuiltModel) -> None:
    from shardline.errors import AliasConflict

    memory_registry.push(breast_cancer_model.bundle_dir)
    memory_registry.set_alias("breast-cancer", "prod", 1)
    memory_registry.move_alias("breast-cancer", "prod", 1, action="promote", expected_seq=1)

    with pytest.raises(AliasConflict, match="moved while you were deciding .*record 2"):
        memory_registry.move_alias("breast-cancer", "prod", 1, action="promote", expected_seq=1)
    assert len(memory_registry.alias_history("breast-cancer", "prod")) == 2


def test_racing_promotions_leave_one_consistent_history(breast_cancer_model: BuiltModel, tmp_path: Path) -> None:
    from shardline.errors import AliasConflict
    from shardline.build.examples import package_breast_cancer

    url = str(tmp_path / "registry")
    ModelRegistry(url).push(breast_cancer_model.bundle_dir)
    package_breast_cancer(tmp_path / "v2", kind="logreg")
    ModelRegistry(url).push(tmp_path / "v2")
    ModelRegistry(url).set_alias("breast-cancer", "prod", 1)
    wins: list[tuple[str, int]] = []
    losses: list[str] = []
    start = threading.Barrier(8)

    def promote(i: int) -> None:
        registry = ModelRegistry(url)  # each writer its own view, as separate processes would have
        start.wait()
        for _ in range(5):
            current = registry.current_move("breast-cancer", "prod")
            assert current is not None
            target = 2 if current.version == 1 else 1
            try:
                move = registry.move_alias("breast-cancer", "prod", target, action="promote",
                                           expected_seq=current.seq, by=f"writer-{i}")
                wins.append((move.by, move.seq))
            except AliasConflict as e:
                losses.append(str(e))

    threads = [threading.Thread(target=promote, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    history = ModelRegistry(url).alias_history("breast-cancer", "prod")
    assert [m.seq for m in history] == list(range(1, len(history) + 1))  # no gap, no duplicate
    assert len(history) == 1 + len(wins) and len(wins) + len(losses) == 40 and losses
    for before, after in zip(history, history[1:]):
        assert after.previous == before.version and after.version != before.version  # each move saw the one before
    assert sorted(seq for _, seq in wins) == [m.seq for m in history[1:]]


def test_search_by_name_alias_and_tag(memory_registry: ModelRegistry, breast_cancer_model: BuiltModel, tmp_path: Path) -> None:
    from shardline.build.examples import package_breast_cancer

    memory_registry.push(breast_cancer_model.bundle_dir)
    package_breast_cancer(tmp_path / "v2", kind="logreg")
    memory_registry.push(tmp_path / "v2")
    memory_registry.set_alias("breast-cancer", "prod", 2)

    assert [m.reference for m in memory_registry.search(name="cancer")] == ["breast-cancer:1", "breast-cancer:2"]
    assert [m.reference for m in memory_registry.search(alias="prod")] == ["breast-cancer:2"]
    assert [m.reference for m in memory_registry.search(tags={"estimator": "Pipeline"})] == ["breast-cancer:2"]
    assert memory_registry.search(name="churn") == []


def test_cache_loads_once_and_scores_like_sklearn(
    memory_registry: ModelRegistry, breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    memory_registry.push(breast_cancer_model.bundle_dir)
    resolved = memory_registry.resolve("breast-cancer:1")
    cache = ModelCache(tmp_path / "cache", capacity=2)
    models = []
    loaded_here = []

    def get() -> None:
        model, loaded = cache.get_or_load(resolved, RuntimeOptions("cpu", 1))
        models.append(model)
        loaded_here.append(loaded)

    threads = [threading.Thread(target=get) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert cache.loads == 1 and len({id(m) for m in models}) == 1
    assert sorted(loaded_here) == [False, False, False, True]  # one caller loaded it; the online metric counts that one
    assert cache.get(resolved, RuntimeOptions("cpu", 1)) is models[0]
    model = models[0]
    assert model.device == "cpu"
    from shardline.build.examples import shard_table

    table = shard_table(breast_cancer_model.data, 300, 0, seed=3)
    out = model.predict(table)
    labels, probabilities = breast_cancer_model.expected(table)
    assert out.schema.names == ["label", "probabilities"]
    assert np.array_equal(out.column("label").to_numpy(), labels)
    np.testing.assert_allclose(np.stack(out.column("probabilities").to_numpy(zero_copy_only=False)), probabilities, atol=1e-5)


def test_cache_evicts_least_recently_used(memory_registry: ModelRegistry, breast_cancer_model: BuiltModel, tmp_path: Path) -> None:
    memory_registry.push(breast_cancer_model.bundle_dir)
    resolved = memory_registry.resolve("breast-cancer:1")
    cache = ModelCache(tmp_path / "cache", capacity=1)
    cache.get(resolved, RuntimeOptions("cpu", 1))
    cache.get(resolved, RuntimeOptions("cpu", 2))
    assert cache.loaded() == [resolved.manifest.content_digest] and cache.loads == 2
    cache.get(resolved, RuntimeOptions("cpu", 1))
    assert cache.loads == 3


def _pushed(bundle_dir: Path, tmp_path: Path) -> tuple[ModelRegistry, ResolvedModel, Path]:
    """A local registry holding the bundle as breast-cancer:1, that version, and its model file's blob."""
    registry = ModelRegistry(str(tmp_path / "registry"))
    registry.push(bundle_dir)
    resolved = registry.resolve("breast-cancer:1")
    model = next(a for a in resolved.manifest.artifacts if a.role == "model")
    return registry, resolved, Path(registry.blob_path("breast-cancer", model.sha256))


def test_tampered_registry_artifact_is_refused_at_load(
    breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    _, resolved, stored = _pushed(breast_cancer_model.bundle_dir, tmp_path)
    stored.write_bytes(stored.read_bytes()[:-10] + b"0123456789")

    with pytest.raises(IntegrityError, match=r"the registry's copy of breast-cancer:1 is damaged: .*; push the bundle "
                       r"of breast-cancer:1 again") as raised:
        ModelCache(tmp_path / "cache").get(resolved, RuntimeOptions("cpu", 1))
    assert not list((tmp_path / "cache").rglob("model.onnx"))
    again = pickle.loads(pickle.dumps(raised.value))  # as a Dask worker's error comes back to the flow
    assert (type(again), str(again), again.path, again.got) == (IntegrityError, str(raised.value), "model.onnx",
                                                                  raised.value.got)


def test_the_registry_check_reads_a_blob_again_once_it_changed_and_a_push_repairs_it(
    breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    registry, resolved, stored = _pushed(breast_cancer_model.bundle_dir, tmp_path)
    stamps = tmp_path / "stamps"
    check_stored(registry, resolved, stamps)  # read and found intact: stamped
    good, before = stored.read_bytes(), stored.stat()
    stored.write_bytes(good[:-10] + b"0123456789")
    with pytest.raises(IntegrityError, match="the registry's copy of breast-cancer:1 is damaged: its artifact "
                                             "'model.onnx' has sha256"):
        check_stored(registry, resolved, stamps)  # another time: read again
    os.utime(stored, ns=(before.st_atime_ns, before.st_mtime_ns))
    check_stored(registry, resolved, stamps)  # same size and time as stamped: taken as read (the cache verifies)
    with pytest.raises(IntegrityError, match="is damaged"):
        check_stored(registry, resolved)  # without stamps every blob is read

    assert registry.push(breast_cancer_model.bundle_dir).version == 1  # the same bytes: the same version, repaired
    assert stored.read_bytes() == good
    check_stored(registry, resolved)


def test_damaged_local_copy_is_fetched_again(breast_cancer_model: BuiltModel, tmp_path: Path) -> None:
    registry = ModelRegistry(str(tmp_path / "registry"))
    registry.push(breast_cancer_model.bundle_dir)
    resolved = registry.resolve("breast-cancer:1")
    first = ModelCache(tmp_path / "cache")
    first.get(resolved, RuntimeOptions("cpu", 1))
    local = first.local_dir(resolved) / "model.onnx"
    local.write_bytes(b"not a model")

    model = ModelCache(tmp_path / "cache").get(resolved, RuntimeOptions("cpu", 1))

    assert model.device == "cpu"
    assert local.read_bytes() == (breast_cancer_model.bundle_dir / "model.onnx").read_bytes()


def test_cuda_asked_for_on_a_cpu_build_says_what_to_install(
    memory_registry: ModelRegistry, breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    from shardline.errors import RuntimeUnavailable

    memory_registry.push(breast_cancer_model.bundle_dir)
    resolved = memory_registry.resolve("breast-cancer:1")
    with pytest.raises(RuntimeUnavailable, match="device 'cuda' was asked for .*shardline\\[gpu\\]"):
        ModelCache(tmp_path / "cache").get(resolved, RuntimeOptions("cuda", 1))


def test_one_cache_per_process_and_folder(tmp_path: Path) -> None:
    assert get_model_cache(tmp_path / "a") is get_model_cache(str(tmp_path / "a"))
    assert get_model_cache(tmp_path / "a") is not get_model_cache(tmp_path / "b")
    shutil.rmtree(tmp_path / "a", ignore_errors=True)


def test_an_evicted_model_still_serves_whoever_holds_it(
    memory_registry: ModelRegistry, breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    from shardline.build.examples import shard_table

    memory_registry.push(breast_cancer_model.bundle_dir)
    resolved = memory_registry.resolve("breast-cancer:1")
    cache = ModelCache(tmp_path / "cache", capacity=1)
    held = cache.get(resolved, RuntimeOptions("cpu", 1))
    cache.get(resolved, RuntimeOptions("cpu", 2))  # evicts the first (LRU) ...
    assert cache.evict(resolved.content_digest)  # ... and scale-to-zero drops the second

    table = shard_table(breast_cancer_model.data, 20, 0, seed=5)
    labels, _ = breast_cancer_model.expected(table)
    assert np.array_equal(held.predict(table).column("label").to_numpy(), labels)  # a caller mid-predict finishes
    assert cache.loaded() == []
