"""What every engine does alike: the base of the CPU engine (``engine.py``) and of the vLLM runtime's.

An engine serves one causal LM bundle (a Hugging Face checkpoint folder). Whatever computes the tokens
(torch in this process, or vLLM's server), the bundle's text side is done here, once:

- ``read_bundle_text`` (``start`` calls it): ``tokenizer.json`` without padding or truncation, the
  beginning- and end-of-sequence tokens and the defaults of ``generation_config.json`` (else
  ``config.json``), and the vocabulary size of ``config.json``;
- ``tokenize`` (the beginning-of-sequence token first), ``detokenize``, ``chat_prompt`` (the bundle's
  chat template) and ``max_prompt_tokens``;
- the one prompt check (``check_prompt``: not empty, within the context, ids in the vocabulary), which
  ``submit`` and ``generate_many`` apply before anything is queued or sent: a refused prompt of a
  batch leaves the others unsent too;
- ``generate`` as ``generate_many`` of one prompt, and ``generate_many`` as ``run_together``.

A subclass implements ``start`` and ``close``, ``stats``, and two hooks: ``_check_running`` (raise
unless requests may be submitted now) and ``_enqueue`` (send checked prompts, return their handles).
With those it is an ``Engine`` (``shardline.runtimes.generation``).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from shardline.errors import InvalidBundle
from shardline.runtimes.generation import RequestHandle
from shardline.runtimes.generation.requests import (
    Completion,
    EngineConfig,
    SamplingParams,
    TokenEvent,
    check_prompt,
    run_together,
)

LLM_EXTRA = "pip install 'shardline[llm]'"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"

Request = tuple[list[int], Callable[[TokenEvent], None]]
"""A checked prompt and the ``on_event`` its events go to."""


class EngineBase(ABC):
    """The text side every engine shares and the request flow around its two hooks (see the module docstring).

    Args:
        model_dir: the bundle folder.
        config: slots, context length and chat template.
    """

    def __init__(self, model_dir: Path, config: EngineConfig) -> None:
        self.model_dir = Path(model_dir)
        self.config = config
        self.generation_defaults: dict[str, Any] = {}
        self.bos_token_id: int | None = None
        self.eos_token_ids: frozenset[int] = frozenset()
        self.vocab_size: int | None = None
        self._tokenizer: Any = None

    # -- what a subclass implements -------------------------------------------------------------

    @abstractmethod
    def start(self) -> None:
        """Read the bundle (``read_bundle_text`` among it) and get ready to generate."""

    @abstractmethod
    def close(self) -> None:
        """End what runs (each request hears "cancelled") and release what ``start`` took; twice is harmless."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """For metrics: at least ``slots_busy`` (requests running now) and ``tokens_generated`` (so far)."""

    @abstractmethod
    def _check_running(self) -> None:
        """Raise unless requests may be submitted now (RuntimeError before ``start`` or after ``close``)."""

    @abstractmethod
    def _enqueue(self, requests: list[Request], params: SamplingParams) -> Sequence[RequestHandle]:
        """Queue or send checked prompts together; their handles, in order."""

    # -- the bundle's text ----------------------------------------------------------------------

    def read_bundle_text(self, tokenizer_class: Any) -> None:
        """Read the tokenizer (a ``tokenizers.Tokenizer`` class), the special tokens, the generation defaults
        and the vocabulary size.

        Raises:
            InvalidBundle: a file is missing or unreadable (the message names it).
        """
        self._tokenizer = read_tokenizer(tokenizer_class, self.model_dir / TOKENIZER_FILE)
        self.generation_defaults = read_generation_config(self.model_dir / GENERATION_CONFIG_FILE)
        path = self.model_dir / CONFIG_FILE
        try:
            raw = json.loads(path.read_text())
            if not isinstance(raw, dict):
                raise ValueError("not an object")
        except (OSError, ValueError) as e:
            raise InvalidBundle(f"{CONFIG_FILE} at {path} is not a readable JSON object ({e}); re-package the "
                                "model") from e
        eos = self.generation_defaults.get("eos_token_id", raw.get("eos_token_id"))
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or [])
        bos = self.generation_defaults.get("bos_token_id", raw.get("bos_token_id"))
        self.bos_token_id = bos[0] if isinstance(bos, list) and bos else bos if isinstance(bos, int) else None
        vocab = raw.get("vocab_size")
        self.vocab_size = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt accepted: the context less one token for the completion."""
        return self.config.max_context - 1

    def tokenize(self, text: str) -> list[int]:
        """A prompt's token ids: the beginning-of-sequence token, then the text's tokens."""
        ids = self._text_tokenizer().encode(text, add_special_tokens=False).ids
        return ids if self.bos_token_id is None else [self.bos_token_id, *ids]

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of token ids, special tokens left out."""
        return str(self._text_tokenizer().decode(list(ids), skip_special_tokens=True))

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt text for chat messages, through the bundle's chat template (``ChatTemplate.render``)."""
        return self.config.chat_template.render(messages)

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt as ``submit`` takes it, or the error that refuses it (``requests.check_prompt``, with the
        vocabulary once started)."""
        return check_prompt(prompt_ids, self.config.max_context, self.vocab_size)

    def _text_tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise RuntimeError("tokenize() or detokenize() before start()")
        return self._tokenizer

    # -- requests -------------------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               on_event: Callable[[TokenEvent], None]) -> RequestHandle:
        """Queue a request; ``on_event`` is then called from the engine's thread (or its event loop: see ``Engine``)
        for each piece and once with a ``finish_reason`` (keep it cheap; it may call the handle's ``cancel``).

        Raises:
            ContextLengthExceeded: the prompt is longer than ``max_prompt_tokens`` (the message says both).
            InvalidInput: the prompt is empty or holds an id outside the vocabulary.
            InferenceFailed: the engine stopped on an error.
            RuntimeError: the engine is not started or is closed.
        """
        self._check_running()
        return self._enqueue([(self.check_prompt(prompt_ids), on_event)], params)[0]

    def generate_many(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """Queue every prompt at once (so they share what the engine batches) and wait for all their completions.

        Raises:
            InvalidInput: a prompt is refused (nothing is queued or sent then).
            InferenceFailed: the engine failed while generating.
        """
        if not prompts:
            return []
        self._check_running()
        checked = [self.check_prompt(prompt) for prompt in prompts]  # refuse a bad prompt before any is queued
        return run_together(len(checked), lambda callbacks: self._enqueue(list(zip(checked, callbacks)), params))

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        """Generate one completion and wait for it (``submit`` with the events joined)."""
        return self.generate_many([prompt_ids], params)[0]


def read_tokenizer(tokenizer_class: Any, path: Path) -> Any:
    """A bundle's ``tokenizer.json`` (``tokenizers.Tokenizer``), without padding or truncation; InvalidBundle if unreadable."""
    try:
        tokenizer = tokenizer_class.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception subclass
        raise InvalidBundle(f"{TOKENIZER_FILE} at {path} is not a readable tokenizer ({e}); re-fetch the bundle "
                            "or package it again") from e
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def read_generation_config(path: Path) -> dict[str, Any]:
    """A bundle's ``generation_config.json`` ({} when there is none); InvalidBundle if it is not a JSON object."""
    if not path.exists():
        return {}
    try:
        values = json.loads(path.read_text())
        if not isinstance(values, dict):
            raise ValueError("not an object")
        return values
    except (OSError, ValueError) as e:
        raise InvalidBundle(f"{GENERATION_CONFIG_FILE} at {path} is not a JSON object ({e}); "
                            "re-package the model") from e


__all__ = ["CONFIG_FILE", "GENERATION_CONFIG_FILE", "LLM_EXTRA", "TOKENIZER_FILE", "EngineBase", "Request",
           "read_generation_config", "read_tokenizer"]
