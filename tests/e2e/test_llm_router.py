"""Text generation through `shardline router --local-replicas 2` as a user runs it, with the official openai
client: streams pass through as they come, prompts that share a prefix land on one replica, the tenant's
token quota is held at the router (a stream past it ends cleanly, saying why), and a client that goes away
mid-stream stops the generation on its replica (the replica's streams gauge is back to 0). The router runs on
its default data plane (nginx in front where installed, which passes every /v1 request on to the router)."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from shardline.local_ports import reserve_port as free_port
from shardline.online.router.nginx_front import find_nginx
from tests.e2e.conftest import SHARDLINE
from tests.support.routers import _env, _stop, _wait_ready, tiny_llm_home

KEY, SMALL = "sk-llm-router", "sk-llm-router-small"
pytestmark = pytest.mark.timeout(300)


@dataclass
class Routed:
    url: str
    log: Path
    replica_metrics: dict[str, str]  # replica url -> its metrics url


def _route_tiny(home: Path, tenants: list[tuple[str, str, str]], replicas: int, plane: str) -> Iterator[Routed]:
    """``shardline router --local-replicas N`` over the tiny LLM for ``tenants`` (name, key, the limit's YAML line)
    on ``plane``, until the generator is closed."""
    tenants_file = tiny_llm_home(home, tenants)
    port = free_port()
    log = home / "router.log"
    with open(log, "wb") as sink:
        router = subprocess.Popen([*SHARDLINE, "router", "--local-replicas", str(replicas), "--tenants",
                                   str(tenants_file), "--port", str(port), "--metrics-port", str(free_port())],
                                  env=_env(home, SHARDLINE_ROUTER_DATA_PLANE=plane),
                                  stdout=sink, stderr=subprocess.STDOUT, cwd=home)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, router, log, available=replicas)
        found = re.findall(r"started replica \d \(pid \d+\) on (http://[0-9.:]+) \(metrics on port (\d+)\)",
                           log.read_text())
        assert len(found) == replicas
        if plane == "nginx":
            assert "nginx" in log.read_text() and "in front of the router" in log.read_text()
        yield Routed(url, log, {replica: f"http://127.0.0.1:{metrics}/metrics" for replica, metrics in found})
    finally:
        _stop(router)


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routed]:
    """The router over 2 local replicas on its default data plane (nginx in front, if installed)."""
    yield from _route_tiny(tmp_path_factory.mktemp("llm-router-home"),
                           [("acme", KEY, "max_streams: 8"), ("small", SMALL, "tokens_per_minute: 80")], 2, "auto")


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _completion_tokens(routed: Routed) -> dict[str, float]:
    return {replica: _metric(httpx.get(metrics, timeout=10).text, "shardline_llm_tokens_total", kind="completion")
            for replica, metrics in routed.replica_metrics.items()}


def _streams(routed: Routed) -> float:
    return sum(_metric(httpx.get(m, timeout=10).text, "shardline_llm_streams", model="tiny")
               for m in routed.replica_metrics.values())


def test_a_stream_passes_through_the_router_as_it_comes(routed: Routed) -> None:
    client = openai.OpenAI(base_url=f"{routed.url}/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "list the parties"}]

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)

    assert len({c.id for c in chunks}) == 1 and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert whole.model == "tiny:1"  # the alias pinned at the router
    with pytest.raises(openai.NotFoundError, match="not available to tenant 'acme'"):
        client.chat.completions.create(model="gpt-4", messages=messages)
    with pytest.raises(openai.BadRequestError, match="field 'top_p'"):
        client.chat.completions.create(model="tiny", messages=messages, top_p=7)


def test_prompts_that_share_a_system_prompt_land_on_one_replica_and_others_spread(routed: Routed) -> None:
    """Each contract's questions go to one replica (its KV cache holds the prefix), and the contracts are spread
    over both replicas. A router that ignored the prefix would pass the first check for all 12 contracts once in
    about 16 million runs (3 questions each, 2 replicas); one that sent everything to one replica fails the second
    (a correct router fails it once in about 2,000 runs: all 12 prefixes hashed to one replica)."""
    client = openai.OpenAI(base_url=f"{routed.url}/v1", api_key=KEY, max_retries=0)
    used: set[str] = set()

    for contract in range(12):
        system = {"role": "system", "content": f"You answer questions about contract {contract}, clause by clause. " * 12}
        before = _completion_tokens(routed)
        for question in ("who signs?", "when does it end?", "who pays?"):
            client.chat.completions.create(model="tiny", messages=[system, {"role": "user", "content": question}],
                                           max_tokens=3, temperature=0)
        grew = {replica for replica, tokens in _completion_tokens(routed).items() if tokens > before[replica]}
        assert len(grew) == 1, f"contract {contract}'s questions went to {sorted(grew)}"
        used |= grew

    assert used == set(routed.replica_metrics)


def test_the_token_quota_is_held_at_the_router_and_a_stream_past_it_ends_cleanly(routed: Routed) -> None:
    small = openai.OpenAI(base_url=f"{routed.url}/v1", api_key=SMALL, max_retries=0)

    chunks = list(small.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go on"}],
                                                max_tokens=300, temperature=0, stream=True,  # greedy: no early end
                                                stream_options={"include_usage": True}))

    last: Any = chunks[-2].choices[0]
    assert last.finish_reason == "length"
    assert "tenant 'small' used its 80 tokens per minute" in last.model_extra["stop_reason"]
    usage = chunks[-1].usage  # asked for: the usage chunk ends a stopped stream too
    assert chunks[-1].choices == [] and usage is not None and 0 < usage.completion_tokens < 80
    assert usage.prompt_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    with pytest.raises(openai.RateLimitError):
        small.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "more"}], max_tokens=2)


def test_a_client_gone_mid_stream_stops_the_generation_on_its_replica(routed: Routed) -> None:
    with httpx.stream("POST", f"{routed.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 450, "stream": True}) as answer:
        assert answer.status_code == 200
        lines = answer.iter_lines()
        got = [next(lines) for _ in range(8)]
        assert sum(1 for line in got if line.startswith("data: ")) >= 3
        assert not [line for line in got if line.startswith(":")]  # the replica's comment lines stay at the router
        assert _streams(routed) == 1
    deadline = time.monotonic() + 10
    while _streams(routed) != 0:
        assert time.monotonic() < deadline, "the replica still generates for a client that is gone"
        time.sleep(0.05)


def _decode_steps(routed: Routed) -> float:
    return sum(_metric(httpx.get(m, timeout=10).text, "shardline_llm_decode_steps", model="tiny")
               for m in routed.replica_metrics.values())


def test_v2_inference_on_the_llm_through_the_router_is_refused_and_generates_nothing(routed: Routed) -> None:
    """The router passes V2 inference on to a replica, which refuses it for a model that generates text: its
    token quota and metering are held on the /v1 endpoints only."""
    before = _decode_steps(routed)
    body = {"inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [4], "data": ["Once upon a time"] * 4}]}

    refused = httpx.post(f"{routed.url}/v2/models/tiny/infer", headers={"Authorization": f"Bearer {SMALL}"},
                         json=body, timeout=60)

    assert refused.status_code == 400, refused.text
    assert "generates text (runtime 'llm'): send its prompts to /v1/chat/completions" in refused.json()["error"]
    assert _decode_steps(routed) == before


def test_eight_streams_through_the_router_share_their_forward_passes(routed: Routed) -> None:
    import concurrent.futures

    before = _decode_steps(routed)
    headers = {"Authorization": f"Bearer {KEY}", "X-Shardline-Route-Key": "one-replica"}

    together = threading.Barrier(8)

    def stream(i: int) -> list[str]:
        with httpx.Client(timeout=120) as client:  # made before the barrier: a client costs tens of ms to make
            together.wait()
            with client.stream("POST", f"{routed.url}/v1/completions", headers=headers,
                               json={"model": "tiny", "prompt": f"Story {i} starts", "max_tokens": 32, "temperature": 0,
                                     "stream": True}) as answer:
                return [line for line in answer.iter_lines() if line.startswith("data: ")]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streams = list(pool.map(stream, range(8)))

    for events in streams:
        assert events[-1] == "data: [DONE]"
        finishes = [e for e in events[:-1] if '"finish_reason":"' in e]
        assert len(finishes) == 1 and '"finish_reason":"length"' in finishes[0]
    steps = _decode_steps(routed) - before
    # one after another they take 8 x 31 = 248 steps; together, 31 plus however far apart they arrived (about half of
    # the sequential count leaves room for a loaded machine's stragglers)
    assert steps < 4 * 32, f"8 streams of 32 tokens took {steps} decode steps: they were not batched"


def test_a_replica_lost_mid_stream_ends_it_with_an_error_event_not_a_cut(routed: Routed) -> None:
    """Both replicas SIGKILLed while one streams: the client's stream ends as serve ends one whose model failed, with
    an error event (OpenAI's clients raise on it) and [DONE]. The router cut the connection instead (a new user's
    test: "peer closed connection without sending complete message body"). The last test of this router: its
    replicas are restarted, not waited for."""
    import os
    import signal

    import orjson

    pids = [int(pid) for pid in re.findall(r"started replica \d \(pid (\d+)\)", routed.log.read_text())]
    lines: list[str] = []
    with httpx.stream("POST", f"{routed.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "messages": [{"role": "user", "content": "tell me more"}],
                            "max_tokens": 400, "temperature": 0, "stream": True}, timeout=60) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():  # a cut connection raises here
            lines.append(line)
            if len(lines) == 6:
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]", lines[-4:]
    failed = orjson.loads(events[-2].removeprefix("data: "))
    assert "the replica generating this stream failed midway" in failed["error"]["message"], failed
    assert failed["error"]["type"] == "server_error"


PAIR, BUDGET = "sk-llm-pair", "sk-llm-budget"


@pytest.fixture(scope="module", params=["nginx", "python"])
def three(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routed]:
    """The router over 3 local replicas, on each data plane: nginx in front (every /v1 request passes through its
    lane to the router) and the router alone."""
    if request.param == "nginx" and find_nginx() is None:
        pytest.skip("nginx with its Lua module is not installed (make setup installs it)")
    yield from _route_tiny(tmp_path_factory.mktemp(f"llm-three-{request.param}"),
                           [("pair", PAIR, "max_streams: 2"), ("budget", BUDGET, "tokens_per_minute: 1500")], 3,
                           request.param)


def test_a_tenants_max_streams_is_held_for_all_replicas_together(three: Routed) -> None:
    """8 streams at once for a tenant of max_streams 2: exactly 2 stream (to their end, with no line of the
    replicas' own) and 6 are 429 with Retry-After before any byte; the replicas never run more than 2 of its
    generations at any moment (their streams gauges, read all along)."""
    import concurrent.futures

    most, watching = 0.0, True

    def watch() -> None:
        nonlocal most
        while watching:
            most = max(most, _streams(three))

    watcher = threading.Thread(target=watch)
    watcher.start()
    together = threading.Barrier(8)

    def stream(i: int) -> tuple[int, str | None, list[str]]:
        with httpx.Client(timeout=120) as client:  # made before the barrier: a client costs tens of ms to make
            together.wait()
            with client.stream("POST", f"{three.url}/v1/chat/completions", headers={"Authorization": f"Bearer {PAIR}"},
                               json={"model": "tiny", "messages": [{"role": "user", "content": f"story {i}"}],
                                     "max_tokens": 300, "temperature": 0, "stream": True}) as answer:
                return answer.status_code, answer.headers.get("retry-after"), list(answer.iter_lines())

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(stream, range(8)))
    finally:
        watching = False
        watcher.join()

    assert sorted(status for status, _, _ in answers) == [200, 200] + [429] * 6
    for status, retry_after, lines in answers:
        if status == 429:
            assert retry_after is not None and int(retry_after) >= 1
            assert "tenant 'pair' has 2 generations in flight, its max_streams" in "".join(lines)
        else:
            assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
            assert not [line for line in lines if line.startswith(":")]
    assert 1 <= most <= 2, f"the replicas ran {most} of the tenant's generations at once"


def test_a_prompt_over_the_context_is_refused_before_the_stream_and_takes_nothing(three: Routed) -> None:
    """Through the router, with the official client: a 400 with OpenAI's code context_length_exceeded, streamed
    or not; the refused prompts (901 tokens each, 3,604 in all) take nothing from a quota of 1,500 a minute."""
    client = openai.OpenAI(base_url=f"{three.url}/v1", api_key=BUDGET, max_retries=0)
    long_prompt = "word " * 900
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            answer = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=2, stream=stream)
            list(answer) if stream else None  # type: ignore[call-overload]
        assert refused.value.code == "context_length_exceeded" and "the prompt is 901 tokens" in refused.value.message
        with pytest.raises(openai.BadRequestError) as chat_refused:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long_prompt}],
                                           stream=stream)
        assert chat_refused.value.code == "context_length_exceeded"
    fine = client.completions.create(model="tiny", prompt="a short one", max_tokens=3)
    assert fine.usage is not None and fine.usage.completion_tokens >= 1


def test_tokens_answers_used_past_the_quota_are_owed_at_the_router(three: Routed) -> None:
    """The router charges an answer's tokens once it has them. Its bucket stopped at zero, forgiving the rest, so
    each answer was admitted on one token whatever it cost: a tenant of 300 tokens a minute used 1,166 in 10 s.
    Now what an answer used past the bucket is owed, and the next request waits it out (Retry-After says how long,
    not 1 s)."""
    client = openai.OpenAI(base_url=f"{three.url}/v1", api_key=BUDGET, max_retries=0)
    prompt = "word " * 400  # ~401 tokens a request against 1,500 a minute (25 a second)
    for _ in range(8):
        try:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=40)
        except openai.RateLimitError as refused:
            # owed: at least a second's refill more than the 1 s that one missing token takes (~11 s here when quiet)
            assert int(refused.response.headers["retry-after"]) >= 2, refused.response.headers
            assert "tenant 'budget' is over its 1500 tokens per minute" in refused.message
            return
    pytest.fail("8 answers of ~440 tokens each passed a quota of 1,500 tokens a minute")


def test_get_health_answers_200_without_a_key(three: Routed) -> None:
    answer = httpx.get(f"{three.url}/health", timeout=10)
    assert answer.status_code == 200 and "budget" not in answer.text and "pair" not in answer.text
