"""OpenAI's text generation: ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed or not.

Decode the body (``shardline.openai_wire.parse_generation_request``: every field the official client sends, each wrong one
a 400 naming it), make one call to the data plane (``plane.llm.start``: model, quotas, engine), and
encode what comes back: one JSON answer, or server-sent events as OpenAI sends them:

- chat: a first chunk with ``delta.role`` ``assistant``, then ``delta.content`` pieces, then one chunk with
  an empty delta and the ``finish_reason``; with ``stream_options.include_usage`` every chunk carries
  ``"usage": null`` and one last chunk with no choices carries the usage; then ``data: [DONE]``.
- completions: ``choices[0].text`` pieces, the last with its ``finish_reason``, the same usage chunk and
  ``[DONE]``.

``finish_reason`` is ``stop`` (a stop string or the end-of-text token), ``length`` (max_tokens, the
context, or the tenant's token quota: then ``stop_reason`` says why, as vLLM's servers put it). The
answer's ``model`` is the version that generated it (``name:version``).

A deadline (``X-Shardline-Timeout-Ms``, as the router sends it) bounds an answer that is not streamed:
past it the generation is cancelled (the engine frees its slot) and the caller gets 504. A stream
is refused only when it arrives past its deadline; once started it runs to its end or the client's.
A client that goes away stops its generation, streamed or not: an answer that is not streamed is
generated while its connection is watched (ASGI's ``http.disconnect``), and cancelled when it closes,
so the engine's slot and the tenant's stream slot are free at once.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, AsyncIterator, Awaitable

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from shardline import openai_wire
from shardline.errors import DeadlineExceeded, InferenceFailed
from shardline.online.bodies import ClientGone
from shardline.online.dataplane import DataPlane
from shardline.online.edge import authenticate, endpoint, error_answer, json_response, note_model, read_body
from shardline.online.generation import Generation
from shardline.online.headers import PROMPT_TOKENS_HEADER, TIMEOUT_HEADER
from shardline.online.logs import deadline_left
from shardline.online.protocols.forms import openai_error_body

PROTOCOL = "openai"


class _Encoder:
    """One answer's OpenAI objects: the id, chunks and the whole answer, for chat or completions."""

    def __init__(self, chat: bool, generation: Generation, include_usage: bool) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.model = generation.served.pinned
        self.created = generation.created
        self.include_usage = include_usage
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def chunk(self, text: str | None, finish: str | None, stop_reason: str | None = None,
              role: bool = False) -> bytes:
        choice: dict[str, Any]
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({} if text is None else
                                                                                     {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if stop_reason is not None:
            choice["stop_reason"] = stop_reason
        doc: dict[str, Any] = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                               "choices": [choice]}
        if self.include_usage:
            doc["usage"] = None
        return b"data: " + orjson.dumps(doc) + b"\n\n"

    def usage_chunk(self, prompt: int, completion: int) -> bytes:
        doc = {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": [],
               "usage": openai_wire.usage(prompt, completion)}
        return b"data: " + orjson.dumps(doc) + b"\n\n"

    def whole(self, text: str, finish: str, stop_reason: str | None, prompt: int, completion: int) -> dict[str, Any]:
        return openai_wire.completion_answer(self.chat, self.id, self.created, self.model, openai_wire.CompletionAnswer(
            text, finish, prompt, completion, stop_reason))


async def _events(encoder: _Encoder, generation: Generation, metered: bool) -> AsyncIterator[bytes]:
    """The answer's server-sent events; ``metered`` (behind a router, which holds the token quota): each
    piece's tokens in a comment line before it (``: tokens N``, which clients ignore and the router drops).

    Everything a request can be refused for is checked before the first byte (``Generations.start``); what can
    only go wrong once the stream runs (the model or its engine failing) ends it with an error event, as OpenAI
    sends one, and ``[DONE]``: never a cut connection."""
    completion = 0
    try:
        if encoder.chat:
            yield encoder.chunk(None, None, role=True)
        try:
            async for event in generation:
                completion = event.completion_tokens
                finish = event.finish_reason
                out = b": tokens %d\n\n" % len(event.token_ids) if metered and event.token_ids else b""
                if finish == "error":  # the model failed mid-stream: OpenAI's clients raise on an error event
                    body = openai_error_body(f"the generation failed: {event.error}", 500)
                    yield out + b"data: " + orjson.dumps(body) + b"\n\n"
                    break
                if event.text or finish is None:
                    out += encoder.chunk(event.text, None)
                if finish is not None:  # (one write for the piece and its end)
                    yield out + encoder.chunk(None if encoder.chat else "", finish, event.stop_reason)
                    break
                yield out
        except Exception as e:  # noqa: BLE001 - after the first byte an error can only be an event
            _, body, _ = error_answer(e, openai_error_body)
            yield b"data: " + orjson.dumps(body) + b"\n\n" + b"data: [DONE]\n\n"
            return
        if encoder.include_usage:
            yield encoder.usage_chunk(generation.prompt_tokens, completion)
        yield b"data: [DONE]\n\n"
    finally:
        await generation.aclose()  # the client went away mid-stream: the engine drops the sequence now


async def _answer(encoder: _Encoder, generation: Generation) -> dict[str, Any]:
    pieces, completion, finish, why = [], 0, "length", None
    try:
        async for event in generation:
            pieces.append(event.text)
            completion = event.completion_tokens
            if event.finish_reason == "error":
                raise InferenceFailed(f"{generation.served.pinned} failed while generating: {event.error}; this is a "
                                      "fault of the model or the server, not of the request")
            if event.finish_reason is not None:
                finish, why = event.finish_reason, event.stop_reason
                break
    finally:
        await generation.aclose()
    return encoder.whole("".join(pieces), finish, why, generation.prompt_tokens, completion)


async def _within_deadline(answer: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """The whole answer, or DeadlineExceeded once the request's deadline passes (the generation is cancelled)."""
    left = deadline_left()
    if left is None:
        return await answer
    try:
        async with asyncio.timeout(left):
            return await answer
    except TimeoutError:
        raise DeadlineExceeded(f"the answer was not complete when the request's deadline ({TIMEOUT_HEADER}) passed; "
                               f"ask for fewer max_tokens, stream it, or send a longer {TIMEOUT_HEADER}") from None


async def _unless_gone(receive: Any, answer: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """The whole answer, or ClientGone once the client disconnects before it is done (its body read, the next ASGI
    message is ``http.disconnect``): the answer is cancelled, and with it the generation."""
    answering = asyncio.ensure_future(answer)

    async def client_gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watching = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({answering, watching}, return_when=asyncio.FIRST_COMPLETED)
        if answering.done():
            return answering.result()
        raise ClientGone("the client went away before its answer was generated")
    finally:
        for task in (answering, watching):
            task.cancel()
        await asyncio.gather(answering, watching, return_exceptions=True)


class _Stream(StreamingResponse):
    """Server-sent events whose clean-up runs however the response ends: the client gone before the first
    byte (Starlette then never starts the body), mid-stream, or after ``[DONE]``."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Any, prompt_tokens: int) -> None:
        super().__init__(content, media_type="text/event-stream", headers={
            "cache-control": "no-cache", "x-accel-buffering": "no", PROMPT_TOKENS_HEADER: str(prompt_tokens)})
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


def routes(plane: DataPlane) -> list[BaseRoute]:
    """``/v1/completions`` and ``/v1/chat/completions`` over a data plane."""
    wrap = endpoint(PROTOCOL, openai_error_body)

    def handler(chat: bool) -> Any:
        @wrap
        async def generate(request: Request) -> Response:
            tenant = authenticate(request, plane)
            headers = request.headers
            gate = plane.admit(tenant)
            gate.__enter__()  # the tenant's requests in flight: held until the answer (or the stream) ends
            try:
                body = await read_body(request.receive, headers.get("content-length"),
                                       headers.get("content-encoding"), plane)
                parsed = openai_wire.parse_generation_request(body, chat)
                generation = await plane.llm.start(tenant, parsed)
            except BaseException:
                gate.__exit__(None, None, None)
                raise
            note_model(generation.served)
            encoder = _Encoder(chat, generation, parsed.include_usage and parsed.stream)
            done = False

            async def cleanup() -> None:
                nonlocal done
                if not done:
                    done = True
                    try:
                        await generation.aclose()  # the engine drops the sequence if it still runs
                    finally:
                        gate.__exit__(None, None, None)

            if parsed.stream:
                return _Stream(_events(encoder, generation, plane.tenants.routed), cleanup, generation.prompt_tokens)
            try:
                return json_response(await _unless_gone(request.receive,
                                                        _within_deadline(_answer(encoder, generation))))
            finally:
                await cleanup()

        return generate

    return [
        Route("/v1/completions", handler(False), methods=["POST"]),
        Route("/v1/chat/completions", handler(True), methods=["POST"]),
    ]
