"""Settings are validated when read; the cluster choice fails early with what to set."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from shardline.errors import InvalidSetting, RuntimeUnavailable
from shardline.settings import DaskSettings, StorageSettings
from shardline.tasks.cluster import dask_scheduler, threads_per_call, worker_memory_config


def test_storage_defaults_follow_home_and_options_parse_from_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SHARDLINE_STORAGE_HOME", str(tmp_path))
    monkeypatch.setenv("SHARDLINE_STORAGE_STORAGE_OPTIONS", '{"endpoint_url": "http://127.0.0.1:9000"}')
    storage = StorageSettings()
    assert storage.registry == str(tmp_path / "registry") and storage.cache == str(tmp_path / "cache")
    assert storage.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}
    monkeypatch.setenv("SHARDLINE_STORAGE_REGISTRY_URL", "s3://models/registry")
    assert StorageSettings().registry == "s3://models/registry"


def test_bad_dask_settings_are_refused_when_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDLINE_DASK_ADDRESS", "10.0.0.5:8786")
    with pytest.raises(ValidationError, match="has no scheme; write it as tcp://HOST:PORT"):
        DaskSettings()
    monkeypatch.setenv("SHARDLINE_DASK_ADDRESS", "tcp://10.0.0.5:8786")
    monkeypatch.setenv("SHARDLINE_DASK_CLUSTER", "yarn")
    with pytest.raises(ValidationError, match="'local', 'address' or 'kubernetes'"):
        DaskSettings()


def test_cluster_choices_say_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(InvalidSetting, match="needs SHARDLINE_DASK_ADDRESS"):
        with dask_scheduler(DaskSettings(cluster="address")):
            pass
    with dask_scheduler(DaskSettings(cluster="address", address="tcp://10.1.2.3:8786")) as address:
        assert address == "tcp://10.1.2.3:8786"  # an existing scheduler is used as given
    with pytest.raises(InvalidSetting, match="SHARDLINE_DASK_KUBERNETES_SPEC=None is not a file"):
        with dask_scheduler(DaskSettings(cluster="kubernetes")):
            pass


def test_kubernetes_without_its_extra_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("kr8s", "kr8s.objects", "dask_kubernetes"):  # as without the extra: importing them fails
        monkeypatch.setitem(sys.modules, module, None)
    spec = tmp_path / "cluster.yaml"
    spec.write_text("kind: DaskCluster\n")
    with pytest.raises(RuntimeUnavailable, match="pip install 'shardline\\[kubernetes\\]'"):
        with dask_scheduler(DaskSettings(cluster="kubernetes", kubernetes_spec=str(spec)), "0123456789abcdef"):
            pass


def test_local_workers_share_the_cores_once() -> None:
    import os

    cores = os.cpu_count() or 1
    assert threads_per_call(DaskSettings(n_workers=1)) == cores
    assert threads_per_call(DaskSettings(n_workers=cores * 2)) == 1
    assert threads_per_call(DaskSettings(cluster="address", address="tcp://h:1")) == 0


def test_the_model_cache_size_is_one_setting_and_the_online_name_is_a_deprecated_alias(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shardline.settings import OnlineSettings, RuntimeSettings, TenancySettings

    assert RuntimeSettings().cache_capacity == 8  # what the server kept before; batch workers alike now
    monkeypatch.setenv("SHARDLINE_ONLINE_MAX_LOADED_MODELS", "3")
    assert RuntimeSettings().cache_capacity == 3
    monkeypatch.setenv("SHARDLINE_RUNTIME_CACHE_CAPACITY", "5")  # the setting's own name wins
    assert RuntimeSettings().cache_capacity == 5
    assert RuntimeSettings(cache_capacity=2).cache_capacity == 2
    assert "deprecated SHARDLINE_ONLINE_MAX_LOADED_MODELS" in (RuntimeSettings.model_fields["cache_capacity"].description or "")
    # one declaration of each: the server reads the tenants file and the cache size where batch jobs do
    assert "max_loaded_models" not in OnlineSettings.model_fields and "tenants_file" not in OnlineSettings.model_fields
    monkeypatch.setenv("SHARDLINE_ONLINE_TENANTS_FILE", "/etc/shardline/tenants.yaml")
    assert TenancySettings().tenants_file == "/etc/shardline/tenants.yaml"


@pytest.mark.parametrize(
    ("cores", "env", "expected"),
    [
        (2, {}, (1, 2, 2, 1)),  # the defaults: one process, a thread and a batch per core, one intra-op thread each
        (16, {}, (1, 16, 16, 1)),
        (16, {"SHARDLINE_ONLINE_INFERENCE_THREADS": "4"}, (1, 4, 4, 4)),  # the cores left to each thread
        (16, {"SHARDLINE_ONLINE_WORKERS": "0", "SHARDLINE_ONLINE_INFERENCE_THREADS": "1"}, (16, 1, 1, 1)),
        (8, {"SHARDLINE_RUNTIME_INTRA_OP_THREADS": "3", "SHARDLINE_ONLINE_MAX_CONCURRENT_BATCHES": "1"}, (1, 8, 1, 3)),
    ],
)
def test_the_servers_threads_come_from_the_cores_unless_set(
    monkeypatch: pytest.MonkeyPatch, cores: int, env: dict[str, str], expected: tuple[int, int, int, int]
) -> None:
    from shardline.settings import OnlineSettings, RuntimeSettings

    monkeypatch.setattr("os.cpu_count", lambda: cores)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    online, runtime = OnlineSettings(), RuntimeSettings()
    got = (online.resolved_workers(), online.resolved_threads(), online.resolved_concurrent_batches(),
           online.resolved_intra_op_threads(runtime.intra_op_threads))
    assert got == expected
    assert runtime.spinning is False


def test_the_clusters_started_here_go_without_the_dashboards_sampling_unless_the_user_set_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dask

    from shardline.tasks.cluster import QUIET_CLUSTER, quiet_cluster_config

    assert quiet_cluster_config() == QUIET_CLUSTER  # Dask's defaults here: every key is ours to set

    with dask.config.set({"distributed.admin.tick.interval": "50ms"}):  # a user's DASK_* variable or YAML file
        chosen = quiet_cluster_config()
    assert "distributed.admin.tick.interval" not in chosen
    assert chosen["distributed.worker.profile.enabled"] is False


def test_local_workers_get_arrows_jemalloc_pool_and_a_heap_for_numpy_unless_the_user_chose(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import dask

    pool = "distributed.nanny.pre-spawn-environ.ARROW_DEFAULT_MEMORY_POOL"
    threshold = "distributed.nanny.pre-spawn-environ.MALLOC_MMAP_THRESHOLD_"
    monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert worker_memory_config() == {pool: "jemalloc", threshold: "33554432"}  # glibc's largest: 32 MiB
    monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", "mimalloc")  # the user's choice wins
    assert worker_memory_config() == {threshold: "33554432"}
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")  # so does this one
    assert worker_memory_config() == {}
    monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    with dask.config.set({threshold: 4194304}):  # or in Dask's config, where Dask's own variables are
        assert worker_memory_config() == {pool: "jemalloc"}
    with dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}):
        assert worker_memory_config() == {pool: "jemalloc"}  # glibc's adaptive threshold is on: nothing to undo
    monkeypatch.setattr("mmap.PAGESIZE", 65536)  # a 64 KiB-page kernel: jemalloc's build must not run
    assert worker_memory_config() == {threshold: "33554432"}
