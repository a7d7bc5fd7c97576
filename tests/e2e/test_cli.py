"""The `shardline` command as a user drives it: registry, batch runs, exit codes, a crash and a resume."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from shardline.build.examples import write_shards
from tests.conftest import BuiltModel

Shardline = Callable[..., subprocess.CompletedProcess[str]]


def test_model_push_alias_and_list(shardline: Shardline, breast_cancer_model: BuiltModel) -> None:
    pushed = shardline("model", "push", str(breast_cancer_model.bundle_dir))
    assert pushed.returncode == 0, pushed.stderr
    assert pushed.stdout.startswith("pushed breast-cancer:1 (digest ")

    aliased = shardline("model", "alias", "breast-cancer", "prod", "1", "--reason", "first release")
    assert aliased.returncode == 0 and "breast-cancer@prod -> breast-cancer:1" in aliased.stdout

    listed = shardline("model", "list")
    assert listed.returncode == 0
    line = listed.stdout.strip().splitlines()[0]
    assert line.split()[:3] == ["breast-cancer:1", "prod", "onnx"] and "mean radius:float32" in line

    wrong = shardline("model", "alias", "breast-cancer", "dev", "4")
    assert wrong.returncode == 2 and "has no version 4 (it has versions [1])" in wrong.stderr
    protected = shardline("model", "alias", "breast-cancer", "prod", "1")
    assert protected.returncode == 2 and "breast-cancer@prod is protected" in protected.stderr


@pytest.mark.usefixtures("local_registry")
def test_batch_run_prints_a_summary_and_exit_codes_tell_the_outcome(
    shardline: Shardline, input_shards: Path, tmp_path: Path
) -> None:
    ok = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", str(input_shards),
                   "--output", str(tmp_path / "out"), "--tenant", "acme")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "rows out  12,000" in ok.stdout and "shards  6 (6 committed, 0 quarantined: 6 this run, 0 by an earlier run)" in ok.stdout

    (input_shards / "broken.parquet").write_bytes(b"PAR1 nope")
    partial = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", str(input_shards),
                        "--output", str(tmp_path / "out"), "--json")
    assert partial.returncode == 3, partial.stderr[-2000:]
    summary = json.loads(partial.stdout)  # the JSON alone on stdout (for jq), the summary table on stderr
    assert "shards  7 (6 committed, 1 quarantined: 1 this run, 6 by an earlier run)" in partial.stderr, \
        partial.stderr[-3000:]
    assert summary["shards_skipped"] == 6 and summary["shards_quarantined"] == 1
    assert "broken.parquet" in summary["quarantined"]
    assert summary["shards_unreadable"] == 1 and summary["rows_in"] == summary["rows_out"] == 12_000
    # run again, finished: every shard settled by an earlier run, and the parts still add up to the whole
    again = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", str(input_shards),
                      "--output", str(tmp_path / "out"))
    assert again.returncode == 3, again.stderr[-2000:]
    assert "shards  7 (6 committed, 1 quarantined: 0 this run, 7 by an earlier run)" in again.stdout, again.stdout

    # the progress bar counts the job's shards, the quarantined one too: 7/7, not 6/6
    fresh = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", str(input_shards),
                      "--output", str(tmp_path / "fresh"))
    assert fresh.returncode == 3, fresh.stderr[-2000:]
    assert " 7/7 12,000 rows " in fresh.stdout, fresh.stdout
    assert "rows quarantined  1 unreadable shard, rows unknown" in fresh.stdout
    reasons = [line for line in (fresh.stdout + fresh.stderr).splitlines() if "not a readable Parquet file" in line]
    assert reasons == [line for line in fresh.stdout.splitlines() if line.startswith("quarantined broken.parquet: ")]
    assert "quarantined broken.parquet (CorruptShard)" in fresh.stderr  # the log line names it, once without why

    # every shard quarantined: its own exit code (running again cannot fix the data), not 1 ("failed: resume")
    bad = tmp_path / "bad"
    write_shards(bad, 2, 10)
    for shard in bad.glob("*.parquet"):
        shard.write_bytes(b"PAR1 nope")
    none_scored = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", str(bad),
                            "--output", str(tmp_path / "bad-out"))
    assert none_scored.returncode == 5, none_scored.stderr[-2000:]
    assert " 2/2 0 rows " in none_scored.stdout and "shards  2 (0 committed, 2 quarantined: 2 this run, 0 by an earlier run)" in (
        none_scored.stdout)
    assert "every shard was quarantined" in none_scored.stdout and "running again will not help" in none_scored.stdout
    assert "error:" not in none_scored.stderr and "| ERROR" not in none_scored.stderr

    missing = shardline("batch", "run", "--model", "churn@prod", "--input", str(input_shards),
                        "--output", str(tmp_path / "out2"))
    assert missing.returncode == 2
    assert "error: model 'churn' is not in the registry" in missing.stderr
    assert "shardline model push" in missing.stderr


@pytest.mark.usefixtures("local_registry")
def test_batch_run_refuses_locations_outside_the_tenant_or_over_the_input_before_anything_starts(
    shardline: Shardline, tmp_path: Path
) -> None:
    lake = tmp_path / "lake"
    write_shards(lake / "globex" / "in", 1, 100)
    (lake / "acme").mkdir()
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  - name: acme\n    batch: {{storage_prefixes: ['{lake / 'acme'}']}}\n")
    before = sorted(p.name for p in (lake / "globex").rglob("*"))
    cases = [
        (f"file://{lake}/acme?/../globex/in", f"{lake}/acme/out", "holds '?' or '#'"),
        (f"{lake}/acme/../globex/in", f"{lake}/acme/out", "may not use"),
        (f"{lake}/acme/in", f"file://{lake}/acme#/../globex/x", "holds '?' or '#'"),
    ]
    for source, target, message in cases:
        refused = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", source, "--output", target,
                            "--tenant", "acme", SHARDLINE_TENANTS_FILE=str(tenants))
        assert refused.returncode == 2, refused.stderr[-2000:]
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], refused.stderr
        assert "Traceback" not in refused.stderr and "temporary server" not in refused.stderr + refused.stdout
    overlap = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", str(lake / "globex" / "in"),
                        "--output", str(lake / "globex" / "in" / "scored"))
    assert overlap.returncode == 2 and "lies inside the input" in overlap.stderr
    assert sorted(p.name for p in (lake / "globex").rglob("*")) == before
    assert not (lake / "acme" / "out").exists()

