"""`shardline serve` as a user runs it: a subprocess, a tenants file, a request, JSON logs, a clean stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import httpx
import orjson
import pytest

from shardline.local_ports import reserve_port as free_port
from shardline.online.server import serving_settings
from shardline.settings import OnlineSettings, RuntimeSettings
from shardline.storage.registry import ModelRegistry
from tests.conftest import BuiltModel
from tests.e2e.conftest import SHARDLINE
from tests.support.serve_process import KEY, wait_ready, write_tenants


def test_serve_answers_logs_json_with_request_ids_and_stops_on_sigterm(
    local_registry: ModelRegistry, breast_cancer_model: BuiltModel, cli_env: dict[str, str], tmp_path: Path
) -> None:
    port = free_port()
    tenants = write_tenants(tmp_path / "tenants.yaml")
    log = tmp_path / "serve.log"
    with open(log, "wb") as sink:
        server = subprocess.Popen([*SHARDLINE, "serve", "--port", str(port), "--metrics-port", str(free_port())],
                                  cwd=tmp_path, stdout=sink, stderr=sink,
                                  env={**cli_env, "SHARDLINE_ONLINE_TENANTS_FILE": str(tenants)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server, log)
        rows = breast_cancer_model.data.features[:2]
        body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [2], "data": rows[:, j].tolist()}
                           for j, n in enumerate(breast_cancer_model.data.names)]}
        answer = httpx.post(f"{url}/v2/models/breast-cancer/infer", content=orjson.dumps(body),
                            headers={"Authorization": f"Bearer {KEY}", "X-Request-ID": "e2e-req-1"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == breast_cancer_model.estimator.predict(rows.astype("float32")).tolist()
        assert answer.headers["x-request-id"] == "e2e-req-1"
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=30)
    assert code in (0, -signal.SIGTERM), log.read_text()  # uvicorn re-raises the signal after a clean shutdown
    assert "Application shutdown complete." in log.read_text()
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    access = [line for line in lines if line["logger"] == "shardline.online.access" and line.get("request_id") == "e2e-req-1"]
    assert access and access[0]["status"] == 200 and access[0]["tenant"] == "acme" and access[0]["model"] == "breast-cancer"
    assert any(line["msg"] == "model loaded" and line.get("request_id") == "e2e-req-1" for line in lines)
    started = [line for line in lines if line["msg"] == "serving settings"]
    assert len(started) == 1 and started[0]["intra_op_threads"] == defaults_here()["intra_op_threads"]
    assert started[0]["workers"] == 1 and started[0]["spinning"] is False


def defaults_here(**env: str) -> dict[str, object]:
    """``serving_settings`` as a shell with no SHARDLINE_* variable but ``env`` gets it on this machine."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("SHARDLINE_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(env)
    try:
        return serving_settings(OnlineSettings(), RuntimeSettings())
    finally:
        for k in env:
            del os.environ[k]
        os.environ.update(saved)


@pytest.mark.parametrize("env", [{}, {"SHARDLINE_RUNTIME_INTRA_OP_THREADS": "3", "SHARDLINE_ONLINE_WORKERS": "2",
                                      "SHARDLINE_ONLINE_PORT": "9123"}])
def test_serve_help_prints_the_defaults_the_code_resolves_for_this_machine(env: dict[str, str]) -> None:
    shell = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLINE_")}
    done = subprocess.run([*SHARDLINE, "serve", "--help"], env={**shell, **env, "COLUMNS": "400"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.replace("│", " ").split())
    on = defaults_here(**env)
    assert on["cores"] == (os.cpu_count() or 1)
    assert f"Runs here with ({on['cores']} cores; this shell's SHARDLINE_* variables included)" in text
    assert f"{on['workers']} server process(es)" in text
    assert f"{on['inference_threads']} inference threads per process" in text
    assert f"{on['intra_op_threads']} onnxruntime intra-op thread(s) per call" in text
    assert f"up to {on['max_concurrent_batches']} batches of a model at once" in text
    assert f"spinning {'on' if on['spinning'] else 'off'}" in text
    assert f"under {on['inline_max_ms']:g} ms run on the event loop" in text
    port = env.get("SHARDLINE_ONLINE_PORT", str(OnlineSettings.model_fields["port"].default))
    assert f"[default: {port}; SHARDLINE_ONLINE_PORT]" in text
    if env:
        assert on["intra_op_threads"] == 3 and on["workers"] == 2  # the variables still override
    else:
        assert on["workers"] == 1 and on["spinning"] is False
        assert on["max_concurrent_batches"] == on["inference_threads"] == (os.cpu_count() or 1)
        assert on["intra_op_threads"] == max(1, (os.cpu_count() or 1) // (1 * on["inference_threads"]))  # type: ignore[operator]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("priority", "tenants[0].priority: Input should be 'high', 'normal' or 'low'"),
        ("missing", "the tenants file"),
        ("none", "no tenants file: pass --tenants PATH"),
    ],
)
def test_serve_refuses_to_start_with_a_bad_tenants_file(
    shardline: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path, setup: str, message: str
) -> None:
    args = ["serve", "--port", str(free_port())]
    if setup == "priority":
        args += ["--tenants", str(write_tenants(tmp_path / "tenants.yaml", priority="urgent"))]
    elif setup == "missing":
        args += ["--tenants", str(tmp_path / "nope.yaml")]
    done = shardline(*args, timeout=60)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


