"""The batch tier: the Dask cluster, jobs and their SLAs, the local Prefect server, placement."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shardline.settings.online import MetricsPort


class DaskSettings(BaseSettings):
    """Which Dask cluster the batch flow runs its shards on."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_DASK_", extra="ignore")

    cluster: Literal["local", "address", "kubernetes"] = Field(
        default="local",
        description="local: a LocalCluster in this process; address: an existing "
        "scheduler; kubernetes: a dask-kubernetes cluster per job, made from a DaskCluster template.",
    )
    address: str | None = Field(
        default=None, description="Scheduler address, e.g. tcp://10.0.0.5:8786."
    )
    n_workers: int = Field(
        default=0, ge=0, description="Local worker processes; 0 picks one per core."
    )
    threads_per_worker: int = Field(default=1, ge=1, description="Threads per local worker.")
    kubernetes_spec: str | None = Field(
        default=None,
        description="Path of the DaskCluster template (YAML) each job's cluster is made from, for cluster=kubernetes.",
    )
    kubernetes_image: str | None = Field(
        default=None,
        description="The image of the job cluster's containers the template gives the image named shardline (the "
        "scheduler, CPU workers); unset: the template's. deploy/k8s ships it in the tenant's ConfigMap "
        "shardline-dask-images, which an overlay's `images:` rewrites.",
    )
    kubernetes_gpu_image: str | None = Field(
        default=None,
        description="The same for the containers the template gives the image named shardline-gpu (GPU workers).",
    )
    kubernetes_workers: int = Field(
        default=2, ge=0,
        description="Workers a job's kubernetes cluster starts with: its minimum (the DaskAutoscaler's, and the floor "
        "the SLA response never scales below).",
    )
    kubernetes_max_workers: int = Field(
        default=10, ge=0,
        description="Most workers of a job's kubernetes cluster (the DaskAutoscaler's maximum, the SLA response's "
        "ceiling); 0: no DaskAutoscaler, the cluster keeps kubernetes_workers (the SLA response adds none).",
    )
    kubernetes_namespace: str | None = Field(
        default=None,
        description="Namespace of the jobs' DaskClusters; unset: the client's own (the flow-run pod's namespace "
        "in a cluster, the kubeconfig context's outside).",
    )
    kubernetes_spot: bool = Field(
        default=True,
        description="The Kubernetes cluster has spot node pools: a job that asks for spot capacity (a tenant past its "
        "budget's soft limit) gets workers that require a spot node. false: none is spot; such a job runs where "
        "the template places its workers, metered as SHARDLINE_METERING_CAPACITY_TYPE says.",
    )
    kubernetes_ready_timeout_s: float = Field(
        default=600.0, gt=0,
        description="How long a job waits for the dask-kubernetes operator to report its new cluster Running.",
    )
    allowed_failures: int = Field(
        default=10,
        ge=0,
        description="Workers that may die (no notice) while running one shard before Dask fails it with "
        "KilledWorker (distributed.scheduler.allowed-failures; set on clusters this process starts).",
    )
    preemption_notices: tuple[str, ...] = Field(
        default=("sigterm",),
        description="Where a worker learns it is being preempted (JSON list): 'sigterm' (the worker process "
        "gets SIGTERM), 'file:/PATH' (the file appears, e.g. written by a preStop hook or a node agent), "
        "'http://URL' (a metadata endpoint answers 200 with a body other than FALSE: GCP), 'aws' (EC2 spot "
        "instance-action through IMDSv2, token first), 'azure' (a Scheduled Events 'Preempt' for this VM); "
        "'aws:URL'/'azure:URL' point those at another metadata address. Empty: never.",
    )
    preemption_poll_s: float = Field(
        default=1.0, gt=0, description="How often a worker looks at its file or HTTP notice source."
    )
    preemption_drain_s: float = Field(
        default=20.0,
        ge=0,
        description="After a notice, how long a worker may finish the shards it runs before handing the rest "
        "back; keep it under the notice period (AWS 120 s, GCP 30 s, terminationGracePeriodSeconds).",
    )

    @field_validator("address")
    @classmethod
    def _address_has_scheme(cls, value: str | None) -> str | None:
        if value is not None and "://" not in value:
            raise ValueError(
                f"address {value!r} has no scheme; write it as tcp://HOST:PORT"
            )
        return value

    @field_validator("preemption_notices")
    @classmethod
    def _known_notice_sources(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for source in value:
            kind, _, rest = source.partition(":")
            if kind in ("aws", "azure") and rest and not rest.startswith(("http://", "https://")):
                raise ValueError(f"preemption notice source {source!r}: after '{kind}:' comes an http(s):// address")
            if source not in ("sigterm", "aws", "azure") and not source.startswith(
                ("file:", "http://", "https://", "aws:", "azure:")
            ):
                raise ValueError(
                    f"preemption notice source {source!r} is unknown; use 'sigterm', 'file:/PATH', an http(s):// "
                    "URL, 'aws' or 'azure'"
                )
        return value

    @model_validator(mode="after")
    def _kubernetes_bounds(self) -> "DaskSettings":
        if self.kubernetes_max_workers and self.kubernetes_max_workers < self.kubernetes_workers:
            raise ValueError(
                f"SHARDLINE_DASK_KUBERNETES_MAX_WORKERS ({self.kubernetes_max_workers}) is below "
                f"SHARDLINE_DASK_KUBERNETES_WORKERS ({self.kubernetes_workers}); raise it, or set 0 for a fixed size"
            )
        return self

    def resolved_workers(self) -> int:
        """Local worker count, with 0 meaning one per core."""
        return self.n_workers or max(1, os.cpu_count() or 1)


class BatchSettings(BaseSettings):
    """Defaults of a batch job."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_BATCH_", extra="ignore")

    batch_rows: int = Field(
        default=65_536,
        ge=1,
        description="Rows read, scored and written at a time; bounds a worker's memory.",
    )
    shard_suffixes: tuple[str, ...] = Field(
        default=(".parquet", ".pq"), description="File suffixes that count as shards."
    )
    checkpoint_bytes: int = Field(
        default=1024 * 1024 * 1024,
        ge=1,
        description="A shard larger than this is scored in ranges of row groups of about this many (compressed) "
        "bytes, each checkpointed, so a lost worker redoes one range, not the shard; the ranges are then copied "
        "into the part, one more read and write of the scored columns.",
    )
    retry_attempts: int = Field(
        default=4, ge=0, description="Retries of a shard after a transient storage error (connection, timeout, throttling)."
    )
    retry_base_s: float = Field(
        default=0.5, gt=0, description="First retry's backoff ceiling; it doubles each retry (full jitter)."
    )
    retry_cap_s: float = Field(default=30.0, gt=0, description="Largest backoff between two retries.")
    max_in_flight: int = Field(
        default=0, ge=0, description="Tasks submitted to the cluster at once (a shard each, or a group of small "
        "shards scored one after the other); 0: 4 per worker thread (at least 8)."
    )
    contract_sample_rows: int = Field(
        default=1_000,
        ge=0,
        description="First rows of each shard checked against the model's data contract before scoring "
        "(when its bundle has a reference profile); a failing shard is quarantined. 0: no check.",
    )
    capture_rows_per_shard: int = Field(
        default=1_000,
        ge=0,
        description="Rows of each shard's inputs and outputs kept for drift checks (tier 'batch'). 0: none.",
    )
    default_sla: str = Field(
        default="24h", description="SLA of a job given neither --sla nor --deadline (a duration: '2h', '90m')."
    )
    sla_margin: float = Field(
        default=0.1, ge=0, lt=1,
        description="Fraction of a job's SLA before its deadline from which a later projected finish is 'at risk'.",
    )
    sla_check_interval_s: float = Field(
        default=5.0, gt=0, description="How often (seconds) a running job projects its finish and updates its record."
    )
    sla_window_s: float = Field(
        default=300.0, gt=0, description="Seconds of recent progress the throughput (and so the projection) is measured over."
    )
    runner_idle_s: float = Field(
        default=900.0, ge=0,
        description="How long the home's warm batch runner (started by the first `batch run`, it keeps the imports, "
        "the Prefect API and a LocalCluster with its loaded models for the next jobs) waits for a job before it "
        "exits. 0: no runner; every job starts and closes its own cluster in its own process.",
    )
    metrics_port: MetricsPort = Field(
        default=0,
        description="Port of a Prometheus /metrics listener in the process that dispatches batch jobs (the warm "
        "runner, or a cold run's own process): rows, shards by state, projected finish and deadline per job and "
        "tenant, scrapeable while a job runs. 0 or 'off': none (the default).",
    )
    metrics_host: str = Field(
        default="127.0.0.1", description="Address of the batch /metrics listener (0.0.0.0 for a scraper elsewhere)."
    )
    lease_ttl_s: float = Field(
        default=180.0, gt=0,
        description="How long a running job's lease on its output folder lasts unless renewed: a job whose owner "
        "died (on another host, or whose process cannot be checked) is taken over this long after its last renewal.",
    )
    lease_renew_s: float = Field(
        default=30.0, gt=0,
        description="How often (seconds) a running job renews its output lease; must be under lease_ttl_s "
        "(a third of it or less leaves room for slow storage).",
    )

    @model_validator(mode="after")
    def _renew_within_ttl(self) -> "BatchSettings":
        if self.lease_renew_s >= self.lease_ttl_s:
            raise ValueError(
                f"SHARDLINE_BATCH_LEASE_RENEW_S ({self.lease_renew_s}) must be under SHARDLINE_BATCH_LEASE_TTL_S "
                f"({self.lease_ttl_s}), or the lease lapses between renewals"
            )
        return self


class PrefectServerSettings(BaseSettings):
    """Which Prefect API batch runs use when ``PREFECT_API_URL`` is not set (in the environment or a Prefect profile)."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_PREFECT_", extra="ignore")

    server: Literal["local", "temporary"] = Field(
        default="local",
        description="local: one `prefect server start` per Shardline home (<home>/prefect), started by the first "
        "run, detached, and reused by later runs (their UI shows every run; `shardline prefect stop` stops it); "
        "temporary: Prefect's temporary server inside each run (seconds per run, nothing left running). "
        "A PREFECT_API_URL, set by you, always wins.",
    )
    start_timeout_s: float = Field(
        default=120.0, gt=0, description="How long a run waits for the local server it started to answer."
    )
