"""`shardline serve` meters what it answers into the ledger: exactly, through a graceful stop; a crash (SIGKILL)
loses the bucket still open and nothing before it.

Two tenants call a tabular model (rows) and one of them a text-generation model (tokens, streamed and not);
the ledger's totals are compared with what the clients sent and what the answers said."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import httpx
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from shardline.build.llm_build import package_tiny_llm
from shardline.local_ports import reserve_port as free_port
from shardline.online.tenants import hash_api_key
from shardline.storage.ledger import SCHEMA, LedgerStore
from shardline.storage.registry import ModelRegistry
from tests.conftest import BuiltModel
from tests.e2e.conftest import SHARDLINE
from tests.support.serve_process import wait_ready

ACME, GLOBEX = "sk-ledger-acme", "sk-ledger-globex"


@pytest.fixture
def home(local_registry: ModelRegistry, shardline_home: Path, tmp_path: Path) -> Path:
    """breast-cancer@prod and a tiny LLM tiny@prod; acme may call both, globex the first."""
    package_tiny_llm(tmp_path / "tiny-bundle", name="tiny")
    local_registry.set_alias("tiny", "prod", local_registry.push(tmp_path / "tiny-bundle").version or 1)
    (tmp_path / "tenants.yaml").write_text(
        "tenants:\n"
        f"  - {{name: acme, api_keys_sha256: ['{hash_api_key(ACME)}'], models: ['breast-cancer@prod', 'tiny@prod']}}\n"
        f"  - {{name: globex, api_keys_sha256: ['{hash_api_key(GLOBEX)}'], models: ['breast-cancer@prod']}}\n")
    return shardline_home


def start(home: Path, log: Path, bucket_s: float, metrics_port: int | None = None
          ) -> tuple[str, subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDLINE_", "PREFECT_"))}
    env.update(SHARDLINE_STORAGE_HOME=str(home), DO_NOT_TRACK="1", ORT_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1",
               SHARDLINE_METERING_BUCKET_S=str(bucket_s), SHARDLINE_METERING_CAPACITY_TYPE="spot")
    port = free_port()
    with open(log, "wb") as sink:
        server = subprocess.Popen([*SHARDLINE, "serve", "--port", str(port), "--metrics-port",
                                   str(metrics_port) if metrics_port else "off", "--tenants",
                                   str(log.parent / "tenants.yaml")], cwd=log.parent, stdout=sink, stderr=sink,
                                  env=env)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, server, log)
    return url, server


@pytest.fixture
def stopped() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Servers a test started, killed at its end if it left them running."""
    servers: list[subprocess.Popen[bytes]] = []
    yield servers
    for server in servers:
        if server.poll() is None:
            server.kill()
            server.wait()