def test_serve_refuses_an_inherited_socket_that_is_not_one(
    shardline: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    done = shardline("serve", "--fd", "999", "--tenants", str(write_tenants(tmp_path / "tenants.yaml")), timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--fd is 999, which is not a socket to serve on (Bad file descriptor)" in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_with_two_workers_answers_on_one_port_and_sums_their_metrics_on_the_metrics_port(
    local_registry: ModelRegistry, breast_cancer_model: BuiltModel, cli_env: dict[str, str], tmp_path: Path
) -> None:
    port, metrics_port = free_port(), free_port()
    tenants = write_tenants(tmp_path / "tenants.yaml")
    log = tmp_path / "serve.log"
    with open(log, "wb") as sink:
        server = subprocess.Popen([*SHARDLINE, "serve", "--port", str(port), "--workers", "2",
                                   "--metrics-port", str(metrics_port), "--max-header-bytes", "4096"], cwd=tmp_path,
                                  stdout=sink, stderr=sink, env={**cli_env, "SHARDLINE_ONLINE_TENANTS_FILE": str(tenants)})
    url, metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"
    rows = breast_cancer_model.data.features[:3]
    body = orjson.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [3], "data": rows[:, j].tolist()}
                                    for j, n in enumerate(breast_cancer_model.data.names)]})
    expected = breast_cancer_model.estimator.predict(rows.astype("float32")).tolist()
    try:
        wait_ready(url, server, log)
        for _ in range(12):  # a new connection each: the kernel hands them to either worker
            answer = httpx.post(f"{url}/v2/models/breast-cancer/infer", content=body,
                                headers={"Authorization": f"Bearer {KEY}"})
            assert answer.status_code == 200, answer.text
            assert answer.json()["outputs"][0]["data"] == expected
        for _ in range(100):  # the gauges are written by each worker every reap_interval_s (1 s)
            if 'shardline_model_loaded{model="breast-cancer",version="1"} 1.0' in httpx.get(f"{metrics_url}/metrics").text:
                break
            time.sleep(0.1)
        scraped = [httpx.get(f"{metrics_url}/metrics").text for _ in range(4)]  # the supervisor reads every worker's
        on_main = [httpx.get(f"{url}/metrics") for _ in range(4)]  # either worker: no metrics on the tenants' port
        big_heads = [httpx.get(f"{url}/v2/health/live", headers={"x-big": "a" * 8192}) for _ in range(4)]
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=30)
    assert code in (0, -signal.SIGTERM), log.read_text()
    for text in scraped:  # it counts every worker's requests
        counted = [line for line in text.splitlines()
                   if line.startswith("shardline_requests_total{") and 'code="200"' in line and 'model="breast-cancer"' in line]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in counted) == 12, text
        assert 'shardline_model_loaded{model="breast-cancer",version="1"} 1.0' in text
    assert all(r.status_code == 404 and "acme" not in r.text for r in on_main)
    assert all(r.status_code == 431 for r in big_heads)  # each worker holds the limits


@pytest.mark.parametrize(("args", "variables", "message"), [
    (["serve", "--metrics-port", "80a"], {},
     "error: a setting is not valid: --metrics-port: Input should be a valid integer, unable to parse string as an "
     "integer; give a port from 1 to 65535, or 0 or 'off' for no metrics listener (got '80a'); fix the option"),
    (["serve", "--metrics-port", "70000"], {},
     "--metrics-port: Input should be less than or equal to 65535; give a port from 1 to 65535, or 0 or 'off' for no "
     "metrics listener (got '70000')"),
    (["serve", "--header-timeout", "-1"], {}, "--header-timeout: Input should be greater than 0 (got -1.0)"),
    (["serve"], {"SHARDLINE_ONLINE_METRICS_PORT": "abc"},
     "error: a setting is not valid: SHARDLINE_ONLINE_METRICS_PORT: Input should be a valid integer, unable to parse "
     "string as an integer; give a port from 1 to 65535, or 0 or 'off' for no metrics listener (got 'abc'); fix or "
     "unset the variable (README.md, Settings)"),
    (["router", "--metrics-port", "abc"], {},
     "error: a setting is not valid: --metrics-port: Input should be a valid integer, unable to parse string as an "
     "integer; give a port from 1 to 65535, or 0 or 'off' for no metrics listener (got 'abc'); fix the option"),
    (["router", "--local-replicas", "1"], {"SHARDLINE_ROUTER_METRICS_PORT": "-1"},
     "error: a setting is not valid: SHARDLINE_ROUTER_METRICS_PORT: Input should be greater than or equal to 0; give "
     "a port from 1 to 65535, or 0 or 'off' for no metrics listener (got '-1')"),
    (["serve", "--metrics-port", "abc"], {"SHARDLINE_ONLINE_WORKERS": "x"},
     "SHARDLINE_ONLINE_WORKERS: Input should be a valid integer, unable to parse string as an integer (got 'x'); "
     "--metrics-port: "),
])
def test_a_bad_setting_of_serve_or_router_is_one_line_naming_the_option_or_variable(
    tmp_path: Path, args: list[str], variables: dict[str, str], message: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDLINE_", "PREFECT_"))}
    env.update(SHARDLINE_STORAGE_HOME=str(tmp_path / "home"), DO_NOT_TRACK="1", ORT_DISABLE_TELEMETRY="1", **variables)
    done = subprocess.run([*SHARDLINE, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: a setting is not valid: "), done.stderr
    assert message in done.stderr and "pydantic" not in done.stderr
