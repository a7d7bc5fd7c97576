"""Settings: one pydantic-settings class per area, env prefix ``SHARDLINE_<AREA>_``.

They are read once, at the entry point (the CLI, a flow, the server), and passed
down; nothing reads the environment at import time.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_home() -> str:
    return str(Path.home() / ".shardline")


def port_or_off(value: Any) -> Any:
    """A metrics port setting as given, with "off", "none", "false" or "" meaning 0 (no listener)."""
    return 0 if isinstance(value, str) and value.strip().lower() in ("off", "none", "false", "") else value


class StorageSettings(BaseSettings):
    """Where models and the local model cache live."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_STORAGE_", extra="ignore")

    home: str = Field(
        default_factory=_default_home,
        description="Local folder for Shardline's own state (registry and cache defaults).",
    )
    registry_url: str | None = Field(
        default=None,
        description="fsspec URL of the model registry; defaults to <home>/registry.",
    )
    cache_dir: str | None = Field(
        default=None,
        description="Local folder where fetched bundles are kept; defaults to <home>/cache.",
    )
    capture_url: str | None = Field(
        default=None,
        description="fsspec URL where both tiers write sampled inputs/outputs (drift checks read it); "
        "defaults to <home>/capture.",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options for every remote URL (JSON), e.g. "
        '{"endpoint_url": "http://127.0.0.1:9000"} for an S3-compatible store.',
    )

    protected_aliases: tuple[str, ...] = Field(
        default=("staging", "prod"),
        description="Aliases that, once set, move only through promotion (gated) or rollback.",
    )

    @property
    def registry(self) -> str:
        """The registry URL, with the default applied."""
        return self.registry_url or str(Path(self.home) / "registry")

    @property
    def cache(self) -> str:
        """The model cache folder, with the default applied."""
        return self.cache_dir or str(Path(self.home) / "cache")


class RuntimeSettings(BaseSettings):
    """How models are loaded and run."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_RUNTIME_", extra="ignore")

    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="auto: CUDA when onnxruntime-gpu and a GPU are present, else CPU.",
    )
    intra_op_threads: int = Field(
        default=0,
        ge=0,
        description="onnxruntime intra-op threads per inference call; 0 lets the tier pick from its cores: "
        "batch workers cores / workers, the server cores / (server processes x inference threads), at least 1 "
        "(1 with the server's defaults: its inference threads, one per core, give the parallelism, and a small "
        "model's call is slower on 2 threads than on 1).",
    )
    spinning: bool = Field(
        default=False,
        description="Let onnxruntime's idle intra-op threads spin (busy-wait) for the next call. Off by default: "
        "a spinning thread takes a core from the event loop, the reader and the writer beside it.",
    )
    cache_capacity: int = Field(
        default=8,
        ge=1,
        # SHARDLINE_ONLINE_MAX_LOADED_MODELS: the online tier's former name of this setting (deprecated)
        validation_alias=AliasChoices(
            "SHARDLINE_RUNTIME_CACHE_CAPACITY", "SHARDLINE_ONLINE_MAX_LOADED_MODELS", "cache_capacity"
        ),
        description="Loaded models the process's model cache keeps (LRU), in batch workers and the server alike "
        "(SHARDLINE_RUNTIME_CACHE_CAPACITY; the deprecated SHARDLINE_ONLINE_MAX_LOADED_MODELS is read when it "
        "is unset).",
    )


class VllmSettings(BaseSettings):
    """Where the ``vllm`` runtime finds vLLM: a server that runs, or an environment to start one from."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_VLLM_", extra="ignore")

    url: str | None = Field(
        default=None, description="Base URL of a running vLLM OpenAI server (http://vllm:8000) whose served model "
        "name is the bundle's name; set: nothing is started.",
    )
    python: str | None = Field(
        default=None, description="The Python of an environment where vLLM is installed (vLLM pins an older fastapi "
        "than Prefect, so it never shares Shardline's): the runtime starts vLLM's server with it for each model.",
    )
    args: list[str] = Field(
        default_factory=list, description="More arguments for the vLLM server it starts, as JSON "
        "('[\"--gpu-memory-utilization\", \"0.9\"]').",
    )
    start_timeout_s: float = Field(default=600.0, gt=0, description="Seconds a started vLLM server may take to be healthy.")
    api_key: str | None = Field(default=None, description="The key the vLLM server wants (its --api-key), if any.")
    device: Literal["cuda", "cpu"] = Field(default="cuda", description="Where the vLLM build runs: its wheels are CUDA builds.")
    log_dir: str = Field(
        default_factory=lambda: str(Path(tempfile.gettempdir()) / "shardline-vllm"),
        description="Folder for the logs of the vLLM servers it starts.",
    )


