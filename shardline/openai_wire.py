"""OpenAI's wire shapes, framework-free: what the HTTP tier and batch files both read and write.

- Request bodies of ``/v1/completions``, ``/v1/chat/completions`` (``parse_generation_request``) and
  ``/v1/embeddings`` (``parse_embedding_request``), checked field by field: each wrong field is an
  ``InvalidInput`` naming it (``field 'x' is ...``) and saying what to send.
- Answers: a whole chat or text completion (``completion_answer``), an embeddings list
  (``embedding_answer``), usage counts, and OpenAI's error object (``error_object``).
- Which models fit: ``embedding_io`` (one string column in, one list of floats out).

The online tier's protocol adapters (``online/protocols/openai*.py``) and the OpenAI Batch file
job (``shardline.openai_batch``) call these, so a request means the same and an answer has the same
shape in both. Pure: no I/O, no web framework.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import orjson

from shardline.errors import InvalidInput, number_out_of_range, shown
from shardline.rows import blank_text
from shardline.runtimes.generation.requests import CHAT_ROLES, MAX_STOP_STRINGS
from shardline.signature import Signature

CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
MAX_STOP = MAX_STOP_STRINGS  # OpenAI's limit on stop strings (the engine's too)
MAX_INPUTS = 2048  # texts in one embeddings request
_INT64 = (-2**63, 2**63 - 1)  # the range of a whole number the wire takes (OpenAI's, vLLM's)
_FIELD = re.compile(r"\bfield '([A-Za-z_][\w.\[\]]*)'")
_JSON_NAMES = {list: "array", dict: "object", bool: "boolean", float: "number", type(None): "null"}  # what a value is


@dataclass(frozen=True)
class GenerationRequest:
    """What a generation request asks for, decoded from OpenAI's completions or chat completions body."""

    model: str
    prompt: str | None = None  # completions
    messages: list[dict[str, Any]] | None = None  # chat completions
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    user: str | None = None

    @property
    def prompt_field(self) -> str:
        """The field that holds the prompt (``messages`` or ``prompt``): the ``param`` of an error over it."""
        return "prompt" if self.messages is None else "messages"


class EmbeddingRequest(NamedTuple):
    """What an embeddings request asks for: the model, the texts, ``float`` or ``base64``, and ``dimensions``."""

    model: str
    texts: list[str]
    encoding: str = "float"
    dimensions: int | None = None


