"""How a bundle runs: device, threads, precision; vLLM's own server."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


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
