"""Budgets online: a real `shardline serve` over a ledger pre-filled for its tenants marks the answers of a tenant
past its warning or soft threshold (soft: served by the model's cheaper variant) and refuses one at its hard limit
with 429 and the figures; a tenant that crosses its limit while the server runs is refused once the background
refresh has read the ledger."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import orjson
import yaml

from shardline.online.tenants import hash_api_key
from shardline.storage.registry import ModelRegistry, Variant
from tests.conftest import BuiltModel
from tests.support.budgets import spend, write_prices
from tests.support.serve_process import serving

SPENT = {"acme": 85.0, "globex": 95.0, "initech": 150.0, "hooli": 10.0}  # of 100 USD each: warn, soft, hard, ok


def test_serve_marks_warn_and_soft_and_refuses_hard_with_the_figures(
    local_registry: ModelRegistry, breast_cancer_model: BuiltModel, shardline_home: Path, tmp_path: Path
) -> None:
    write_prices(shardline_home)  # a CPU core-second costs 1 USD
    # a precision variant to degrade to (its file the version's own: what is checked is the choice, not int8's math)
    model = next(a for a in local_registry.get_manifest("breast-cancer", 1).artifacts if a.role == "model")
    local_registry.add_variant("breast-cancer", 1, Variant(name="int8", precision="int8", device="cpu", artifact=model),
                               breast_cancer_model.bundle_dir / model.path)
    for tenant, amount in SPENT.items():
        spend(shardline_home, tenant, amount, tier="online")
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": [
        {"name": name, "api_keys_sha256": [hash_api_key(f"sk-{name}")], "models": ["breast-cancer@prod"],
         "budget": {"monthly": 100.0, "warn_at": 0.8, "soft_at": 0.9}} for name in SPENT]}))
    rows = breast_cancer_model.data.features[:2]
    body = orjson.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [2], "data": rows[:, j].tolist()}
                                    for j, n in enumerate(breast_cancer_model.data.names)]})
    month = datetime.now(timezone.utc).strftime("%Y-%m")

    with serving(shardline_home, tenants, tmp_path / "serve.log", SHARDLINE_METERING_BUDGET_REFRESH_S="0.3") as url:
        def infer(tenant: str) -> httpx.Response:
            return httpx.post(f"{url}/v2/models/breast-cancer/infer", content=body,
                              headers={"Authorization": f"Bearer sk-{tenant}"}, timeout=30)

        ok, warned, degraded, refused = (infer(t) for t in ("hooli", "acme", "globex", "initech"))
        assert ok.status_code == 200 and "x-shardline-budget" not in ok.headers, ok.text
        assert warned.status_code == 200 and warned.headers["x-shardline-budget"] == "warn", warned.text
        assert degraded.status_code == 200 and degraded.headers["x-shardline-budget"] == "soft", degraded.text
        assert degraded.json()["outputs"][0]["data"] == ok.json()["outputs"][0]["data"]  # served all the same
        # soft: the cheaper variant answers, and says so; the others get the version itself
        assert degraded.headers["x-shardline-fallback"] == "breast-cancer:1#int8"
        assert "x-shardline-fallback" not in warned.headers and "x-shardline-fallback" not in ok.headers
        assert refused.status_code == 429
        assert refused.json() == {"error": (
            "tenant 'initech' is at its budget's hard limit: new work is refused until the month ends or the budget "
            f"grows (spent 150.00 USD of 100.00 USD (150%) in {month}); this request was refused")}
        assert 1 <= int(refused.headers["retry-after"]) <= 3600
        assert b"\n" not in refused.content.strip()

        # hooli crosses its limit while the server runs: refused once the refresh has priced the ledger again
        spend(shardline_home, "hooli", 95.0, tier="online")
        deadline = time.monotonic() + 20
        while (answer := infer("hooli")).status_code == 200:
            assert time.monotonic() < deadline, "hooli was never refused"
            time.sleep(0.2)
        assert answer.status_code == 429 and "spent 105.00 USD of 100.00 USD (105%)" in answer.json()["error"]
        assert infer("acme").status_code == 200  # the others are as they were


def _same_file_variant(registry: ModelRegistry, name: str, bundle: Path, variant: str, precision: str) -> None:
    """A precision variant of ``name:1`` whose file is the version's own (what is checked is the choice)."""
    model = next(a for a in registry.get_manifest(name, 1).artifacts if a.role == "model")
    registry.add_variant(name, 1, Variant(name=variant, precision=precision, device="cpu", artifact=model),
                         bundle / model.path)


