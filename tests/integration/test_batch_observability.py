"""A real batch job traced and scraped: OTLP to a loopback receiver, the batch /metrics listener on a free port.

The job runs on a LocalCluster of its own, started after the ``OTEL_*`` variables are set (its worker
processes inherit them, as a deployment's workers would be given them): the job span in this process, a
shard span per shard under it, and each shard's work under its shard span from a worker process."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from shardline.flows.batch_inference import batch_inference
from shardline.local_ports import reserve_port
from shardline.observability import tracing
from shardline.tasks import batch_telemetry
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan

CALLER_TRACE, CALLER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("prefect_harness", "local_registry")]


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


@pytest.fixture
def traced_cluster(receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """OTLP on for this process and a LocalCluster whose workers inherit it; tracing off again afterwards."""
    from distributed import LocalCluster

    for name, value in {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                        "OTEL_BSP_SCHEDULE_DELAY": "200"}.items():
        monkeypatch.setenv(name, value)
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=None) as cluster:
        monkeypatch.setenv("SHARDLINE_DASK_CLUSTER", "address")
        monkeypatch.setenv("SHARDLINE_DASK_ADDRESS", cluster.scheduler_address)
        yield cluster.scheduler_address
    tracing.shutdown()
    monkeypatch.setattr(tracing, "ENABLED", False)
    from opentelemetry.trace import NoOpTracer

    monkeypatch.setattr(tracing, "_TRACER", NoOpTracer())


def _sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the series ``name`` whose labels include ``labels``, from an exposition."""
    for line in text.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            return float(match.group(2))
    return None


def test_a_job_is_traced_to_its_workers_and_scraped_while_it_runs(
    input_shards: Path, tmp_path: Path, receiver: OtlpReceiver, traced_cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (input_shards / "corrupt.parquet").write_bytes(b"this is not parquet at all")  # quarantined by the footer check
    port = reserve_port()
    monkeypatch.setenv("SHARDLINE_BATCH_METRICS_PORT", str(port))
    monkeypatch.setenv("TRACEPARENT", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01")  # the caller's trace: the job joins it
    scraped: list[tuple[int, str]] = []

    def scrape(settled: int, total: int, rows: int) -> None:
        if not scraped:  # while the job runs: its first shard settled on the cluster
            scraped.append((rows, httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text))

    try:
        state = batch_inference(model="breast-cancer@prod", input_uri=str(input_shards), output_uri=str(tmp_path / "out"),
                                tenant="acme", sla="2h", watchers=[scrape], return_state=True)
        after = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        batch_telemetry.stop_metrics()
    assert state.is_completed() and state.name == "Quarantined"
    summary = state.result()
    job = summary["job_id"]
    assert (summary["shards_committed"], summary["shards_quarantined"], summary["rows_out"]) == (6, 1, 12_000)

    # during the run: the rows scored so far, exactly what the flow's own watcher was told, and shards left
    [(rows_then, during)] = scraped
    assert _sample(during, "shardline_batch_job_rows_total", job_id=job, tenant="acme") == rows_then > 0
    assert _sample(during, "shardline_batch_job_running", job_id=job) == 1
    assert _sample(during, "shardline_batch_job_shards", job_id=job, state="quarantined") == 1
    assert (_sample(during, "shardline_batch_job_shards", job_id=job, state="pending") or 0) > 0
    deadline = _sample(during, "shardline_batch_job_deadline_timestamp_seconds", job_id=job, tenant="acme")
    assert deadline is not None
    # after: every count matches the job's summary, the projected finish is the finish, before the deadline
    assert _sample(after, "shardline_batch_job_rows_total", job_id=job, model="breast-cancer", version="1") == 12_000
    for shard_state, count in {"committed": 6, "quarantined": 1, "failed": 0, "pending": 0, "resumed": 0}.items():
        assert _sample(after, "shardline_batch_job_shards", job_id=job, state=shard_state) == count, shard_state
    assert _sample(after, "shardline_batch_job_running", job_id=job) == 0
    finish = _sample(after, "shardline_batch_job_projected_finish_timestamp_seconds", job_id=job)
    assert finish is not None and finish < deadline

    def complete(spans: list[ReceivedSpan]) -> bool:
        return sum(s.name == "shardline.batch.score" for s in spans) == 6 and any(
            s.name == "shardline.batch.job" for s in spans)

    spans = [s for s in receiver.wait_for(complete, timeout_s=30)
             if s.attributes.get("shardline.batch.job_id", job) == job]
    [root] = [s for s in spans if s.name == "shardline.batch.job"]
    assert (root.trace_id, root.parent_id) == (CALLER_TRACE, CALLER_SPAN)
    assert root.service == "shardline-batch" and root.attributes["shardline.batch.job_id"] == job
    assert (root.attributes["shardline.tenant"], root.attributes["shardline.model"]) == ("acme", "breast-cancer")
    assert root.attributes["shardline.model.version"] == 1 and root.attributes["shardline.batch.shards"] == 7
    assert root.attributes["process.pid"] == os.getpid()
    shard_spans = {s.span_id: s for s in spans if s.name == "shardline.batch.shard"}
    assert len(shard_spans) == 7 and {s.parent_id for s in shard_spans.values()} == {root.span_id}
    assert {s.trace_id for s in spans if s.name.startswith("shardline.batch.")} == {root.trace_id}, [
        (s.name, s.service, s.trace_id) for s in spans]
    outcomes = sorted(s.attributes["shardline.batch.outcome"] for s in shard_spans.values())
    assert outcomes == ["committed"] * 6 + ["quarantined"]
    assert sum(s.attributes["shardline.batch.rows"] for s in shard_spans.values()) == 12_000
    work = [s for s in spans if s.name == "shardline.batch.score"]
    for span in work:  # on a worker: another process, under the shard span of its own shard
        parent = shard_spans[span.parent_id]
        assert parent.attributes["shardline.batch.shard"] == span.attributes["shardline.batch.shard"]
        assert span.service == "shardline-batch-worker" and span.attributes["process.pid"] != os.getpid()
        assert span.attributes["shardline.batch.rows"] == 2_000
