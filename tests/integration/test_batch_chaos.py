"""Chaos over a real LocalCluster: workers die (SIGKILL) or are preempted with a notice
(SIGTERM) at seeded random moments, and the flow process itself is killed and resumed.
Every input row comes out exactly once and nothing half-written is ever visible."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from shardline.build.examples import write_shards
from shardline.storage.output import OutputLayout

SHARDS, ROWS = 40, 4_000
SEED = 20261130


@pytest.fixture(scope="module")
def chaos_cluster() -> Iterator[Any]:
    """Four worker processes of our own (the session's cluster is not ours to kill)."""
    import dask
    from distributed import LocalCluster

    with dask.config.set({"distributed.scheduler.allowed-failures": 10}), LocalCluster(
        n_workers=4, threads_per_worker=1, processes=True, dashboard_address=None,
        scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
    ) as cluster:
        yield cluster


@pytest.fixture
def on_chaos_cluster(chaos_cluster: Any, prefect_harness: None, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The batch flow pointed at the chaos cluster; small batches so shards take a while."""
    chaos_cluster.wait_for_workers(2, timeout=60)  # preempted workers do not come back; killed ones do
    monkeypatch.setenv("SHARDLINE_DASK_CLUSTER", "address")
    monkeypatch.setenv("SHARDLINE_DASK_ADDRESS", chaos_cluster.scheduler_address)
    monkeypatch.setenv("SHARDLINE_BATCH_CHECKPOINT_BYTES", "150000")  # some shards run in checkpointed ranges
    monkeypatch.setenv("SHARDLINE_BATCH_RETRY_BASE_S", "0.05")
    monkeypatch.setenv("SHARDLINE_BATCH_CONTRACT_SAMPLE_ROWS", "0")  # the contract has its own test
    return chaos_cluster


def _worker_pids(client: Any) -> dict[str, int]:
    return client.run(os.getpid, on_error="ignore")  # type: ignore[no-any-return]


def _assert_exactly_once(input_dir: Path, out: Path) -> None:
    ids = ds.dataset(input_dir).to_table(columns=["id"]).column("id").to_pylist()
    scored = ds.dataset(out, format="parquet").to_table(columns=["id"]).column("id").to_pylist()
    assert len(scored) == len(ids) and sorted(scored) == sorted(ids)  # every row once: no loss, no duplicate
    visible = sorted(p.relative_to(out).as_posix() for p in out.rglob("*")  # what readers see: no '_' name on the way
                     if p.is_file() and not any(n.startswith("_") for n in p.relative_to(out).parts))
    assert visible == sorted(p.name for p in input_dir.glob("*.parquet"))  # one whole part per shard, no orphan
    for part in visible:
        assert pq.read_metadata(out / part).num_rows == ROWS
    assert (out / "_SUCCESS").exists() and not (out / "_staging").exists()


@pytest.mark.usefixtures("local_registry")
def test_workers_killed_and_preempted_at_random_lose_nothing(on_chaos_cluster: Any, tmp_path: Path) -> None:
    from distributed import Client

    from shardline.flows.batch_inference import batch_inference

    write_shards(tmp_path / "input", SHARDS, ROWS, row_group_rows=500)
    out = tmp_path / "out"
    rng = random.Random(SEED)
    moments = sorted(rng.sample(range(3, SHARDS - 8), 4))
    actions = dict(zip(moments, rng.sample(["kill", "kill", "notice", "notice"], 4)))
    settled = {"n": 0}
    done: list[tuple[str, str]] = []
    stop = threading.Event()

    def chaos(client: Any) -> None:
        for moment, action in actions.items():
            while settled["n"] < moment and not stop.is_set():
                time.sleep(0.01)
            if stop.is_set():
                return
            pids = _worker_pids(client)
            victim = rng.choice(sorted(pids))
            os.kill(pids[victim], signal.SIGKILL if action == "kill" else signal.SIGTERM)
            done.append((action, victim))

    def listen(n: int, total: int, rows: int) -> None:
        settled["n"] = n

    with Client(on_chaos_cluster.scheduler_address, set_as_default=False) as client:
        monkey = threading.Thread(target=chaos, args=(client,), daemon=True)
        monkey.start()
        try:
            state = batch_inference(model="breast-cancer@prod", input_uri=str(tmp_path / "input"),
                                    output_uri=str(out), batch_rows=100, watchers=[listen], return_state=True)
        finally:
            stop.set()
            monkey.join(10)
        retired = [w for action, w in done if action == "notice"]
        deadline = time.monotonic() + 20
        while any(w in client.scheduler_info(n_workers=-1)["workers"] for w in retired) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = set(client.scheduler_info(n_workers=-1)["workers"])

    assert [a for a, _ in done] == list(actions.values())  # all four blows landed while the job ran
    assert state.is_completed() and state.name == "Completed", state.message
    summary = state.result()
    assert summary["shards_committed"] == SHARDS and summary["shards_quarantined"] == 0
    assert summary["rows_out"] == summary["rows_in"] == SHARDS * ROWS
    _assert_exactly_once(tmp_path / "input", out)
    assert not set(retired) & left  # preempted workers left for good (their nannies did not restart them)


@pytest.mark.usefixtures("local_registry")
def test_flow_process_killed_midway_resumes_and_redoes_only_unsettled_shards(
    on_chaos_cluster: Any, tmp_path: Path
) -> None:
    from prefect.settings import get_current_settings

    from shardline.flows.batch_inference import batch_inference

    write_shards(tmp_path / "input", SHARDS, ROWS, row_group_rows=500)
    out = tmp_path / "out"
    # the flow's own process is what is killed: the job runs cold, not on a warm batch runner
    env = {**os.environ, "PREFECT_API_URL": str(get_current_settings().api.url), "PYTHONUNBUFFERED": "1",
           "SHARDLINE_BATCH_RUNNER_IDLE_S": "0"}
    args = [sys.executable, "-m", "shardline.cli", "batch", "run", "--model", "breast-cancer@prod",
            "--input", str(tmp_path / "input"), "--output", str(out), "--batch-rows", "100"]
    victim = subprocess.Popen(args, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ledger = out / "_ledger"
    try:
        deadline = time.monotonic() + 90
        while len(list(ledger.glob("*.json"))) < 6:
            assert victim.poll() is None, f"the run ended before it could be killed: {victim.stderr.read()[-2000:]!r}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "no shard was committed in time"
            time.sleep(0.02)
    finally:
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
    at_kill = OutputLayout(str(out)).read_ledger()
    # shards in flight at the kill may still finish on the workers (they commit their own
    # parts); wait until the ledger is quiet
    quiet, before = 0, len(at_kill)
    while quiet < 10:
        time.sleep(0.1)
        now = len(list(ledger.glob("*.json")))
        quiet, before = (quiet + 1, now) if now == before else (0, now)
    settled = OutputLayout(str(out)).read_ledger()
    assert 6 <= len(at_kill) <= len(settled) < SHARDS, "the kill came too late to test a resume"
    assert not (out / "_SUCCESS").exists()
    for part in out.glob("*.parquet"):  # whatever is visible is whole
        assert pq.read_metadata(part).num_rows == ROWS

    resumed = batch_inference(model="breast-cancer@prod", input_uri=str(tmp_path / "input"), output_uri=str(out),
                              batch_rows=100, return_state=True)

    assert resumed.is_completed() and resumed.name == "Completed", resumed.message
    summary = resumed.result()
    after = OutputLayout(str(out)).read_ledger()
    for shard, record in settled.items():  # committed before the resume: never redone
        assert after[shard] == record
    assert summary["shards_skipped"] == len(settled)
    assert summary["shards_committed"] == SHARDS and summary["rows_scored"] == (SHARDS - len(settled)) * ROWS
    _assert_exactly_once(tmp_path / "input", out)


def test_a_metadata_endpoint_notice_is_seen_over_real_http() -> None:
    """AWS-style: 404 until the notice, then 200 with the action; GCP-style FALSE is no notice."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from shardline.tasks.preemption import NoticeSources

    answers = {"/aws": (404, b"Not Found"), "/gcp": (200, b"FALSE")}

    class Metadata(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            status, body = answers[self.path]
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        sources = NoticeSources.parse((f"{base}/aws", f"{base}/gcp"))
        assert sources.polled_notice() is None
        answers["/aws"] = (200, b'{"action": "terminate", "time": "2026-11-30T12:00:00Z"}')
        assert sources.polled_notice() == f"endpoint {base}/aws"
        answers["/aws"], answers["/gcp"] = (404, b""), (200, b"TRUE")
        assert sources.polled_notice() == f"endpoint {base}/gcp"
    finally:
        server.shutdown()
        server.server_close()
