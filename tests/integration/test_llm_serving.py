"""Text generation over real HTTP with the official openai client: a tiny causal LM built here (random weights,
the real MiniLM tokenizer) served by `serve`'s app on a free port, its engine generating real tokens.

Streaming as OpenAI streams (one id, the role first, exactly one finish_reason, usage when asked, ``[DONE]``
last), the sampling fields, OpenAI's error shapes, a client that goes away mid-stream (the engine's slot and
the tenant's stream slot are free at once: counted), and a tenant's token quota crossed mid-stream (the
stream ends cleanly, saying why)."""

from __future__ import annotations

import time
from typing import Any, Iterator

import httpx
import openai
import orjson
import pytest

from shardline.build.llm_build import package_tiny_llm
from shardline.online.dataplane import DataPlane
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.storage.registry import ModelRegistry
from tests.support.serving import serve_home

KEY, SMALL, OTHER = "sk-llm-main", "sk-llm-small-quota", "sk-llm-other"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "name three rivers"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, DataPlane]]:
    home = tmp_path_factory.mktemp("llm-home")
    package_tiny_llm(home / "tiny-bundle", name="tiny")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias("tiny", "prod", registry.push(home / "tiny-bundle").version or 1)
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key(KEY)], "models": ["tiny@prod"], "max_streams": 4},
        {"name": "small", "api_keys_sha256": [hash_api_key(SMALL)], "models": ["tiny@prod"],
         "tokens_per_minute": 60},
        {"name": "other", "api_keys_sha256": [hash_api_key(OTHER)], "models": ["tiny@prod"]},
    ]})
    with serve_home(home, tenants) as served:
        yield served


@pytest.fixture
def client(served: tuple[str, DataPlane]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=KEY, max_retries=0)


def test_chat_and_completions_answer_with_usage_and_finish_reason(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0)
    text = client.completions.create(model="tiny", prompt="The river", max_tokens=5, temperature=0)

    assert chat.model == "tiny:1" and chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str)
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage is not None and chat.usage.prompt_tokens > 5 and 1 <= chat.usage.completion_tokens <= 6
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    assert text.object == "text_completion" and text.usage is not None and text.usage.completion_tokens <= 5
    again = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0)
    assert again.choices[0].message.content == chat.choices[0].message.content  # greedy: the same text
    assert "tiny" in {m.id for m in client.models.list()}


def test_a_stream_comes_as_openai_streams_it(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)

    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]  # exactly one
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content


def test_the_raw_stream_ends_with_done_and_completions_stream_text(served: tuple[str, DataPlane]) -> None:
    url, _ = served
    with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": "tiny", "prompt": "The river", "max_tokens": 4, "stream": True}) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        events = [line for line in answer.iter_lines() if line]

    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    docs = [orjson.loads(e[6:]) for e in events[:-1]]
    assert all(d["object"] == "text_completion" for d in docs)
    assert [d["choices"][0]["finish_reason"] for d in docs].count(None) == len(docs) - 1


def test_the_same_seed_gives_the_same_text_and_another_seed_another(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        answer = client.completions.create(model="tiny", prompt="Once", max_tokens=12, temperature=1.0, seed=seed)
        return answer.choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_a_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    free = client.completions.create(model="tiny", prompt="Once", max_tokens=12, temperature=0).choices[0].text
    stop = free.strip().split(" ")[min(2, len(free.strip().split(" ")) - 1)]
    assert stop

    stopped = client.completions.create(model="tiny", prompt="Once", max_tokens=12, temperature=0, stop=[stop])

    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == free[:free.index(stop)]


def test_errors_come_in_openais_shapes(served: tuple[str, DataPlane], client: openai.OpenAI) -> None:
    url, _ = served
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).chat.completions.create(
            model="tiny", messages=CHAT)
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4' is not available to tenant 'acme'"):
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    with pytest.raises(openai.BadRequestError, match="field 'temperature'") as bad:
        client.chat.completions.create(model="tiny", messages=CHAT, temperature=5)
    assert bad.value.body["type"] == "invalid_request_error" and bad.value.body["param"] == "temperature"  # type: ignore[index]
    small = openai.OpenAI(base_url=f"{url}/v1", api_key=SMALL, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="more than the whole quota of tenant 'small'"):
        small.completions.create(model="tiny", prompt="word " * 80, max_tokens=2)
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError, match="field 'tools' is .*; tool calls are not supported") as tools:
        client.chat.completions.create(model="tiny", messages=CHAT, tools=[tool])  # type: ignore[list-item]
    assert tools.value.param == "tools" and tools.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="json_object") as formatted:
        client.chat.completions.create(model="tiny", messages=CHAT, response_format={"type": "json_object"})
    assert formatted.value.param == "response_format"


