"""A user error in `shardline batch run` ends with one `error:` line and exit 2: no traceback, no repeats.

Prefect logs a failed task and flow run at ERROR with their tracebacks and repeats the error in its
"Finished in state Failed" lines; for an error the user must fix, the CLI's one line says it all,
and the rest goes to DEBUG (shown with PREFECT_LOGGING_LEVEL=DEBUG). Each run goes through the
flow (these errors are found inside it, not by the checks before Prefect starts).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Callable

import fsspec
import pytest

from shardline.build.examples import write_shards
from shardline.storage.lease import LeaseTerms, OutputLease

Shardline = Callable[..., subprocess.CompletedProcess[str]]


def assert_one_error_line(run: subprocess.CompletedProcess[str], message: str) -> None:
    assert run.returncode == 2, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert "Traceback" not in run.stderr, run.stderr
    assert lines[-1].startswith("error: ") and message in lines[-1], run.stderr
    assert [line for line in lines if line.startswith("error: ") or message in line] == [lines[-1]], run.stderr
    assert not [line for line in lines if "| ERROR" in line], run.stderr


@pytest.mark.usefixtures("local_registry")
def test_user_errors_inside_the_flow_print_one_line_and_exit_2(shardline: Shardline, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    shards = tmp_path / "input"
    write_shards(shards, 1, 100)
    busy = tmp_path / "busy"
    fs = fsspec.filesystem("file")
    lease = OutputLease.acquire(fs, str(busy), str(busy), "job-elsewhere", "breast-cancer:1", LeaseTerms())  # a live job
    run = ("batch", "run", "--model")
    try:
        cases = [
            (shardline(*run, "breast-cancer@prod", "--input", str(empty), "--output", str(tmp_path / "out")),
             f"the input '{empty}' holds no shard"),
            (shardline(*run, "churn@prod", "--input", str(shards), "--output", str(tmp_path / "out")),
             "model 'churn' is not in the registry"),
            (shardline(*run, "breast-cancer@prod", "--input", str(shards), "--output", str(busy)),
             f"the output {busy} is in use by job job-elsewhere"),
        ]
    finally:
        lease.release()
    for finished, message in cases:
        assert_one_error_line(finished, message)
    assert not (tmp_path / "out").exists()

    debug = shardline(*run, "churn@prod", "--input", str(shards), "--output", str(tmp_path / "out"),
                      PREFECT_LOGGING_LEVEL="DEBUG")
    assert debug.returncode == 2 and debug.stderr.count("Traceback") == 2  # the task's and the flow's, at DEBUG
    assert "DEBUG   | Flow run" in debug.stderr and "Encountered exception during execution: ModelNotFound" in debug.stderr


@pytest.mark.usefixtures("local_registry")
def test_a_link_in_the_input_out_of_the_tenants_prefixes_is_one_line_and_exit_2(
    shardline: Shardline, tmp_path: Path
) -> None:
    lake = Path(os.path.realpath(tmp_path / "lake"))
    write_shards(lake / "acme" / "in", 1, 100)
    write_shards(lake / "globex" / "in", 1, 100)
    (lake / "acme" / "in" / "theirs.parquet").symlink_to(lake / "globex" / "in" / "part-00000.parquet")
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  - name: acme\n    batch: {{storage_prefixes: ['{lake / 'acme'}']}}\n")

    refused = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", str(lake / "acme" / "in"),
                        "--output", str(lake / "acme" / "out"), "--tenant", "acme", SHARDLINE_TENANTS_FILE=str(tenants))

    assert_one_error_line(refused, f"the link '{lake}/acme/in/theirs.parquet' in the input leads to "
                                   f"'{lake}/globex/in/part-00000.parquet', outside the tenant's storage prefixes")
    assert not (lake / "acme" / "out").exists()


@pytest.mark.usefixtures("local_registry")
def test_a_rollout_promotion_or_release_of_what_is_not_there_is_one_line_and_exit_2(shardline: Shardline) -> None:
    """Found before any flow starts: no failed run, no traceback."""
    cases = [
        (shardline("rollout", "start", "breast-cancer", "--candidate", "breast-cancer:7", "--steps", "5,100"),
         "model 'breast-cancer' has no version 7"),
        (shardline("rollout", "start", "breast-cancer", "--candidate", "1", "--steps", "5,100"),
         "breast-cancer:1 is what breast-cancer@prod points at already"),
        (shardline("rollout", "start", "breast-cancer", "--candidate", "1", "--alias", "staging", "--shadow", "5%"),
         "breast-cancer@staging was never set, so there is no baseline"),
        (shardline("rollout", "start", "breast-cancer", "--candidate", "1", "--steps", "50,5"),
         "steps '50,5' are not rising percents"),
        (shardline("rollout", "promote", "breast-cancer"), "no rollout runs on breast-cancer@prod"),
        (shardline("model", "promote", "churn:2", "--to", "prod"), "model 'churn' is not in the registry"),
        (shardline("model", "release", "breast-cancer:7"), "model 'breast-cancer' has no version 7"),
        (shardline("model", "release", "breast-cancer"), "the candidate 'breast-cancer' is not name:version"),
    ]
    for finished, message in cases:
        assert_one_error_line(finished, message)
