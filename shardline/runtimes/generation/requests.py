"""What a generation request is made of and what it gives back, the same for every engine: sampling
parameters, token events, completions, the chat template, the engine's shape, the one prompt check
(``check_prompt``), how much of a streamed text may be sent (``held_back``), and how a batch of requests
is run and waited for (``run_together``).

The package's face (``shardline.runtimes.generation``) re-exports what its callers need.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from shardline.errors import ContextLengthExceeded, InferenceFailed, InvalidBundle, InvalidInput, InvalidParameter

CHAT_ROLES = ("system", "developer", "user", "assistant")
MAX_STOP_STRINGS = 4
FinishReason = Literal["stop", "length", "cancelled", "error"]
_LAST_WORD = re.compile(r"\s+\S*\Z")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick a request's tokens, checked as OpenAI checks them.

    Attributes:
        max_tokens: completion tokens at most (also capped so that prompt and completion fit the context).
        temperature: 0 picks the most likely token (greedy); up to 2.
        top_p: sample only from the most likely tokens whose probabilities add up to ``top_p`` (0 to 1).
        seed: the same seed, prompt and model give the same text; None draws a random seed.
        stop: up to 4 strings (a single string, a list or None are taken too); the text ends before the
            first one that appears (it is not included).

    Raises:
        InvalidParameter: a field is out of range; its ``param`` names the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidParameter(f"max_tokens must be an integer of at least 1, got {self.max_tokens!r}",
                                   "max_tokens")
        for name, high in (("temperature", 2.0), ("top_p", 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= high:
                raise InvalidParameter(f"{name} must be between 0 and {high:g}, got {value!r}", name)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidParameter(f"seed must be an integer, got {self.seed!r}", "seed")
        given: Any = self.stop
        if given is not None and not isinstance(given, (str, list, tuple)):
            raise InvalidParameter(f"stop must be a string or a list of strings, got {given!r}", "stop")
        stop = () if given is None else (given,) if isinstance(given, str) else tuple(given)
        if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
            raise InvalidParameter(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings, "
                                   f"got {self.stop!r}", "stop")
        object.__setattr__(self, "stop", stop)


@dataclass(frozen=True)
class TokenEvent:
    """What a request's ``on_event`` gets after each token, and once at its end.

    Attributes:
        text: the text new since the previous event (may be empty while a word is held back).
        token_ids: the tokens new since the previous event (an end-of-sequence token included).
        finish_reason: None while it runs; then "stop" (end-of-sequence token or stop string),
            "length" (``max_tokens`` or the context is full), "cancelled" or "error".
        prompt_tokens: tokens in the prompt.
        completion_tokens: tokens generated so far.
        error: what went wrong, when ``finish_reason`` is "error".
        stop_reason: why a stream was stopped before the model's own end (a tenant's token quota ran out).
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    stop_reason: str | None = None


@dataclass(frozen=True)
class Completion:
    """A finished request: its whole text (the events' pieces joined), tokens and why it ended."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class ChatTemplate:
    """How chat messages become a prompt: each message is ``message`` with ``{role}`` and ``{content}``
    filled in, and ``reply`` follows the last one, e.g.::

        system: You are terse.
        user: Hello
        assistant:
    """

    message: str = "{role}: {content}\n"
    reply: str = "assistant:"

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt for a list of ``{"role": ..., "content": ...}`` messages.

        Raises:
            InvalidParameter: the list is empty, or a message has no known role or no text content.
        """
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise InvalidParameter("messages must be a non-empty list of {role, content} objects", "messages")
        lines = []
        for i, message in enumerate(messages):
            role = message.get("role") if isinstance(message, Mapping) else None
            if role not in CHAT_ROLES:
                # said as the request's own checks say it (shardline.openai_wire reads the same CHAT_ROLES)
                raise InvalidParameter(f"field 'messages[{i}].role' is {role!r}; this model's chat template takes one "
                                       f"of {sorted(CHAT_ROLES)}", f"messages[{i}].role")
            lines.append(self.message.replace("{role}", role).replace("{content}", _content(message, i)))
        return "".join(lines) + self.reply

    @classmethod
    def from_config(cls, value: Any, where: str) -> ChatTemplate:
        """Read ``runtime_config['chat_template']`` (``{"message": ..., "reply": ...}``; None: the default).

        Raises:
            InvalidBundle: it is not such an object, or ``message`` lacks ``{content}``.
        """
        if value is None:
            return cls()
        if (not isinstance(value, Mapping) or not isinstance(value.get("message", ""), str)
                or not isinstance(value.get("reply", ""), str) or "{content}" not in value.get("message", "{content}")):
            raise InvalidBundle(f"{where}: runtime_config chat_template must be "
                                f"{{'message': '{{role}}: {{content}}\\n', "
                                f"'reply': 'assistant:'}} (message holding {{content}}), got {value!r}")
        return cls(**{k: value[k] for k in ("message", "reply") if k in value})


