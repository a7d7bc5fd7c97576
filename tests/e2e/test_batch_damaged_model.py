"""A model whose files in the registry were changed after `shardline model push` (damaged: its bytes no longer
hash to what its manifest records) cannot be loaded by any run, and running again will not help.

`batch run` refuses it before any flow run (exit 2, one line naming the version and what to do: push its bundle
again, which rewrites the damaged file). Where only the workers see the damage (a change that kept the file's
size and time, which the command's check takes as read before), the job fails with the same line (exit 2, not
"run again"), hands out no more shards, keeps the parts committed, and counts no failed shard as settled; after
the push a re-run scores the rest, each shard once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from shardline.build.examples import write_shards
from shardline.cli.batch_runner import find
from shardline.storage.registry import ModelRegistry
from tests.conftest import BuiltModel
from tests.e2e.test_cli_user_errors import assert_refused, flow_runs

Shardline = Callable[..., subprocess.CompletedProcess[str]]
DAMAGED = "the registry's copy of breast-cancer:1 is damaged: its artifact 'model.onnx' has sha256 "
DO = ("no run can load it; push the bundle of breast-cancer:1 again (`shardline model push BUNDLE_DIR` rewrites the "
      "damaged file, and the version keeps its number)")


def damage_model_file(registry: ModelRegistry, keep_time: bool = False) -> Path:
    """Flip one byte of breast-cancer:1's model file in the registry (with ``keep_time``, its modification time kept,
    as a copy that keeps times does); returns the blob's path."""
    manifest = registry.get_manifest("breast-cancer", 1)
    artifact = next(a for a in manifest.artifacts if a.role == "model")
    blob = Path(registry.blob_path("breast-cancer", artifact.sha256))
    before = blob.stat()
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    if keep_time:
        os.utime(blob, ns=(before.st_atime_ns, before.st_mtime_ns))
    return blob


def test_a_damaged_model_is_refused_before_any_flow_run_and_pushing_its_bundle_again_repairs_it(
    shardline: Shardline, prefect_api: str, local_registry: ModelRegistry, breast_cancer_model: BuiltModel,
    shardline_home: Path, tmp_path: Path,
) -> None:
    shards, warm_up, out = tmp_path / "input", tmp_path / "warm-up", tmp_path / "out"
    write_shards(shards, 2, 100)
    write_shards(warm_up, 1, 10)
    blob = damage_model_file(local_registry)
    request = ("batch", "run", "--model", "breast-cancer@prod", "--input", str(shards), "--output", str(out))

    before = flow_runs(prefect_api)
    for env in ({"SHARDLINE_BATCH_RUNNER_IDLE_S": "0"}, {}):  # the cold path; checked in the command, no runner yet
        refused = shardline(*request, **env)
        assert_refused(refused, DAMAGED)
        assert DO in refused.stderr
    assert flow_runs(prefect_api) == before
    assert not out.exists()
    assert "no batch jobs recorded" in shardline("batch", "status").stdout  # no job record either

    pushed = shardline("model", "push", str(breast_cancer_model.bundle_dir))
    assert pushed.returncode == 0 and "pushed breast-cancer:1 " in pushed.stdout, pushed.stderr
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name  # rewritten: the version keeps its number
    done = shardline(*request, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["rows_out"] == 200


@pytest.mark.parametrize("runner", ["warm", "cold"])
def test_a_model_only_the_workers_find_damaged_fails_the_job_with_one_line_and_keeps_its_parts(
    runner: str, shardline: Shardline, local_registry: ModelRegistry, breast_cancer_model: BuiltModel,
    shardline_home: Path, tmp_path: Path,
) -> None:
    shards, out = tmp_path / "input", tmp_path / "out"
    write_shards(shards, 8, 500)
    later = [shards / f"part-0000{i}.parquet" for i in (6, 7)]
    for shard in later:  # the first job scores 6 shards; these 2 come later
        shard.rename(tmp_path / shard.name)
    request = ("batch", "run", "--model", "breast-cancer@prod", "--input", str(shards), "--output", str(out))
    cold = {"SHARDLINE_BATCH_RUNNER_IDLE_S": "0"}
    first = shardline(*request, **cold)  # its check stamps the model's files as read intact
    assert first.returncode == 0, first.stderr[-3000:]
    parts = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.glob("part-*.parquet")}
    assert len(parts) == 6

    damage_model_file(local_registry, keep_time=True)  # same size, same time: the command's check reads it as before
    shutil.rmtree(shardline_home / "cache" / "breast-cancer")  # the workers fetch it from the registry
    for shard in later:
        (tmp_path / shard.name).rename(shard)
    failed = shardline(*request, **({} if runner == "warm" else cold))

    assert failed.returncode == 2, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [failed.stderr.strip().splitlines()[-1]]
    assert errors[0].startswith(f"error: {DAMAGED}") and DO in errors[0], errors
    assert errors[0].endswith("; then run the same command again: the 6 of 8 shards settled are kept, the rest is "
                              "scored"), errors
    assert "run the same command again to resume" not in failed.stderr
    if runner == "warm":
        assert find(shardline_home) is not None
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.glob("part-*.parquet")} == parts
    assert not (out / "_SUCCESS").exists()
    listed = shardline("batch", "status").stdout.splitlines()
    job = next(line.split()[0] for line in listed if "8 shards" in line)
    record = json.loads(shardline("batch", "status", job, "--json").stdout)
    assert (record["state"], record["shards_done"], record["shards_total"]) == ("failed", 6, 8), record
    assert record["message"].startswith(f"IntegrityError: {DAMAGED}"), record

    assert shardline("model", "push", str(breast_cancer_model.bundle_dir)).returncode == 0
    again = shardline(*request, "--json", **({} if runner == "warm" else cold))
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert (summary["shards_committed"], summary["shards_skipped"], summary["rows_out"]) == (8, 6, 4000), summary
    manifest = json.loads((out / "_manifest.json").read_text())
    assert sorted(Path(p["part"]).name for p in manifest["parts"]) == [f"part-0000{i}.parquet" for i in range(8)]
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.glob("part-*.parquet")
            if p.name in parts} == parts