def _slots(plane: DataPlane) -> tuple[int, int]:
    """(sequences in the engine, the tenant acme's generations in flight)."""
    served = next(iter(plane.models.values()))
    runtime = plane.cache.held(served.content_digest, plane.runtime)
    assert runtime is not None
    return runtime.engine.stats()["slots_busy"], plane.llm.gate(plane.tenants.tenants["acme"]).streams


def test_a_client_that_goes_away_mid_stream_frees_its_slots_at_once(served: tuple[str, DataPlane]) -> None:
    url, plane = served
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": "tiny", "messages": CHAT, "max_tokens": 400, "stream": True}) as answer:
        lines = answer.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert sum(1 for line in got if line.startswith("data: ")) >= 3
        assert _slots(plane) == (1, 1)  # generating now
    deadline = time.monotonic() + 5
    while _slots(plane) != (0, 0):
        assert time.monotonic() < deadline, f"slots still held: {_slots(plane)}"
        time.sleep(0.02)


def _loaded(url: str, plane: DataPlane) -> Any:
    """The tiny model's runtime, loaded by one request (so that its engine's decode steps can be counted)."""
    httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
               json={"model": "tiny", "prompt": "warm", "max_tokens": 1})
    served_model = next(iter(plane.models.values()))
    runtime = plane.cache.held(served_model.content_digest, plane.runtime)
    assert runtime is not None
    return runtime


def test_a_client_that_goes_away_before_its_whole_answer_frees_its_slots_at_once(
        served: tuple[str, DataPlane]) -> None:
    """Not streamed: the client's time-out closes the connection, which cancels the generation (its decode steps
    stop) and gives the tenant's stream slot back, as a stream's does."""
    url, plane = served
    runtime = _loaded(url, plane)
    for path, body in (("/v1/completions", {"prompt": "Once upon a time"}), ("/v1/chat/completions", {"messages": CHAT})):
        steps = runtime.engine.stats()["decode_steps"]
        with pytest.raises(httpx.ReadTimeout):  # 450 greedy tokens take about 2 s here
            httpx.post(f"{url}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=0.3,
                       json={"model": "tiny", **body, "max_tokens": 450, "temperature": 0})
        deadline = time.monotonic() + 5
        while _slots(plane) != (0, 0):
            assert time.monotonic() < deadline, f"slots still held: {_slots(plane)}"
            time.sleep(0.02)
        ran = runtime.engine.stats()["decode_steps"] - steps
        assert ran < 300, f"{ran} decode steps ran for a client that was gone"


def test_a_stream_past_the_tenants_token_quota_ends_cleanly_saying_why(served: tuple[str, DataPlane]) -> None:
    url, _ = served
    small = openai.OpenAI(base_url=f"{url}/v1", api_key=SMALL, max_retries=0)
    # greedy: sampled, a random-weight model may end its answer before the quota runs out
    chunks = list(small.chat.completions.create(model="tiny", messages=CHAT, max_tokens=200, stream=True,
                                                temperature=0))

    last: Any = chunks[-1].choices[0]
    assert last.finish_reason == "length"
    assert "tenant 'small' used its 60 tokens per minute" in last.model_extra["stop_reason"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert 0 < len(text)
    with pytest.raises(openai.RateLimitError) as limited:  # the quota is spent: the next is refused before it starts
        small.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    assert int(limited.value.response.headers["retry-after"]) >= 1


def test_streams_beyond_the_tenants_max_streams_are_refused_with_429(served: tuple[str, DataPlane]) -> None:
    url, plane = served
    clients = [httpx.Client(timeout=60) for _ in range(4)]  # held: a client (or line reader) collected closes its stream
    streams, readers = [], []
    try:
        for held in clients:
            stream = held.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                 json={"model": "tiny", "prompt": "Once", "max_tokens": 400, "stream": True})
            streams.append(stream)
            readers.append(stream.__enter__().iter_lines())
            next(readers[-1])
        refused = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                             json={"model": "tiny", "prompt": "Once", "max_tokens": 2})
        assert refused.status_code == 429 and "4 generations in flight, its max_streams" in refused.text
        assert refused.json()["error"]["type"] == "rate_limit_error"
        # counted beside the server's other quotas (the dashboards' "Over quota (429)")
        assert plane.metrics.registry.get_sample_value("shardline_rate_limited_total",
                                                       {"tenant": "acme", "quota": "streams"}) == 1
    finally:
        for stream in streams:
            stream.__exit__(None, None, None)
        for held in clients:
            held.close()


