"""Who owns a batch output folder, as real `shardline batch run` processes see it.

Two jobs on one output, a SIGKILLed owner, an output that cannot be written, a
finished job re-run against a read-only archive: each with the exit code and the one
line a user acts on, and the folder checked afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import psutil
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from shardline.build.examples import write_shards
from shardline.storage.registry import ModelRegistry
from tests.e2e.conftest import SHARDLINE
from tests.support.batch_process import descendants_alive, read_only, wait_for
from tests.support.gated_model import check_scores, package_gated, push_gated

Shardline = Callable[..., subprocess.CompletedProcess[str]]


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and mtime."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def test_a_second_job_on_a_running_jobs_output_is_refused_and_the_folder_stays_one_models(
    cli_env: dict[str, str], shardline: Shardline, local_registry: ModelRegistry, tmp_path: Path,
) -> None:
    # breast-cancer:2, the gated model (tests/support/gated_model.py): each call waits 2 s while the gate is there,
    # so the first job runs until the second command is refused, then at full speed
    gate = tmp_path / "gate"
    assert local_registry.push(package_gated(tmp_path / "gated", gate, 2.0, name="breast-cancer")).version == 2
    gate.touch()
    inputs, out = tmp_path / "input", tmp_path / "out"
    write_shards(inputs, 40, 100)
    first_log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(
        [*SHARDLINE, "batch", "run", "--model", "breast-cancer:2", "--input", str(inputs), "--output", str(out),
         "--json"],
        env={**cli_env, "SHARDLINE_DASK_N_WORKERS": "1"}, cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=first_log, text=True,
    )
    try:
        wait_for("lease taken", lambda: any((out / "_lease").glob("*.json")), first)

        # the first job's settings: its runner refuses the second job (a command with other settings would run
        # it cold, and the lease would refuse it the same way)
        second = shardline("batch", "run", "--model", "breast-cancer:1", "--input", str(inputs), "--output", str(out),
                           SHARDLINE_DASK_N_WORKERS="1")

        assert first.poll() is None, (f"the first job ended ({first.returncode}) before the second was refused: "
                                      f"{(tmp_path / 'first.log').read_text()[-3000:]}")
        gate.unlink()
        stdout, _ = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 2, second.stderr[-2000:]
    assert first.returncode == 0
    summary = json.loads(stdout.strip().splitlines()[-1])
    errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in second.stderr
    assert f"the output {out} is in use by job {summary['job_id']} (model breast-cancer:2, on host " in errors[0]
    assert f"wait for it to finish (`shardline batch status {summary['job_id']}`) or choose another --output" in errors[0]

    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["model"]["pinned"] == "breast-cancer:2" and len(manifest["parts"]) == 40
    assert (out / "_SUCCESS").exists() and not (out / "_staging").exists()
    check_scores(out, inputs)

    # the folder is finished, but with the other model's parts: still refused, nothing touched
    before = snapshot(out)
    later = shardline("batch", "run", "--model", "breast-cancer:1", "--input", str(inputs), "--output", str(out),
                      SHARDLINE_DASK_N_WORKERS="1")
    assert later.returncode == 2, later.stderr[-2000:]
    assert f"holds the parts of job {summary['job_id']} (model breast-cancer:2; its manifest is there)" in later.stderr
    assert "choose another --output, or delete the folder" in later.stderr
    assert snapshot(out) == before


def test_a_sigkilled_run_leaves_no_process_behind_and_the_next_run_takes_its_output_over(
    cli_env: dict[str, str], local_registry: ModelRegistry, tmp_path: Path,
) -> None:
    gate = tmp_path / "gate"  # the gated model: each call waits 1 s while the gate is there
    push_gated(local_registry, tmp_path / "gated", gate, 1.0)
    gate.touch()
    inputs, out = tmp_path / "input", tmp_path / "out"
    write_shards(inputs, 12, 5_000, row_group_rows=2_500)
    args = [*SHARDLINE, "batch", "run", "--model", "gated@prod", "--input", str(inputs), "--output", str(out)]
    # no PREFECT_API_URL and SHARDLINE_PREFECT_SERVER=temporary: the command starts Prefect's temporary server,
    # which must not outlive it (the local server, the default, outlives runs on purpose: test_prefect_server.py)
    env = {k: v for k, v in cli_env.items() if k != "PREFECT_API_URL"}
    env.update(SHARDLINE_DASK_N_WORKERS="1", SHARDLINE_BATCH_LEASE_TTL_S="600", SHARDLINE_PREFECT_SERVER="temporary")
    victim = subprocess.Popen([*args, "--batch-rows", "5000"], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True, text=True)
    try:
        wait_for("two shards committed", lambda: len(list((out / "_ledger").glob("*.json"))) >= 2, victim)
        started = psutil.Process(victim.pid).children(recursive=True)
        while_running = subprocess.run([*SHARDLINE, "batch", "status"], env=env, cwd=tmp_path, capture_output=True,
                                       text=True, timeout=120)
        commands = [" ".join(p.cmdline()) for p in started]
    finally:
        os.kill(victim.pid, signal.SIGKILL)  # the command only: what it started must go with it
        victim.wait()
    assert any("uvicorn" in c and "prefect" in c for c in commands), commands  # Prefect's temporary server
    assert any("multiprocessing" in c for c in commands), commands  # the Dask worker
    deadline = time.monotonic() + 30
    while descendants_alive(started):
        assert time.monotonic() < deadline, f"still running after the command was killed: {descendants_alive(started)}"
        time.sleep(0.1)
    settled = len(list((out / "_ledger").glob("*.json")))
    assert 2 <= settled < 12 and not (out / "_SUCCESS").exists()
    for part in out.glob("*.parquet"):  # whatever is visible is whole
        assert pq.read_metadata(part).num_rows == 5_000
    assert not (Path(env["SHARDLINE_STORAGE_HOME"]) / "prefect").exists()  # no local server was started

    # `batch status` does not call the killed job running: its lease's holder is gone; the shards its output's
    # ledger holds are its progress (the record may be a write or two behind), and it has no finish to expect
    [record] = (Path(env["SHARDLINE_STORAGE_HOME"]) / "jobs").glob("*.json")
    job = record.stem
    listed = subprocess.run([*SHARDLINE, "batch", "status"], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    shown = subprocess.run([*SHARDLINE, "batch", "status", job[:8]], env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
    assert listed.returncode == 0 and shown.returncode == 0, listed.stderr[-2000:] + shown.stderr[-2000:]
    [line] = [line for line in listed.stdout.splitlines() if line.startswith(job)]
    assert line.split()[1] == "interrupted" and f" {settled}/12 shards " in line, line
    assert [row.split()[1] for row in while_running.stdout.splitlines() if row.startswith(job)] == ["running"], \
        while_running.stdout + while_running.stderr[-2000:]
    assert "state  running" not in shown.stdout, shown.stdout
    assert f"state  interrupted (its run stopped before the end and no run holds its output now; run the same " \
           f"command again, or `shardline batch resume {job}`, to resume it)" in shown.stdout, shown.stdout
    assert f"progress  {settled}/12 shards" in shown.stdout, shown.stdout
    assert f"ETA  none: the job is not running ({12 - settled} of 12 shards left)" in shown.stdout, shown.stdout
    assert "SLA  on-track when it stopped (it is not running)" in shown.stdout, shown.stdout

    # the lease lasts 10 minutes, but its holder is a dead process of this host: taken over at once (on the
    # session's Prefect server: the takeover is the output's, whichever API the run uses, and a second
    # temporary server would cost the suite its start-up for nothing)
    gate.unlink()
    resumed_env = {**env, "PREFECT_API_URL": cli_env["PREFECT_API_URL"]}
    resumed = subprocess.run([*args, "--json"], env=resumed_env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=600)

    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["shards_skipped"] >= settled and summary["rows_out"] == 60_000
    assert sorted(ds.dataset(out).to_table(columns=["id"]).column("id").to_pylist()) == list(range(60_000))
    assert (out / "_SUCCESS").exists() and not (out / "_staging").exists()
    assert [p.name for p in (out / "_lease").glob("*.json")] == ["0000000002.json"]
    assert json.loads((out / "_lease" / "0000000002.json").read_text())["released"] is True
    check_scores(out, inputs)


@pytest.mark.usefixtures("local_registry")
def test_an_output_that_cannot_be_written_exits_2_and_a_finished_read_only_output_exits_0(
    shardline: Shardline, input_shards: Path, tmp_path: Path
) -> None:
    a_file = tmp_path / "scores.parquet"
    a_file.write_bytes(b"not a folder")
    run = ("batch", "run", "--model", "breast-cancer@prod", "--input", str(input_shards), "--output")

    into_file = shardline(*run, str(a_file))

    assert into_file.returncode == 2, into_file.stderr[-2000:]
    assert f"error: the output {a_file} is a file, not a folder" in into_file.stderr
    assert "running again will not help: choose a folder for --output" in into_file.stderr
    assert a_file.read_bytes() == b"not a folder"

    empty = tmp_path / "archive-empty"
    empty.mkdir()
    with read_only(empty):
        refused = shardline(*run, str(empty))
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"error: the output {empty} cannot be written" in refused.stderr and "make it writable" in refused.stderr

    out = tmp_path / "archive"
    assert shardline(*run, str(out)).returncode == 0
    before = snapshot(out)
    with read_only(out):
        again = shardline(*run, str(out), "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["shards_skipped"] == 6 and summary["rows_scored"] == 0 and summary["rows_out"] == 12_000
    assert summary["manifest"] == f"file://{out}/_manifest.json"
    assert snapshot(out) == before


@pytest.mark.usefixtures("local_registry")
def test_an_output_holding_parts_of_shards_another_input_had_is_refused(
    shardline: Shardline, input_shards: Path, tmp_path: Path
) -> None:
    # Another input into the same output (the same model) scored its own shards and left the earlier job's parts in
    # the folder, while the manifest and _SUCCESS listed this job's alone: a reader of the folder read both.
    run = ("batch", "run", "--model", "breast-cancer@prod", "--output", str(tmp_path / "out"), "--input")
    assert shardline(*run, str(input_shards)).returncode == 0
    before = snapshot(tmp_path / "out")
    other = tmp_path / "other"
    other.mkdir()
    (other / "part-00000.parquet").write_bytes((input_shards / "part-00001.parquet").read_bytes())

    refused = shardline(*run, str(other))

    assert refused.returncode == 2, refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: the output {tmp_path / 'out'} holds the parts of 5 shards this input does not have (first: "
        "part-00001.parquet), from an earlier job's input; a reader of the folder would read them with this job's: "
        "choose another --output, or delete the folder to score it anew")
    assert snapshot(tmp_path / "out") == before  # nothing written
    assert shardline(*run, str(input_shards)).returncode == 0  # its own input still resumes there (all done)
