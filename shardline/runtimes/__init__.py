"""Runtimes: how a bundle becomes a loaded model. Found by name, imported lazily."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from shardline.bundle import Manifest
from shardline.errors import InvalidBundle, NotInstalled
from shardline.runtimes.base import Runtime, RuntimeOptions


@dataclass(frozen=True)
class RuntimeEntry:
    """Where a runtime lives and what it needs, found without importing it.

    Attributes:
        module: the module that holds the runtime class.
        class_name: the ``Runtime`` subclass in that module.
        extra: what to install when one of its packages is missing (the error message says it).
        generates: its models generate text: the class is a ``GeneratingRuntime``, with an ``engine`` for token
            streams, and the OpenAI text-generation endpoints call it.
    """

    module: str
    class_name: str
    extra: str
    generates: bool = False


KNOWN_RUNTIMES: dict[str, RuntimeEntry] = {
    "onnx": RuntimeEntry("shardline.runtimes.onnx", "OnnxModel", "pip install 'shardline[cpu]' (or [gpu])"),
    # A bundle's own Python class (custom code): what it needs is what its requirements list.
    "python": RuntimeEntry("shardline.runtimes.custom", "CustomCodeModel", "install the packages its requirements list"),
    # vLLM runs in an environment of its own; this process needs only the tokenizer and an HTTP client.
    "vllm": RuntimeEntry("shardline.runtimes.vllm", "VllmModel", "pip install 'shardline[llm]'", generates=True),
    # A causal LM on CPU with continuous batching (shardline.runtimes.generation): torch, safetensors, tokenizers.
    "llm": RuntimeEntry("shardline.runtimes.llm", "LlmModel", "pip install 'shardline[llm]'", generates=True),
}

__all__ = ["KNOWN_RUNTIMES", "Runtime", "RuntimeEntry", "RuntimeOptions", "create_runtime", "generates"]


def generates(runtime: str) -> bool:
    """Whether the models of a runtime (by name) generate text; False for a runtime Shardline does not know."""
    entry = KNOWN_RUNTIMES.get(runtime)
    return entry is not None and entry.generates


def create_runtime(bundle_dir: Path, manifest: Manifest, options: RuntimeOptions) -> Runtime:
    """Make the (not yet loaded) runtime that the manifest names.

    Raises:
        InvalidBundle: the manifest names a runtime Shardline does not know.
        NotInstalled: the runtime's packages are not installed.
    """
    try:
        entry = KNOWN_RUNTIMES[manifest.runtime]
    except KeyError as e:
        raise InvalidBundle(
            f"{manifest.reference} asks for runtime {manifest.runtime!r}; known runtimes "
            f"are {sorted(KNOWN_RUNTIMES)}"
        ) from e
    try:
        module = importlib.import_module(entry.module)
    except ImportError as e:
        raise NotInstalled(
            f"runtime {manifest.runtime!r} needs a package that is not installed ({e.name}); "
            f"{entry.extra}"
        ) from e
    cls: type[Runtime] = getattr(module, entry.class_name)
    return cls(bundle_dir, manifest, options)
