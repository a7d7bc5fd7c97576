"""The ``vllm`` runtime in every test run: its engine and ``serve``'s app over a server that answers as vLLM's
OpenAI server does (``tests/support/vllm_server.py``: the tiny Llama on the CPU engine, behind vLLM's wire
format, on a loopback port, with an API key).

- ``TestRemoteEngine``: the engine contract (``tests/engine_conformance.py``) on ``RemoteEngine``, and what it
  adds: what it sends vLLM, the abort in vLLM when a request is cancelled, nothing sent for a refused prompt,
  and a refusal or failure of vLLM ending the request with an error.
- A ``vllm`` bundle served as ``shardline serve`` serves it (``SHARDLINE_VLLM_URL`` mode) answering the official
  openai client, streamed and not; a prompt over the context is a 400 ``context_length_exceeded`` before
  anything reaches vLLM; a client gone mid-stream aborts the request in vLLM; batch ``predict`` gives what the
  CPU ``llm`` runtime gives on the same weights.

The real vLLM runs in ``test_vllm_runtime.py``, where it is installed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pyarrow as pa
import pytest

from shardline.build.llm_build import package_tiny_llm
from shardline.bundle import Manifest, read_manifest
from shardline.errors import ContextLengthExceeded, InferenceFailed
from shardline.online.dataplane import DataPlane
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.runtimes import RuntimeOptions, create_runtime
from shardline.runtimes.generation import Engine, EngineConfig, SamplingParams, TokenEvent
from shardline.runtimes.vllm import RemoteEngine, VllmModel
from shardline.storage.registry import ModelRegistry
from tests.engine_conformance import GREEDY, PROMPT, EngineConformance, Recorder, wait_until
from tests.support.serving import serve_home
from tests.support.vllm_server import VllmCompatibleServer, serve_vllm_compatible

VLLM_KEY, TENANT_KEY = "sk-vllm-stand-in", "sk-tenant"
CHAT: Any = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "name three rivers"}]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    folder = tmp_path_factory.mktemp("vllm") / "tiny"
    manifest = package_tiny_llm(folder, name="tiny", runtime="vllm")
    return folder, manifest


@pytest.fixture(scope="module")
def vllm(bundle: tuple[Path, Manifest]) -> Iterator[VllmCompatibleServer]:
    with serve_vllm_compatible(bundle[0], "tiny", api_key=VLLM_KEY) as server:
        yield server


def remote_engine(bundle: tuple[Path, Manifest], url: str, served_name: str = "tiny",
                  api_key: str | None = VLLM_KEY) -> RemoteEngine:
    config = EngineConfig.from_runtime_config(bundle[1].runtime_config, bundle[1].reference)
    return RemoteEngine(bundle[0], config, url, served_name, api_key)


@pytest.fixture(scope="module")
def remote(bundle: tuple[Path, Manifest], vllm: VllmCompatibleServer) -> Iterator[RemoteEngine]:
    engine = remote_engine(bundle, vllm.url)
    engine.start()
    yield engine
    engine.close()


class TestRemoteEngine(EngineConformance):
    @pytest.fixture
    def engine(self, remote: RemoteEngine) -> Engine:
        return remote

    @pytest.fixture
    def new_engine(self, bundle: tuple[Path, Manifest], vllm: VllmCompatibleServer) -> Callable[[], Engine]:
        return lambda: remote_engine(bundle, vllm.url)


def test_it_sends_token_ids_and_asks_for_token_ids_and_running_usage(remote: RemoteEngine,
                                                                    vllm: VllmCompatibleServer) -> None:
    ids = remote.tokenize(PROMPT)
    remote.generate(ids, SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, seed=3, stop=("zz",)))
    assert vllm.bodies[-1] == {
        "model": "tiny", "prompt": ids, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["zz"]}
    remote.generate(ids, SamplingParams(max_tokens=5, temperature=0.7, top_p=0.0))  # vLLM refuses top_p 0
    assert (vllm.bodies[-1]["temperature"], vllm.bodies[-1]["top_p"]) == (0.0, 1.0)  # the most likely token: greedy
    long = remote.tokenize("word " * 600)[:510]
    remote.generate(long, SamplingParams(max_tokens=100, temperature=0.0))
    assert vllm.bodies[-1]["max_tokens"] == 2  # what the context leaves: vLLM refuses more


def test_its_tokens_and_text_are_vllms_unchanged(remote: RemoteEngine, vllm: VllmCompatibleServer) -> None:
    """The stand-in generates with the CPU engine: through the wire, the same completion."""
    ids = remote.tokenize(PROMPT)
    for params in (GREEDY, SamplingParams(max_tokens=20, temperature=1.0, seed=9, stop=("the",))):
        assert remote.generate(ids, params) == vllm.engine.generate(ids, params)


def test_a_cancelled_request_is_aborted_in_vllm(remote: RemoteEngine, vllm: VllmCompatibleServer) -> None:
    before = vllm.aborted
    recorder = Recorder()
    handle = remote.submit(remote.tokenize(PROMPT), SamplingParams(max_tokens=400, temperature=0.0), recorder)
    wait_until(lambda: len(recorder.events) >= 3)
    assert vllm.running == 1
    handle.cancel()
    wait_until(lambda: (vllm.aborted, vllm.running, vllm.engine.stats()["slots_busy"]) == (before + 1, 0, 0))
    assert recorder.finished.wait(10) and recorder.events[-1].finish_reason == "cancelled"


def test_requests_one_after_another_reuse_one_kept_alive_connection_to_vllm(remote: RemoteEngine,
                                                                           vllm: VllmCompatibleServer) -> None:
    for _ in range(3):  # each stream is read to vLLM's [DONE], so that its connection serves the next one
        remote.generate(remote.tokenize(PROMPT), SamplingParams(max_tokens=3, temperature=0.0))
    assert len(set(vllm.peers[-3:])) == 1


def test_streams_submitted_on_an_event_loop_run_on_it_without_a_thread_each(remote: RemoteEngine) -> None:
    async def four_streams() -> tuple[set[int], int, int]:
        threads: set[int] = set()
        done = asyncio.Event()
        finished = [0]

        def on_event(event: TokenEvent) -> None:
            threads.add(threading.get_ident())
            if event.finish_reason is not None:
                finished[0] += 1
                if finished[0] == 4:
                    done.set()

        before = threading.active_count()
        for i in range(4):
            remote.submit(remote.tokenize(f"{PROMPT} {i}"), SamplingParams(max_tokens=6, temperature=0.0), on_event)
        await asyncio.sleep(0.05)
        during = threading.active_count()
        await asyncio.wait_for(done.wait(), 30)
        return threads, before, during

    threads, before, during = asyncio.run(four_streams())
    assert threads == {threading.get_ident()}  # every event on the loop that submitted it: no hop, no thread
    assert during == before


def test_a_prompt_refused_here_never_reaches_vllm(remote: RemoteEngine, vllm: VllmCompatibleServer) -> None:
    sent = len(vllm.bodies)
    with pytest.raises(ContextLengthExceeded):
        remote.generate_many([remote.tokenize(PROMPT), remote.tokenize("word " * 600)], GREEDY)
    assert len(vllm.bodies) == sent


def test_vllm_refusing_or_failing_ends_the_request_with_an_error(bundle: tuple[Path, Manifest],
                                                                  vllm: VllmCompatibleServer) -> None:
    cases = [(remote_engine(bundle, vllm.url, served_name="other"), "vLLM answered 404: The model `other` does not exist."),
             (remote_engine(bundle, vllm.url, api_key="sk-wrong"), "vLLM answered 401"),
             (remote_engine(bundle, "http://127.0.0.1:9"), "ConnectError")]
    for engine, message in cases:
        engine.start()
        try:
            with pytest.raises(InferenceFailed, match=message):
                engine.generate(engine.tokenize(PROMPT), GREEDY)
            assert engine.stats()["slots_busy"] == 0
        finally:
            engine.close()


def test_vllm_failing_mid_stream_ends_the_request_with_its_error(bundle: tuple[Path, Manifest]) -> None:
    with serve_vllm_compatible(bundle[0], "tiny", max_batch=2) as failing:
        engine = remote_engine(bundle, failing.url, api_key=None)
        engine.start()
        try:
            recorder = Recorder()
            engine.submit(engine.tokenize(PROMPT), SamplingParams(max_tokens=400, temperature=0.0), recorder)
            wait_until(lambda: len(recorder.events) >= 2)
            failing.engine.close()  # vLLM's engine dies under the request: its error object, then [DONE]
            assert recorder.finished.wait(10)
        finally:
            engine.close()
    last = recorder.events[-1]
    assert last.finish_reason == "error" and last.error == "vLLM failed: the request was aborted"


# -- served ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(bundle: tuple[Path, Manifest], vllm: VllmCompatibleServer,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, DataPlane]]:
    home = tmp_path_factory.mktemp("vllm-home")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias("tiny", "prod", registry.push(bundle[0]).version or 1)
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key(TENANT_KEY)], "models": ["tiny@prod"], "max_streams": 4}]})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SHARDLINE_VLLM_URL", vllm.url)
        env.setenv("SHARDLINE_VLLM_API_KEY", VLLM_KEY)
        env.setenv("SHARDLINE_VLLM_DEVICE", "cpu")
        with serve_home(home, tenants) as served:
            yield served


@pytest.fixture
def client(served: tuple[str, DataPlane]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=TENANT_KEY, max_retries=0)


def test_serve_answers_the_openai_client_from_vllm_streamed_and_not(client: openai.OpenAI,
                                                                     vllm: VllmCompatibleServer) -> None:
    text = client.completions.create(model="tiny", prompt="The river", max_tokens=5, temperature=0)
    engine = vllm.engine
    assert text.choices[0].text == engine.generate(engine.tokenize("The river"), SamplingParams(max_tokens=5,
                                                                                               temperature=0.0)).text
    assert text.model == "tiny:1" and text.usage is not None and text.usage.completion_tokens == 5

    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 8
    assert vllm.bodies[-1]["prompt"] == engine.tokenize(engine.chat_prompt(CHAT))  # the chat template's prompt


def test_a_prompt_over_the_context_is_a_400_context_length_exceeded_and_never_reaches_vllm(
        client: openai.OpenAI, vllm: VllmCompatibleServer) -> None:
    sent = len(vllm.bodies)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            answer = client.completions.create(model="tiny", prompt="word " * 900, max_tokens=2, stream=stream)
            list(answer) if stream else None  # type: ignore[call-overload]
        assert refused.value.code == "context_length_exceeded"
        assert "the prompt is 901 tokens; this model takes at most 511" in refused.value.message
        with pytest.raises(openai.BadRequestError) as chat_refused:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 900}],
                                           stream=stream)
        assert chat_refused.value.code == "context_length_exceeded"
    assert len(vllm.bodies) == sent


def test_a_client_gone_mid_stream_aborts_the_request_in_vllm(served: tuple[str, DataPlane],
                                                             vllm: VllmCompatibleServer) -> None:
    url, plane = served
    before = vllm.aborted
    with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {TENANT_KEY}"}, timeout=60,
                      json={"model": "tiny", "prompt": "Once", "max_tokens": 400, "stream": True}) as answer:
        lines = answer.iter_lines()
        assert sum(1 for _ in range(6) if next(lines).startswith("data: ")) >= 3
        assert vllm.running == 1
    runtime = plane.cache.held(next(iter(plane.models.values())).content_digest, plane.runtime)
    assert isinstance(runtime, VllmModel)
    deadline = time.monotonic() + 10
    while (vllm.aborted, vllm.running, runtime.engine.stats()["slots_busy"]) != (before + 1, 0, 0):
        assert time.monotonic() < deadline, "the request still runs in vLLM after its client went away"
        time.sleep(0.02)
    assert plane.llm.gate(plane.tenants.tenants["acme"]).streams == 0


def test_serve_passes_the_first_token_on_while_vllm_holds_the_next(served: tuple[str, DataPlane],
                                                                    vllm: VllmCompatibleServer) -> None:
    url = served[0]
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 6, "stream": True, "temperature": 0}
    vllm.hold.set()  # vLLM sends the first token, then nothing until released
    try:
        with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {TENANT_KEY}"},
                          json=body, timeout=httpx.Timeout(30, read=10)) as answer:
            lines = answer.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))  # a ReadTimeout if it was held back
            assert vllm.hold.is_set() and json.loads(first[6:])["choices"][0]["finish_reason"] is None
            vllm.hold.clear()
            rest = [line for line in lines if line.startswith("data: ")]
    finally:
        vllm.hold.clear()
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    peers = len(vllm.peers)
    with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {TENANT_KEY}"},
                      json=body, timeout=30) as answer:
        answer.read()
    assert len(vllm.peers) == peers + 1 and vllm.peers[-1] == vllm.peers[-2]  # the same kept-alive connection


def test_a_short_prompt_is_tokenized_on_the_loop_a_long_one_on_the_codec_threads(
        served: tuple[str, DataPlane], monkeypatch: pytest.MonkeyPatch) -> None:
    url, plane = served
    hops: list[str] = []
    off_loop = plane.off_loop

    async def recorded(call: Any) -> Any:
        hops.append("codec")
        return await off_loop(call)

    monkeypatch.setattr(plane, "off_loop", recorded)
    headers = {"Authorization": f"Bearer {TENANT_KEY}"}
    answer = httpx.post(f"{url}/v1/completions", headers=headers, timeout=30,
                        json={"model": "tiny", "prompt": "The river " * 50, "max_tokens": 2})
    assert answer.status_code == 200 and hops == []  # ~500 characters: no hop to a thread for a millisecond's work
    refused = httpx.post(f"{url}/v1/completions", headers=headers, timeout=30,
                         json={"model": "tiny", "prompt": "word " * 1000, "max_tokens": 2})
    assert refused.status_code == 400 and hops == ["codec"]  # 5,000 characters: tokenized off the loop, then refused


def test_batch_predict_gives_what_the_cpu_runtime_gives_on_the_same_weights(
        bundle: tuple[Path, Manifest], vllm: VllmCompatibleServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDLINE_VLLM_URL", vllm.url)
    monkeypatch.setenv("SHARDLINE_VLLM_API_KEY", VLLM_KEY)
    manifest = read_manifest(bundle[0])
    options = RuntimeOptions(device="cpu", intra_op_threads=1)
    served, cpu = (create_runtime(bundle[0], m, options)
                   for m in (manifest, manifest.model_copy(update={"runtime": "llm"})))
    rows = pa.table({"prompt": ["The river", "Once upon a time", '[{"role": "user", "content": "name a bridge"}]']})
    served.load()
    cpu.load()
    try:
        assert isinstance(served, VllmModel)
        assert served.predict(rows).equals(cpu.predict(rows))
        assert served.predict(rows).column("completion_tokens").to_pylist() == [64, 64, 64]  # generation_config
    finally:
        served.close()
        cpu.close()