def test_an_answer_past_its_deadline_is_504_and_its_generation_stops(served: tuple[str, DataPlane]) -> None:
    url, plane = served
    # 400 greedy tokens take about 2 s here: 500 ms passes while the answer is generated, not before it starts
    late = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}", "X-Shardline-Timeout-Ms": "500"},
                      json={"model": "tiny", "messages": CHAT, "max_tokens": 400, "temperature": 0})
    assert late.status_code == 504, late.text
    assert late.json()["error"]["message"] == (
        "the answer was not complete when the request's deadline (x-shardline-timeout-ms) passed; ask for fewer "
        "max_tokens, stream it, or send a longer x-shardline-timeout-ms")
    deadline = time.monotonic() + 5
    while _slots(plane) != (0, 0):  # the engine's slot and the tenant's are given back
        assert time.monotonic() < deadline, f"slots still held: {_slots(plane)}"
        time.sleep(0.02)
    # a deadline it can meet is answered
    answer = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                        headers={"Authorization": f"Bearer {KEY}", "X-Shardline-Timeout-Ms": "60000"},
                        json={"model": "tiny", "messages": CHAT, "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] >= 1


def test_a_prompt_over_the_context_is_a_400_context_length_exceeded_streamed_or_not(
        served: tuple[str, DataPlane]) -> None:
    """Checked before the first byte of the answer: the official client raises BadRequestError with OpenAI's code,
    streamed too (no 200, role chunk and cut connection), and the refused prompt took nothing from the quota."""
    url, plane = served
    long_prompt = "word " * 900  # the tiny model's context is 512 tokens
    for api_key in (KEY, SMALL):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                answer = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=2, stream=stream)
                list(answer) if stream else None  # type: ignore[call-overload]
            assert refused.value.code == "context_length_exceeded" and refused.value.param == "prompt"
            assert "the prompt is 901 tokens; this model takes at most 511" in refused.value.message
            with pytest.raises(openai.BadRequestError) as chat_refused:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long_prompt}],
                                               stream=stream)
            assert chat_refused.value.code == "context_length_exceeded" and chat_refused.value.param == "messages"
    acme = plane.llm.gate(plane.tenants.tenants["acme"])
    assert acme.streams == 0


def test_get_health_answers_200_without_a_key(served: tuple[str, DataPlane]) -> None:
    answer = httpx.get(f"{served[0]}/health", timeout=10)
    assert answer.status_code == 200 and answer.content == b""


def test_a_failure_after_the_stream_started_ends_it_with_an_error_event_and_done(
        served: tuple[str, DataPlane]) -> None:
    """The engine gone between the request's checks and its first token: the stream has started (200, the role
    chunk), so it ends with OpenAI's error event and [DONE], never a cut connection."""
    url, plane = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    client.completions.create(model="tiny", prompt="warm", max_tokens=1)  # loaded
    served_model = next(iter(plane.models.values()))
    runtime = plane.cache.held(served_model.content_digest, plane.runtime)
    assert runtime is not None
    engine = runtime.engine
    submit = engine.submit

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the engine stopped")

    engine.submit = failing
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          timeout=60, json={"model": "tiny", "messages": CHAT, "stream": True}) as answer:
            assert answer.status_code == 200
            events = [line for line in answer.iter_lines() if line]
    finally:
        engine.submit = submit
    assert events[-1] == "data: [DONE]"
    error = orjson.loads(events[-2][len("data: "):])["error"]
    assert error["type"] == "server_error" and "internal error (RuntimeError)" in error["message"]
    assert plane.llm.gate(plane.tenants.tenants["acme"]).streams == 0


def test_v2_inference_on_a_text_model_is_refused_naming_the_v1_endpoints(served: tuple[str, DataPlane]) -> None:
    """V2 inference would bypass the tenant's token quota, stream slots and token metering (which only the
    generation endpoints hold): it is a 400 naming them, and nothing is generated or taken from the quota."""
    url, plane = served
    runtime = _loaded(url, plane)
    steps = runtime.engine.stats()["decode_steps"]
    body = {"inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [16], "data": ["Once upon a time"] * 16}]}
    for path in ("/v2/models/tiny/infer", "/v2/models/tiny/versions/1/infer"):
        refused = httpx.post(f"{url}{path}", headers={"Authorization": f"Bearer {SMALL}"}, json=body, timeout=60)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"] == (
            "tiny:1 generates text (runtime 'llm'): send its prompts to /v1/chat/completions or /v1/completions, "
            "where the tenant's token quotas and metering hold")
    assert runtime.engine.stats()["decode_steps"] == steps
    assert plane.llm.gate(plane.tenants.tenants["small"]).streams == 0
