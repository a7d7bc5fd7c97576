"""The registry on fsspec (memory:// and local files) and the per-process model cache."""

from __future__ import annotations

import shutil
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from shardline.errors import IntegrityError, InvalidSetting, ModelNotFound
from shardline.runtimes import RuntimeOptions
from shardline.storage.model_cache import ModelCache, get_model_cache
from shardline.storage.registry import ModelRegistry

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
    from shardline.examples import package_breast_cancer

    package_breast_cancer(other, kind="logreg")
    v2 = memory_registry.push(other)
    memory_registry.set_alias("breast-cancer", "prod", 1, reason="first")
    memory_registry.set_alias("breast-cancer", "staging", 2)

    assert v2.version == 2
    assert memory_registry.aliases("breast-cancer") == {"prod": 1, "staging": 2}
    prod = memory_registry.resolve("breast-cancer@prod")
    assert (prod.version, prod.pinned, prod.reference) == (1, "breast-cancer:1", "breast-cancer@prod")
    assert memory_registry.resolve("breast-cancer:2").digest == v2.digest
    assert memory_registry.resolve("breast-cancer").version == 1  # a bare name means @prod


def test_missing_names_say_what_exists_and_what_to_do(memory_registry: ModelRegistry, breast_cancer_model: BuiltModel) -> None:
    with pytest.raises(ModelNotFound, match="'churn' is not in the registry .*nothing yet.*shardline model push"):
        memory_registry.resolve("churn@prod")
    memory_registry.push(breast_cancer_model.bundle_dir)
    with pytest.raises(ModelNotFound, match="'churn' is not in the registry .*\\['breast-cancer'\\]"):
        memory_registry.resolve("churn:1")
    with pytest.raises(ModelNotFound, match="has no alias 'prod' .*shardline model alias breast-cancer prod VERSION"):
        memory_registry.resolve("breast-cancer@prod")
    with pytest.raises(ModelNotFound, match="has no version 9 \\(it has versions \\[1\\]\\)"):
        memory_registry.resolve("breast-cancer:9")
    with pytest.raises(ModelNotFound):
        memory_registry.set_alias("breast-cancer", "prod", 9)
    with pytest.raises(InvalidSetting, match="alias 'Prod!' is not allowed"):
        memory_registry.set_alias("breast-cancer", "Prod!", 1)


def test_cache_loads_once_and_scores_like_sklearn(
    memory_registry: ModelRegistry, breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    memory_registry.push(breast_cancer_model.bundle_dir)
    resolved = memory_registry.resolve("breast-cancer:1")
    cache = ModelCache(tmp_path / "cache", capacity=2)
    models = []

    def get() -> None:
        models.append(cache.get(resolved, RuntimeOptions("cpu", 1)))

    threads = [threading.Thread(target=get) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert cache.loads == 1 and len({id(m) for m in models}) == 1
    model = models[0]
    assert model.device == "cpu"
    from shardline.examples import shard_table

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
    assert cache.loaded() == [resolved.digest] and cache.loads == 2
    cache.get(resolved, RuntimeOptions("cpu", 1))
    assert cache.loads == 3


def test_tampered_registry_artifact_is_refused_at_load(
    breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    registry = ModelRegistry(str(tmp_path / "registry"))
    registry.push(breast_cancer_model.bundle_dir)
    resolved = registry.resolve("breast-cancer:1")
    stored = tmp_path / "registry" / "breast-cancer" / "versions" / "1" / "model.onnx"
    stored.write_bytes(stored.read_bytes()[:-10] + b"0123456789")

    with pytest.raises(IntegrityError, match="was changed after packaging: do not load it"):
        ModelCache(tmp_path / "cache").get(resolved, RuntimeOptions("cpu", 1))
    assert not list((tmp_path / "cache").rglob("model.onnx"))


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
