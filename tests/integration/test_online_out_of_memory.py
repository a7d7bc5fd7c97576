"""A batch the device has no memory for is split and retried, and the model's batch limit lowered: no
request fails that a smaller batch could serve. The GPU's out-of-memory is the one thing faked here (onnxruntime's
own message, raised by the real ONNX model's predict for batches over a size); the server, the HTTP and the model
are real."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import orjson
import pytest

from shardline.online.app import create_app
from shardline.online.server import build_plane
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.online.testing import serve_listeners_in_thread
from shardline.runtimes.onnx import OnnxModel
from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings

from tests.conftest import BuiltModel

KEY = "sk-oom-test-key"
MODEL = "breast-cancer"
FITS = [8]  # rows the fake device holds at once
OOM = ("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running Gemm node. "
       "Status Message: Failed to allocate memory for requested buffer of size 2621440 (CUDA out of memory)")


@pytest.fixture
def served(local_registry: Any, shardline_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Any]]:
    real = OnnxModel.predict

    def predict(self: OnnxModel, rows: Any) -> Any:
        if rows.num_rows > FITS[0]:
            raise RuntimeError(OOM)
        return real(self, rows)

    monkeypatch.setattr(OnnxModel, "predict", predict)
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key(KEY)], "models": [f"{MODEL}@prod"]}]})
    plane = build_plane(OnlineSettings(alias_refresh_s=0), StorageSettings(home=str(shardline_home)),
                        RuntimeSettings(device="cpu", intra_op_threads=1), tenants)
    with serve_listeners_in_thread(create_app(plane)) as server:
        yield server.url, plane


def _infer(url: str, model: BuiltModel, rows: np.ndarray) -> httpx.Response:
    body = orjson.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [len(rows)], "data": rows[:, j].tolist()}
                                    for j, n in enumerate(model.data.names)]})
    return httpx.post(f"{url}/v2/models/{MODEL}/infer", content=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30)


def test_a_batch_out_of_device_memory_is_split_and_every_row_answered(
    served: tuple[str, Any], breast_cancer_model: BuiltModel
) -> None:
    url, plane = served
    rows = breast_cancer_model.data.features[:50].astype(np.float32)
    FITS[0] = 8
    answer = _infer(url, breast_cancer_model, rows)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == breast_cancer_model.estimator.predict(rows).tolist()
    model = plane.models[(MODEL, 1, "")]
    assert model.batcher.limits.max_batch_size <= 8  # lowered to what fit: later batches are cut before they are tried
    assert plane.metrics.oom_splits.labels(MODEL, "1")._value.get() >= 3  # 50 -> 25 -> 12 -> 6


def test_a_single_row_that_does_not_fit_fails_with_the_reason(
    served: tuple[str, Any], breast_cancer_model: BuiltModel
) -> None:
    url, _ = served
    FITS[0] = 0
    answer = _infer(url, breast_cancer_model, breast_cancer_model.data.features[:1].astype(np.float32))
    FITS[0] = 8
    assert answer.status_code == 500 and "Failed to allocate memory" in answer.json()["error"]