class DaskSettings(BaseSettings):
    """Which Dask cluster the batch flow runs its shards on."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_DASK_", extra="ignore")

    cluster: Literal["local", "address", "kubernetes"] = Field(
        default="local",
        description="local: a LocalCluster in this process; address: an existing "
        "scheduler; kubernetes: a dask-kubernetes cluster from a spec file.",
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
        description="Path of a DaskCluster spec (YAML) for cluster=kubernetes.",
    )
    kubernetes_workers: int = Field(
        default=2, ge=0, description="Workers to scale a kubernetes cluster to."
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
        "run, detached, and reused by later runs (their UI shows every run; `shardline server stop` stops it); "
        "temporary: Prefect's temporary server inside each run (seconds per run, nothing left running). "
        "A PREFECT_API_URL, set by you, always wins.",
    )
    start_timeout_s: float = Field(
        default=120.0, gt=0, description="How long a run waits for the local server it started to answer."
    )


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


class PlacementSettings(BaseSettings):
    """Prices the placement decision weighs measured profiles with (see docs/placement.md)."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_PLACEMENT_", extra="ignore")

    costs_per_hour: dict[str, float] = Field(
        default_factory=lambda: {"cpu": 0.20, "cuda": 4.00, "cuda-nvidia-h200-mig": 0.60},
        description="Machine kind (or a prefix of it, longest wins) -> price of one device per hour (JSON).",
    )


class DriftSettings(BaseSettings):
    """Drift checks over captured data, and the flows that answer them (see docs/drift.md)."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_DRIFT_", extra="ignore")

    window_hours: float = Field(
        default=24.0, gt=0, description="How far back a drift check reads captured rows when no window is given."
    )
    contract_sample_rows: int = Field(
        default=10_000, ge=1, description="Newest captured rows checked against the model's data contract per check."
    )
    reports_url: str | None = Field(
        default=None,
        description="fsspec URL where drift reports are kept, one JSON per check (their history); "
        "defaults to <home>/drift.",
    )
    labelled_url: str | None = Field(
        default=None,
        description="fsspec URL of fresh labelled data for re-validation: <url>/<model>/ holds Parquet with the "
        "model's inputs and its evaluation's label column.",
    )


class ModelServing(BaseModel):
    """Per-model overrides of the online tier's defaults (any field left out keeps the default)."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int | None = Field(default=None, ge=1, description="Rows per batch at most.")
    max_batch_wait_ms: float | None = Field(
        default=None, ge=0, le=10_000, description="How long the oldest queued request may wait for a fuller batch."
    )
    queue_capacity: int | None = Field(default=None, ge=1, description="Requests queued for the model at most.")
    idle_timeout_s: float | None = Field(
        default=None, ge=0, description="Unload the model after this many idle seconds; 0 keeps it loaded."
    )


