"""LLM generation on the data plane: one tenant's request from the model's name to a stream of tokens.

``Generations.start`` is the one call a protocol adapter makes (decode, start, encode): it resolves
the model the tenant may call (``DataPlane.model_for_reference``: the same 404s, the custom-code and
alias rules), checks that it generates text, takes the tenant's stream slot and the prompt's tokens
from its token quota (``LlmGate``), loads the runtime through the model cache, and submits the prompt
to the runtime's engine (an ``Engine``: ``shardline.runtimes.generation``). What it returns is a
``Generation``: an async iterator of ``TokenEvent`` that the adapter encodes as server-sent events or
one JSON answer.

- **Quotas** (the tenants file's ``tokens_per_minute`` and ``max_streams``): a stream over the
  tenant's streams in flight, or a prompt the token bucket cannot cover now, is refused before it
  starts (429 with Retry-After); a prompt larger than the whole minute's quota is a 400. While it
  runs, each token it generates is taken from the bucket; a stream that finds it empty is stopped
  at once (its generation cancelled) and ends cleanly: finish_reason ``length``, and ``stop_reason``
  saying why.
- **Cancellation**: closing the iterator (the client went away, or a handler failed) cancels the
  generation in the engine, which frees its slot at its next step, and gives the tenant's stream
  slot back at once.
- **Metrics**: time to first token, the time between tokens, prompt and completion tokens per
  tenant and model, and streams in flight.

The engine runs on its own thread and calls back from it; events hop to the event loop with
``call_soon_threadsafe`` (sync core, async edge). An engine whose requests run on the event loop itself (the
``vllm`` runtime's streams to vLLM) calls back on it: its events are queued without a hop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, Callable

from opentelemetry.trace import Span, SpanKind

from shardline.errors import ContextLengthExceeded, DeadlineExceeded, InvalidInput, RateLimited
from shardline.observability import tracing
from shardline.online.admission import TokenBucket, retry_after
from shardline.online.headers import TIMEOUT_HEADER
from shardline.online.logs import deadline_left
from shardline.online.models import ServedModel
from shardline.online.tenants import Tenant
from shardline.openai_wire import GenerationRequest
from shardline.runtimes import generates

TOKENIZE_WEIGHT = 64  # a character to tokenize costs about what 64 bytes of a body to decode do (edge.runs_off_loop)

if TYPE_CHECKING:
    from shardline.online.dataplane import DataPlane
    from shardline.runtimes.generation import Engine, SamplingParams

class LlmGate:
    """One tenant's LLM quotas in this server: streams in flight and tokens per minute (a token bucket
    refilled at tokens_per_minute / 60 a second, holding at most a minute's worth)."""

    __slots__ = ("tenant", "streams", "bucket", "clock")

    def __init__(self, tenant: Tenant, clock: Callable[[], float]) -> None:
        self.tenant = tenant
        self.streams = 0
        tpm = tenant.tokens_per_minute
        self.bucket = None if tpm is None else TokenBucket(tpm / 60.0, tpm)
        self.clock = clock

    def open(self, prompt_tokens: int) -> None:
        """Take a stream slot and the prompt's tokens, or refuse. ``prompt_tokens`` 0 (the router, which does
        not tokenize): refuse only when the bucket is empty; the prompt is charged once its size is known.

        Raises:
            RateLimited: at ``max_streams``, or the bucket lacks the prompt's tokens now (Retry-After: when it will not).
            InvalidInput: the prompt alone is more tokens than a minute's quota.
        """
        name = self.tenant.name
        limit = self.tenant.max_streams
        if limit is not None and self.streams >= limit:
            raise RateLimited(f"tenant {name!r} has {self.streams} generations in flight, its max_streams; wait for "
                              "one to finish or ask for a larger quota", name, 1, "streams")
        if self.bucket is not None:
            now = self.clock()
            wait = self.bucket.take(now, prompt_tokens) if prompt_tokens else self.bucket.wait(now, 1)
            if wait == float("inf"):
                raise InvalidInput(f"the prompt is {prompt_tokens} tokens, more than the whole quota of tenant {name!r}, "
                                   f"{self.tenant.tokens_per_minute} tokens per minute; send a shorter prompt")
            if wait > 0:
                size = f" (this prompt is {prompt_tokens})" if prompt_tokens else ""
                raise RateLimited(f"tenant {name!r} is over its {self.tenant.tokens_per_minute} tokens per minute"
                                  f"{size}; retry after {retry_after(wait)} s", name, retry_after(wait), "tokens")
        self.streams += 1

    def spend(self, tokens: int) -> bool:
        """Take generated tokens from the bucket; False when it ran out (the stream must stop)."""
        return self.bucket is None or self.bucket.spend(self.clock(), tokens)

    def close(self) -> None:
        """Give the stream slot back."""
        self.streams -= 1


