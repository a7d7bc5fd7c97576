"""`shardline router`: its replicas, placement, retries, health, rollouts, scaling, its data plane."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shardline.settings.online import MetricsPort


class RouterSettings(BaseSettings):
    """`shardline router`: where it listens, its replicas, and its failure policy (docs/routing.md)."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_ROUTER_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=8080, ge=0, le=65_535, description="TCP port to listen on (0 picks a free one).")
    config_file: str | None = Field(default=None, description="router.yaml: the replica groups (docs/routing.md).")
    local_replicas: int = Field(
        default=0, ge=0, le=64,
        description="Start and supervise this many `shardline serve` processes on loopback as the one group "
        "(instead of a config file).",
    )
    key: str | None = Field(
        default=None, min_length=16,
        description="The key the router sends its replicas (they hold its sha256, SHARDLINE_TENANCY_ROUTER_KEY_SHA256). "
        "Unset with --local-replicas: a random one for each start.",
    )
    data_plane: Literal["auto", "nginx", "python"] = Field(
        default="auto",
        description="What relays requests: nginx (in front, answering pinned V2 inference natively, the router the "
        "rest; docs/routing.md), python (the router alone), auto (nginx when it and its Lua module are installed).",
    )
    balance: float = Field(
        default=1.25, ge=1.0, le=10.0,
        description="c of hashing with bounded loads: a replica holding more than c times the mean in-flight "
        "requests passes a model's requests on to the next replica in the model's order.",
    )
    request_timeout_s: float = Field(
        default=30.0, gt=0, description="A request's deadline when it sends no X-Shardline-Timeout-Ms."
    )
    max_timeout_s: float = Field(default=300.0, gt=0, description="The longest deadline a request may ask for.")
    retries: int = Field(default=2, ge=0, le=10, description="Tries on other replicas after the first one failed.")
    retry_budget_ratio: float = Field(
        default=0.2, ge=0, le=1, description="Retries are at most this share of the requests of the last 10 s, "
        "plus retry_min_per_s a second."
    )
    retry_min_per_s: float = Field(default=5.0, ge=0, description="Retries allowed a second whatever the traffic.")
    breaker_failures: int = Field(
        default=5, ge=1, description="Consecutive failures (connection, 502-504) that open a replica's breaker."
    )
    breaker_open_s: float = Field(
        default=2.0, gt=0, description="How long an open breaker passes nothing before probing (doubled at each re-open, at most 30 s)."
    )
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="Largest request body the router takes (413 past it), and "
        "what an OpenAI body it reads may inflate to."
    )
    health_interval_s: float = Field(default=1.0, gt=0, description="How often each replica's /v2/health/ready is read.")
    failback_s: float = Field(
        default=10.0, ge=0,
        description="A higher-priority group takes traffic back only after it has been available this long.",
    )
    stall_ms: float = Field(
        default=250.0, ge=0,
        description="How long a try on a replica may go without an answer before the router checks the replica is "
        "alive: the router probes its health (no answer within this too: it is hung, taken out until a health check "
        "passes, and its requests go to another replica); nginx's fast lane gives a try this long, or 8x the "
        "model's usual answer time when longer, then tries another replica. 0: tries wait for their deadline.",
    )
    hedge_after_ms: float = Field(
        default=0.0, ge=0, description="Send a second copy of a request to the next replica when the first has not "
        "answered within this (within the retry budget; the first good answer wins, the other is cancelled); 0: off.",
    )
    min_replicas: int | None = Field(
        default=None, ge=0, le=64,
        description="With --local-replicas N: scale between this and N by demand (0: scale to zero, requests wait "
        "while one starts); unset: run N.",
    )
    target_in_flight: float = Field(
        default=4.0, gt=0, description="Requests in flight per replica that scaling aims at (and that "
        "shardline_router_replicas_wanted is worked out with)."
    )
    scale_up_delay_s: float = Field(default=2.0, ge=0, description="Demand must want more replicas this long before "
                                    "they start (from zero: at once).")
    scale_down_delay_s: float = Field(default=60.0, ge=0, description="Demand must want fewer replicas this long "
                                      "before one stops.")
    activator_queue: int = Field(default=1000, ge=1, description="Requests held at most while a replica starts "
                                 "from zero; more get 503 with Retry-After.")
    rollout_refresh_s: float = Field(
        default=2.0, gt=0, description="How often the router reads the aliases its tenants call and decides for "
        "the rollouts on them (step, promote, roll back)."
    )
    metrics_host: str = Field(default="127.0.0.1", description="Address of the router's Prometheus /metrics listener.")
    metrics_port: MetricsPort = Field(
        default=8082, description="Port of the router's /metrics listener; 0 or 'off': none."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="Log level.")
