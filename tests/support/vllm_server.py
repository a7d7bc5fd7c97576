"""A server that answers as vLLM's OpenAI server does, for what the ``vllm`` runtime sends it, so the vLLM path
(``shardline.runtimes.vllm``: ``RemoteEngine``, ``VllmModel`` in ``SHARDLINE_VLLM_URL`` mode) runs in every test
run. vLLM itself cannot run here (it shares no environment with Prefect, and its wheels need a GPU);
``tests/integration/test_vllm_runtime.py`` runs the real one where it is installed.

Behind it is the real tiny Llama on the CPU engine (``GenerationEngine``), so it answers with real tokens, the
same for a greedy or seeded request every time. What it answers follows vLLM's ``vllm/entrypoints/openai``
(``completion/protocol.py``: ``CompletionRequest``, ``CompletionStreamResponse``; ``completion/serving.py``:
``completion_stream_generator``; ``sampling_params.py``; ``renderers/params.py``), not what the runtime hopes:

- ``POST /v1/completions``, the prompt a list of token ids (a text prompt is refused: the runtime sends ids).
  Fields: ``max_tokens`` (16 when absent), ``temperature`` and ``top_p`` (1.0), ``seed``, ``stop``, ``stream``,
  ``stream_options`` (``include_usage``, ``continuous_usage_stats``), ``return_token_ids``. Checked as vLLM
  checks them, each refusal a 400 with vLLM's error object ``{"error": {"message", "type", "param", "code"}}``:
  ``top_p`` in (0, 1] (even when greedy), ``temperature`` in [0, 2], ``max_tokens`` at least 1, the prompt at
  most ``max_model_len - max_tokens`` tokens, every id in the vocabulary, ``stream_options`` only with
  ``stream``, no empty stop string; a model other than the served one is a 404.
- Streamed: one ``data:`` chunk a token (``text_completion``, ``choices[0]`` with ``text``, ``finish_reason``
  and ``stop_reason``: the stop string that ended it, None at the end of sequence or length; ``token_ids`` with
  ``return_token_ids``, and ``prompt_token_ids`` on the first chunk only), ``usage`` on every chunk with
  ``continuous_usage_stats``, then with ``include_usage`` a last chunk with ``choices: []`` and the usage,
  then ``data: [DONE]``. A generation that fails ends with ``data: {"error": ...}`` and ``[DONE]``.
  A client that closes the stream before its end aborts the request (the engine's slot is freed at once):
  counted in ``aborted``.
- Not streamed: one ``text_completion`` object with the whole text and ``usage``.
- ``GET /health``: 200, empty. ``GET /v1/models``: the served model with its ``max_model_len``.
- ``api_key`` (``vllm serve --api-key``): a ``/v1`` request without ``Authorization: Bearer <key>`` is a 401
  ``{"error": "Unauthorized"}``.

``bodies`` keeps every completions body received, in order: what the runtime sent; ``peers`` the address each came
from (one per connection: a client that keeps its connections alive sends many from one). ``hold`` set, a stream
stops after its first chunk until ``hold`` is cleared: what reached the client meanwhile was not held back on the
way.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from shardline.errors import InvalidParameter
from shardline.online.testing import serve_in_thread
from shardline.runtimes.generation import EngineConfig, SamplingParams, TokenEvent
from shardline.runtimes.generation.engine import GenerationEngine

DEFAULT_MAX_TOKENS = 16  # CompletionRequest.max_tokens


def error_object(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> dict[str, Any]:
    """vLLM's ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``, ``code`` the HTTP status."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class Refused(Exception):
    """A request vLLM refuses: its status, message, error type and the parameter at fault."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> JSONResponse:
        return JSONResponse(error_object(self.status, self.message, self.kind, self.param), status_code=self.status)


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends, the client gone or not."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class VllmCompatibleServer:
    """The app and its counters (see the module docstring); ``serve_vllm_compatible`` runs one on loopback."""

    def __init__(self, engine: GenerationEngine, served_name: str, api_key: str | None = None) -> None:
        self.engine = engine
        self.served_name = served_name
        self.api_key = api_key
        self.max_model_len = engine.config.max_context
        self.url = ""
        self.bodies: list[dict[str, Any]] = []  # every completions body received, in order
        self.peers: list[tuple[str, int]] = []  # the client address of each (one per connection)
        self.hold = threading.Event()  # set: streams pause after their first chunk until it is cleared
        self.running = 0  # generations under way now
        self.aborted = 0  # streams whose client went away before the end: aborted in the engine

    def app(self) -> Starlette:
        """The ASGI app: /v1/completions, /v1/models, /health."""
        return Starlette(routes=[
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", lambda request: Response(status_code=200), methods=["GET"]),
        ])

    def _unauthorized(self, request: Request) -> Response | None:
        if self.api_key is None or request.headers.get("authorization") == f"Bearer {self.api_key}":
            return None
        return JSONResponse({"error": "Unauthorized"}, status_code=401)

    async def _models(self, request: Request) -> Response:
        denied = self._unauthorized(request)
        if denied is not None:
            return denied
        return JSONResponse({"object": "list", "data": [{
            "id": self.served_name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": str(self.engine.model_dir), "parent": None, "max_model_len": self.max_model_len}]})

    async def _completions(self, request: Request) -> Response:
        denied = self._unauthorized(request)
        if denied is not None:
            return denied
        try:
            body = await request.json()
        except ValueError:
            return Refused(400, "the body is not JSON").response()
        self.bodies.append(body)
        self.peers.append((request.client.host, request.client.port) if request.client else ("?", 0))
        try:
            prompt, params = self._read(body)
        except Refused as refused:
            return refused.response()
        options = body.get("stream_options") or {}
        answer = _Answer(self, prompt, bool(body.get("return_token_ids")))
        if not body.get("stream"):
            return JSONResponse(await answer.whole(params))
        include_usage = options.get("include_usage", True) is not False
        continuous = include_usage and bool(options.get("continuous_usage_stats"))
        return _EventStream(answer.chunks(params, include_usage, continuous), media_type="text/event-stream")

    def _read(self, body: dict[str, Any]) -> tuple[list[int], SamplingParams]:
        """The prompt and sampling of a completions body, or the 400/404 vLLM answers."""
        if body.get("model") != self.served_name:
            raise Refused(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError", "model")
        prompt = body.get("prompt")
        if isinstance(prompt, str) or not isinstance(prompt, list) or not prompt:
            raise Refused(400, "this stand-in takes a prompt of token ids only (as the vllm runtime sends)", param="prompt")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in prompt):
            raise Refused(400, "prompt token ids must be non-negative integers", param="prompt")
        if body.get("stream_options") and not body.get("stream"):
            raise Refused(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
        max_tokens = DEFAULT_MAX_TOKENS if body.get("max_tokens") is None else body["max_tokens"]
        temperature = 1.0 if body.get("temperature") is None else body["temperature"]
        top_p = 1.0 if body.get("top_p") is None else body["top_p"]
        if not 0.0 <= temperature <= 2.0:
            raise Refused(400, f"temperature must be in [0, 2], got {temperature}.", param="temperature")
        if not 0.0 < top_p <= 1.0:  # checked before a greedy request's top_p is set aside, as vLLM does
            raise Refused(400, f"top_p must be in (0, 1], got {float(top_p)}.", param="top_p")
        if max_tokens < 1:
            raise Refused(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        if len(prompt) > self.max_model_len - max_tokens:
            raise Refused(400, f"You passed {len(prompt)} input tokens and requested {max_tokens} output tokens. "
                          f"However, the model's context length is only {self.max_model_len} tokens, resulting in "
                          f"a maximum input length of {self.max_model_len - max_tokens} tokens. Please reduce the "
                          "length of the input prompt.", param="input_tokens")
        vocab = self.engine.vocab_size or 0
        if max(prompt) >= vocab:
            raise Refused(400, f"Token id {max(prompt)} is out of vocabulary", param="prompt")
        given = body.get("stop") or []
        stop = (given,) if isinstance(given, str) else tuple(given)
        if any(not s for s in stop):
            raise Refused(400, "stop cannot contain an empty string.", param="stop")
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=body.get("seed"),
                                    stop=stop)
        except InvalidParameter as e:
            raise Refused(400, str(e), param=e.param) from e
        return prompt, params


class _Answer:
    """One completions request on the engine: its events as vLLM's chunks, or as one answer."""

    def __init__(self, server: VllmCompatibleServer, prompt: list[int], return_token_ids: bool) -> None:
        self.server = server
        self.prompt = prompt
        self.return_token_ids = return_token_ids
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tokens: list[int] = []

    def _submit(self, params: SamplingParams) -> tuple[Any, asyncio.Queue[TokenEvent]]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def on_event(event: TokenEvent) -> None:  # the engine's thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the loop is closed
                pass

        return self.server.engine.submit(self.prompt, params, on_event), queue

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        prompt_tokens = len(self.prompt)
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens}

    def _stop_reason(self, event: TokenEvent, params: SamplingParams) -> str | None:
        """The stop string that ended it (the first in the text), None for the end-of-sequence token or length."""
        if event.finish_reason != "stop" or not self.tokens or self.tokens[-1] in self.server.engine.eos_token_ids:
            return None
        text = self.server.engine.detokenize(self.tokens)
        found = [(text.find(s), s) for s in params.stop if s in text]
        return min(found)[1] if found else None

    def _choice(self, event: TokenEvent, params: SamplingParams, text: str, first: bool) -> dict[str, Any]:
        ids = self.return_token_ids
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": event.finish_reason,
                "stop_reason": self._stop_reason(event, params),
                "prompt_token_ids": self.prompt if ids and first else None,
                "token_ids": list(event.token_ids) if ids else None}

    def _document(self, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        document: dict[str, Any] = {"id": self.id, "object": "text_completion", "created": self.created,
                                    "model": self.server.served_name, "choices": choices}
        if usage is not None:
            document["usage"] = usage
        return document

    async def chunks(self, params: SamplingParams, include_usage: bool, continuous: bool) -> AsyncIterator[str]:
        """The stream: a chunk a token, the usage chunk, [DONE]; the request aborted if the client leaves first."""
        handle, queue = self._submit(params)
        self.server.running += 1
        ended = False
        try:
            first, completion = True, 0
            while True:
                event = await queue.get()
                if event.finish_reason in ("cancelled", "error"):  # the engine closed or failed under it
                    ended = True
                    failure = error_object(500, event.error or "the request was aborted", "InternalServerError")
                    yield f"data: {json.dumps(failure)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                self.tokens.extend(event.token_ids)
                completion = event.completion_tokens
                chunk = self._document([self._choice(event, params, event.text, first)],
                                       self._usage(completion) if continuous else None)
                yield f"data: {json.dumps(chunk)}\n\n"
                while first and self.server.hold.is_set():
                    await asyncio.sleep(0.005)
                first = False
                if event.finish_reason is not None:
                    break
            ended = True
            if include_usage:
                yield f"data: {json.dumps(self._document([], self._usage(completion)))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.server.running -= 1
            if not ended:
                handle.cancel()
                self.server.aborted += 1

    async def whole(self, params: SamplingParams) -> dict[str, Any]:
        """The answer of a request that is not streamed."""
        handle, queue = self._submit(params)
        self.server.running += 1
        try:
            events: list[TokenEvent] = []
            while not events or events[-1].finish_reason is None:
                events.append(await queue.get())
        finally:
            self.server.running -= 1
            handle.cancel()  # a no-op once it ended
        last = events[-1]
        self.tokens = [t for e in events for t in e.token_ids]
        choice = self._choice(last, params, "".join(e.text for e in events), True)
        choice["token_ids"] = self.tokens if self.return_token_ids else None
        return self._document([choice], self._usage(last.completion_tokens))


@contextmanager
def serve_vllm_compatible(bundle_dir: Path, served_name: str, *, max_model_len: int = 512, max_batch: int = 16,
                          api_key: str | None = None) -> Iterator[VllmCompatibleServer]:
    """Serve a bundle as ``vllm serve <bundle> --served-model-name <name> --max-model-len <n>`` would, on a free
    loopback port (``server.url``); the engine and the server are stopped on exit."""
    engine = GenerationEngine(bundle_dir, EngineConfig(max_batch=max_batch, max_context=max_model_len), threads=1)
    engine.start()
    try:
        server = VllmCompatibleServer(engine, served_name, api_key)
        with serve_in_thread(server.app()) as url:
            server.url = url
            yield server
    finally:
        engine.close()
