"""The tenants file both tiers read, and a replica's trust in its router."""

from __future__ import annotations

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class TenancySettings(BaseSettings):
    """The tenants file both tiers read, and how batch tenants share the cluster (see docs/batch.md, Fairness)."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_TENANCY_", extra="ignore")

    tenants_file: str | None = Field(
        default=None,
        validation_alias=AliasChoices("SHARDLINE_TENANTS_FILE", "SHARDLINE_ONLINE_TENANTS_FILE", "tenants_file"),
        description="The tenants YAML both tiers read, batch jobs and `shardline serve` (SHARDLINE_TENANTS_FILE, "
        "else SHARDLINE_ONLINE_TENANTS_FILE; `serve --tenants` overrides both); unset: batch jobs run in "
        "single-tenant development mode, no limits, and the server refuses to start.",
    )
    router_key_sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-fA-F]{64}$",
        description="`shardline serve` behind `shardline router`: the hex sha256 of the router's key. Set, the server "
        "takes requests only with that key (Authorization: Bearer) and the tenant the router names "
        "(X-Shardline-Tenant), and leaves the tenants' rate and concurrency quotas to the router, which holds "
        "them for all its replicas; tenants' own keys are refused. `router --local-replicas` sets it itself.",
    )
    priority_job_slots: dict[str, int] = Field(
        default_factory=lambda: {"high": 8, "normal": 4, "low": 1},
        description="Batch jobs of each priority class running at once, across tenants (Prefect global "
        "concurrency limits shardline-batch-priority-<class>, created or resized at run time) (JSON).",
    )
    wait_timeout_s: float | None = Field(
        default=None, gt=0, description="How long a job waits for its tenant's and class's slots; unset: as long as it takes."
    )
    quota_store: str | None = Field(
        default=None,
        pattern=r"^rediss?://",
        description="Where every router holds the tenants' rate, concurrency and LLM token and stream quotas "
        "together: a Redis URL (redis://host:port/db). Unset: each router holds them in its own process (one "
        "router: as before; N routers: N times each quota). nginx's fast lane holds them there too (a redis:// "
        "store; with rediss:// the lane is not started) (docs/routing.md, Quotas for many routers).",
    )
    quota_store_routers: int = Field(
        default=1, ge=1,
        description="How many routers share the quota store: while Redis cannot be reached each router holds "
        "1/N of every quota in its own process (logged once per outage, counted in "
        "shardline_router_quota_store_fallbacks_total).",
    )
