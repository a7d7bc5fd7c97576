"""Runtimes: how a bundle becomes a loaded model. Found by name, imported lazily."""

from __future__ import annotations

import importlib
from pathlib import Path

from shardline.bundle import Manifest
from shardline.errors import InvalidBundle, RuntimeUnavailable
from shardline.runtimes.base import Runtime, RuntimeOptions

# name -> (module, class, the extra that installs what it needs)
KNOWN_RUNTIMES: dict[str, tuple[str, str, str]] = {
    "onnx": ("shardline.runtimes.onnx", "OnnxModel", "pip install 'shardline[cpu]' (or [gpu])"),
    # A bundle's own Python class (custom code): what it needs is what its requirements list.
    "python": ("shardline.runtimes.custom", "CustomCodeModel", "install the packages its requirements list"),
    # vLLM runs in an environment of its own; this process needs only the tokenizer and an HTTP client.
    "vllm": ("shardline.runtimes.vllm", "VllmModel", "pip install 'shardline[llm]'"),
    # A causal LM on CPU with continuous batching (shardline.generation): torch, safetensors, tokenizers.
    "llm": ("shardline.runtimes.llm", "LlmModel", "pip install 'shardline[llm]'"),
}

__all__ = ["KNOWN_RUNTIMES", "Runtime", "RuntimeOptions", "create_runtime"]


def create_runtime(bundle_dir: Path, manifest: Manifest, options: RuntimeOptions) -> Runtime:
    """Make the (not yet loaded) runtime that the manifest names.

    Raises:
        InvalidBundle: the manifest names a runtime Shardline does not know.
        RuntimeUnavailable: the runtime's packages are not installed.
    """
    try:
        module_name, class_name, extra = KNOWN_RUNTIMES[manifest.runtime]
    except KeyError as e:
        raise InvalidBundle(
            f"{manifest.reference} asks for runtime {manifest.runtime!r}; known runtimes "
            f"are {sorted(KNOWN_RUNTIMES)}"
        ) from e
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RuntimeUnavailable(
            f"runtime {manifest.runtime!r} needs a package that is not installed ({e.name}); "
            f"{extra}"
        ) from e
    cls: type[Runtime] = getattr(module, class_name)
    return cls(bundle_dir, manifest, options)