def infer(url: str, key: str, model: BuiltModel, rows: int) -> None:
    features = model.data.features[:rows]
    body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [rows], "data": features[:, j].tolist()}
                       for j, n in enumerate(model.data.names)]}
    answer = httpx.post(f"{url}/v2/models/breast-cancer/infer", content=orjson.dumps(body),
                        headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text


def usage_rows(home: Path) -> pa.Table:
    store = LedgerStore(str(home))
    table = pa.concat_tables([store.read(month) for month in store.months()] or [SCHEMA.empty_table()])
    return table.filter(pc.equal(table["kind"], "usage"))


def totals(table: pa.Table, *measures: str) -> dict[tuple[str, str], tuple[Any, ...]]:
    found: dict[tuple[str, str], list[Any]] = {}
    for row in table.to_pylist():
        sums = found.setdefault((row["tenant"], row["model"]), [0] * len(measures))
        for i, m in enumerate(measures):
            sums[i] += row[m]
    return {k: tuple(v) for k, v in found.items()}


def test_a_graceful_stop_meters_every_request_row_and_token(
    home: Path, breast_cancer_model: BuiltModel, tmp_path: Path, stopped: list[subprocess.Popen[bytes]]
) -> None:
    metrics_port = free_port()
    url, server = start(home, tmp_path / "serve.log", bucket_s=1.0, metrics_port=metrics_port)
    stopped.append(server)
    began = time.time()
    sent: Counter[tuple[str, str]] = Counter()
    rows: Counter[tuple[str, str]] = Counter()
    for i in range(7):
        infer(url, ACME, breast_cancer_model, 3)
        sent["acme", "breast-cancer"] += 1
        rows["acme", "breast-cancer"] += 3
        if i % 2:
            infer(url, GLOBEX, breast_cancer_model, 2)
            sent["globex", "breast-cancer"] += 1
            rows["globex", "breast-cancer"] += 2
    auth = {"Authorization": f"Bearer {ACME}"}
    whole = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "The river", "max_tokens": 5},
                       headers=auth, timeout=60)
    assert whole.status_code == 200, whole.text
    streamed = httpx.post(f"{url}/v1/chat/completions", headers=auth, timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "name three rivers"}], "max_tokens": 7,
        "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200, streamed.text
    chunks = [orjson.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    usages = [whole.json()["usage"], chunks[-1]["usage"]]
    sent["acme", "tiny"] += 2
    exposition = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    batch_seconds = sum(float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines()
                        if line.startswith('shardline_batch_seconds_sum{model="breast-cancer"'))
    time.sleep(1.5)  # a bucket or more closes while the server runs: the flusher writes it
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=30) in (0, -signal.SIGTERM), (tmp_path / "serve.log").read_text()
    ended = time.time()

    table = usage_rows(home)
    counted = totals(table, "requests", "rows", "prompt_tokens", "completion_tokens", "device_seconds")
    assert {k: v[0] for k, v in counted.items()} == dict(sent)
    assert {k: v[1] for k, v in counted.items() if v[1]} == dict(rows)
    assert counted["acme", "tiny"][2:4] == (sum(u["prompt_tokens"] for u in usages),
                                             sum(u["completion_tokens"] for u in usages))
    assert all(v[4] > 0 for v in counted.values())  # each tenant's share of the device time
    # the tabular model's device time is the batcher's own timing of its batches, split, nothing lost
    metered = sum(v[4] for k, v in counted.items() if k[1] == "breast-cancer")
    assert metered == pytest.approx(batch_seconds, rel=0.01) and batch_seconds > 0
    assert set(table["capacity_type"].to_pylist()) == {"spot"} and set(table["tier"].to_pylist()) == {"online"}
    store = LedgerStore(str(home))
    everything = pa.concat_tables([store.read(month) for month in store.months()])
    capacity = everything.filter(pc.equal(everything["kind"], "capacity"))
    assert capacity.num_rows >= 2  # a bucket closed while it ran, then the stop wrote the open one
    reserved = sum(capacity["reserved_seconds"].to_pylist())
    assert 0 < reserved <= ended - began + 60  # the server's time up (from its start, before the requests)

    # the month's chargeback, as a user asks for it: charges + idle == the capacity the server held, priced
    month = capacity["bucket_start"][0].as_py().strftime("%Y-%m")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLINE_")}
    env["SHARDLINE_STORAGE_HOME"] = str(home)
    done = subprocess.run([*SHARDLINE, "cost", "report", "--month", month, "-o", str(tmp_path / "cost.html"),
                           "--prometheus", str(tmp_path / "cost.prom")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "acme" in done.stdout and "globex" in done.stdout and "idle (carried by the platform)" in done.stdout
    costs = {}
    for line in (tmp_path / "cost.prom").read_text().splitlines():
        if line.startswith("shardline_cost{"):
            labels, value = line.rsplit(" ", 1)
            costs[labels] = float(value)
    held = sum(r["reserved_seconds"] * r["units"] for r in capacity.to_pylist()) * 0.0202 / 3600  # spot core-hours
    assert sum(costs.values()) == pytest.approx(held, rel=1e-3)
    assert sum(v for k, v in costs.items() if 'tenant="(idle)"' not in k) > 0
    page = (tmp_path / "cost.html").read_text()
    assert page.count("<svg") == 3 and "Cost by tenant" in page and "breast-cancer" in page
    one = subprocess.run([*SHARDLINE, "cost", "report", "--month", month, "--tenant", "globex"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert one.returncode == 0 and "globex" in one.stdout and "acme" not in one.stdout, one.stderr
    for args, message in ((["--month", "2026-13"], "is not a month; give it as YYYY-MM"),
                          (["--month", "1999-01"], f"holds nothing for 1999-01 (its months: {month})"),
                          (["--month", month, "--tenant", "nobody"], "tenant 'nobody' used nothing")):
        refused = subprocess.run([*SHARDLINE, "cost", "report", *args], capture_output=True, text=True, env=env,
                                 timeout=120)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr


def test_a_crash_loses_the_open_bucket_and_nothing_before_it(
    home: Path, breast_cancer_model: BuiltModel, tmp_path: Path, stopped: list[subprocess.Popen[bytes]]
) -> None:
    bucket = 3.0
    url, server = start(home, tmp_path / "serve.log", bucket_s=bucket)
    stopped.append(server)
    for _ in range(4):
        infer(url, ACME, breast_cancer_model, 1)
    deadline = time.monotonic() + 20
    while sum(usage_rows(home)["requests"].to_pylist()) < 4:  # their buckets closed and were written
        assert time.monotonic() < deadline, "the closed buckets were never written"
        time.sleep(0.2)
    time.sleep(bucket - time.time() % bucket + 0.1)  # just past a bucket's start: the next requests share it
    for _ in range(3):
        infer(url, GLOBEX, breast_cancer_model, 1)
    assert time.time() % bucket < bucket - 0.5, "the requests took too long to stay in one bucket"
    server.kill()
    server.wait()
    counted = totals(usage_rows(home), "requests")
    assert counted == {("acme", "breast-cancer"): (4,)}  # the open bucket (globex's 3) is what the crash lost
