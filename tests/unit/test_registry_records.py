"""Alias records a dead writer left (empty, cut short, unparseable) and protected first sets, on real files."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardline.errors import AliasConflict, ModelNotFound, ProtectedAlias, RegistryUnreadable
from shardline.build.examples import package_breast_cancer
from shardline.storage.fs import create_exclusive, open_fs
from shardline.storage.registry import AliasMove, ModelRegistry, parse_move, record_seq

from tests.conftest import BuiltModel

MODEL = "breast-cancer"


@pytest.fixture
def registry(breast_cancer_model: BuiltModel, tmp_path: Path) -> ModelRegistry:
    """A local registry with breast-cancer:1 and :2, prod set to 1 (record 1)."""
    registry = ModelRegistry(str(tmp_path / "registry"))
    registry.push(breast_cancer_model.bundle_dir)
    package_breast_cancer(tmp_path / "v2", kind="logreg")
    registry.push(tmp_path / "v2")
    registry.set_alias(MODEL, "prod", 1, by="ana")
    return registry


def record(registry: ModelRegistry, alias: str, seq: int) -> Path:
    return Path(registry.root) / MODEL / "aliases" / alias / f"{seq:08d}.json"


def a_valid_record(seq: int, version: int, alias: str = "prod") -> bytes:
    return AliasMove(seq=seq, alias=alias, version=version, action="set", by="bo").model_dump_json().encode()


LEFT_BEHIND = {
    "empty": b"",
    "cut short": a_valid_record(2, 2)[:25],
    "not json": b"\x00\x00\x00\x00",
    "another record's number": a_valid_record(7, 2),
}


@pytest.mark.parametrize("kind", sorted(LEFT_BEHIND))
def test_a_record_a_dead_writer_left_is_read_as_not_written(
    registry: ModelRegistry, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    record(registry, "prod", 2).write_bytes(LEFT_BEHIND[kind])

    with caplog.at_level(logging.WARNING, logger="shardline.registry"):
        resolved = ModelRegistry(registry.url).resolve(f"{MODEL}@prod")  # a fresh reader, as after a restart

    assert resolved.version == 1  # the previous record of the alias history
    assert [m.seq for m in registry.alias_history(MODEL, "prod")] == [1]
    assert registry.aliases(MODEL) == {"prod": 1}
    assert str(record(registry, "prod", 2)) in caplog.text  # the location goes to the log


def test_the_next_move_supersedes_a_broken_record(registry: ModelRegistry) -> None:
    record(registry, "prod", 2).write_bytes(b"")
    current = registry.current_move(MODEL, "prod")
    assert current is not None and current.seq == 1

    promoted = registry.move_alias(MODEL, "prod", 2, action="promote", expected_seq=current.seq, by="cy")

    assert (promoted.seq, promoted.previous) == (3, 1)
    assert registry.resolve(f"{MODEL}@prod").version == 2
    assert [(m.seq, m.version) for m in registry.alias_history(MODEL, "prod")] == [(1, 1), (3, 2)]
    back = registry.rollback(MODEL, "prod")
    assert (back.seq, back.version, back.previous) == (4, 1, 2)
    with pytest.raises(AliasConflict, match="moved while you were deciding"):  # still a compare-and-swap
        registry.move_alias(MODEL, "prod", 2, action="promote", expected_seq=3)


def test_an_alias_whose_only_record_is_empty_reads_as_never_set(registry: ModelRegistry) -> None:
    record(registry, "staging", 1).parent.mkdir(parents=True)
    record(registry, "staging", 1).write_bytes(b"")

    with pytest.raises(ModelNotFound, match="has no alias 'staging'"):
        registry.resolve(f"{MODEL}@staging")
    first = registry.set_alias(MODEL, "staging", 2, protected=True)  # a first set still: the dead one never landed

    assert (first.seq, first.previous) == (2, None)
    assert registry.resolve(f"{MODEL}@staging").version == 2


def test_registry_errors_name_the_alias_never_its_location(registry: ModelRegistry, caplog: pytest.LogCaptureFixture) -> None:
    record(registry, "prod", 2).mkdir()  # a record the storage cannot read as a file

    with caplog.at_level(logging.ERROR, logger="shardline.registry"), pytest.raises(RegistryUnreadable) as refused:
        registry.resolve(f"{MODEL}@prod")

    assert "record 2 of breast-cancer@prod" in str(refused.value)
    assert registry.root not in str(refused.value) and "/" not in str(refused.value)
    assert str(record(registry, "prod", 2)) in caplog.text


def test_a_protected_alias_is_set_only_the_first_time(registry: ModelRegistry) -> None:
    with pytest.raises(ProtectedAlias, match=r"breast-cancer@prod is protected and already set \(it points at "
                                             r"breast-cancer:1, set by ana, record 1\): it moves only through"):
        registry.set_alias(MODEL, "prod", 2, protected=True)
    assert registry.set_alias(MODEL, "prod", 2).version == 2  # unprotected: 'set' moves it
    assert registry.set_alias(MODEL, "staging", 2, protected=True).seq == 1


def test_record_names_and_contents_parse_as_pure_functions() -> None:
    assert record_seq("00000012.json") == 12
    assert [record_seq(n) for n in ("00000012.json.ab12.tmp", "latest.json", "²².json", "12")] == [None] * 4
    blob = a_valid_record(3, 2)
    assert parse_move(blob, 3, "prod") == AliasMove.model_validate_json(blob)
    assert parse_move(a_valid_record(3, 2), 4, "prod") is None
    assert parse_move(a_valid_record(3, 2, alias="dev"), 3, "prod") is None
    assert parse_move(b"  \n", 1, "prod") is None
    assert parse_move(b'{"seq": 1, "alias": "prod"', 1, "prod") is None


def test_a_local_exclusive_create_is_whole_or_absent(tmp_path: Path) -> None:
    fs, root = open_fs(str(tmp_path))
    target = f"{root}/a/00000001.json"
    assert create_exclusive(fs, target, b"first")
    assert not create_exclusive(fs, target, b"second")
    assert Path(target).read_bytes() == b"first" and os.listdir(tmp_path / "a") == ["00000001.json"]


def test_a_writer_killed_between_write_and_link_leaves_no_record(tmp_path: Path) -> None:
    """SIGKILL inside create_exclusive, after the data is written and before it is linked."""
    target = tmp_path / "aliases" / "prod" / "00000001.json"
    child = subprocess.run([sys.executable, "-c", (
        "import os, signal\n"
        "from shardline.storage import fs\n"
        "fs.os.link = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        "f, root = fs.open_fs(" + repr(str(tmp_path)) + ")\n"
        "fs.create_exclusive(f, " + repr(str(target)) + ", b'{}' * 100000)\n"
    )], capture_output=True, timeout=120)

    assert child.returncode == -signal.SIGKILL
    assert not target.exists()  # never visible empty or cut short
    leftovers = os.listdir(target.parent)
    assert all(record_seq(name) is None for name in leftovers)  # a temporary name that listings skip
