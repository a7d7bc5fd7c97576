"""The router's side of text generation: where a prompt goes, and the relay of a streamed answer.

- ``affinity``: the part of a generation's placement key after the model. Requests with the same
  key go to the same replica while its load allows (rendezvous hashing with bounded loads,
  ``placement.choose``), so its KV cache is reused: the caller's ``X-Shardline-Route-Key`` header,
  else its ``user`` field (session affinity), else a hash of the prompt's first ``PREFIX_CHARS``
  characters (a shared system prompt or document: prefix affinity). A replica past the bound
  spills to the next in the key's order: the least loaded take over when loads diverge.
- ``metered``: the replica's server-sent events passed on as they come, without its comment lines, with the
  tenant's token quota held here, for every replica together. A replica behind the router says how many tokens
  each piece took in SSE comment lines (``: tokens N``) and the prompt's size in the
  ``X-Shardline-Prompt-Tokens`` header; the router takes them from the tenant's token bucket
  (``online.generation.LlmGate``) and drops the lines, so a client reads what ``serve`` itself would send. A
  stream that finds the bucket empty is stopped (the replica's connection is closed, so it cancels the
  generation) and ends cleanly for the client: a last chunk with finish_reason ``length`` and ``stop_reason``
  saying why, the usage chunk when ``stream_options.include_usage`` asked for it, then ``data: [DONE]``.
"""

from __future__ import annotations

import hashlib
from typing import Any, AsyncIterator, Callable

import orjson

from shardline import openai_wire
from shardline.online import headers
from shardline.online.generation import LlmGate
from shardline.online.router.upstream import Relay

PREFIX_CHARS = 512  # how much of a prompt decides its replica: a system prompt's worth
PROMPT_TOKENS_HEADER = headers.PROMPT_TOKENS_HEADER.encode()
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_TOKENS = b": tokens "


def affinity(doc: dict[str, Any], route_key: str | None) -> str:
    """The placement key's affinity part for a generation body (see the module docstring)."""
    if route_key:
        return f"key:{route_key}"
    user = doc.get("user")
    if isinstance(user, str) and user:
        return f"user:{user}"
    messages = doc.get("messages")
    if isinstance(messages, list):
        text = "\n".join(f"{m.get('role')}: {m.get('content')}" for m in messages if isinstance(m, dict))
    else:
        prompt = doc.get("prompt")
        text = prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode()
    return "prefix:" + hashlib.blake2b(text[:PREFIX_CHARS].encode(), digest_size=8).hexdigest()


def tokens_of(block: bytes) -> int | None:
    """The count a ``: tokens N`` comment block carries, else None (any other event)."""
    if not block.startswith(_TOKENS):
        return None
    try:
        return int(block[len(_TOKENS):].split(b"\n", 1)[0])
    except ValueError:
        return None


def _last_chunk(block: bytes) -> dict[str, Any] | None:
    if not block.startswith(b"data: {"):
        return None
    try:
        doc = orjson.loads(block[6:])
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) and doc.get("choices") else None


def _chunk_base(last: dict[str, Any] | None) -> dict[str, Any]:
    """The id, object, created and model of the stream's last chunk (what a chunk the router adds carries)."""
    return {k: last[k] for k in ("id", "object", "created", "model") if last and k in last}


def stop_chunk(last: dict[str, Any] | None, chat: bool, why: str) -> bytes:
    """The chunk that ends a stream the router stopped: finish_reason length, stop_reason ``why``."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length", "stop_reason": why}
    if chat:
        choice["delta"] = {}
    else:
        choice["text"] = ""
    doc = {**_chunk_base(last), "choices": [choice]}
    if last is not None and "usage" in last:
        doc["usage"] = None  # as every chunk of a stream that asked for its usage
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def usage_chunk(last: dict[str, Any] | None, prompt_tokens: int, completion_tokens: int) -> bytes:
    """The last chunk of a stream that asked for its usage (``stream_options.include_usage``): no choices."""
    doc = {**_chunk_base(last), "choices": [], "usage": openai_wire.usage(prompt_tokens, completion_tokens)}
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def metered(pieces: AsyncIterator[bytes], gate: LlmGate, prompt_tokens: int, chat: bool,
            done: Callable[[], None], include_usage: bool = False) -> Relay:
    """Relay server-sent events without the replica's comment lines, taking their tokens from the tenant's quota
    (see the module docstring); ``done`` is called once the stream ends, however it ends (the gate's slot given
    back), and ``pieces`` is closed then (stopped early: the replica's connection closes and it cancels the
    generation). ``include_usage``: the caller asked for the usage chunk, which a stopped stream ends with too."""

    async def finished(_: bool) -> None:
        try:
            close = getattr(pieces, "aclose", None)
            if close is not None:
                await close()
        finally:
            done()

    return Relay(_metered(pieces, gate, prompt_tokens, chat, include_usage), finished)


async def _metered(pieces: AsyncIterator[bytes], gate: LlmGate, prompt_tokens: int, chat: bool,
                   include_usage: bool) -> AsyncIterator[bytes]:
    why = (f"tenant {gate.tenant.name!r} used its {gate.tenant.tokens_per_minute} tokens per minute; the generation "
           "was stopped (ask for a larger quota, or a smaller max_tokens)")
    buffer = b""
    last = b""  # the last data block: the stop chunk takes its id and model
    completion = 0

    def stopped() -> bytes:
        chunk = _last_chunk(last)
        end = stop_chunk(chunk, chat, why)
        if include_usage:
            end += usage_chunk(chunk, prompt_tokens, completion)
        return end + b"data: [DONE]\n\n"

    if prompt_tokens and not gate.spend(prompt_tokens):
        yield stopped()
        return
    async for piece in pieces:
        buffer += piece
        out = []
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            count = tokens_of(block)
            if count is None:
                if block.startswith(b"data: {"):
                    last = block
                if not block.startswith(b":"):  # any other comment line is the replica's own too
                    out.append(block + b"\n\n")
                continue
            completion += count
            if not gate.spend(count):
                if out:
                    yield b"".join(out)
                yield stopped()
                return
        if out:
            yield b"".join(out)
    if buffer and not buffer.startswith(b":"):
        yield buffer
