"""The HTTP tier (`shardline serve`): connections, batching, scale to zero, capture, metrics."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, WrapValidator, \
    field_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict


def port_or_off(value: Any) -> Any:
    """A metrics port setting as given, with "off", "none", "false" or "" meaning 0 (no listener)."""
    return 0 if isinstance(value, str) and value.strip().lower() in ("off", "none", "false", "") else value


def _metrics_port(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A metrics port (``port_or_off``); a refusal says what a port is and that 0 or 'off' turns the listener off."""
    try:
        return handler(port_or_off(value))
    except ValidationError as e:
        problem = e.errors()[0]["msg"] if e.errors() else str(e)
        raise PydanticCustomError(
            "metrics_port", "{problem}; give a port from 1 to 65535, or 0 or 'off' for no metrics listener",
            {"problem": problem},
        ) from None


# The port of a /metrics listener: 0 (or "off", "none", "false", "") means none.
MetricsPort = Annotated[int, Field(ge=0, le=65_535), WrapValidator(_metrics_port)]


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
    metrics_port: MetricsPort = Field(
        default=8002,
        description="Port of the /metrics listener (8002, as Triton's); 0 or 'off': no metrics listener.",
    )
    metrics_fd: int | None = Field(
        default=None, ge=0,
        description="A bound TCP socket this process inherited, served as the /metrics listener instead of "
        "metrics_host and metrics_port (as fd is for the main listener).",
    )

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
        hand-off to each call (figures: bench/README.md, "Figures behind the code").
        """
        if requested:
            return requested
        cores = max(1, os.cpu_count() or 1)
        return max(1, cores // (self.resolved_workers() * self.resolved_threads()))
