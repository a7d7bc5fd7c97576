"""What the router's end-to-end tests share (tests/e2e/test_router*.py, test_llm_router.py, test_tracing.py):
the tenants and models of the module's home, starting and stopping a router, its metrics, steady load."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton

from shardline.online.router.nginx_front import find_nginx
from shardline.online.tenants import hash_api_key
from shardline.storage.registry import ModelRegistry
from tests.conftest import BuiltModel
from tests.tensor_models import breast_cancer_bundle

KEY = "sk-router-e2e"
TIGHT_KEY = "sk-router-tight"
MODEL = "breast-cancer"
CHURN = "churn"
# The router's data planes, for the tests that run with each: the router alone, nginx in front (where installed).
PLANES = [pytest.param("python"),
          pytest.param("nginx", marks=pytest.mark.skipif(find_nginx() is None, reason=(
              "nginx's Lua module is not installed (apt-get install nginx-light libnginx-mod-http-lua)")))]


def _churn(folder: Path, kind: str, fails_from: float | None = None) -> Path:
    """The breast-cancer classifier packaged as ``churn``; with ``fails_from``, one that errors on some inputs."""
    return breast_cancer_bundle(folder, CHURN, kind, fails_from)


def key() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDLINE_", "PREFECT_"))}
    env.update(SHARDLINE_STORAGE_HOME=str(home), DO_NOT_TRACK="1", ORT_DISABLE_TELEMETRY="1",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONUNBUFFERED="1", SHARDLINE_ROUTER_DATA_PLANE="python")
    env.update(extra)
    return env


def _tenants(path: Path) -> Path:
    path.write_text(
        "tenants:\n"
        "  - name: acme\n"
        f"    api_keys_sha256: [\"{hash_api_key(KEY)}\"]\n"
        "    models: [\"breast-cancer@prod\", \"minilm@prod\", \"churn@prod\", \"mlp@prod\"]\n"
        "    rate: {requests_per_second: 5000, burst: 5000}\n"
        "    max_concurrent: 64\n"
        "  - name: tight\n"
        f"    api_keys_sha256: [\"{hash_api_key(TIGHT_KEY)}\"]\n"
        "    models: [\"breast-cancer@prod\"]\n"
        "    rate: {requests_per_second: 1, burst: 5}\n"
    )
    return path


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, available: int | None = None,
                timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, log.read_text()[-4000:]
        try:
            answer = httpx.get(f"{url}/v2/health/ready", timeout=2)
            if answer.status_code == 200 and (available is None or answer.json().get("available") == available):
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.1)


def _stop(process: subprocess.Popen[bytes]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, breast_cancer_model: BuiltModel, minilm_bundle: Path) -> Path:
    home = tmp_path_factory.mktemp("router-home")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias(MODEL, "prod", registry.push(breast_cancer_model.bundle_dir).version or 1)
    registry.set_alias("minilm", "prod", registry.push(minilm_bundle).version or 1)
    registry.set_alias(CHURN, "prod", registry.push(_churn(home / "churn-1", "gbt")).version or 1)
    registry.push(_churn(home / "churn-2", "logreg"))
    registry.push(_churn(home / "churn-3", "logreg", fails_from=1000.0))
    return home


def v2_inputs(model: BuiltModel, rows: np.ndarray, binary: bool) -> list[triton.InferInput]:
    inputs = []
    for j, name in enumerate(model.data.names):
        tensor = triton.InferInput(name, [len(rows)], "FP32")
        tensor.set_data_from_numpy(rows[:, j].astype(np.float32), binary_data=binary)
        inputs.append(tensor)
    return inputs


def _infer_body(model: BuiltModel) -> bytes:
    rows = model.data.features[:4]
    return orjson.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [4], "data": rows[:, j].tolist()}
                                    for j, n in enumerate(model.data.names)]})


def _wait_for_log(log: Path, pattern: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, log.read_text()):
        assert time.monotonic() < deadline, f"no {pattern!r} in the router's log: {log.read_text()[-4000:]}"
        time.sleep(0.2)


@contextlib.contextmanager
def steady_load(url: str, body: bytes, senders: int = 4) -> Iterator[list[Any]]:
    """Inference requests sent without pause by ``senders`` threads while the block runs; yields their outcomes
    as they come: (status, JSON, Retry-After), or ("lost", error) for a request dropped or hung, or ("not json",
    ...). The threads are stopped and joined when the block ends."""
    outcomes: list[Any] = []
    stop = threading.Event()

    def send() -> None:
        with httpx.Client(base_url=url, headers=key(), timeout=20) as client:
            while not stop.is_set():
                try:
                    answer = client.post(f"/v2/models/{MODEL}/infer", content=body)
                except httpx.HTTPError as e:  # a hung or dropped request: what must not happen
                    outcomes.append(("lost", repr(e), None))
                    continue
                try:
                    outcomes.append((answer.status_code, answer.json(), answer.headers.get("retry-after")))
                except ValueError:
                    outcomes.append(("not json", answer.status_code, answer.content[:200]))
                time.sleep(0.005)

    threads = [threading.Thread(target=send) for _ in range(senders)]
    for thread in threads:
        thread.start()
    try:
        yield outcomes
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads)


def none_lost(outcomes: list[Any], before: int, expected: list[Any]) -> list[Any]:
    """Every request answered: 200 with the model's labels, or a clean 503 with Retry-After; none lost or hung,
    and the load went on (more than 50 answers after ``before``). Returns the 200s."""
    assert len(outcomes) - before > 50
    assert [o for o in outcomes if o[0] in ("lost", "not json")] == []
    unavailable = [o for o in outcomes if o[0] == 503]
    assert all("error" in o[1] and o[2] is not None for o in unavailable)
    answered = [o for o in outcomes if o[0] == 200]
    assert len(answered) + len(unavailable) == len(outcomes)
    assert all(o[1]["outputs"][0]["data"] == expected for o in answered)
    return answered


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _eventually(check: Any, timeout: float, what: str | Callable[[], str]) -> Any:
    """``check()`` once it is truthy; fails with ``what`` (or what ``what()`` says then: a log's tail) after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, what if isinstance(what, str) else what()
        time.sleep(0.2)


def tiny_llm_home(home: Path, tenants: list[tuple[str, str, str]]) -> Path:
    """The tiny LLM (``tiny@prod``) in ``home``'s registry, and a tenants file for ``tenants`` (name, key, the
    limit's YAML line) that may call it; returns the tenants file."""
    from shardline.build.llm_build import package_tiny_llm

    package_tiny_llm(home / "tiny-bundle", name="tiny")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias("tiny", "prod", registry.push(home / "tiny-bundle").version or 1)
    tenants_file = home / "tenants.yaml"
    tenants_file.write_text("tenants:\n" + "".join(
        f"  - name: {name}\n    api_keys_sha256: [\"{hash_api_key(key)}\"]\n    models: [\"tiny@prod\"]\n    {limit}\n"
        for name, key, limit in tenants))
    return tenants_file
