"""A server behind a router: only the router's key, the tenant it names, and no quotas of the server's own."""

from __future__ import annotations

import hashlib

import pytest

from shardline.errors import Unauthenticated
from shardline.online.tenants import TenantDirectory, hash_api_key

ROUTER_KEY = "router-key-0123456789"


def directory() -> TenantDirectory:
    return TenantDirectory.from_config({"tenants": [{
        "name": "acme", "api_keys_sha256": [hash_api_key("sk-acme")], "models": ["churn@prod"], "priority": "high",
        "rate": {"requests_per_second": 10, "burst": 20}, "max_concurrent": 4,
    }]})


def test_a_server_on_its_own_takes_tenant_keys_with_their_quotas() -> None:
    tenant = directory().authenticate("Bearer sk-acme", "ignored")
    assert tenant.name == "acme" and tenant.max_concurrent == 4 and tenant.rate is not None


def test_behind_a_router_it_takes_the_router_key_and_the_tenant_it_names_without_quotas() -> None:
    behind = directory().behind_router(hashlib.sha256(ROUTER_KEY.encode()).hexdigest())
    tenant = behind.authenticate(f"Bearer {ROUTER_KEY}", "acme")
    assert (tenant.name, tenant.priority, tenant.rate, tenant.max_concurrent) == ("acme", "high", None, None)
    assert str(tenant.reference_for("churn")) == "churn@prod"
    with pytest.raises(Unauthenticated, match="only through its router"):
        behind.authenticate("Bearer sk-acme", "acme")  # a tenant's own key, straight to the replica
    with pytest.raises(Unauthenticated, match="the router named tenant 'globex', which this server's tenants file"):
        behind.authenticate(f"Bearer {ROUTER_KEY}", "globex")
    with pytest.raises(Unauthenticated, match="the router named tenant None"):
        behind.authenticate(f"Bearer {ROUTER_KEY}", None)
