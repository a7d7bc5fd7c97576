"""Online capture over real HTTP: sampled requests and their answers land in Parquet (issue 6).

A real server on a free loopback port serves the real breast-cancer classifier; the
capture buffers are flushed when the server stops, and the rows are read back with
``scan_capture`` as the drift checks read them.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import orjson
import polars as pl
import pytest

from shardline.online.app import create_app
from shardline.online.server import build_plane
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.online.testing import serve_in_thread
from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings
from shardline.storage.capture import CAPTURE_META, capture_files, capture_root, scan_capture
from shardline.storage.registry import ModelRegistry

from tests.conftest import BuiltModel

KEYS = {"acme": "sk-acme-capture", "initech": "sk-initech-capture"}


def serve_and_send(home: Path, model: BuiltModel, rate: float, requests: list[tuple[str, str, slice]]) -> list[int]:
    """Serve with ``capture_rate=rate``, send (tenant, request id, rows) V2 requests, stop; returns the statuses."""
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": name, "api_keys_sha256": [hash_api_key(key)], "models": ["breast-cancer@prod"]}
        for name, key in KEYS.items()
    ]})
    storage = StorageSettings(home=str(home))
    plane = build_plane(OnlineSettings(capture_rate=rate), storage, RuntimeSettings(device="cpu", intra_op_threads=1),
                        tenants)
    statuses = []
    with serve_in_thread(create_app(plane, log_requests=False)) as url:
        for tenant, request_id, rows in requests:
            values = model.data.features[rows]
            body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [len(values)], "data": values[:, j].tolist()}
                               for j, n in enumerate(model.data.names)]}
            answer = httpx.post(f"{url}/v2/models/breast-cancer/infer", content=orjson.dumps(body),
                                headers={"Authorization": f"Bearer {KEYS[tenant]}", "X-Request-ID": request_id})
            statuses.append(answer.status_code)
    return statuses  # the server stopped: its capture buffers were flushed and closed


def test_every_request_is_captured_with_its_rows_answers_tenant_and_request_id(
    local_registry: ModelRegistry, breast_cancer_model: BuiltModel, shardline_home: Path
) -> None:
    requests = [("acme", "req-a1", slice(0, 3)), ("initech", "req-i1", slice(3, 4)), ("acme", "req-a2", slice(4, 9))]
    assert serve_and_send(shardline_home, breast_cancer_model, 1.0, requests) == [200, 200, 200]

    root = capture_root(StorageSettings(home=str(shardline_home)))
    frame = scan_capture(root, "breast-cancer", version=1, tier="online").collect().sort(CAPTURE_META[3], maintain_order=True)
    names = breast_cancer_model.data.names
    assert frame.columns == [*names, "label", "probabilities", *CAPTURE_META]
    by_request = {rid: frame.filter(pl.col("_source") == rid) for _, rid, _ in requests}
    for tenant, rid, rows in requests:
        got = by_request[rid]
        sent = breast_cancer_model.data.features[rows].astype(np.float32)
        assert got.height == len(sent)
        assert set(got["_tenant"]) == {tenant} and set(got["_tier"]) == {"online"}
        np.testing.assert_array_equal(got.select(names).to_numpy(), sent)  # the rows, as the model read them
        expected = breast_cancer_model.estimator.predict(sent).tolist()
        assert got["label"].to_list() == expected  # the answers the clients got
    assert frame["_captured_at"].null_count() == 0


def test_with_a_rate_of_zero_nothing_is_written(
    local_registry: ModelRegistry, breast_cancer_model: BuiltModel, shardline_home: Path
) -> None:
    assert serve_and_send(shardline_home, breast_cancer_model, 0.0, [("acme", "req-0", slice(0, 2))]) == [200]
    root = capture_root(StorageSettings(home=str(shardline_home)))
    assert capture_files(root, "breast-cancer") == []
    assert not Path(root).exists()


@pytest.mark.parametrize("rate", [-0.1, 1.5])
def test_a_capture_rate_outside_zero_to_one_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="capture_rate"):
        OnlineSettings(capture_rate=rate)
