"""A batch job whose metrics port is taken (SHARDLINE_BATCH_METRICS_PORT held by another process: the home's
busy warm runner when a command with other settings runs its job cold, or any program) runs without its metrics,
saying so once, and its record ends as the job did (docs/metrics.md, "Batch job metrics")."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from shardline.storage.job_records import JobRecords

Shardline = Callable[..., subprocess.CompletedProcess[str]]


@pytest.mark.usefixtures("local_registry")
def test_a_cold_run_whose_metrics_port_is_taken_warns_once_and_its_job_completes(
    shardline: Shardline, input_shards: Path, tmp_path: Path, shardline_home: Path,
) -> None:
    with socket.socket() as holder:  # another process's listener, as a busy runner's is
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", str(input_shards), "--output",
                         str(tmp_path / "out"), "--json", SHARDLINE_BATCH_RUNNER_IDLE_S="0",
                         SHARDLINE_BATCH_METRICS_PORT=str(port))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    warned = [line for line in done.stderr.splitlines() if "metrics are not served" in line]
    assert len(warned) == 1, done.stderr[-3000:]
    assert f"cannot listen on 127.0.0.1:{port} (Address already in use;" in warned[0]
    assert "Give SHARDLINE_BATCH_METRICS_PORT a free port to serve them" in warned[0]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["rows_out"] == 12_000
    record = JobRecords(str(shardline_home)).read(summary["job_id"])
    assert record.state == "completed" and record.finished_at is not None
    assert json.loads((tmp_path / "out" / "_lease" / "0000000001.json").read_text())["released"] is True
