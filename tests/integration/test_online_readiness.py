"""Model readiness as tritonclient users wait for it: ready means a request would be served, loaded or not.

A client that waits for ``is_model_ready`` before its first request must not wait forever for
a model that loads on that request. One real server (uvicorn on a free loopback port, in a
thread) with a short idle time-out, so the module also sees a model scaled to zero.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import numpy as np
import pytest
import tritonclient.http as triton

from shardline.build.examples import package_breast_cancer
from shardline.online.app import create_app
from shardline.online.metrics import metrics_app
from shardline.online.server import build_plane
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.online.testing import Served, serve_listeners_in_thread
from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings
from shardline.storage.registry import ModelRegistry

from tests.conftest import BuiltModel

ACME, GLOBEX = "sk-acme-ready", "sk-globex-ready"
MODEL = "breast-cancer"


@pytest.fixture(scope="module")
def home(breast_cancer_model: BuiltModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """breast-cancer:1 (prod); breast-cancer:2 whose model file the registry has lost."""
    home = tmp_path_factory.mktemp("online-readiness")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias(MODEL, "prod", registry.push(breast_cancer_model.bundle_dir).version or 1)
    package_breast_cancer(home / "logreg-bundle", kind="logreg")
    lost = registry.push(home / "logreg-bundle")
    model_file = next(a for a in lost.artifacts if a.role == "model")
    registry.fs.rm(registry.blob_path(MODEL, model_file.sha256))
    return home


@pytest.fixture(scope="module")
def served(home: Path) -> Iterator[tuple[Served, Any]]:
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key(ACME)], "models": [f"{MODEL}@prod"]},
        {"name": "globex", "api_keys_sha256": [hash_api_key(GLOBEX)], "models": ["minilm@prod"]},
    ]})
    settings = OnlineSettings(idle_timeout_s=2.0, reap_interval_s=0.1)  # long enough to see it loaded
    plane = build_plane(settings, StorageSettings(home=str(home), cache_dir=str(home / "cache")),
                        RuntimeSettings(device="cpu", intra_op_threads=1), tenants)
    with serve_listeners_in_thread(create_app(plane, log_requests=False),
                                   metrics_app=metrics_app(plane.metrics.exposition)) as served:
        yield served, plane


@pytest.fixture
def client(served: tuple[Served, Any]) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(served[0].url.removeprefix("http://"))
    yield c
    c.close()


def key(token: str = ACME) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}  # a fresh dict: tritonclient writes into the one it is given


def infer(client: triton.InferenceServerClient, model: BuiltModel, rows: np.ndarray) -> np.ndarray:
    inputs = []
    for j, name in enumerate(model.data.names):
        tensor = triton.InferInput(name, [len(rows)], "FP32")
        tensor.set_data_from_numpy(rows[:, j].astype(np.float32))
        inputs.append(tensor)
    labels: np.ndarray = client.infer(MODEL, inputs, headers=key()).as_numpy("label")
    return labels


def ready_body(served: tuple[Served, Any], path: str = f"/v2/models/{MODEL}/ready") -> tuple[int, dict[str, Any]]:
    response = httpx.get(served[0].url + path, headers=key(), timeout=30)
    return response.status_code, response.json()


def wait_for(check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_model_never_requested_is_ready_unloaded_and_then_serves(
    client: triton.InferenceServerClient, served: tuple[Served, Any], breast_cancer_model: BuiltModel
) -> None:
    plane = served[1]
    wait_for(lambda: client.is_model_ready(MODEL, headers=key()), timeout=5)  # what a Triton user's start-up loop does
    assert plane.cache.loaded() == []  # answered without loading it
    assert ready_body(served) == (200, {"name": MODEL, "version": "1", "ready": True, "state": "unloaded"})
    assert client.get_model_metadata(MODEL, headers=key())["parameters"] == {"state": "unloaded"}
    metrics = httpx.get(f"{served[0].metrics_url}/metrics").text
    assert 'shardline_model_loaded{model="breast-cancer",version="1"} 0.0' in metrics

    rows = breast_cancer_model.data.features[:16]
    np.testing.assert_array_equal(infer(client, breast_cancer_model, rows),
                                  breast_cancer_model.estimator.predict(rows.astype(np.float32)))
    assert ready_body(served)[1]["state"] == "loaded"
    assert client.get_model_metadata(MODEL, headers=key())["parameters"] == {"state": "loaded"}
    assert 'shardline_model_loaded{model="breast-cancer",version="1"} 1.0' in httpx.get(
        f"{served[0].metrics_url}/metrics").text


def test_a_model_scaled_to_zero_stays_ready_and_serves_again(
    client: triton.InferenceServerClient, served: tuple[Served, Any], breast_cancer_model: BuiltModel
) -> None:
    plane = served[1]
    rows = breast_cancer_model.data.features[20:30]
    infer(client, breast_cancer_model, rows)
    wait_for(lambda: plane.cache.loaded() == [])  # idle past its time-out: unloaded

    assert client.is_model_ready(MODEL, headers=key())
    assert client.is_model_ready(MODEL, "1", headers=key())
    assert ready_body(served)[1] == {"name": MODEL, "version": "1", "ready": True, "state": "unloaded"}
    assert 'shardline_model_loaded{model="breast-cancer",version="1"} 0.0' in httpx.get(
        f"{served[0].metrics_url}/metrics").text
    np.testing.assert_array_equal(infer(client, breast_cancer_model, rows),
                                  breast_cancer_model.estimator.predict(rows.astype(np.float32)))


def test_a_model_the_tenant_may_not_call_or_that_does_not_exist_is_not_ready(
    client: triton.InferenceServerClient, served: tuple[Served, Any]
) -> None:
    assert not client.is_model_ready(MODEL, headers=key(GLOBEX))  # registered, but not globex's
    assert not client.is_model_ready("minilm", headers=key(GLOBEX))  # globex's, but not in the registry
    assert not client.is_model_ready("no-such-model", headers=key())
    assert not client.is_model_ready(MODEL, "7", headers=key())
    other = httpx.get(f"{served[0].url}/v2/models/{MODEL}/ready", headers=key(GLOBEX))
    missing = httpx.get(f"{served[0].url}/v2/models/no-such-model/ready", headers=key())
    assert other.status_code == missing.status_code == 404
    assert "is not available to tenant 'globex'" in other.json()["error"]
    assert httpx.get(f"{served[0].url}/v2/models/{MODEL}/ready").status_code == 401


def test_a_version_whose_bundle_is_gone_is_not_ready_and_says_why(
    client: triton.InferenceServerClient, served: tuple[Served, Any]
) -> None:
    assert not client.is_model_ready(MODEL, "2", headers=key())
    status, body = ready_body(served, f"/v2/models/{MODEL}/versions/2/ready")
    assert status == 503 and body["ready"] is False and body["state"] == "unloaded"
    assert "the registry lacks artifacts of breast-cancer:2" in body["reason"] and "push its bundle again" in body["reason"]
    assert client.is_model_ready(MODEL, "1", headers=key())  # the other version is unaffected
