"""The s3:// path end to end against a real S3 API (moto's server mode) on loopback.

The registry, the input shards and the output all live in the bucket; Shardline
reaches it only through SHARDLINE_STORAGE_STORAGE_OPTIONS, and Dask worker
processes reach it through the storage options carried in the ScoringJob.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from shardline.build.examples import package_breast_cancer
from shardline.bundle import MANIFEST, verify_artifacts
from shardline.errors import IntegrityError, ModelNotFound
from shardline.flows.batch_inference import batch_inference
from shardline.settings import StorageSettings
from shardline.storage.model_cache import ModelCache
from shardline.storage.registry import ModelRegistry
from tests.conftest import BuiltModel
from tests.integration.conftest import S3Server
from tests.support.s3 import keys_under, upload

pytestmark = pytest.mark.s3

MODEL = "breast-cancer"


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any connection this process opens beyond loopback (real AWS above all)."""
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def check(address: Any) -> None:
        if isinstance(address, tuple):
            host = str(address[0])
            if host != "localhost" and not _is_loopback(host):
                raise AssertionError(f"an S3 test tried to reach {address!r}; only loopback is allowed")

    def connect(self: socket.socket, address: Any) -> None:
        check(address)
        return real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        check(address)
        return real_connect_ex(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@pytest.fixture
def s3_registry(
    s3_server: S3Server, s3_prefix: str, shardline_home: Path, breast_cancer_model: BuiltModel,
    monkeypatch: pytest.MonkeyPatch,
) -> ModelRegistry:
    """A registry on S3 (set through SHARDLINE_STORAGE_REGISTRY_URL) holding breast-cancer:1 as prod."""
    monkeypatch.setenv("SHARDLINE_STORAGE_REGISTRY_URL", s3_server.url(s3_prefix, "registry"))
    storage = StorageSettings()
    registry = ModelRegistry.from_settings(storage)
    pushed = registry.push(breast_cancer_model.bundle_dir)
    registry.set_alias(pushed.name, "prod", pushed.version or 1, reason="integration test")
    return registry


def read_scored(s3_server: S3Server, url: str) -> pa.Table:
    """The output as a reader sees it: pyarrow's dataset over s3fs, '_' names skipped."""
    return ds.dataset(url.removeprefix("s3://"), filesystem=s3_server.filesystem(), format="parquet").to_table()


def run(model: str, input_uri: str, output_uri: str, **kwargs: Any):  # type: ignore[no-untyped-def]
    return batch_inference(model=model, input_uri=input_uri, output_uri=output_uri, return_state=True, **kwargs)


def test_registry_on_s3_pushes_resolves_and_lists(
    s3_server: S3Server, s3_prefix: str, s3_registry: ModelRegistry, breast_cancer_model: BuiltModel
) -> None:
    manifest = breast_cancer_model.manifest
    registry_url = s3_server.url(s3_prefix, "registry")
    # a second client, as another process would open it, from the settings alone
    storage = StorageSettings()
    assert storage.registry == registry_url and storage.storage_options["endpoint_url"] == s3_server.endpoint
    registry = ModelRegistry.from_settings(storage)

    by_alias = registry.resolve(f"{MODEL}@prod")
    by_version = registry.resolve(f"{MODEL}:1")
    assert (by_alias.version, by_version.version) == (1, 1)
    assert by_alias.outputs_digest == by_version.outputs_digest == manifest.outputs_digest
    assert by_alias.uri == f"{registry_url}/{MODEL}/versions/1"
    assert registry.list_models() == [MODEL]
    assert [m.version for m in registry.list_versions(MODEL)] == [1]
    assert registry.aliases(MODEL) == {"prod": 1}
    # the same bytes again are the same version, not a new one
    assert registry.push(breast_cancer_model.bundle_dir).version == 1
    assert [m.version for m in registry.list_versions(MODEL)] == [1]

    # the objects are really in the bucket: blobs by content, the manifest, the alias log
    stored = keys_under(s3_server, registry_url)
    expected = {f"{MODEL}/blobs/{a.sha256}" for a in manifest.artifacts}
    expected |= {f"{MODEL}/versions/1/{MANIFEST}", f"{MODEL}/aliases/prod/00000001.json"}
    assert set(stored) == expected

    with pytest.raises(ModelNotFound) as missing:
        registry.resolve("no-such-model@prod")
    message = str(missing.value)
    assert "'no-such-model'" in message and registry_url in message
    assert MODEL in message and "shardline model push" in message
    assert missing.value.reference == "no-such-model@prod"

    with pytest.raises(ModelNotFound, match=r"has no version 7 \(it has versions \[1\]\)"):
        registry.resolve(f"{MODEL}:7")
    with pytest.raises(ModelNotFound, match=r"has no alias 'staging'.*shardline model alias"):
        registry.resolve(f"{MODEL}@staging")


def test_open_registry_sees_versions_and_aliases_another_process_adds(
    s3_server: S3Server, s3_registry: ModelRegistry, tmp_path: Path
) -> None:
    # a long-lived client (the online server, a served flow) has listed the registry:
    # s3fs caches listings per process
    assert [m.version for m in s3_registry.list_versions(MODEL)] == [1]
    assert s3_registry.aliases(MODEL) == {"prod": 1}
    # another process (its own file system, no shared cache) pushes v2 and aliases it
    other = ModelRegistry(s3_registry.url, {**s3_server.storage_options, "skip_instance_cache": True})
    package_breast_cancer(tmp_path / "logreg", kind="logreg")
    assert other.push(tmp_path / "logreg").version == 2
    other.set_alias(MODEL, "staging", 2)

    # the long-lived client sees both; its next push would number after 2, not overwrite it
    assert [m.version for m in s3_registry.list_versions(MODEL)] == [1, 2]
    assert s3_registry.aliases(MODEL) == {"prod": 1, "staging": 2}
    assert s3_registry.resolve(f"{MODEL}@staging").version == 2
    assert s3_registry.push(tmp_path / "logreg").version == 2


def test_model_cache_fetches_from_s3_and_refuses_tampered_artifacts(
    s3_server: S3Server, s3_registry: ModelRegistry, breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    resolved = s3_registry.resolve(f"{MODEL}@prod")
    cache = ModelCache(tmp_path / "cache")

    model = cache.get(resolved, storage_options=s3_server.storage_options)

    local = cache.local_dir(resolved)
    verify_artifacts(local, resolved.manifest)
    table = pa.table({n: breast_cancer_model.data.features[:50, j] for j, n in enumerate(breast_cancer_model.data.names)})
    labels, _ = breast_cancer_model.expected(table)
    assert np.array_equal(model.predict(table).column("label").to_numpy(), labels)

    # an artifact changed in the bucket after the push is caught by its sha256
    artifact = resolved.manifest.artifacts[0]
    s3_server.filesystem().pipe_file(s3_registry.blob_path(MODEL, artifact.sha256), b"tampered")
    with pytest.raises(IntegrityError, match="sha256") as tampered:
        ModelCache(tmp_path / "other-cache").get(resolved, storage_options=s3_server.storage_options)
    assert tampered.value.path == artifact.path


@pytest.mark.usefixtures("on_cluster")
def test_batch_flow_reads_and_writes_s3_and_reruns_idempotently(
    s3_server: S3Server, s3_prefix: str, s3_registry: ModelRegistry, input_shards: Path,
    shardline_home: Path, breast_cancer_model: BuiltModel,
) -> None:
    input_url, output_url = s3_server.url(s3_prefix, "input"), s3_server.url(s3_prefix, "out")
    upload(s3_server, input_shards, input_url)
    shard_names = sorted(p.name for p in input_shards.iterdir())

    state = run(f"{MODEL}@prod", input_url, output_url, tenant="acme")

    assert state.is_completed() and state.name == "Completed", state.message
    summary = state.result()
    assert (summary["shards"], summary["shards_committed"], summary["shards_quarantined"]) == (6, 6, 0)
    assert summary["rows_in"] == summary["rows_out"] == summary["rows_scored"] == 12_000
    assert summary["manifest"] == f"{output_url}/_manifest.json"

    inputs = ds.dataset(str(input_shards)).to_table().sort_by("id")
    scored = read_scored(s3_server, output_url).sort_by("id")
    assert scored.column_names == ["id", "label", "probabilities"]
    assert scored.column("id").to_pylist() == inputs.column("id").to_pylist()  # each row exactly once
    labels, probabilities = breast_cancer_model.expected(inputs)
    assert np.array_equal(scored.column("label").to_numpy(), labels)
    got = np.stack(scored.column("probabilities").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(got, probabilities, atol=1e-5)

    # one part per shard, the ledger, the manifest and _SUCCESS; nothing left in _staging
    objects = keys_under(s3_server, output_url)
    assert [k for k in objects if not k.startswith("_")] == shard_names
    assert "_manifest.json" in objects and "_SUCCESS" in objects
    assert not [k for k in objects if k.startswith("_staging")]
    assert sorted(k for k in objects if k.startswith("_ledger/")) == [f"_ledger/{n}.json" for n in shard_names]
    manifest = json.loads(s3_server.filesystem().cat_file(f"{output_url.removeprefix('s3://')}/_manifest.json"))
    assert manifest["tenant"] == "acme" and manifest["model"]["pinned"] == f"{MODEL}:1"
    assert sorted(p["part"] for p in manifest["parts"]) == [f"{output_url}/{n}" for n in shard_names]
    assert sorted(p["shard"] for p in manifest["parts"]) == [f"{input_url}/{n}" for n in shard_names]
    assert sum(p["rows"] for p in manifest["parts"]) == 12_000 and manifest["quarantined"] == []

    # the workers fetched the bundle from S3 into their local cache and verified it
    cached = shardline_home / "cache" / MODEL / breast_cancer_model.manifest.content_digest[:32]
    assert (cached / MANIFEST).is_file()
    verify_artifacts(cached, breast_cancer_model.manifest)

    fs = s3_server.filesystem()
    before = {n: fs.info(f"{output_url.removeprefix('s3://')}/{n}") for n in shard_names}

    again = run(f"{MODEL}@prod", input_url, output_url, tenant="acme")

    assert again.is_completed() and again.name == "Completed", again.message
    repeat = again.result()
    assert repeat["shards_skipped"] == 6 and repeat["rows_scored"] == 0
    assert repeat["rows_out"] == 12_000 and repeat["shards_committed"] == 6
    after = {n: fs.info(f"{output_url.removeprefix('s3://')}/{n}") for n in shard_names}
    assert {n: (i["ETag"], i["LastModified"]) for n, i in after.items()} == {
        n: (i["ETag"], i["LastModified"]) for n, i in before.items()
    }
    assert keys_under(s3_server, output_url) == objects
    assert read_scored(s3_server, output_url).num_rows == 12_000


@pytest.mark.usefixtures("on_cluster")
def test_an_output_in_a_bucket_that_does_not_exist_is_refused_and_no_bucket_is_made(
    s3_server: S3Server, s3_prefix: str, s3_registry: ModelRegistry, input_shards: Path,
) -> None:
    # s3fs's makedirs, called before each write, created the bucket a mistyped output URL named
    import boto3

    input_url = s3_server.url(s3_prefix, "input")
    upload(s3_server, input_shards, input_url)
    missing = f"nobucket-{s3_prefix}"

    state = run(f"{MODEL}@prod", input_url, f"s3://{missing}/out/", tenant="acme")

    assert state.is_failed(), state.message
    assert f"the output s3://{missing}/out cannot be written" in str(state.message), state.message
    assert "check the bucket's name in --output: Shardline creates no bucket" in str(state.message)
    client = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1")
    assert missing not in [b["Name"] for b in client.list_buckets()["Buckets"]]


@pytest.mark.usefixtures("on_cluster")
def test_an_output_that_is_an_earlier_jobs_part_is_refused_as_a_file_and_the_part_kept(
    s3_server: S3Server, s3_prefix: str, s3_registry: ModelRegistry, input_shards: Path,
) -> None:
    # an object store takes keys below an object's name: the new job's parts once hid the old part from readers
    from shardline.cli.batch_jobs import JobRequest, check_request
    from shardline.errors import OutputNotWritable

    input_url, output_url = s3_server.url(s3_prefix, "input"), s3_server.url(s3_prefix, "out")
    upload(s3_server, input_shards, input_url)
    assert run(f"{MODEL}@prod", input_url, output_url).is_completed()
    objects = keys_under(s3_server, output_url)
    typo = f"{output_url}/part-00000.parquet"

    with pytest.raises(OutputNotWritable, match=f"the output {typo} is a file, not a folder; running again will "
                                                "not help: choose a folder for --output"):
        check_request(JobRequest(model=f"{MODEL}@prod", input_uri=input_url, output_uri=typo))
    state = run(f"{MODEL}@prod", input_url, typo)  # the flow's own check (a deployment's run)

    assert state.is_failed() and f"the output {typo} is a file, not a folder" in str(state.message), state.message
    assert keys_under(s3_server, output_url) == objects
    assert read_scored(s3_server, output_url).num_rows == 12_000


def test_an_output_inside_or_holding_another_jobs_folder_on_s3_is_refused_in_few_round_trips(
    s3_server: S3Server, s3_prefix: str, s3_registry: ModelRegistry, input_shards: Path,
) -> None:
    # the readers of the outer folder would read the inner job's files as its own; each check once probed four
    # names per folder above the output (a HEAD and a listing each): 32 round trips for a new output 3 deep
    from shardline.cli.batch_jobs import JobRequest, check_request
    from shardline.errors import OutputInUse
    from shardline.storage.fs import open_fs
    from shardline.storage.job_folders import job_folder_overlap

    input_url, jobs = s3_server.url(s3_prefix, "input"), s3_server.url(s3_prefix, "jobs")
    upload(s3_server, input_shards, input_url)
    s3_server.filesystem().pipe(f"{jobs.removeprefix('s3://')}/a/answers/_job.json", b"{}")  # a `batch openai` job
    for output, message in [
        (f"{jobs}/a", f"the output {jobs}/a holds {jobs}/a/answers, another job's output folder (a `batch openai` "
                      "job's: it holds its _job.json or _parts); this job's readers would read that job's files"),
        (f"{jobs}/a/answers/more", f"the output {jobs}/a/answers/more is inside {jobs}/a/answers, another job's "
                                   "output folder (a `batch openai` job's"),
    ]:
        with pytest.raises(OutputInUse, match=re.escape(message)):
            check_request(JobRequest(model=f"{MODEL}@prod", input_uri=input_url, output_uri=output))

    fs, root = open_fs(f"{jobs}/b/new/out", StorageSettings().storage_options)
    sent: list[str] = []

    def count(request: Any, **_: Any) -> None:
        sent.append(f"{request.method} {request.url}")

    fs.s3.meta.events.register("before-send.s3", count)
    try:
        assert job_folder_overlap(fs, root, f"{jobs}/b/new/out", "batch run") is None
        new_output = list(sent)
        sent.clear()
        assert job_folder_overlap(fs, f"{root.rsplit('/', 3)[0]}/a", f"{jobs}/a", "batch run") is not None
    finally:
        fs.s3.meta.events.unregister("before-send.s3", count)
    assert len(new_output) == 3, new_output  # the bucket, the test's prefix, jobs/: no 'b' there, nothing below
    assert len(sent) == 5, sent  # the bucket, the prefix, jobs/, jobs/a/, and everything below jobs/a/


@pytest.mark.usefixtures("on_cluster")
def test_corrupt_shard_on_s3_is_quarantined_and_the_rest_completes(
    s3_server: S3Server, s3_prefix: str, s3_registry: ModelRegistry, input_shards: Path
) -> None:
    input_url, output_url = s3_server.url(s3_prefix, "input"), s3_server.url(s3_prefix, "out")
    upload(s3_server, input_shards, input_url)
    s3_server.filesystem().pipe_file(f"{input_url.removeprefix('s3://')}/bad.parquet", b"this is not parquet" * 64)

    state = run(f"{MODEL}@prod", input_url, output_url)

    assert state.is_completed() and state.name == "Quarantined", state.message
    summary = state.result()
    assert (summary["shards"], summary["shards_committed"], summary["shards_quarantined"]) == (7, 6, 1)
    assert summary["rows_out"] == 12_000
    assert list(summary["quarantined"]) == ["bad.parquet"]
    assert summary["quarantined"]["bad.parquet"].startswith("CorruptShard:")
    assert state.message.endswith(f"reasons in {output_url}/_manifest.json")

    manifest = json.loads(s3_server.filesystem().cat_file(f"{output_url.removeprefix('s3://')}/_manifest.json"))
    assert len(manifest["parts"]) == 6 and sum(p["rows"] for p in manifest["parts"]) == 12_000
    [quarantined] = manifest["quarantined"]
    assert quarantined["shard"] == f"{input_url}/bad.parquet"
    assert "not a readable Parquet file" in quarantined["reason"]

    objects = keys_under(s3_server, output_url)
    assert "bad.parquet" not in objects and "_SUCCESS" in objects
    assert not [k for k in objects if k.startswith("_staging")]
    assert read_scored(s3_server, output_url).num_rows == 12_000


def test_racing_promotions_on_s3_keep_one_history_and_rollback_works(
    s3_server: S3Server, s3_registry: ModelRegistry, tmp_path: Path
) -> None:
    import threading

    from shardline.errors import AliasConflict

    package_breast_cancer(tmp_path / "v2", kind="logreg")
    assert s3_registry.push(tmp_path / "v2").version == 2
    wins: list[int] = []
    losses: list[str] = []
    start = threading.Barrier(4)

    def promote() -> None:
        registry = ModelRegistry(s3_registry.url, s3_server.storage_options)  # its own client and cache
        start.wait()
        for _ in range(3):
            current = registry.current_move(MODEL, "prod")
            assert current is not None
            try:
                move = registry.move_alias(MODEL, "prod", 2 if current.version == 1 else 1, action="promote",
                                           expected_seq=current.seq)
                wins.append(move.seq)
            except AliasConflict as e:
                losses.append(str(e))

    threads = [threading.Thread(target=promote) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    history = s3_registry.alias_history(MODEL, "prod")
    assert [m.seq for m in history] == list(range(1, len(history) + 1))  # If-None-Match: one writer per record
    assert sorted(wins) == [m.seq for m in history[1:]] and len(wins) + len(losses) == 12
    for before, after in zip(history, history[1:]):
        assert after.previous == before.version != after.version
    current = history[-1].version
    back = s3_registry.rollback(MODEL, "prod", reason="s3 rollback")
    assert back.version != current and s3_registry.resolve(f"{MODEL}@prod").version == back.version