class OnlineSettings(BaseSettings):
    """The HTTP tier: where it listens, how it batches, sheds and scales to zero.

    Who may call it is the tenants file (``TenancySettings.tenants_file``, shared with batch jobs);
    how many models it keeps loaded is the model cache's ``RuntimeSettings.cache_capacity``.
    """

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_ONLINE_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=8000, ge=0, le=65_535, description="TCP port to listen on (0 picks a free one).")
    fd: int | None = Field(
        default=None, ge=0,
        description="A bound TCP socket this process inherited (its file descriptor), served instead of host and "
        "port: how a supervisor that binds the port itself hands it over (`shardline router --local-replicas` "
        "does, so that no other process can take the port first). Unset: bind host:port.",
    )
    max_batch_size: int = Field(
        default=64, ge=1, description="Rows per batch at most, for models without a profile or an override."
    )
    max_batch_wait_ms: float = Field(
        default=0.0,
        ge=0,
        le=10_000,
        description="How long the oldest queued request may wait for a fuller batch while the model is idle; "
        "0 sends what is queued at once (batches still form while the model is busy).",
    )
    batch_latency_budget_ms: float = Field(
        default=10.0,
        gt=0,
        description="With a measured profile, the largest batch size whose p99 fits this budget is the default.",
    )
    max_concurrent_batches: int = Field(
        default=0, ge=0, description="Batches of one model running at once; 0: one per inference thread (a slow "
        "model's batches then use every core, each on one intra-op thread; a model fast enough to run on the event "
        "loop runs one batch at a time there whatever this is)."
    )
    queue_capacity: int = Field(
        default=256,
        ge=1,
        description="Requests queued per model; low priority is shed at half of it, normal at 80%, high when full.",
    )
    idle_timeout_s: float = Field(
        default=300.0, ge=0, description="Unload a model idle this long (scale to zero); 0 keeps models loaded."
    )
    reap_interval_s: float = Field(default=1.0, gt=0, description="How often idle models are looked for.")
    alias_refresh_s: float = Field(
        default=5.0, ge=0, description="How long an alias's version is trusted before the registry is read again "
        "(in the background: requests keep the known version meanwhile); 0: read it for every request."
    )
    inference_threads: int = Field(
        default=0, ge=0, description="Threads that run inference off the event loop; 0 picks one per core."
    )
    capture_rate: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Fraction of requests whose rows and answers are captured to Parquet under the storage's "
        "capture URL (for drift checks): 0 is off, 0.01 one request in a hundred, 1 all. Written by a background "
        "thread per model version, never on a request's path; samples are dropped, not queued, if the store "
        "falls behind.",
    )
    workers: int = Field(
        default=1,
        ge=0,
        le=64,
        description="Server processes sharing the port (0: one per core). Each holds 1/N of every tenant's rate, "
        "burst and max_concurrent (rounded up) and its own copy of the models; /metrics sums all of them.",
    )
    inline_max_ms: float = Field(
        default=0.5,
        ge=0,
        le=100,
        description="A loaded model whose measured time for a batch is under this is run on the event loop "
        "(no thread hand-off: the fastest path for small models); slower ones, and loading, always go to "
        "the inference threads. 0 sends every batch to the threads.",
    )
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="Largest request body, compressed and decompressed."
    )
    offload_min_bytes: int = Field(
        default=256 * 1024,
        ge=0,
        description="Request bodies at least this large (decompressed; a compressed one from a 32nd of it) are "
        "decompressed and decoded, and answers this large encoded and gzipped, on the codec threads instead of "
        "the event loop (zlib and numpy let the loop answer others meanwhile; a JSON parse still holds the GIL "
        "while it runs); smaller ones stay on the loop (a hand-off costs more). 0 sends every body to the threads.",
    )
    queue_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=1,
        description="Bytes of decoded rows queued per model at most (besides queue_capacity requests); low "
        "priority is shed at half of it, normal at 80%, high when full (503 with Retry-After). A request alone "
        "in the queue is always taken.",
    )
    models: dict[str, ModelServing] = Field(
        default_factory=dict,
        description='Per-model overrides (JSON), e.g. {"minilm": {"max_batch_size": 16, "idle_timeout_s": 60}}.',
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="Log level.")
    access_log: bool = Field(default=True, description="Write one JSON line per request.")
    # -- what a connection may hold (per server process; see online/limits.py) --
    max_header_bytes: int = Field(
        default=64 * 1024, ge=1024, le=1024 * 1024,
        description="Largest request head (request line and headers), in bytes; a larger one is answered 431 "
        "and the connection closed.",
    )
    max_headers: int = Field(default=100, ge=8, le=1000, description="Most header fields in one request (else 431).")
    header_timeout_s: float = Field(
        default=10.0, gt=0, le=300,
        description="A new connection must send its first request's whole head within this (slow or silent "
        "clients are answered 408 and closed).",
    )
    body_timeout_s: float = Field(
        default=60.0, gt=0, le=3600,
        description="A request's whole body must arrive within this of its head (else 408 and the connection "
        "closed).",
    )
    keep_alive_s: float = Field(
        default=5.0, gt=0, le=300,
        description="An idle keep-alive connection is closed after this; the next request's whole head must "
        "arrive within it.",
    )
    max_connections: int = Field(
        default=0, ge=0,
        description="Open connections per server process; at the cap the longest-waiting idle one is closed for "
        "a new one, or the new one is answered 503 when all are busy. 0: derived from the open-file limit "
        "(ulimit -n less an eighth, at most 4096).",
    )
    max_in_flight: int = Field(
        default=0, ge=0,
        description="Requests being answered at once per server process; more are answered 503 with Retry-After "
        "(health checks never are). 0: three quarters of max_connections.",
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        description="Address of the Prometheus /metrics listener (its own port; the main port has no /metrics).",
    )
    metrics_port: int = Field(
        default=8002, ge=0, le=65_535,
        description="Port of the /metrics listener (8002, as Triton's); 0 or 'off': no metrics listener.",
    )
    metrics_fd: int | None = Field(
        default=None, ge=0,
        description="A bound TCP socket this process inherited, served as the /metrics listener instead of "
        "metrics_host and metrics_port (as fd is for the main listener).",
    )

    @field_validator("metrics_port", mode="before")
    @classmethod
    def _metrics_off(cls, value: Any) -> Any:
        return port_or_off(value)

    @field_validator("models")
    @classmethod
    def _model_names(cls, value: dict[str, ModelServing]) -> dict[str, ModelServing]:
        from shardline.bundle import check_model_name

        for name in value:
            check_model_name(name)
        return value

    def resolved_workers(self) -> int:
        """Server processes, with 0 meaning one per core."""
        return self.workers or max(1, os.cpu_count() or 1)

    def resolved_threads(self) -> int:
        """Inference threads, with 0 meaning one per core."""
        return self.inference_threads or max(1, os.cpu_count() or 1)

    def resolved_concurrent_batches(self) -> int:
        """Batches of one model running at once, with 0 meaning one per inference thread."""
        return self.max_concurrent_batches or self.resolved_threads()

    def resolved_intra_op_threads(self, requested: int) -> int:
        """onnxruntime intra-op threads per inference call in the server: ``requested``
        (``RuntimeSettings.intra_op_threads``) when set, else the cores left to each inference
        thread, cores / (server processes x inference threads), at least 1.

        With the defaults (one process, one inference thread per core, as many batches of a
        model at once as threads) that is 1: the threads, and the event loop running small
        models inline, already use every core, and a second intra-op thread only adds a
        hand-off to each call. Measured on 2 cores: one row of the breast-cancer GBT took
        23 us on one thread, 40 us on two, and the server's CPU per request was ~1.1-1.3x on
        two; MiniLM at 120 requests/s, p50 16 ms on one thread with two batches at once,
        30 ms on two threads with one batch at a time, 42 ms on one thread with one batch.
        """
        if requested:
            return requested
        cores = max(1, os.cpu_count() or 1)
        return max(1, cores // (self.resolved_workers() * self.resolved_threads()))


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
    metrics_port: int = Field(
        default=8082, ge=0, le=65_535, description="Port of the router's /metrics listener; 0 or 'off': none."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="Log level.")

    @field_validator("metrics_port", mode="before")
    @classmethod
    def _metrics_off(cls, value: Any) -> Any:
        return port_or_off(value)