@dataclass
class Generation:
    """One generation under way: its model, prompt size, and the events to come (iterate once; ``aclose``
    cancels it). The prompt is submitted to the engine when the events are first read."""

    served: ServedModel
    prompt_tokens: int
    events: AsyncGenerator[Any, None]
    release: Callable[[], None]  # gives the tenant's stream slot back (once, however often it is called)
    created: int = field(default_factory=lambda: int(time.time()))

    def __aiter__(self) -> AsyncIterator[Any]:
        return self.events

    async def aclose(self) -> None:
        """Stop it (the engine drops the sequence) and give its quota slot back; harmless when it ended, and
        when its events were never read (nothing was submitted then)."""
        try:
            await self.events.aclose()
        finally:
            self.release()


class Generations:
    """The generation side of a data plane (see the module docstring)."""

    def __init__(self, plane: DataPlane) -> None:
        self._plane = plane
        self._gates: dict[str, LlmGate] = {}

    def gate(self, tenant: Tenant) -> LlmGate:
        """The tenant's LLM gate (made anew when the tenants file changed the tenant)."""
        gate = self._gates.get(tenant.name)
        if gate is None or gate.tenant is not tenant:
            gate = self._gates[tenant.name] = LlmGate(tenant, self._plane.clock)
        return gate

    async def start(self, tenant: Tenant, request: GenerationRequest) -> Generation:
        """Start generating for the tenant (see the module docstring).

        Raises:
            ModelNotFound, AccessDenied: as for any model the tenant calls.
            ContextLengthExceeded: the prompt is longer than the model's context leaves room for (before any byte
                of the answer, and before the tenant's quotas are touched).
            InvalidInput: the model does not generate text, the prompt is empty, or a parameter is wrong.
            RateLimited: over max_streams or tokens_per_minute.
            RuntimeUnavailable: the runtime cannot load here.
            DeadlineExceeded: the request's deadline (``RequestInfo.deadline``) had passed.
        """
        from shardline.runtimes.generation import SamplingParams

        plane = self._plane
        left = deadline_left()
        if left is not None and left <= 0:
            raise DeadlineExceeded(f"the request's deadline ({TIMEOUT_HEADER}) had passed when it reached the server; "
                                   f"send a longer {TIMEOUT_HEADER}")
        served = await plane.model_for_reference(tenant, request.model)
        if not generates(served.resolved.manifest.runtime):
            raise InvalidInput(f"field 'model': {served.pinned} does not generate text (runtime "
                               f"{served.resolved.manifest.runtime!r}); call a text-generation model, or "
                               f"/v2/models/{served.name}/infer for this one")
        runtime = await plane.runtime_for(served)
        engine = runtime.engine
        # no max_tokens: a chat answer may fill the context (as OpenAI's), a completion is 16 tokens (as OpenAI's)
        default = engine.config.max_context if request.messages is not None else 16
        params = SamplingParams(max_tokens=request.max_tokens or default, temperature=request.temperature,
                                top_p=request.top_p, seed=request.seed, stop=request.stop)
        prompt = request.prompt if request.messages is None else engine.chat_prompt(request.messages)
        from shardline.online.edge import runs_off_loop  # (edge imports the data plane, which imports this module)

        text = prompt or ""
        try:
            if runs_off_loop(len(text) * TOKENIZE_WEIGHT, False, plane.settings.offload_min_bytes):
                prompt_ids = await plane.off_loop(lambda: engine.check_prompt(engine.tokenize(text)))
            else:  # a prompt of a few thousand characters takes about a millisecond: a hop to a thread costs more
                prompt_ids = engine.check_prompt(engine.tokenize(text))
        except ContextLengthExceeded as e:
            e.param = request.prompt_field
            raise
        gate = self.gate(tenant)  # a prompt refused above took nothing from the tenant's quotas
        try:
            gate.open(len(prompt_ids))
        except RateLimited as e:  # its streams or tokens: counted as a server counts its other quotas
            plane.metrics.rate_limited.labels(e.tenant, e.quota).inc()
            raise
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                gate.close()

        operation = "text_completion" if request.messages is None else "chat"
        return Generation(served, len(prompt_ids), self._events(tenant, served, engine, prompt_ids, params, gate,
                                                                release, operation), release)

    async def _events(self, tenant: Tenant, served: ServedModel, engine: Engine, prompt_ids: list[int],
                      params: SamplingParams, gate: LlmGate, release: Callable[[], None],
                      operation: str = "text_completion") -> AsyncGenerator[Any, None]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        loop_thread = threading.get_ident()

        def on_event(event: Any) -> None:  # the engine's thread, or this loop (the vllm runtime's streams)
            if threading.get_ident() == loop_thread:
                queue.put_nowait(event)
                return
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody is left to tell
                pass

        plane = self._plane
        metrics = plane.metrics
        model, version = served.name, str(served.version)
        metrics.llm_streams.labels(model).inc()
        span = _generation_span(operation, model, version, len(prompt_ids), params) if tracing.ENABLED and tracing.recording() else None
        started = last = first = time.perf_counter()
        handle = engine.submit(prompt_ids, params, on_event)
        finished = False
        completion = 0
        reason = None
        try:
            while True:
                event = await queue.get()
                now = time.perf_counter()
                served.last_used = plane.clock()  # a stream keeps its model loaded
                if event.token_ids:
                    if completion == 0:
                        first = now
                        metrics.llm_first_token(model, version, tenant.name, now - started)
                    else:
                        metrics.llm_between_tokens(model, version, now - last)
                    last = now
                    completion += len(event.token_ids)
                    if not gate.spend(len(event.token_ids)) and event.finish_reason is None:
                        handle.cancel()
                        finished, reason = True, "length"
                        yield _ran_out(event, tenant)
                        return
                if event.finish_reason is not None:
                    finished, reason = True, event.finish_reason
                yield event
                if finished:
                    return
        finally:
            if not finished:
                handle.cancel()  # the client went away (or the handler failed): free the engine's slot now
            release()
            metrics.llm_streams.labels(model).dec()
            metrics.llm_tokens(model, version, tenant.name, len(prompt_ids), completion, last - started)
            if completion > 1:
                metrics.llm_per_output_token(model, version, tenant.name, (last - first) / (completion - 1))
            if span is not None:
                span.set_attributes({"gen_ai.usage.input_tokens": len(prompt_ids),
                                     "gen_ai.usage.output_tokens": completion,
                                     "gen_ai.response.finish_reasons": [reason or "cancelled"]})
                if completion:
                    span.set_attribute("shardline.time_to_first_token_s", first - started)
                span.end()


def _generation_span(operation: str, model: str, version: str, prompt_tokens: int, params: Any) -> Span:
    """A generation's span with the OpenTelemetry GenAI attributes; it ends with the last token."""
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation, "gen_ai.provider.name": "shardline", "gen_ai.request.model": model,
        "gen_ai.response.model": f"{model}:{version}", "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.usage.input_tokens": prompt_tokens,
    }
    for name, value in (("gen_ai.request.temperature", params.temperature), ("gen_ai.request.top_p", params.top_p),
                        ("gen_ai.request.seed", params.seed)):
        if value is not None:
            attributes[name] = value
    return tracing.start(f"{operation} {model}", kind=SpanKind.INTERNAL, attributes=attributes)


def _ran_out(event: Any, tenant: Tenant) -> Any:
    """The stream's last event when the tenant's token quota ran out: its text, finish_reason length, and why."""
    from dataclasses import replace

    return replace(event, finish_reason="length", stop_reason=(
        f"tenant {tenant.name!r} used its {tenant.tokens_per_minute} tokens per minute; the generation was "
        "stopped (ask for a larger quota, or a smaller max_tokens)"))
