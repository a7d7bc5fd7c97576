"""Tenants: who may call the server, with which key, on which models, at what priority and rate.

The tenants file is the one both tiers read (its format, loader and checks are in
``shardline/tenants.py``): it is read and checked once, when the server starts; a bad
file stops the start with an error naming the field. API keys are stored as sha256 hex
digests only and compared in constant time.

    tenants:
      - name: acme
        api_keys_sha256: ["<hex sha256 of the key>"]
        models: ["breast-cancer@prod", "minilm@prod"]
        priority: high            # high | normal | low
        rate: {requests_per_second: 200, burst: 400}
        max_concurrent: 64
        batch: {storage_prefixes: ["s3://lake/acme/"]}   # batch jobs only (shardline/tenants.py)

A tenant with no API keys but a ``batch:`` section is batch-only: the server ignores it.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shardline.bundle import ModelRef
from shardline.errors import ModelNotFound, Unauthenticated
from shardline.online.errors import shown
from shardline.tenants import (  # noqa: F401 - hash_api_key: the online tier's name for it too
    Priority,
    RateQuota,
    TenantsFile,
    hash_api_key,
    load_tenants_file,
    parse_tenants_file,
)


@dataclass(frozen=True)
class Tenant:
    """A tenant as the server uses it: its default reference per model name, priority and quotas."""

    name: str
    priority: Priority
    models: dict[str, ModelRef] = field(hash=False)
    rate: RateQuota | None = field(default=None, hash=False)
    max_concurrent: int | None = None
    custom_code: bool = False  # may call models that carry their own Python code
    tokens_per_minute: int | None = None  # LLM prompt + completion tokens a minute
    max_streams: int | None = None  # LLM generations in flight

    def reference_for(self, name: str) -> ModelRef | None:
        """The reference the tenant listed for a model name, or None if it may not call it."""
        return self.models.get(name)


def not_available(tenant: Tenant, name: str) -> ModelNotFound:
    """The refusal of a model the tenant may not call: the same answer whether or not the model exists
    (nothing leaks to other tenants), from a server and from the router alike."""
    return ModelNotFound(
        f"model {shown(name)} is not available to tenant {tenant.name!r}; it may call {sorted(tenant.models)}", name
    )


def load_tenants(path: str | Path) -> "TenantDirectory":
    """Read and check a tenants file (``shardline.tenants.load_tenants_file``) into the server's directory.

    Raises:
        InvalidSetting: the file is missing, is not YAML, or a field is wrong.
    """
    return TenantDirectory.from_file(load_tenants_file(path))


class TenantDirectory:
    """Tenants by API key: a key is hashed and compared with every stored digest in constant time.

    Behind a router (``router_key_sha256``) the one key taken is the router's, and the tenant is the one
    the router names in ``X-Shardline-Tenant``; the router has checked the tenant's own key and holds its
    rate, concurrency and LLM token and stream quotas for every replica, so the tenants this directory
    answers carry none.
    """

    def __init__(self, tenants: list[Tenant], digests: list[tuple[str, str]], router_key_sha256: str | None = None) -> None:
        self.tenants = {t.name: t for t in tenants}
        self._digests = [(bytes.fromhex(d), self.tenants[name]) for d, name in digests]
        self._router = bytes.fromhex(router_key_sha256) if router_key_sha256 else None
        self._unmetered = {t.name: replace(t, rate=None, max_concurrent=None, tokens_per_minute=None, max_streams=None)
                           for t in tenants}

    def digests(self) -> list[tuple[str, str]]:
        """(sha256 hex of a key, tenant name) for every key (what a native data plane looks keys up in)."""
        return [(stored.hex(), tenant.name) for stored, tenant in self._digests]

    @property
    def routed(self) -> bool:
        """Whether requests come through a router (which holds the quotas: see the class docstring)."""
        return self._router is not None

    def behind_router(self, router_key_sha256: str) -> "TenantDirectory":
        """The same tenants, taking requests only from the router whose key hashes to ``router_key_sha256``."""
        return TenantDirectory(list(self.tenants.values()), self.digests(), router_key_sha256)

    @classmethod
    def from_file(cls, parsed: TenantsFile) -> "TenantDirectory":
        """The online view of a checked tenants file: the tenants with keys, and their key digests."""
        served = parsed.served()
        tenants = [
            Tenant(name=t.name, priority=t.priority, models=t.model_refs(), rate=t.rate, max_concurrent=t.max_concurrent,
                   custom_code=t.custom_code, tokens_per_minute=t.tokens_per_minute, max_streams=t.max_streams)
            for t in served
        ]
        return cls(tenants, [(digest, t.name) for t in served for digest in t.api_keys_sha256])

    @classmethod
    def from_config(cls, data: Any) -> "TenantDirectory":
        """A directory from an already parsed tenants mapping (tests, embedding the server).

        Raises:
            InvalidSetting: a field is wrong (the same check and message as a file).
        """
        return cls.from_file(parse_tenants_file(data, "given"))

    def authenticate(self, authorization: str | None, on_behalf_of: str | None = None) -> Tenant:
        """The tenant whose key an ``Authorization: Bearer <key>`` header carries; behind a router, the
        tenant ``on_behalf_of`` (its ``X-Shardline-Tenant`` header) when the key is the router's.

        Raises:
            Unauthenticated: no header, another scheme, or a key no tenant holds; behind a router, a key
                that is not the router's or a tenant it does not name.
        """
        if not authorization:
            raise Unauthenticated("no API key was sent; send it as the header 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise Unauthenticated(
                "the Authorization header is not 'Bearer <key>'; send the API key your tenant was given that way"
            )
        digest = hashlib.sha256(key.encode()).digest()
        if self._router is not None:
            return self._through_router(digest, on_behalf_of)
        found: Tenant | None = None
        for stored, tenant in self._digests:  # every digest is compared: the time does not tell which matched
            if hmac.compare_digest(stored, digest):
                found = tenant
        if found is None:
            raise Unauthenticated("the API key is not valid; ask for a key of your tenant, or check it was not revoked")
        return found

    def _through_router(self, digest: bytes, on_behalf_of: str | None) -> Tenant:
        assert self._router is not None
        if not hmac.compare_digest(self._router, digest):
            raise Unauthenticated(
                "this server takes requests only through its router; send them to the router's address"
            )
        tenant = self._unmetered.get(on_behalf_of or "")
        if tenant is None:
            raise Unauthenticated(
                f"the router named tenant {on_behalf_of!r}, which this server's tenants file does not hold; give "
                "the router and its replicas the same tenants file"
            )
        return tenant
