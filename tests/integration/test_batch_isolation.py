"""A batch job reads and writes only where it was admitted to, on local disk and on a real S3 server.

Each refused form below once passed the prefix check while fsspec opened another
tenant's folder. The jobs are real flow runs on the session's Dask cluster; after every
refusal the other tenant's data is byte for byte what it was and nothing was written.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
import yaml

from shardline.errors import AccessDenied, InvalidSetting
from shardline.flows.batch_inference import batch_inference
from shardline.storage.registry import ModelRegistry
from tests.conftest import write_shards
from tests.integration.conftest import S3Server
from tests.support.s3 import keys_under, upload

MODEL = "breast-cancer@prod"


def run(input_uri: str, output_uri: str, tenant: str = "acme") -> Any:
    return batch_inference(model=MODEL, input_uri=input_uri, output_uri=output_uri, tenant=tenant,
                           return_state=True)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under a folder with the sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def lake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_registry: ModelRegistry) -> Path:
    """Two tenants' folders with shards; acme holds a link into globex's; the tenants file names both."""
    lake = Path(os.path.realpath(tmp_path / "lake"))
    for tenant in ("acme", "globex"):
        write_shards(lake / tenant / "in", 2, 300)
    (lake / "acme" / "link").symlink_to(lake / "globex")
    tenants = {"tenants": [{"name": "acme", "batch": {"storage_prefixes": [str(lake / "acme"), "s3://shardline-test/"
                                                                            "acme/"]}},
                           {"name": "globex", "batch": {"storage_prefixes": [str(lake / "globex")]}}]}
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(tenants))
    monkeypatch.setenv("SHARDLINE_TENANTS_FILE", str(path))
    monkeypatch.chdir(lake)
    return lake


@pytest.mark.usefixtures("on_cluster")
@pytest.mark.parametrize(("input_form", "output_form", "error", "message"), [
    ("file://{lake}/acme?/../globex/in", "{lake}/acme/out", InvalidSetting, r"holds '\?' or '#'"),
    ("{lake}/acme/in", "file://{lake}/acme?/../globex/x", InvalidSetting, r"holds '\?' or '#'"),
    ("{lake}/acme/in", "file://{lake}/acme#/../globex/x", InvalidSetting, r"holds '\?' or '#'"),
    ("file://globex/in", "{lake}/acme/out", InvalidSetting, r"names the host 'globex'"),
    ("{lake}/acme/link/in", "{lake}/acme/out", AccessDenied, r"resolves to '{lake}/globex/in'\) as its input"),
    ("{lake}/acme/in", "{lake}/acme/link/stolen", AccessDenied, r"as its output"),
    ("{lake}/acme/in", "{lake}/acme/../globex/x", AccessDenied, r"as its output"),
])
def test_a_location_that_escapes_the_tenants_prefixes_is_refused_and_nothing_moves(
    lake: Path, input_form: str, output_form: str, error: type[Exception], message: str,
) -> None:
    before = snapshot(lake / "globex")
    state = run(input_form.format(lake=lake), output_form.format(lake=lake))
    assert state.is_failed()
    with pytest.raises(error, match=message.format(lake=lake)):
        state.result()
    assert snapshot(lake / "globex") == before
    assert not (lake / "acme" / "out").exists()


@pytest.mark.usefixtures("on_cluster")
def test_the_same_tenant_scores_its_own_folders_through_a_url_that_resolves_inside(lake: Path) -> None:
    state = run(f"file://{lake}/acme/x/../in/", f"{lake}/acme/out")
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["rows_out"] == 600 and summary["output"] == str(lake / "acme" / "out")
    assert ds.dataset(str(lake / "acme" / "out")).count_rows() == 600


@pytest.mark.usefixtures("on_cluster")
@pytest.mark.parametrize(("output", "how"), [("in", "is the input"), ("in/scored", "lies inside the input"),
                                             (".", "holds the input")])
def test_an_output_that_overlaps_the_input_is_refused_and_the_shards_are_untouched(
    lake: Path, output: str, how: str,
) -> None:
    shards = snapshot(lake / "acme" / "in")
    state = run(f"{lake}/acme/in", f"{lake}/acme/{output}")
    with pytest.raises(InvalidSetting, match=f"the output .* {how} "):
        state.result()
    assert snapshot(lake / "acme" / "in") == shards


@pytest.mark.s3
@pytest.mark.usefixtures("on_cluster")
@pytest.mark.parametrize(("output", "message"), [
    ("s3://shardline-test/acme#/../globex/x", r"holds '\?' or '#'"),
    ("s3://shardline-test//acme/x", r"empty, '\.' or '\.\.' path segment"),
    ("s3://shardline-test/acme/../globex/x", r"empty, '\.' or '\.\.' path segment"),
    ("s3://shardline-test/globex/x", r"may not use .* as its output"),
])
def test_s3_keys_outside_the_prefix_are_refused_and_nothing_is_written(
    lake: Path, s3_server: S3Server, s3_prefix: str, output: str, message: str,
) -> None:
    assert s3_server.bucket == "shardline-test"
    upload(s3_server, lake / "acme" / "in", s3_server.url("acme", s3_prefix))
    state = run(s3_server.url("acme", s3_prefix), output)
    with pytest.raises((InvalidSetting, AccessDenied), match=message):
        state.result()
    fs = s3_server.filesystem()
    assert not [k for k in fs.find(s3_server.bucket) if "globex" in k or "acme#" in k or k.startswith("/")]
    assert keys_under(s3_server, s3_server.url("acme", s3_prefix)) == sorted(p.name for p in (lake / "acme" / "in").iterdir())


@pytest.mark.usefixtures("on_cluster")
@pytest.mark.parametrize("link", ["_ledger", "_staging", "_lease", "sub"])
def test_a_link_below_the_output_into_another_tenant_carries_no_write_out(lake: Path, link: str) -> None:
    write_shards(lake / "acme" / "nested" / "sub", 1, 100)
    (lake / "acme" / "out").mkdir()
    (lake / "globex" / "target").mkdir()
    (lake / "acme" / "out" / link).symlink_to(lake / "globex" / "target")
    before = snapshot(lake / "globex")
    state = run(f"{lake}/acme/nested", f"{lake}/acme/out")
    with pytest.raises(InvalidSetting, match=r"holds a symbolic link .*/out/" + link + r"' that leads outside it"):
        state.result()
    assert snapshot(lake / "globex") == before


def dvc_like(folder: Path, cache: Path, shards: list[Path]) -> None:
    """``folder`` holds a link per shard into ``cache``, where the shard's bytes live under their md5 (as DVC keeps them)."""
    folder.mkdir(parents=True)
    for shard in shards:
        digest = hashlib.md5(shard.read_bytes()).hexdigest()
        blob = cache / digest[:2] / digest[2:]
        blob.parent.mkdir(parents=True, exist_ok=True)
        shard.rename(blob)
        (folder / shard.name).symlink_to(os.path.relpath(blob, folder))


