"""The warm batch runner (cli/batch_runner.py): `batch run` on the default settings hands its job to
a long-lived runner per home that keeps the imports and a Dask cluster warm.

These runs keep the session's PREFECT_API_URL (the runner's jobs go to the session's Prefect server, as a
user's do when they set it). conftest's autouse fixture kills every runner a test leaves.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Callable

import numpy as np
import psutil
import pyarrow.dataset as ds
import pytest

from shardline.build.examples import write_shards
from shardline.cli.batch_runner import find, runner_dir
from shardline.storage.job_records import JobRecords
from shardline.storage.registry import ModelRegistry
from tests.conftest import BuiltModel
from tests.e2e.conftest import SHARDLINE
from tests.support.gated_model import push_gated

Shardline = Callable[..., subprocess.CompletedProcess[str]]
WARM: dict[str, str | None] = {"SHARDLINE_PREFECT_SERVER": None}  # the default, local: the runner applies


def workers_of(pid: int) -> set[int]:
    """The pids of a runner's Dask worker processes (spawned by multiprocessing, below their nannies)."""
    return {p.pid for p in psutil.Process(pid).children(recursive=True) if "spawn_main" in " ".join(p.cmdline())}


def gone(pid: int) -> bool:
    """Whether a process has ended (a zombie not yet reaped by init counts as ended)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(what: str, ready: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.usefixtures("local_registry")
def test_runs_go_to_one_warm_runner_whose_cluster_stays_and_prefect_stop_stops_it(
    shardline: Shardline, input_shards: Path, tmp_path: Path, shardline_home: Path, prefect_api: str,
    breast_cancer_model: BuiltModel,
) -> None:
    first = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", str(input_shards), "--output",
                      str(tmp_path / "out1"), "--json", **WARM)
    assert first.returncode == 0, first.stderr[-3000:]
    runner = find(shardline_home)
    assert runner is not None and f"started the batch runner of this home (pid {runner.pid})" in first.stderr
    assert f"View at {prefect_api.removesuffix('/api')}/runs/flow-run/" in first.stderr  # its log lines, relayed
    workers = workers_of(runner.pid)
    assert len(workers) >= 1

    second = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", str(input_shards), "--output",
                       str(tmp_path / "out2"), "--json", **WARM)

    assert second.returncode == 0, second.stderr[-3000:]
    assert "started the batch runner" not in second.stderr and "Beginning flow run" in second.stderr
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["rows_out"] == 12_000 and summary["shards_committed"] == 6
    assert find(shardline_home) == runner and workers_of(runner.pid) == workers  # the same process and cluster
    table = ds.dataset(tmp_path / "out2").to_table().sort_by("id")
    inputs = ds.dataset(input_shards).to_table().sort_by("id")
    labels, _ = breast_cancer_model.expected(inputs)
    assert np.array_equal(table.column("id").to_numpy(), np.arange(12_000))
    assert np.array_equal(table.column("label").to_numpy(), labels)

    wrong = shardline("batch", "run", "--model", "missing@prod", "--input", str(input_shards), "--output",
                      str(tmp_path / "out3"), **WARM)
    assert wrong.returncode == 2
    errors = [line for line in wrong.stderr.splitlines() if line.startswith("error:")]
    assert errors == [errors[0]] and "model 'missing' is not in the registry" in errors[0]
    assert "Traceback" not in wrong.stderr
    outside = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", str(input_shards), "--output",
                        str(input_shards / "scored"), **WARM)  # refused by the early check, on the runner
    assert outside.returncode == 2 and outside.stderr.startswith("error: the output") and "lies inside" in outside.stderr

    stopped = shardline("prefect", "stop", **WARM)
    assert stopped.returncode == 0 and f"stopped the batch runner (pid {runner.pid})" in stopped.stdout
    assert gone(runner.pid) and all(gone(pid) for pid in workers) and find(shardline_home) is None


def test_a_killed_command_stops_its_job_a_busy_runner_with_other_settings_is_left_and_a_rerun_resumes(
    cli_env: dict[str, str], shardline: Shardline, local_registry: ModelRegistry, tmp_path: Path,
    shardline_home: Path,
) -> None:
    # 60 shards of 500 rows, a shard a call, each call waiting 2 s while the gate is there: the job still runs when
    # the other command below (a small job run cold: seconds on a busy machine) is done and this one is killed;
    # the gate gone, the resume below scores the rest at full speed, in batches of 100 (the batch size is not the
    # job's identity)
    gate = tmp_path / "gate"
    push_gated(local_registry, tmp_path / "gated", gate, 2.0)
    gate.touch()
    shards = write_shards(tmp_path / "big", 60, 500)
    out = tmp_path / "out"
    args = [*SHARDLINE, "batch", "run", "--model", "gated@prod", "--input", str(tmp_path / "big"),
            "--output", str(out)]
    env = {k: v for k, v in {**cli_env, **WARM, "SHARDLINE_DASK_N_WORKERS": "1"}.items() if v is not None}
    victim = subprocess.Popen([*args, "--batch-rows", "500"], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_for("a first committed shard", lambda: victim.poll() is None and len(list(
            (out / "_ledger").glob("*.json"))) >= 1 or victim.poll() is not None, timeout=180)
        assert victim.poll() is None, victim.stderr.read() if victim.stderr else ""
        runner = find(shardline_home)
        assert runner is not None

        # Other settings while the runner is busy: the runner is left to its job, and this one runs on its own,
        # cold (a small job: one shard of ten rows on one worker)
        small = write_shards(tmp_path / "small", 1, 10)
        other = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", str(tmp_path / "small"),
                          "--output", str(tmp_path / "small-out"), SHARDLINE_DASK_N_WORKERS="2", **WARM)
        assert other.returncode == 0, other.stderr[-3000:]
        assert f"the batch runner of this home (pid {runner.pid}) runs jobs with other settings" in other.stderr
        assert "SHARDLINE_DASK_N_WORKERS" in other.stderr and "rows out  10" in other.stdout and len(small) == 1
        assert find(shardline_home) == runner

        assert victim.poll() is None, "the job ended before its command could be killed"
        victim.kill()  # SIGKILL: no clean-up in the command; the runner sees its connection close
        victim.wait()
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()

    records = JobRecords(str(shardline_home))
    wait_for("the job to stop on the runner", lambda: any(
        (r := records.find(job)) is not None and r.state != "running" and r.parameters.output_uri == str(out)
        for job in records.ids()))
    settled = len(list((out / "_ledger").glob("*.json")))
    assert settled < len(shards) and not (out / "_SUCCESS").exists()  # it stopped: it did not run on
    assert find(shardline_home) == runner  # the runner outlives the command it served

    gate.unlink()
    resumed = subprocess.run([*args, "--batch-rows", "100", "--json"], env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=300)

    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["shards_skipped"] == settled and summary["rows_out"] == len(shards) * 500
    ids = ds.dataset(out).to_table(columns=["id"]).column("id").to_numpy()
    assert np.array_equal(np.sort(ids), np.arange(len(shards) * 500))  # every row exactly once

    os.rename(runner_dir(shardline_home), tmp_path / "moved-away")  # as `rm -rf` of the home would
    wait_for("the runner to exit without its home", lambda: gone(runner.pid), timeout=60)


@pytest.mark.usefixtures("local_registry")
def test_an_idle_runner_with_other_settings_is_replaced_and_a_runner_exits_when_idle(
    shardline: Shardline, input_shards: Path, tmp_path: Path, shardline_home: Path,
) -> None:
    def run(output: str, idle_s: str) -> subprocess.CompletedProcess[str]:
        done = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", str(input_shards), "--output",
                         str(tmp_path / output), SHARDLINE_BATCH_RUNNER_IDLE_S=idle_s, **WARM)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    run("a", "600")
    first = find(shardline_home)
    assert first is not None

    replaced = run("b", "3")

    second = find(shardline_home)
    assert second is not None and second.pid != first.pid
    assert ("replaced the batch runner of this home: it ran with other settings (SHARDLINE_BATCH_RUNNER_IDLE_S "
            "differ)") in replaced.stderr
    assert gone(first.pid)
    wait_for("the idle runner to exit", lambda: find(shardline_home) is None, timeout=60)
    assert not (runner_dir(shardline_home) / "runner.json").exists()