def _content(message: Mapping[str, Any], i: int) -> str:
    content = message.get("content")
    if isinstance(content, list):  # OpenAI's content parts: only text ones
        if all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
    elif isinstance(content, str):
        return content
    raise InvalidParameter(f"messages[{i}].content must be a string or a list of text parts, got {content!r}",
                           f"messages[{i}].content")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's shape: slots decoded together, tokens per slot (prompt and completion), chat template."""

    max_batch: int = 16
    max_context: int = 512
    chat_template: ChatTemplate = field(default_factory=ChatTemplate)

    @classmethod
    def from_runtime_config(cls, config: Mapping[str, Any], where: str) -> EngineConfig:
        """Read ``max_batch``, ``max_context`` and ``chat_template`` from a manifest's runtime_config.

        Raises:
            InvalidBundle: a value is not a positive integer (``max_context`` at least 2) or the template is malformed.
        """
        values = {"max_batch": config.get("max_batch", 16), "max_context": config.get("max_context", 512)}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < (2 if name == "max_context" else 1):
                raise InvalidBundle(f"{where}: runtime_config {name} must be a positive integer"
                                    f"{' of at least 2' if name == 'max_context' else ''}, got {value!r}; "
                                    "re-package the model with a valid value")
        template = ChatTemplate.from_config(config.get("chat_template"), where)
        return cls(values["max_batch"], values["max_context"], template)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How much of a completion's text may be sent before it is finished: all but the last word (the
    next token may still change it) and any tail that could begin a stop string."""
    match = _LAST_WORD.search(text)
    end = match.start() if match else 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                end = min(end, len(text) - k)
                break
    return end


def check_prompt(prompt_ids: Sequence[int], max_context: int, vocab_size: int | None = None) -> list[int]:
    """A prompt's token ids as ints, checked as every engine checks them before anything is generated or sent:
    at least one token, at most ``max_context - 1`` (one is left for the completion), and, with ``vocab_size``,
    every id in the vocabulary. The HTTP tier calls it before a stream's first byte, so a refusal is a 400.

    Raises:
        ContextLengthExceeded: the prompt is longer than the context leaves room for.
        InvalidInput: the prompt is empty or holds an id outside the vocabulary.
    """
    prompt = [int(i) for i in prompt_ids]
    most = max_context - 1
    if not prompt:
        raise InvalidInput("the prompt has no tokens; send some text")
    if len(prompt) > most:
        raise ContextLengthExceeded(f"the prompt is {len(prompt)} tokens; this model takes at most {most} (its context "
                                    f"of {max_context} less one for the completion); shorten it", len(prompt), most)
    if vocab_size is not None and any(not 0 <= i < vocab_size for i in prompt):
        raise InvalidInput(f"the prompt holds token ids outside the vocabulary (0..{vocab_size - 1}); tokenize it "
                           "with the model's tokenizer")
    return prompt


def run_together(count: int, start: Callable[[list[Callable[[TokenEvent], None]]], Sequence[Any]]) -> list[Completion]:
    """Run ``count`` requests at once and wait for all of them: ``start`` gets one ``on_event`` callback per
    request (callable from any thread) and submits them, returning their handles; whatever is still running
    when this returns or fails is cancelled. The engines' ``generate_many``.

    Raises:
        InferenceFailed: a request ended on an error.
    """
    if count == 0:
        return []
    results: list[list[TokenEvent]] = [[] for _ in range(count)]
    remaining = [count]
    finished = threading.Event()
    guard = threading.Lock()

    def collect(index: int) -> Callable[[TokenEvent], None]:
        def on_event(event: TokenEvent) -> None:
            results[index].append(event)
            if event.finish_reason is not None:
                with guard:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        finished.set()
        return on_event

    handles: Sequence[Any] = []
    try:
        handles = start([collect(i) for i in range(count)])
        finished.wait()
    finally:
        for handle in handles:
            handle.cancel()  # a no-op for those that finished
    return [_completion(events) for events in results]


def _completion(events: list[TokenEvent]) -> Completion:
    last = events[-1]
    if last.finish_reason == "error":
        raise InferenceFailed(f"generation failed: {last.error}; reload the model")
    assert last.finish_reason is not None
    return Completion("".join(e.text for e in events), tuple(t for e in events for t in e.token_ids),
                      last.finish_reason, last.prompt_tokens, last.completion_tokens)
