"""Tenants: who may call the server, with which key, on which models, at what priority and rate.

The tenants file (YAML) is read and checked once, when the server starts; a bad file
stops the start with an error naming the field. API keys are stored as sha256 hex
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shardline.bundle import ModelRef
from shardline.errors import InvalidSetting, ShardlineError, Unauthenticated
from shardline.tenants import BatchPolicy, Priority


def hash_api_key(key: str) -> str:
    """The hex sha256 of an API key: what the tenants file stores."""
    return hashlib.sha256(key.encode()).hexdigest()


class RateQuota(BaseModel):
    """A token bucket: ``requests_per_second`` on average, up to ``burst`` at once."""

    model_config = ConfigDict(extra="forbid")

    requests_per_second: float = Field(gt=0, description="Average requests per second allowed.")
    burst: int = Field(ge=1, description="Requests allowed at once after a quiet spell.")


class TenantConfig(BaseModel):
    """One entry of the tenants file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="Tenant name (metrics, logs).")
    api_keys_sha256: list[str] = Field(
        default_factory=list, description="Hex sha256 digests of the tenant's API keys; none: a batch-only tenant."
    )
    models: list[str] = Field(default_factory=list, description="Model references the tenant may call, one per model.")
    priority: Priority = Field(default="normal", description="Shedding class: low is shed first.")
    rate: RateQuota | None = Field(default=None, description="Request rate quota; none means unlimited.")
    max_concurrent: int | None = Field(default=None, ge=1, description="Requests in flight at most; none: unlimited.")
    batch: BatchPolicy | None = Field(default=None, description="Batch jobs' prefixes and quotas (shardline.tenants).")

    @model_validator(mode="after")
    def _serves_something(self) -> "TenantConfig":
        if self.api_keys_sha256 and not self.models:
            raise ValueError("models: list at least one model the tenant may call (or drop its API keys)")
        if not self.api_keys_sha256 and self.batch is None:
            raise ValueError("api_keys_sha256: give the tenant an API key, or a batch: section for batch-only use")
        return self

    @field_validator("api_keys_sha256")
    @classmethod
    def _hex_digests(cls, value: list[str]) -> list[str]:
        digests = [v.strip().lower() for v in value]
        for i, digest in enumerate(digests):
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(
                    f"entry {i} is not a hex sha256 digest (64 hex characters); store the key's digest, "
                    "e.g. `printf %s \"$KEY\" | sha256sum`, never the key itself"
                )
        return digests

    @field_validator("models")
    @classmethod
    def _references(cls, value: list[str]) -> list[str]:
        seen: dict[str, str] = {}
        for i, text in enumerate(value):
            try:
                ref = ModelRef.parse(text)
            except ShardlineError as e:
                raise ValueError(f"entry {i}: {e}") from e
            if ref.name in seen:
                raise ValueError(
                    f"entry {i} ({text!r}) names model {ref.name!r} again (first as {seen[ref.name]!r}); list a "
                    "model once: its reference picks the version on unversioned paths, other versions are "
                    "reached on versioned paths or as name@alias"
                )
            seen[ref.name] = text
        return value


class TenantsFile(BaseModel):
    """The whole tenants file."""

    model_config = ConfigDict(extra="forbid")

    tenants: list[TenantConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> "TenantsFile":
        names: set[str] = set()
        owners: dict[str, str] = {}
        for tenant in self.tenants:
            if tenant.name in names:
                raise ValueError(f"tenant name {tenant.name!r} appears twice; give each tenant its own name")
            names.add(tenant.name)
            for digest in tenant.api_keys_sha256:
                if digest in owners:
                    raise ValueError(
                        f"one API key digest is listed for both {owners[digest]!r} and {tenant.name!r}; "
                        "a key belongs to one tenant"
                    )
                owners[digest] = tenant.name
        return self


@dataclass(frozen=True)
class Tenant:
    """A tenant as the server uses it: its default reference per model name, priority and quotas."""

    name: str
    priority: Priority
    models: dict[str, ModelRef] = field(hash=False)
    rate: RateQuota | None = field(default=None, hash=False)
    max_concurrent: int | None = None

    def reference_for(self, name: str) -> ModelRef | None:
        """The reference the tenant listed for a model name, or None if it may not call it."""
        return self.models.get(name)


def _field_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "the file"


def parse_tenants(data: Any, where: str) -> list[Tenant]:
    """Check parsed YAML against the tenants format.

    Raises:
        InvalidSetting: naming the first wrong field (``tenants[0].rate.burst``) and what it got.
    """
    try:
        parsed = TenantsFile.model_validate(data)
    except ValidationError as e:
        problems = []
        for error in e.errors():
            got = f" (got {error['input']!r})" if error["type"] not in ("missing", "model_type") else ""
            problems.append(f"{_field_path(error['loc'])}: {error['msg']}{got}")
        raise InvalidSetting(
            f"the tenants file {where} is not valid: " + "; ".join(problems)
            + "; see online/README.md for the format"
        ) from e
    return [
        Tenant(
            name=t.name, priority=t.priority, rate=t.rate, max_concurrent=t.max_concurrent,
            models={ref.name: ref for ref in map(ModelRef.parse, t.models)},
        )
        for t in parsed.tenants
        if t.api_keys_sha256  # a batch-only tenant is not served
    ]


def load_tenants(path: str | Path) -> "TenantDirectory":
    """Read and check a tenants file.

    Raises:
        InvalidSetting: the file is missing, is not YAML, or a field is wrong.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise InvalidSetting(
            f"the tenants file {path} cannot be read ({e.strerror}); pass --tenants PATH or set "
            "SHARDLINE_ONLINE_TENANTS_FILE"
        ) from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InvalidSetting(f"the tenants file {path} is not valid YAML: {e}") from e
    return TenantDirectory(parse_tenants(data, str(path)), _digests(data))


def _digests(data: Any) -> list[tuple[str, str]]:
    return [(d.strip().lower(), t["name"]) for t in data["tenants"] for d in t.get("api_keys_sha256") or []]


class TenantDirectory:
    """Tenants by API key: a key is hashed and compared with every stored digest in constant time."""

    def __init__(self, tenants: list[Tenant], digests: list[tuple[str, str]]) -> None:
        self.tenants = {t.name: t for t in tenants}
        self._digests = [(bytes.fromhex(d), self.tenants[name]) for d, name in digests]

    @classmethod
    def from_config(cls, data: Any) -> "TenantDirectory":
        """A directory from an already parsed tenants mapping (tests, embedding the server)."""
        return cls(parse_tenants(data, "given"), _digests(data))

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant whose key an ``Authorization: Bearer <key>`` header carries.

        Raises:
            Unauthenticated: no header, another scheme, or a key no tenant holds.
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
        found: Tenant | None = None
        for stored, tenant in self._digests:  # every digest is compared: the time does not tell which matched
            if hmac.compare_digest(stored, digest):
                found = tenant
        if found is None:
            raise Unauthenticated("the API key is not valid; ask for a key of your tenant, or check it was not revoked")
        return found