def _number(doc: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = doc.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise InvalidInput(f"field '{name}' is {shown(value)}; send a number from {low:g} to {high:g}")
    return float(value)


def _whole(doc: dict[str, Any], name: str, low: int, high: int = _INT64[1]) -> int | None:
    value = doc.get(name)
    if value is None:
        return None
    wanted = f"a whole number of at least {low}" if low > _INT64[0] else "a whole number"
    # a whole number past 64 bits comes out of the JSON parser as a float: it is out of range, not a fraction
    huge = isinstance(value, float) and value.is_integer() and not low <= value <= high
    if type(value) is int and value < low and low > _INT64[0]:
        raise InvalidInput(f"field '{name}' is {shown(value)}; send {wanted}")
    if huge or (type(value) is int and not low <= value <= high):
        raise InvalidInput(f"field '{name}' is out of range; send a whole number from {low} to {high}")
    if type(value) is not int:
        raise InvalidInput(f"field '{name}' is {shown(value)}; send {wanted}")
    return value


# What OpenAI's endpoints take and this server does not do: each is refused by name (so a client that relies on it
# learns so) unless it is sent as the value that asks for nothing (the client's own default).
_NOT_OFFERED: tuple[tuple[str, tuple[Any, ...], str], ...] = (
    ("tools", (None, []), "tool calls are not supported"),
    ("tool_choice", (None, "none"), "tool calls are not supported"),
    ("parallel_tool_calls", (None,), "tool calls are not supported"),
    ("functions", (None, []), "function calls are not supported"),
    ("function_call", (None, "none"), "function calls are not supported"),
    ("response_format", (None, {"type": "text"}), "this server answers plain text only, without JSON mode or schemas"),
    ("logit_bias", (None, {}), "logit bias is not supported"),
    ("presence_penalty", (None, 0), "penalties are not supported"),
    ("frequency_penalty", (None, 0), "penalties are not supported"),
    ("suffix", (None, ""), "a suffix (insertion) is not supported"),
    ("logprobs", (None, False, 0), "log probabilities are not offered"),
    ("top_logprobs", (None, 0), "log probabilities are not offered"),
    ("echo", (None, False), "echoing the prompt is not offered"),
    ("best_of", (None, 1), "this server generates one choice per request"),
)


def _asks_nothing(value: Any, nothing: tuple[Any, ...]) -> bool:
    """Whether a value is one of ``nothing`` (None, true and false as themselves; no bool passes for 0)."""
    return any(value is quiet if quiet is None or isinstance(quiet, bool) else
               (not isinstance(value, bool) and value == quiet) for quiet in nothing)


def _refuse_not_offered(doc: dict[str, Any]) -> None:
    for name, nothing, why in _NOT_OFFERED:
        value = doc.get(name)
        if not _asks_nothing(value, nothing):
            raise InvalidInput(f"field '{name}' is {shown(value)}; {why}: leave it out")


def _stop(doc: dict[str, Any]) -> tuple[str, ...]:
    stop = doc.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise InvalidInput(f"field 'stop' is {shown(stop)}; send a non-empty string or a list of up to {MAX_STOP}")
    return tuple(stops)


def _messages(doc: dict[str, Any]) -> list[dict[str, Any]]:
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("field 'messages' must be a non-empty list of {\"role\": ..., \"content\": ...}")
    checked = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role in ("tool", "function"):
            raise InvalidInput(f"field 'messages[{i}].role' is {shown(role)}; tool and function calls are not "
                               f"supported: send messages of the roles {sorted(CHAT_ROLES)}")
        if role not in CHAT_ROLES:
            raise InvalidInput(f"field 'messages[{i}].role' is {shown(role)}; use one of {sorted(CHAT_ROLES)}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text is read
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise InvalidInput(f"field 'messages[{i}].content' holds parts other than text; this server reads "
                                   "text only")
            content = "".join(texts)  # type: ignore[arg-type]
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise InvalidInput(f"field 'messages[{i}].content' is {shown(content)}; send the message's text")
        checked.append({"role": role, "content": content})
    return checked


def _object(body: bytes | dict[str, Any], example: str, not_object: str) -> dict[str, Any]:
    """The body as a JSON object (already decoded, or bytes to decode)."""
    if isinstance(body, dict):
        return body
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        if number_out_of_range(e):
            raise InvalidInput(f"the request body holds a number past the range of a double, ±1.8e+308 ({e}); send "
                               "numbers within it") from e
        raise InvalidInput(f"the request body is not valid JSON ({e}); send {example}") from e
    if not isinstance(doc, dict):
        raise InvalidInput(not_object)
    return doc


def request_object(body: bytes | dict[str, Any], generation: bool) -> dict[str, Any]:
    """An embeddings (``generation`` False) or a completions request's body as a JSON object, and its ``model``
    checked: what serve's parsers and the router (which reads no other field) both refuse, in the same words.

    Raises:
        InvalidInput: the body is not JSON, not an object, or names no model.
    """
    if generation:
        doc = _object(body, "{\"model\": ..., ...}", "the request body is not a JSON object")
    else:
        doc = _object(body, "{\"model\": ..., \"input\": ...}",
                      "the request body is not a JSON object with 'model' and 'input'")
    model = doc.get("model")
    if not isinstance(model, str) or not model.strip():
        kind = "a text-generation" if generation else "an embedding"
        raise InvalidInput(f"field 'model' is missing or not a string; name {kind} model you may call")
    return doc


def parse_generation_request(body: bytes | dict[str, Any], chat: bool) -> GenerationRequest:
    """A completions (``chat`` False) or chat completions request body (bytes, or the decoded object), checked
    field by field.

    Raises:
        InvalidInput: naming the field that is wrong and what to send.
    """
    doc = request_object(body, generation=True)
    model = doc["model"]
    n = doc.get("n")
    if n not in (None, 1):
        raise InvalidInput(f"field 'n' is {shown(n)}; this server generates one choice per request: leave 'n' out")
    _refuse_not_offered(doc)
    options = doc.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidInput(f"field 'stream_options' is {shown(options)}; send {{\"include_usage\": true}}")
    include_usage = (options or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise InvalidInput(f"field 'stream_options.include_usage' is {shown(include_usage)}; send true or false")
    stream = doc.get("stream") or False
    if not isinstance(stream, bool):
        raise InvalidInput(f"field 'stream' is {shown(stream)}; send true or false")
    max_tokens = _whole(doc, "max_completion_tokens", 1) if chat else None
    max_tokens = max_tokens if max_tokens is not None else _whole(doc, "max_tokens", 1)
    seed = _whole(doc, "seed", *_INT64)
    user = doc.get("user")
    prompt: str | None = None
    messages = None
    if chat:
        messages = _messages(doc)
    else:
        raw = doc.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
            raw = raw[0]
        if not isinstance(raw, str):
            raise InvalidInput(f"field 'prompt' is {shown(raw)}; send one prompt as a string (token ids and "
                               "several prompts in one request are not offered)")
        prompt = raw
    return GenerationRequest(
        model=model.strip(), prompt=prompt, messages=messages, max_tokens=max_tokens,
        temperature=_number(doc, "temperature", 1.0, 0.0, 2.0), top_p=_number(doc, "top_p", 1.0, 0.0, 1.0),
        seed=seed, stop=_stop(doc), stream=stream,
        include_usage=bool(include_usage), user=user if isinstance(user, str) else None,
    )


def parse_embedding_request(body: bytes | dict[str, Any]) -> EmbeddingRequest:
    """An embeddings request body (bytes, or the decoded object), checked field by field.

    Raises:
        InvalidInput: naming the field that is wrong.
    """
    doc = request_object(body, generation=False)
    model = doc["model"]
    texts = doc.get("input")
    if isinstance(texts, str):
        if (blank := blank_text(texts)) is not None:
            raise InvalidInput(f"field 'input' is {blank}; send the text to embed")
        texts = [texts]
    if not isinstance(texts, list) or not texts:
        raise InvalidInput("field 'input' must be a string or a non-empty list of strings")
    if len(texts) > MAX_INPUTS:
        raise InvalidInput(f"field 'input' holds {len(texts)} texts; send at most {MAX_INPUTS} per request")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            ids = isinstance(text, int) or isinstance(text, list) and all(type(t) is int for t in text)
            kind = "token ids" if ids else f"a JSON {_JSON_NAMES.get(type(text), type(text).__name__)}"
            raise InvalidInput(f"field 'input[{i}]' is {kind}; this server embeds text: send strings")
        if (blank := blank_text(text)) is not None:
            raise InvalidInput(f"field 'input[{i}]' is {blank}; send the text to embed or leave the entry out")
    encoding = doc.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise InvalidInput(f"field 'encoding_format' is {shown(encoding)}; use 'float' or 'base64'")
    dimensions = doc.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
        raise InvalidInput(f"field 'dimensions' is {shown(dimensions)}, not a positive whole number")
    return EmbeddingRequest(model.strip(), texts, encoding, dimensions)


def embedding_io(signature: Signature) -> tuple[str, str, int] | None:
    """(text input, embedding output, its size) when the signature is an embedding model's (one string column
    in, one ``fixed_size_list<float>`` out); None otherwise (``SignaturePlan.embedding``, worked out once)."""
    return signature.plan.embedding


def usage(prompt: int, completion: int) -> dict[str, int]:
    """OpenAI's ``usage`` of a completion."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass(frozen=True)
class CompletionAnswer:
    """What one finished generation gives an answer: its text, why it ended, and its token counts."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stop_reason: str | None = None  # why a stream was stopped early (vLLM's field), when it was


def completion_answer(chat: bool, answer_id: str, created: int, model: str, done: CompletionAnswer) -> dict[str, Any]:
    """The whole (not streamed) ``chat.completion`` or ``text_completion`` object OpenAI answers."""
    choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": done.text}, "logprobs": None,
                               "finish_reason": done.finish_reason} if chat else
                              {"index": 0, "text": done.text, "logprobs": None, "finish_reason": done.finish_reason})
    if done.stop_reason is not None:
        choice["stop_reason"] = done.stop_reason
    return {"id": answer_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage(done.prompt_tokens, done.completion_tokens)}


def embedding_answer(model: str, vectors: np.ndarray, encoding: str, tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings response for a (texts, dimensions) float32 matrix."""
    data: list[dict[str, Any]] = []
    for i, vector in enumerate(vectors):
        value: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode() if encoding == "base64" else vector
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


_OPENAI_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
    501: "not_implemented", 503: "overloaded_error",
}
_OPENAI_CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded", 503: "overloaded"}


def error_object(message: str, status: int, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error form; ``param`` the error's own (``ShardlineError.param``), else the request field a 400's
    message names first (``field 'x'``); ``code`` the error's own (``ShardlineError.code``, e.g.
    ``context_length_exceeded``), else the status's."""
    named = _FIELD.search(message) if status == 400 and param is None else None
    return {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "server_error"),
                      "param": param or (named.group(1) if named else None), "code": code or _OPENAI_CODES.get(status)}}


__all__ = ["CHAT_COMPLETIONS", "COMPLETIONS", "EMBEDDINGS", "MAX_INPUTS", "MAX_STOP", "CompletionAnswer",
           "EmbeddingRequest", "GenerationRequest", "completion_answer", "embedding_answer", "embedding_io",
           "error_object", "parse_embedding_request", "parse_generation_request", "shown", "usage"]
