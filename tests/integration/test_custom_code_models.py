"""A custom-code bundle (pre- and post-processing around an ONNX graph), pushed and scored in both tiers:
the batch flow on the session's real Dask cluster and `serve` over real HTTP answer as scikit-learn does,
and only tenants whose entry says ``custom_code: true`` may run it (the flag is off by default): a tenant
without it gets 403 online and a refused batch job with nothing written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pyarrow.dataset as ds
import pytest
import yaml

from shardline.errors import AccessDenied
from shardline.build.examples import breast_cancer, shard_table
from shardline.flows.batch_inference import batch_inference
from shardline.online.app import create_app
from shardline.online.server import build_plane
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.online.testing import serve_listeners_in_thread
from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings
from shardline.storage.registry import ModelRegistry

from tests.conftest import write_shards
from tests.custom_models import CustomModel, build_custom_model

TRUSTED, OTHER = "sk-trusted-tenant-key", "sk-other-tenant-key"


@pytest.fixture(scope="module")
def pushed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CustomModel]:
    home = tmp_path_factory.mktemp("custom-home")
    custom = build_custom_model(home / "build")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias("diagnosis", "prod", registry.push(custom.bundle_dir).version or 1)
    return home, custom


@pytest.fixture
def lake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pushed: tuple[Path, CustomModel]) -> Path:
    home, _ = pushed
    monkeypatch.setenv("SHARDLINE_STORAGE_HOME", str(home))
    lake = Path(os.path.realpath(tmp_path / "lake"))
    for tenant in ("trusted", "other"):
        write_shards(lake / tenant / "in", 2, 400)
    tenants = {"tenants": [
        {"name": "trusted", "custom_code": True, "batch": {"storage_prefixes": [str(lake / "trusted")]}},
        {"name": "other", "batch": {"storage_prefixes": [str(lake / "other")]}},
    ]}
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    monkeypatch.setenv("SHARDLINE_TENANTS_FILE", str(tmp_path / "tenants.yaml"))
    return lake


@pytest.mark.usefixtures("on_cluster")
def test_the_batch_flow_runs_the_code_for_a_trusted_tenant_and_refuses_another(
        lake: Path, pushed: tuple[Path, CustomModel]) -> None:
    _, custom = pushed

    trusted = batch_inference(model="diagnosis@prod", input_uri=str(lake / "trusted" / "in"),
                              output_uri=str(lake / "trusted" / "out"), tenant="trusted", return_state=True)
    other = batch_inference(model="diagnosis@prod", input_uri=str(lake / "other" / "in"),
                            output_uri=str(lake / "other" / "out"), tenant="other", return_state=True)

    assert trusted.is_completed(), trusted.message
    rows = ds.dataset(lake / "trusted" / "in").to_table().sort_by("id")
    scored = ds.dataset(lake / "trusted" / "out").to_table().sort_by("id")
    assert scored.column("id").to_pylist() == rows.column("id").to_pylist()  # every row once
    want = custom.expected(rows)
    assert scored.column("diagnosis").to_pylist() == want["diagnosis"].tolist()
    np.testing.assert_allclose(scored.column("confidence").to_numpy(), want["confidence"], rtol=1e-5, atol=1e-6)

    assert other.is_failed()
    with pytest.raises(AccessDenied, match="tenant 'other' may not run"):
        other.result()
    assert not (lake / "other" / "out").exists()


@pytest.fixture(scope="module")
def url(pushed: tuple[Path, CustomModel]) -> Iterator[str]:
    home, _ = pushed
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "trusted", "api_keys_sha256": [hash_api_key(TRUSTED)], "models": ["diagnosis@prod"],
         "custom_code": True},
        {"name": "other", "api_keys_sha256": [hash_api_key(OTHER)], "models": ["diagnosis@prod"]},
    ]})
    plane = build_plane(OnlineSettings(), StorageSettings(home=str(home)),
                        RuntimeSettings(device="cpu", intra_op_threads=1), tenants)
    with serve_listeners_in_thread(create_app(plane)) as served:
        yield served.url


def _body(table: object) -> dict[str, object]:
    names = breast_cancer().names
    return {"inputs": [{"name": n, "shape": [table.num_rows], "datatype": "FP32",  # type: ignore[attr-defined]
                        "data": table.column(n).to_pylist()} for n in names]}  # type: ignore[attr-defined]


def test_serve_answers_a_trusted_tenant_as_scikit_learn_does_and_refuses_another_with_403(
        url: str, pushed: tuple[Path, CustomModel]) -> None:
    _, custom = pushed
    rows = shard_table(breast_cancer(), 40, 0, 3)

    answer = httpx.post(f"{url}/v2/models/diagnosis/infer", json=_body(rows),
                        headers={"Authorization": f"Bearer {TRUSTED}"}, timeout=30)
    refused = httpx.post(f"{url}/v2/models/diagnosis/infer", json=_body(rows),
                         headers={"Authorization": f"Bearer {OTHER}"}, timeout=30)

    assert answer.status_code == 200, answer.text
    outputs = {o["name"]: o for o in answer.json()["outputs"]}
    want = custom.expected(rows)
    assert outputs["diagnosis"]["datatype"] == "BYTES"
    assert outputs["diagnosis"]["data"] == want["diagnosis"].tolist()
    np.testing.assert_allclose(outputs["confidence"]["data"], want["confidence"], rtol=1e-5, atol=1e-6)
    assert refused.status_code == 403
    assert "tenant 'other' may not run" in refused.json()["error"]
