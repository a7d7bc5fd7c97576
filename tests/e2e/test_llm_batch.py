"""Batch generation through `shardline batch run` as a user runs it: Parquet shards of prompts (plain text and
chat messages as JSON) in, completions and token counts out, through the same batch flow, checkpointing and
output commit as any model. A run SIGKILLed midway and run again answers every prompt exactly once, each
with the completion the model gives it alone (greedy: the same text alone or in any batch)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from shardline.build.llm_build import package_tiny_llm
from shardline.bundle import read_manifest
from shardline.runtimes import RuntimeOptions, create_runtime
from shardline.storage.registry import ModelRegistry
from tests.e2e.conftest import SHARDLINE
from tests.support.batch_process import descendants_alive, wait_for

SHARDS, PER_SHARD = 6, 6


def _prompts(folder: Path) -> pa.Table:
    """Shards of prompts with an ``id``: completion prompts and chat conversations (a JSON list of messages)."""
    folder.mkdir(parents=True)
    rows = []
    for i in range(SHARDS * PER_SHARD):
        if i % 3 == 2:
            prompt = json.dumps([{"role": "system", "content": "be brief"}, {"role": "user", "content": f"item {i}?"}])
        else:
            prompt = f"Story number {i} begins"
        rows.append({"id": i, "prompt": prompt})
    table = pa.Table.from_pylist(rows)
    for shard in range(SHARDS):
        pq.write_table(table.slice(shard * PER_SHARD, PER_SHARD), folder / f"part-{shard:05d}.parquet")
    return table


def test_a_prompt_job_killed_midway_and_run_again_answers_every_prompt_once(
    cli_env: dict[str, str], shardline_home: Path, tmp_path: Path,
) -> None:
    bundle = package_tiny_llm(tmp_path / "tiny-bundle", name="tiny")
    registry = ModelRegistry(str(shardline_home / "registry"))
    registry.set_alias("tiny", "prod", registry.push(tmp_path / "tiny-bundle").version or 1)
    prompts = _prompts(tmp_path / "prompts")
    out = tmp_path / "completions"
    args = [*SHARDLINE, "batch", "run", "--model", "tiny@prod", "--input", str(tmp_path / "prompts"), "--output",
            str(out), "--batch-rows", "2"]
    # the killed run in a process of its own (Prefect's temporary server, no warm runner), as
    # test_batch_output.py's SIGKILL test runs it: everything it started goes with it
    env = {k: v for k, v in cli_env.items() if k != "PREFECT_API_URL"}
    env.update(SHARDLINE_DASK_N_WORKERS="1", SHARDLINE_BATCH_LEASE_TTL_S="600", SHARDLINE_PREFECT_SERVER="temporary")
    victim = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        wait_for("two shards settled", lambda: len(list((out / "_ledger").glob("*.json"))) >= 2, victim)
        started = psutil.Process(victim.pid).children(recursive=True)
    finally:
        os.kill(victim.pid, signal.SIGKILL)  # the command only: what it started must go with it
        victim.wait()
    deadline = time.monotonic() + 30
    while descendants_alive(started):
        assert time.monotonic() < deadline, f"still running after the command was killed: {descendants_alive(started)}"
        time.sleep(0.1)
    settled = len(list((out / "_ledger").glob("*.json")))
    assert 2 <= settled < SHARDS and not (out / "_SUCCESS").exists()
    before = {p.name: p.read_bytes() for p in out.glob("*.parquet")}

    resumed = subprocess.run([*args, "--json"], env={**env, "PREFECT_API_URL": cli_env["PREFECT_API_URL"]},
                             cwd=tmp_path, capture_output=True, text=True, timeout=600)

    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["shards_skipped"] >= settled and summary["rows_out"] == SHARDS * PER_SHARD
    assert all((out / name).read_bytes() == data for name, data in before.items())  # committed parts not redone
    scored = ds.dataset(out).to_table().sort_by("id")
    assert scored.column("id").to_pylist() == list(range(SHARDS * PER_SHARD))  # every prompt exactly once
    runtime = create_runtime(tmp_path / "tiny-bundle", read_manifest(tmp_path / "tiny-bundle"),
                             RuntimeOptions(device="cpu", intra_op_threads=1))
    runtime.load()
    try:
        alone = [runtime.predict(prompts.slice(i, 1).select(["prompt"])) for i in (0, 2, 17, 35)]
    finally:
        runtime.close()
    for i, answer in zip((0, 2, 17, 35), alone):
        assert scored.column("completion")[i].as_py() == answer.column("completion")[0].as_py()
        assert scored.column("completion_tokens")[i].as_py() == answer.column("completion_tokens")[0].as_py() > 0
    assert bundle.runtime == "llm"
