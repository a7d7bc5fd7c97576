"""Editing the tenants file (`shardline tenant`): an edit that races another writer writes nothing, a file
reached through a symbolic link is replaced at its target, and a result the loader refuses is not written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shardline.cli.tenants_file import edit, new_api_key
from shardline.errors import InvalidSetting
from shardline.tenants import hash_api_key, load_tenants_file

FILE = 'tenants:\n  - name: acme\n    api_keys_sha256: ["{digest}"]\n    models: ["churn@prod"]\n'


def _file(path: Path) -> Path:
    path.write_text(FILE.format(digest=hash_api_key("sk-old")))
    return path


def test_an_edit_that_races_another_writer_writes_nothing(tmp_path: Path) -> None:
    path = _file(tmp_path / "tenants.yaml")

    def meanwhile(document: Any) -> None:
        document.entries[0]["models"].append("minilm@prod")
        path.write_text(path.read_text().replace("churn@prod", "other@prod"))  # someone else's edit lands first

    with pytest.raises(InvalidSetting, match="changed while this command ran; nothing was written: run the command"):
        edit(path, meanwhile)
    assert load_tenants_file(path).tenants[0].models == ["other@prod"]  # theirs kept, ours not written
    assert [p.name for p in tmp_path.iterdir()] == ["tenants.yaml"]


def test_a_linked_file_is_replaced_at_its_target_and_a_refused_result_is_not_written(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    target = _file(tmp_path / "real" / "tenants.yaml")
    link = tmp_path / "tenants.yaml"
    link.symlink_to(target)
    key = new_api_key()
    assert key.startswith("sk-") and len(key) == 46 and key != new_api_key()

    def add_key(document: Any) -> None:
        document.entries[0]["api_keys_sha256"].append(hash_api_key(key))

    edit(link, add_key)
    assert link.is_symlink() and hash_api_key(key) in target.read_text()
    before = target.read_text()

    def drop_models(document: Any) -> None:
        document.entries[0]["models"].clear()

    with pytest.raises(InvalidSetting, match=r"tenants\[0\]: Value error, models: list at least one model"):
        edit(link, drop_models)
    assert target.read_text() == before
