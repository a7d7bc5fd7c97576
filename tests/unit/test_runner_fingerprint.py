"""The warm batch runner's fingerprint holds Shardline's code as installed: a runner left running from before an
upgrade (or a `git pull` of an editable install) differs from the command, so an idle one is replaced instead of
running the job with the old code (the replacement itself: tests/e2e/test_batch_runner.py)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from shardline.cli.batch_runner import AREAS, code_fingerprint, differences, fingerprint

REPO = Path(__file__).resolve().parents[2]


def test_the_areas_are_the_packages_pyproject_installs() -> None:
    mapped = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert sorted(name.removeprefix("shardline").removeprefix(".") for name in mapped) == sorted(AREAS)


def test_a_changed_added_or_removed_source_file_changes_the_fingerprint(tmp_path: Path) -> None:
    area = tmp_path / "area"
    (area / "__pycache__").mkdir(parents=True)
    module = area / "jobs.py"
    module.write_text("ROWS = 1\n")
    roots = (str(area),)
    first = code_fingerprint(roots)
    code_fingerprint.cache_clear()
    (area / "__pycache__" / "jobs.cpython-311.pyc").write_bytes(b"compiled")  # not source: the same code
    assert code_fingerprint(roots) == first
    code_fingerprint.cache_clear()
    module.write_text("ROWS = 2\n")
    stat = module.stat()
    os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # (a same-size edit in the same tick)
    changed = code_fingerprint(roots)
    assert changed != first
    code_fingerprint.cache_clear()
    (area / "new.py").write_text("")
    added = code_fingerprint(roots)
    assert added not in (first, changed)
    code_fingerprint.cache_clear()
    (area / "new.py").unlink()
    assert code_fingerprint(roots) == changed


def test_the_commands_fingerprint_names_the_code_where_it_differs() -> None:
    mine = fingerprint({}, "/work")
    assert len(mine["(shardline's code)"]) == 16
    older = {**mine, "(shardline's code)": "0" * 16}
    assert differences(older, mine) == ["(shardline's code)"]


def test_a_command_with_another_umask_has_another_fingerprint() -> None:
    """The runner writes the job's files (parts, manifest, ledger, records) with its own umask: one started under
    022 must not take the job of a command under 077, whose files a cold run would keep to the user."""
    mask = os.umask(0o077)
    try:
        private = fingerprint({}, "/work")
    finally:
        os.umask(mask)
    os.umask(0o022)
    try:
        shared = fingerprint({}, "/work")
    finally:
        os.umask(mask)
    assert (private["(umask)"], shared["(umask)"]) == ("077", "022")
    assert differences(private, shared) == ["(umask)"]