@pytest.mark.usefixtures("on_cluster")
def test_a_folder_of_links_and_a_linked_folder_inside_the_prefix_are_scored_row_for_row(lake: Path) -> None:
    dvc_like(lake / "acme" / "dataset", lake / "acme" / ".dvc" / "cache", write_shards(lake / "acme" / "tmp", 3, 200))
    (lake / "acme" / "dataset" / "earlier").symlink_to(lake / "acme" / "in")  # a linked sub-folder: 2 x 300 rows
    state = run(f"{lake}/acme/dataset", f"{lake}/acme/out")
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["rows_in"] == summary["rows_out"] == 1200 and summary["shards"] == 5
    assert ds.dataset(str(lake / "acme" / "out")).count_rows() == 1200
    parts = sorted(p.relative_to(lake / "acme" / "out").as_posix() for p in (lake / "acme" / "out").rglob("*.parquet")
                   if not any(s.startswith(("_", ".")) for s in p.relative_to(lake / "acme" / "out").parts))
    assert len(parts) == 5 and sum(p.startswith("earlier/") for p in parts) == 2  # named after the links


@pytest.mark.usefixtures("on_cluster")
@pytest.mark.parametrize(("link", "target"), [("stolen.parquet", "globex/in/part-00000.parquet"), ("stolen", "globex/in")])
def test_a_link_in_the_input_into_another_tenants_prefix_is_refused_and_nothing_is_written(
    lake: Path, link: str, target: str,
) -> None:
    write_shards(lake / "acme" / "mixed", 1, 100)
    (lake / "acme" / "mixed" / link).symlink_to(lake / target)
    before = snapshot(lake / "globex")
    state = run(f"{lake}/acme/mixed", f"{lake}/acme/out")
    assert state.is_failed()
    with pytest.raises(InvalidSetting, match=re.escape(
            f"the link '{lake}/acme/mixed/{link}' in the input leads to '{lake}/{target}', outside the tenant's")):
        state.result()
    assert snapshot(lake / "globex") == before
    assert not (lake / "acme" / "out").exists()


@pytest.mark.usefixtures("on_cluster")
def test_a_link_loop_in_the_input_is_refused_at_once(lake: Path) -> None:
    write_shards(lake / "acme" / "looped" / "sub", 1, 100)
    (lake / "acme" / "looped" / "sub" / "again").symlink_to(lake / "acme" / "looped")
    state = run(f"{lake}/acme/looped", f"{lake}/acme/out")
    with pytest.raises(InvalidSetting, match=r"again' in the input leads back to .*, a folder that holds it \(a loop\)"):
        state.result()
    assert not (lake / "acme" / "out").exists()
