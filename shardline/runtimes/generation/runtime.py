"""``GeneratingRuntime``: the runtime contract for a model that generates text, over its ``Engine``.

What the ``llm`` runtime (``shardline.runtimes.llm``: the CPU engine) and the ``vllm`` runtime
(``shardline.runtimes.vllm``: vLLM's server) share; each adds its ``load``, which starts its engine and
hands it to ``_use``, and its ``device``.

- ``predict(rows)`` is batch generation: the ``prompt`` column in; ``completion``, ``prompt_tokens`` and
  ``completion_tokens`` out, one row per prompt. All rows go to the engine at once
  (``generate_many``), so a batch shares its decode steps. A prompt that is a JSON list of chat
  messages (``[{"role": "user", "content": "..."}]``: a list of objects that all have a ``role``) goes
  through the bundle's chat template; any other text is the prompt as it is. Generation is greedy with
  the bundle's ``generation_config.json`` ``max_new_tokens`` unless runtime_config sets ``max_tokens``,
  ``temperature``, ``top_p``, ``seed`` or ``stop``; greedy (or a fixed seed) gives a row the same
  completion alone as in any batch.
- ``engine`` is the running engine, for the HTTP tier's streams (``submit`` with its own
  ``SamplingParams``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, overload

import pyarrow as pa

from shardline.bundle import Manifest
from shardline.errors import ContextLengthExceeded, InvalidBundle, InvalidInput, InvalidParameter
from shardline.rows import Rows, check_rows
from shardline.runtimes.base import Answer, Runtime, RuntimeOptions
from shardline.runtimes.generation import Engine, SamplingParams

PROMPT_COLUMN = "prompt"
_GENERATION_SETTINGS = ("max_tokens", "temperature", "top_p", "seed", "stop")


class GeneratingRuntime(Runtime):
    """A text-generating model behind the rows contract, with its engine for streams (see the module docstring).

    A subclass's ``load`` makes and starts its engine and calls ``_use(engine)``; ``close`` closes the engine.
    """

    def __init__(self, bundle_dir: Path, manifest: Manifest, options: RuntimeOptions) -> None:
        super().__init__(bundle_dir, manifest, options)
        self._engine: Engine | None = None
        self._params: SamplingParams | None = None

    def _use(self, engine: Engine) -> None:
        """Take a started engine and the bundle's default sampling; close the engine when those are refused.

        Raises:
            InvalidBundle: a runtime_config generation setting is out of range.
        """
        try:
            self._params = self._default_params(engine)
        except BaseException:
            engine.close()
            raise
        self._engine = engine

    def _default_params(self, engine: Engine) -> SamplingParams:
        """Greedy, ``max_new_tokens`` of the generation config, and what runtime_config overrides."""
        config = self.manifest.runtime_config
        values: dict[str, Any] = {"max_tokens": engine.generation_defaults.get("max_new_tokens", 16),
                                  "temperature": 0.0}
        values.update({name: config[name] for name in _GENERATION_SETTINGS if name in config})
        if isinstance(values.get("stop"), list):
            values["stop"] = tuple(values["stop"])
        try:
            return SamplingParams(**values)
        except InvalidParameter as e:
            raise InvalidBundle(f"{self.manifest.reference}: runtime_config {e.param}: {e}; re-package the model "
                                "with a valid value") from e

    @property
    def engine(self) -> Engine:
        """The running generation engine (for token streams).

        Raises:
            RuntimeError: before ``load()`` or after ``close()``.
        """
        if self._engine is None:
            raise RuntimeError(f"the {self.manifest.runtime} runtime's engine is asked for before load() or after "
                               "close()")
        return self._engine

    @overload
    def predict(self, rows: Rows) -> Answer: ...

    @overload
    def predict(self, rows: pa.RecordBatch | pa.Table) -> pa.RecordBatch: ...

    def predict(self, rows: pa.RecordBatch | pa.Table | Rows) -> Answer:
        """Generate one completion per prompt, all prompts batched together (see the module docstring).

        Raises:
            InvalidInput: the ``prompt`` column is missing or not text, or a prompt is too long (the row is named).
            InferenceFailed: the engine failed.
        """
        engine, params = self._engine, self._params
        if engine is None or params is None:
            raise RuntimeError("predict() before load() or after close()")
        reference = self.manifest.reference
        checked = rows if isinstance(rows, Rows) else check_rows(rows, self.manifest.signature, reference)
        prompts = checked.table().column(PROMPT_COLUMN).to_pylist()
        ids = [self._prompt_ids(engine, text, row) for row, text in enumerate(prompts)]
        completions = engine.generate_many(ids, params)
        return pa.RecordBatch.from_arrays(
            [pa.array([c.text for c in completions], pa.string()),
             pa.array([c.prompt_tokens for c in completions], pa.int64()),
             pa.array([c.completion_tokens for c in completions], pa.int64())],
            schema=self.manifest.signature.plan.output_schema,
        )

    def _prompt_ids(self, engine: Engine, text: str, row: int) -> list[int]:
        """A row's prompt tokens: chat messages through the template, any other text as it is."""
        messages = _chat_messages(text)
        try:
            prompt = engine.chat_prompt(messages) if messages is not None else text
        except InvalidInput as e:
            raise InvalidInput(f"row {row} of column {PROMPT_COLUMN!r} is a list of chat messages, but {e}") from e
        ids = engine.tokenize(prompt)
        try:
            return engine.check_prompt(ids)
        except ContextLengthExceeded as e:
            raise ContextLengthExceeded(
                f"row {row} of column {PROMPT_COLUMN!r} is {e.prompt_tokens} tokens; {self.manifest.reference} takes "
                f"prompts of at most {e.most} tokens (its context of {e.most + 1} less one for the completion); "
                "shorten it", e.prompt_tokens, e.most) from e

    def close(self) -> None:
        """Close the engine (twice is harmless)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()


def _chat_messages(text: str) -> list[dict[str, Any]] | None:
    """The messages of a prompt that is a JSON list of objects that all have a ``role``, else None."""
    if not text.lstrip().startswith("["):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        return value
    return None


__all__ = ["PROMPT_COLUMN", "GeneratingRuntime"]
