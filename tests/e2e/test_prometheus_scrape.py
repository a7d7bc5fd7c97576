"""A real Prometheus (Debian's package) scrapes a running `shardline serve` and evaluates the generated SLO rules."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from shardline.local_ports import reserve_port as free_port
from shardline.online.tenants import hash_api_key
from shardline.storage.registry import ModelRegistry
from tests.conftest import BuiltModel
from tests.e2e.conftest import SHARDLINE
from tests.support.routers import _stop
from tests.support.serve_process import wait_ready

RULES = Path(__file__).resolve().parents[2] / "deploy" / "observability" / "rules" / "shardline-slos.rules.yaml"
KEY = "sk-prometheus-acme"
PROMETHEUS = shutil.which("prometheus")


def _query(url: str, promql: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=5)
    assert answer.status_code == 200, answer.text
    result: list[dict[str, Any]] = answer.json()["data"]["result"]
    return result


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus here: apt-get install prometheus (`make test` does, as root)")
def test_prometheus_scrapes_a_replica_and_records_its_slo_ratios(local_registry: ModelRegistry, shardline_home: Path,
                                                                  breast_cancer_model: BuiltModel,
                                                                  tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n"
                       f"  - {{name: acme, api_keys_sha256: ['{hash_api_key(KEY)}'], models: ['breast-cancer@prod']}}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDLINE_", "PREFECT_"))}
    env.update(SHARDLINE_STORAGE_HOME=str(shardline_home), DO_NOT_TRACK="1", ORT_DISABLE_TELEMETRY="1")
    port, metrics_port, prometheus_port = free_port(), free_port(), free_port()
    with open(tmp_path / "serve.log", "wb") as sink:
        serve = subprocess.Popen([*SHARDLINE, "serve", "--port", str(port), "--metrics-port", str(metrics_port),
                                  "--tenants", str(tenants)], cwd=tmp_path, stdout=sink, stderr=sink, env=env)
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n"
                      f"rule_files: ['{RULES}']\n"
                      "scrape_configs:\n"
                      f"  - job_name: shardline-replicas\n    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n")
    prometheus = None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, serve, tmp_path / "serve.log")
        with open(tmp_path / "prometheus.log", "wb") as sink:
            prometheus = subprocess.Popen([str(PROMETHEUS), f"--config.file={config}",
                                           f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                           f"--web.listen-address=127.0.0.1:{prometheus_port}"],
                                          stdout=sink, stderr=sink, cwd=tmp_path)
        features = breast_cancer_model.data.features[:2]
        body = orjson.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [2], "data": features[:, j].tolist()}
                                        for j, n in enumerate(breast_cancer_model.data.names)]})
        api = f"http://127.0.0.1:{prometheus_port}"
        deadline, recorded = time.monotonic() + 60, []
        while not recorded:  # answers keep coming while Prometheus scrapes (a rate needs two samples that differ)
            assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no SLO ratio was recorded: " + (tmp_path / "prometheus.log").read_text()[-3000:]
            for _ in range(5):
                answer = httpx.post(f"{url}/v2/models/breast-cancer/infer", content=body,
                                    headers={"Authorization": f"Bearer {KEY}"})
                assert answer.status_code == 200, answer.text
            time.sleep(0.5)
            try:
                recorded = _query(api, 'model:shardline_slo_errors:ratio_rate5m{slo="classifier-availability"}')
            except httpx.HTTPError:
                recorded = []  # not listening yet
        assert recorded[0]["metric"]["model"] == "breast-cancer" and float(recorded[0]["value"][1]) == 0.0
        [up] = _query(api, 'up{job="shardline-replicas"}')
        assert up["value"][1] == "1"
        [tenant] = _query(api, 'model_tenant:shardline_slo_errors:ratio_rate5m{slo="classifier-availability"}')
        assert tenant["metric"]["tenant"] == "acme"  # the per-tenant ratio the tenant alerts read
    finally:
        for process in (prometheus, serve):
            if process is not None:
                _stop(process)
