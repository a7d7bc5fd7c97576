"""Budgets at the router: `shardline router` reads the tenants' budget states itself (the same published file its
replicas read) and, on each of its lanes (its own relay, and nginx's fast lane in front where nginx is installed),
refuses a tenant at its hard limit with 429 and the figures, sends a tenant past its soft limit to the model's
cheaper group (``router.yaml``'s ``fallbacks:``), marked in the answer, and passes the others on.

The replicas here are real `shardline serve` processes over the same registry but a home of their own, whose
ledger holds no spend: every refusal and every degradation seen is the router's."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import httpx
import orjson
import pytest
import yaml

from shardline.local_ports import reserve_port as free_port
from shardline.online.router.nginx_front import find_nginx
from shardline.online.tenants import hash_api_key
from shardline.storage.registry import ModelRegistry, Variant
from tests.conftest import BuiltModel
from tests.e2e.conftest import SHARDLINE
from tests.support.budgets import spend, write_prices
from tests.support.routers import _env, _eventually, _scrape, _stop, _wait_ready
from tests.support.serve_process import wait_ready
from tests.tensor_models import breast_cancer_bundle

pytestmark = pytest.mark.timeout(300)
ROUTER_KEY = "router-key-for-the-budget-test"
SPENT = {"hooli": 10.0, "acme": 85.0, "globex": 95.0, "initech": 150.0}  # of 100 USD each: ok, warn, soft, hard
LATE = {"python": "umbrella", "nginx": "wonka"}  # ok at first, each over its budget during one lane's run
PLANES = ["python", pytest.param("nginx", marks=pytest.mark.skipif(find_nginx() is None, reason=(
    "nginx's Lua module is not installed (apt-get install nginx-light libnginx-mod-http-lua)")))]


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory: pytest.TempPathFactory, breast_cancer_model: BuiltModel) -> Iterator[tuple[Path, Path, Path]]:
    """A home whose ledger holds the tenants' spend, its tenants file, and two replicas (groups ``main`` and
    ``cheap``, breast-cancer's fallback group; churn has none, so nginx's fast lane may carry it) serving its
    registry from homes of their own; yields (home, tenants file, router.yaml)."""
    home = tmp_path_factory.mktemp("budget-router")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias("breast-cancer", "prod", registry.push(breast_cancer_model.bundle_dir).version or 1)
    registry.set_alias("churn", "prod", registry.push(breast_cancer_bundle(home / "churn", "churn", "gbt")).version or 1)
    model = next(a for a in registry.get_manifest("breast-cancer", 1).artifacts if a.role == "model")
    registry.add_variant("breast-cancer", 1, Variant(name="int8", precision="int8", device="cpu", artifact=model),
                         breast_cancer_model.bundle_dir / model.path)  # its file the version's own: the choice counts
    write_prices(home)
    for tenant, amount in [*SPENT.items(), *((late, 10.0) for late in LATE.values())]:
        spend(home, tenant, amount, tier="online")
    tenants = home / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": [
        {"name": name, "api_keys_sha256": [hash_api_key(f"sk-{name}")], "models": ["breast-cancer@prod", "churn@prod"],
         "rate": {"requests_per_second": 1000, "burst": 1000}, "budget": {"monthly": 100.0}} for name in [*SPENT, *LATE.values()]]}))
    ports = {"main": free_port(), "cheap": free_port()}
    config = home / "router.yaml"
    config.write_text(yaml.safe_dump({
        "groups": [{"name": g, "priority": i, "replicas": [f"http://127.0.0.1:{p}"]} for i, (g, p) in enumerate(ports.items())],
        "fallbacks": [{"model": "breast-cancer", "variant": "int8", "group": "cheap"}]}))
    servers = {}
    try:
        for group, port in ports.items():
            env = _env(home / f"replica-{group}", SHARDLINE_STORAGE_REGISTRY_URL=str(home / "registry"),
                       SHARDLINE_TENANCY_ROUTER_KEY_SHA256=hashlib.sha256(ROUTER_KEY.encode()).hexdigest())
            with open(home / f"replica-{group}.log", "wb") as sink:
                servers[group] = subprocess.Popen([*SHARDLINE, "serve", "--port", str(port), "--metrics-port", "off",
                                                   "--tenants", str(tenants)], env=env, stdout=sink,
                                                  stderr=subprocess.STDOUT)
        for group, port in ports.items():
            wait_ready(f"http://127.0.0.1:{port}", servers[group], home / f"replica-{group}.log")
        yield home, tenants, config
    finally:
        for server in servers.values():
            _stop(server)


@pytest.mark.parametrize("plane", PLANES)
def test_the_router_refuses_hard_degrades_soft_to_the_cheaper_group_and_marks_warn(
    budgeted: tuple[Path, Path, Path], breast_cancer_model: BuiltModel, plane: str
) -> None:
    home, tenants, config = budgeted
    port, metrics_port = free_port(), free_port()
    log = home / f"router-{plane}.log"
    with open(log, "wb") as sink:
        router = subprocess.Popen([*SHARDLINE, "router", "--config", str(config), "--tenants", str(tenants), "--port",
                                   str(port), "--metrics-port", str(metrics_port)],
                                  env=_env(home, SHARDLINE_ROUTER_KEY=ROUTER_KEY, SHARDLINE_ROUTER_DATA_PLANE=plane,
                                           SHARDLINE_METERING_BUDGET_REFRESH_S="0.3"),
                                  stdout=sink, stderr=subprocess.STDOUT)
    url, metrics = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    rows = breast_cancer_model.data.features[:3]
    body = orjson.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [3], "data": rows[:, j].tolist()}
                                    for j, n in enumerate(breast_cancer_model.data.names)]})
    month = datetime.now(timezone.utc).strftime("%Y-%m")

    def infer(tenant: str, model: str = "breast-cancer") -> httpx.Response:
        return httpx.post(f"{url}/v2/models/{model}/infer", content=body,
                          headers={"Authorization": f"Bearer sk-{tenant}"}, timeout=30)

    try:
        _wait_ready(url, router, log, available=2)
        ok, warned, degraded, refused = (infer(t) for t in ("hooli", "acme", "globex", "initech"))
        assert ok.status_code == 200, ok.text
        assert "x-shardline-budget" not in ok.headers and "x-shardline-fallback" not in ok.headers
        assert warned.status_code == 200 and "x-shardline-fallback" not in warned.headers, warned.text
        if plane == "python":  # nginx's fast lane carries a warned tenant's requests: its replicas say warn
            assert warned.headers["x-shardline-budget"] == "warn"
        # soft: sent to the model's cheaper group, which answers with its int8 variant, marked
        assert degraded.status_code == 200, degraded.text
        assert degraded.headers["x-shardline-budget"] == "soft"
        assert degraded.headers["x-shardline-fallback"] == "breast-cancer:1#int8"
        assert degraded.json()["outputs"][0]["data"] == ok.json()["outputs"][0]["data"]
        # hard: refused by the router, with the figures, in the protocol's form
        assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 3600
        assert refused.json() == {"error": (
            "tenant 'initech' is at its budget's hard limit: new work is refused until the month ends or the budget "
            f"grows (spent 150.00 USD of 100.00 USD (150%) in {month}); this request was refused")}
        openai = httpx.post(f"{url}/v1/embeddings", json={"model": "breast-cancer", "input": ["x"]},
                            headers={"Authorization": "Bearer sk-initech"}, timeout=30)
        assert openai.status_code == 429 and "spent 150.00 USD" in openai.json()["error"]["message"]
        # churn has no cheaper group (nginx's fast lane takes it for the tenants within their soft limit): hard is
        # refused all the same, soft is sent on marked (a replica that knows the state serves its own cheaper variant)
        assert infer("hooli", "churn").status_code == 200
        assert infer("initech", "churn").status_code == 429
        soft = infer("globex", "churn")
        assert soft.status_code == 200 and soft.headers["x-shardline-budget"] == "soft", soft.text
        assert "x-shardline-fallback" not in soft.headers
        series = _scrape(metrics)
        assert series[("shardline_router_fallbacks_total", (("model", "breast-cancer:1"), ("variant", "int8")))] == 1
        assert series[("shardline_router_budget_requests_total", (("state", "hard"), ("tenant", "initech")))] == 3
        assert series[("shardline_router_budget_requests_total", (("state", "soft"), ("tenant", "globex")))] == 2
        if plane == "nginx":  # the fast lane was there to take them: it carried hooli's churn request
            assert _eventually(lambda: _scrape(metrics).get(
                ("shardline_router_fast_lane_requests_total", (("model", "churn:1"),)), 0) >= 1, 10, "no fast lane")

        # a tenant crosses its limit while the router runs: refused on every lane once the states are read again
        late = LATE[plane]
        assert infer(late, "churn").status_code == 200
        spend(home, late, 95.0, tier="online")
        deadline = time.monotonic() + 20
        while (answer := infer(late, "churn")).status_code == 200:
            assert time.monotonic() < deadline, f"{late} was never refused"
            time.sleep(0.2)
        assert answer.status_code == 429 and "spent 105.00 USD of 100.00 USD (105%)" in answer.json()["error"]
        assert [infer(late, "churn").status_code for _ in range(5)] == [429] * 5  # none gets past on the fast lane
        assert infer("hooli", "churn").status_code == 200  # the others are as they were
    finally:
        code = _stop(router)
    assert code in (0, -signal.SIGTERM), log.read_text()[-3000:]
