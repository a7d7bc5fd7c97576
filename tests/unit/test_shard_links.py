"""Symbolic links in an input folder (how DVC and other data versioning tools lay data out) are followed.

A shard is read from the link's real target (its fingerprint: a changed target is scored
again) under the link's own name; with a tenant's prefixes a link must lead under them;
a loop of links is refused at once, never walked.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardline.errors import EmptyInput, InvalidSetting
from shardline.storage.shards import list_shards


def parquet(path: Path, rows: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"x": list(range(rows))}), path)
    return path


@pytest.fixture
def lake(tmp_path: Path) -> Path:
    """acme/data: a DVC-like folder (links into acme/.dvc/cache, whose files have no suffix); globex/ beside it."""
    lake = Path(os.path.realpath(tmp_path))
    cache = lake / "acme" / ".dvc" / "cache"
    data = lake / "acme" / "data"
    data.mkdir(parents=True)
    for i, rows in enumerate((3, 5)):
        blob = parquet(cache / "tmp.parquet", rows)
        digest = hashlib.md5(blob.read_bytes()).hexdigest()
        target = cache / digest[:2] / digest[2:]
        target.parent.mkdir(parents=True, exist_ok=True)
        blob.rename(target)
        (data / f"part-{i}.parquet").symlink_to(os.path.relpath(target, data))
    parquet(lake / "acme" / "more" / "m-0.parquet", 7)
    parquet(lake / "globex" / "secret.parquet", 11)
    return lake


def test_a_dvc_like_folder_of_links_lists_each_link_as_a_shard_read_from_its_target(lake: Path) -> None:
    shards = list_shards(str(lake / "acme" / "data"))

    assert [s.relative for s in shards] == ["part-0.parquet", "part-1.parquet"]
    targets = [Path(s.uri.removeprefix("file://")) for s in shards]
    assert all(t.parent.parent == lake / "acme" / ".dvc" / "cache" and not t.is_symlink() for t in targets)
    assert [pq.read_metadata(t).num_rows for t in targets] == [3, 5]
    assert [s.size for s in shards] == [t.stat().st_size for t in targets]


def test_a_changed_target_changes_the_fingerprint_so_the_shard_is_scored_again(lake: Path) -> None:
    before = list_shards(str(lake / "acme" / "data"))[0]
    target = Path(before.uri.removeprefix("file://"))
    parquet(target, 9)
    os.utime(target, (1, 1))  # a new mtime for sure, whatever the clock's resolution
    after = list_shards(str(lake / "acme" / "data"))[0]
    assert after.relative == before.relative and after.fingerprint != before.fingerprint


def test_a_linked_folder_is_walked_under_the_links_name(lake: Path) -> None:
    (lake / "acme" / "data" / "extra").symlink_to(lake / "acme" / "more")
    (lake / "acme" / "data" / "README").symlink_to(lake / "acme" / "more" / "m-0.parquet")  # no suffix: not a shard
    shards = list_shards(str(lake / "acme" / "data"), link_roots=[str(lake / "acme")])
    assert [s.relative for s in shards] == ["extra/m-0.parquet", "part-0.parquet", "part-1.parquet"]
    assert shards[0].uri == f"file://{lake}/acme/more/m-0.parquet"


@pytest.mark.parametrize("link", ["stolen.parquet", "stolen-folder"])
def test_a_link_outside_the_tenants_prefixes_is_refused_naming_link_and_target(lake: Path, link: str) -> None:
    target = lake / "globex" / ("secret.parquet" if link.endswith(".parquet") else "")
    (lake / "acme" / "data" / link).symlink_to(target)
    with pytest.raises(InvalidSetting, match=re.escape(
            f"the link '{lake}/acme/data/{link}' in the input leads to '{target}', outside the tenant's storage "
            "prefixes")):
        list_shards(str(lake / "acme" / "data"), link_roots=[str(lake / "acme")])
    assert len(list_shards(str(lake / "acme" / "data"))) == 3  # single-tenant mode: links lead anywhere


def test_a_linked_input_is_vetted_like_the_links_below_it(lake: Path) -> None:
    (lake / "acme" / "alias").symlink_to(lake / "globex")
    with pytest.raises(InvalidSetting, match="outside the tenant's storage prefixes"):
        list_shards(str(lake / "acme" / "alias"), link_roots=[str(lake / "acme")])
    assert [s.relative for s in list_shards(str(lake / "acme" / "alias"))] == ["secret.parquet"]


def test_a_link_back_up_the_tree_is_refused_at_once_not_walked_forever(lake: Path) -> None:
    (lake / "acme" / "data" / "sub").mkdir()
    (lake / "acme" / "data" / "sub" / "up").symlink_to(lake / "acme" / "data")
    with pytest.raises(InvalidSetting, match=r"leads back to .*/acme/data', a folder that holds it \(a loop\)"):
        list_shards(str(lake / "acme" / "data"))


def test_two_folders_linking_each_other_are_a_loop(lake: Path) -> None:
    (lake / "acme" / "data" / "there").symlink_to(lake / "acme" / "more")
    (lake / "acme" / "more" / "back").symlink_to(lake / "acme" / "data")
    with pytest.raises(InvalidSetting, match="a loop"):
        list_shards(str(lake / "acme" / "data"))


def test_a_loop_of_links_or_a_broken_link_named_as_a_shard_is_refused(lake: Path) -> None:
    data = lake / "acme" / "data"
    (data / "a.parquet").symlink_to(data / "b.parquet")
    (data / "b.parquet").symlink_to(data / "a.parquet")
    with pytest.raises(InvalidSetting, match=r"which is not a file \(a broken link, or a loop of links\)"):
        list_shards(str(data))
    for name in ("a.parquet", "b.parquet"):
        (data / name).unlink()
    (data / "gone.parquet").symlink_to(lake / "acme" / "nowhere.parquet")
    with pytest.raises(InvalidSetting, match="gone.parquet' in the input leads to .*nowhere.parquet"):
        list_shards(str(data))


def test_a_folder_of_links_to_nothing_shard_like_still_holds_no_shard(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    parquet(tmp_path / "elsewhere" / "x.parquet", 1)
    (tmp_path / "in" / "notes").symlink_to(tmp_path / "elsewhere" / "x.parquet")
    with pytest.raises(EmptyInput, match="holds no shard"):
        list_shards(str(tmp_path / "in"))
