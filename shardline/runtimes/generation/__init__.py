"""Text generation: the ``Engine`` contract that the HTTP tier and batch generation call, and what it speaks.

A model that generates text (a runtime whose registry entry says ``generates``: ``llm`` and ``vllm``) is a
``GeneratingRuntime`` (``runtime.py``): ``predict`` is batch generation over a ``prompt`` column, and its
``engine`` is an ``Engine``, for token streams. Two engines implement it, on one base (``base.py``: the
bundle's tokenizer, the chat template, the one prompt check):

- ``engine.GenerationEngine``: on CPU in this process, continuous batching over a static slot cache
  (``llama.py``: the Llama forward pass in plain torch), runtime ``llm``;
- ``shardline.runtimes.vllm.RemoteEngine``: over vLLM's OpenAI server, runtime ``vllm``.

The contract as tests: ``tests/engine_conformance.py``, mixed into each engine's tests.

This module is the face: the protocols, and the request types of ``requests.py`` (sampling parameters,
token events, completions, the engine's shape, ``check_prompt`` and ``run_together``). Importing it costs
nothing; torch, safetensors and tokenizers are imported when an engine starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from shardline.runtimes.generation.requests import (
    ChatTemplate,
    Completion,
    EngineConfig,
    FinishReason,
    SamplingParams,
    TokenEvent,
    check_prompt,
    run_together,
)


class RequestHandle(Protocol):
    """A submitted request."""

    def cancel(self) -> None:
        """Stop it: its place in the engine is free at once or soon after, and its ``on_event`` gets one last
        event with finish_reason "cancelled". Harmless after its end."""


class Engine(Protocol):
    """Generates text for many requests at once for one bundle; what both tiers call.

    Contract (``tests/engine_conformance.py`` checks it):
        - ``start()`` reads the bundle and gets ready (``RuntimeUnavailable``, ``InvalidBundle``); ``close()``
          ends every request still running with a "cancelled" event (twice is harmless); ``submit`` before
          ``start`` or after ``close`` is a ``RuntimeError``.
        - A prompt is token ids from ``tokenize`` (or ``chat_prompt`` then ``tokenize``); ``check_prompt``
          refuses an empty one (``InvalidInput``), one longer than ``max_prompt_tokens``
          (``ContextLengthExceeded``, with both lengths) and ids outside the vocabulary (``InvalidInput``),
          before anything is generated: ``submit`` and ``generate_many`` raise what it raises, and
          ``generate_many`` then queues none of its prompts.
        - ``submit`` calls ``on_event`` from another thread (or, for an engine whose requests run on an event loop,
          ``RemoteEngine`` submitted from a running loop, on that loop, never before ``submit`` returns) with the
          tokens as they come, in order, and
          exactly once with a ``finish_reason``, last: "stop" (end of sequence, or a stop string, whose text
          is left out), "length" (``max_tokens``, or the context is full), "cancelled" or "error". The
          events' texts add up to the completion; their ``completion_tokens`` grow to the tokens generated.
        - The same prompt, parameters and seed give the same tokens (greedy: always).
        - ``stats()`` holds at least ``slots_busy`` (requests running now) and ``tokens_generated``.
    """

    @property
    def config(self) -> EngineConfig:
        """Slots, context length and chat template."""

    @property
    def generation_defaults(self) -> Mapping[str, Any]:
        """The bundle's ``generation_config.json`` ({} without one)."""

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt accepted: the context less one token for the completion."""

    def start(self) -> None:
        """Read the bundle and get ready to generate."""

    def close(self) -> None:
        """End what runs ("cancelled") and release what ``start`` took; twice is harmless."""

    def tokenize(self, text: str) -> list[int]:
        """A prompt's token ids (the beginning-of-sequence token first, where the model has one)."""

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of token ids, special tokens left out."""

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt text for chat messages, through the bundle's chat template."""

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt as ``submit`` takes it, or the error that refuses it."""

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               on_event: Callable[[TokenEvent], None]) -> RequestHandle:
        """Start a request; its events go to ``on_event`` (see the contract)."""

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        """Generate one completion and wait for it."""

    def generate_many(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """Generate for every prompt at once and wait for all; the completions in the prompts' order."""

    def stats(self) -> dict[str, int]:
        """For metrics: at least ``slots_busy`` and ``tokens_generated``."""


__all__ = ["ChatTemplate", "Completion", "Engine", "EngineConfig", "FinishReason", "RequestHandle", "SamplingParams",
           "TokenEvent", "check_prompt", "run_together"]