def test_the_openai_paths_serve_a_soft_tenant_the_cheaper_variant_and_keep_a_named_one(
    shardline_home: Path, minilm_bundle: Path, tmp_path: Path
) -> None:
    from shardline.build.llm_build import package_tiny_llm
    from shardline.storage.ledger import LedgerStore

    write_prices(shardline_home)
    registry = ModelRegistry(str(shardline_home / "registry"))
    registry.set_alias("minilm", "prod", registry.push(minilm_bundle).version or 1)
    package_tiny_llm(tmp_path / "tiny-bundle", name="tiny")
    registry.set_alias("tiny", "prod", registry.push(tmp_path / "tiny-bundle").version or 1)
    for variant, precision in (("int8", "int8"), ("half", "fp16")):  # soft picks int8, the cheapest
        _same_file_variant(registry, "minilm", minilm_bundle, variant, precision)
    _same_file_variant(registry, "tiny", tmp_path / "tiny-bundle", "int8", "int8")
    spent = {"globex": 95.0, "hooli": 10.0}  # soft, ok
    for tenant, amount in spent.items():
        spend(shardline_home, tenant, amount, tier="online")
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": [
        {"name": name, "api_keys_sha256": [hash_api_key(f"sk-{name}")], "models": ["minilm@prod", "tiny@prod"],
         "budget": {"monthly": 100.0}} for name in spent]}))

    with serving(shardline_home, tenants, tmp_path / "serve.log") as url:
        def post(path: str, tenant: str, body: dict, **headers: str) -> httpx.Response:
            return httpx.post(f"{url}/v1/{path}", json=body, timeout=60,
                              headers={"Authorization": f"Bearer sk-{tenant}", **headers})

        texts = {"model": "minilm", "input": ["a river", "a mountain"]}
        ok, degraded = post("embeddings", "hooli", texts), post("embeddings", "globex", texts)
        assert ok.status_code == 200 and "x-shardline-budget" not in ok.headers, ok.text
        assert "x-shardline-fallback" not in ok.headers
        assert degraded.status_code == 200, degraded.text
        assert degraded.headers["x-shardline-budget"] == "soft"
        assert degraded.headers["x-shardline-fallback"] == "minilm:1#int8"  # marked as on V2
        assert len(degraded.json()["data"]) == 2 and degraded.json()["model"] == "minilm:1"
        # a request that names a variant (a router's fallback) keeps it: not marked by the replica
        named = post("embeddings", "globex", texts, **{"X-Shardline-Variant": "half"})
        assert named.status_code == 200 and named.headers["x-shardline-budget"] == "soft", named.text
        assert "x-shardline-fallback" not in named.headers
        missing = post("embeddings", "hooli", texts, **{"X-Shardline-Variant": "fp4"})
        assert missing.status_code == 404 and "has no variant 'fp4'" in missing.json()["error"]["message"]

        chat = {"model": "tiny", "messages": [{"role": "user", "content": "name a river"}], "max_tokens": 3,
                "temperature": 0}
        plain, cheaper = post("chat/completions", "hooli", chat), post("chat/completions", "globex", chat)
        assert plain.status_code == 200 and "x-shardline-fallback" not in plain.headers, plain.text
        assert cheaper.status_code == 200 and cheaper.headers["x-shardline-fallback"] == "tiny:1#int8", cheaper.text
        assert cheaper.headers["x-shardline-budget"] == "soft"
        assert cheaper.json()["usage"]["completion_tokens"] >= 1
        completion = post("completions", "globex", {"model": "tiny", "prompt": "The river", "max_tokens": 2})
        assert completion.status_code == 200 and completion.headers["x-shardline-fallback"] == "tiny:1#int8"

    # the ledger (written whole at the graceful stop) says which variant scored whose rows
    month = datetime.now(timezone.utc).strftime("%Y-%m")
    rows = [r for r in LedgerStore(str(shardline_home)).read(month).to_pylist()
            if r["kind"] == "usage" and r["model"] == "minilm" and r["rows"]]  # (requests are counted by version)
    scored: dict[tuple[str, str], int] = {}
    for row in rows:
        scored[(row["tenant"], row["version"])] = scored.get((row["tenant"], row["version"]), 0) + row["rows"]
    assert scored == {("hooli", "1"): 2, ("globex", "1#int8"): 2, ("globex", "1#half"): 2}
