"""The ``llm`` runtime: a causal LM on CPU, for development, tests and batch generation of small models.

It runs a bundle as ``shardline.build.llm_build.package_tiny_llm`` writes it (a Hugging Face Llama checkpoint,
``tokenizer.json``, ``generation_config.json``) through one CPU engine
(``shardline.runtimes.generation.engine.GenerationEngine``): continuous batching over a static slot
cache, in a thread of its own. ``predict`` (batch generation over the ``prompt`` column) and ``engine``
(for the HTTP tier's streams) are every generating runtime's: ``GeneratingRuntime``.

runtime_config: ``max_batch`` (slots decoded together, 16), ``max_context`` (tokens per slot, prompt
and completion, 512), ``chat_template`` (``{"message": "{role}: {content}\\n", "reply": "assistant:"}``)
and the generation settings ``max_tokens``, ``temperature``, ``top_p``, ``seed`` and ``stop``. torch,
safetensors and tokenizers are imported at ``load`` (``pip install 'shardline[llm]'``).
"""

from __future__ import annotations

from shardline.errors import RuntimeUnavailable
from shardline.runtimes.generation import EngineConfig
from shardline.runtimes.generation.engine import GenerationEngine
from shardline.runtimes.generation.runtime import GeneratingRuntime


class LlmModel(GeneratingRuntime):
    """A causal LM on the CPU engine (see the module docstring)."""

    def load(self) -> None:
        """Check the settings, load tokenizer and weights, and start the engine thread.

        Raises:
            RuntimeUnavailable: torch, safetensors or tokenizers is missing, or a device other than the CPU
                is asked for.
            InvalidBundle: a file is missing or unreadable (named), or a runtime_config value is out of range.
        """
        reference = self.manifest.reference
        device = self._device(reference)
        config = EngineConfig.from_runtime_config(self.manifest.runtime_config, reference)
        engine = GenerationEngine(self.bundle_dir, config, threads=self.options.intra_op_threads, device=device)
        engine.start()
        self._use(engine)

    def _device(self, reference: str) -> str:
        """'cuda' where torch sees a GPU and the settings allow it ('auto' or 'cuda'), else 'cpu'.

        Raises:
            RuntimeUnavailable: 'cuda' was asked for and torch sees no GPU.
        """
        asked = self.options.device
        if asked == "cpu":
            return "cpu"
        try:
            import torch
        except ImportError:
            return "cpu"  # the engine's start says which package to install
        if torch.cuda.is_available():
            return "cuda"
        if asked == "cuda":
            raise RuntimeUnavailable(f"{reference}: device 'cuda' was asked for, but torch sees no GPU "
                                     f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); install "
                                     "a CUDA build of torch on a GPU machine, or serve with device 'cpu' or 'auto'")
        return "cpu"

    @property
    def device(self) -> str:
        """Where the engine runs once loaded: 'cpu' or 'cuda'."""
        engine = self._engine
        if engine is None:
            return "unloaded"
        return "cuda" if str(getattr(engine, "device", "cpu")).startswith("cuda") else "cpu"


__all__ = ["LlmModel"]
