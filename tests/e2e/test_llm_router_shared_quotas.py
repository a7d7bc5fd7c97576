"""Two routers, one Redis, the tiny LLM: a tenant's token quota and its streams held for both routers together
(SHARDLINE_TENANCY_QUOTA_STORE, online/quota_store.py); with each data plane (nginx's lane passes every stream on
to its router, which charges the tokens and holds the streams in Redis)."""

from __future__ import annotations

import concurrent.futures
import subprocess
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from shardline.local_ports import reserve_port as free_port
from tests.e2e.conftest import SHARDLINE
from tests.support.redis_server import redis_server
from tests.support.routers import PLANES, _env, _stop, _wait_ready, tiny_llm_home

pytestmark = pytest.mark.timeout(240)
TOKENS, STREAMS = "sk-shared-tokens", "sk-shared-streams"


@pytest.fixture(scope="module", params=PLANES)
def urls(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    home = tmp_path_factory.mktemp(f"llm-shared-quotas-{request.param}")
    # 30 tokens a minute: one comes back every 2 s, so the second router's request finds none (at 80, one came back
    # every 0.75 s, within a loaded machine's pause between the two requests)
    tenants = tiny_llm_home(home, [("tokens", TOKENS, "tokens_per_minute: 30"), ("streams", STREAMS, "max_streams: 2")])
    redis = redis_server(home)
    routers: list[subprocess.Popen[bytes]] = []
    found: list[str] = []
    try:
        for i in range(2):
            port = free_port()
            log = home / f"router-{i}.log"
            with open(log, "wb") as sink:
                routers.append(subprocess.Popen(
                    [*SHARDLINE, "router", "--local-replicas", "1", "--tenants", str(tenants), "--port", str(port),
                     "--metrics-port", "off"],
                    env=_env(home, SHARDLINE_TENANCY_QUOTA_STORE=redis.url, SHARDLINE_TENANCY_QUOTA_STORE_ROUTERS="2",
                             SHARDLINE_ROUTER_DATA_PLANE=request.param),
                    stdout=sink, stderr=subprocess.STDOUT, cwd=home))
            found.append(f"http://127.0.0.1:{port}")
        for i, (url, router) in enumerate(zip(found, routers)):
            _wait_ready(url, router, home / f"router-{i}.log", available=1)
        yield found
    finally:
        for router in routers:
            _stop(router)
        redis.stop()


def test_a_token_quota_spent_through_one_router_is_spent_at_the_other(urls: list[str]) -> None:
    one = openai.OpenAI(base_url=f"{urls[0]}/v1", api_key=TOKENS, max_retries=0)
    two = openai.OpenAI(base_url=f"{urls[1]}/v1", api_key=TOKENS, max_retries=0)

    # greedy: sampled, the random-weight model can draw its end of text before the quota runs out (a CI run's
    # stream ended "stop", with no stop_reason to read)
    chunks = list(one.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go on"}],
                                              max_tokens=300, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))

    last: Any = chunks[-2].choices[0]
    assert "tenant 'tokens' used its 30 tokens per minute" in last.model_extra["stop_reason"]
    usage = chunks[-1].usage
    assert usage is not None and 0 < usage.completion_tokens < 30
    with pytest.raises(openai.RateLimitError, match="over its 30 tokens per minute"):  # a quota per router: 200
        two.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "more"}], max_tokens=2)


def test_max_streams_is_held_across_both_routers(urls: list[str]) -> None:
    headers = {"Authorization": f"Bearer {STREAMS}"}
    for url in urls:  # each router's replica has loaded the model
        warm = httpx.post(f"{url}/v1/completions", headers=headers, timeout=60,
                          json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert warm.status_code == 200
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 450, "stream": True}
    start = threading.Barrier(8)

    def one(url: str) -> tuple[int, str]:
        with httpx.Client(timeout=60) as client:
            start.wait()
            answer = client.post(f"{url}/v1/completions", headers=headers, json=body)
            return answer.status_code, answer.text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(one, urls * 4))  # 4 streams at once to each router

    refused = [text for status, text in outcomes if status == 429]
    # 2 streams for both routers together (a stream lasts ~100 ms, the 8 start within a few): max_streams per
    # router would have let 4 through
    assert 2 <= len(outcomes) - len(refused) <= 3, [status for status, _ in outcomes]
    assert all("generations in flight, its max_streams" in text for text in refused)
    assert all(status in (200, 429) for status, _ in outcomes)
