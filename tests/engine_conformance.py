"""The generation engine contract as tests: one abstract class each engine's tests mix in (as ``runtime_conformance``).

``shardline.runtimes.generation.Engine`` states the contract that the HTTP tier and batch generation rely on;
``EngineConformance`` checks it on the tiny Llama that ``shardline.build.llm_build.package_tiny_llm`` builds (its
default shape and chat template). An engine's test module subclasses it
(``class TestMyEngine(EngineConformance)``) and provides two fixtures:

- ``engine``: a started engine over that bundle (any scope; a class or module one saves the loads), its
  context large enough for a prompt of a few hundred tokens;
- ``new_engine``: a function that makes another one, not started, over the same bundle (for the start and
  close checks; the suite closes what it makes).

The checks: tokens come in order with exactly one finish_reason, last; the streamed pieces add up to the
completion; ``max_tokens``, a full context and a stop string end a sequence as the contract says; cancel
ends a request with one "cancelled" event and frees it; the prompt check refuses empty, over-context and
out-of-vocabulary prompts before anything is queued or sent; ``generate_many`` answers each prompt as
alone, in order, with its usage; a seed gives the same text again; ``top_p`` 0 is the most likely token;
``close`` ends what runs. This class is not collected by itself: its name does not start with ``Test``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from shardline.errors import ContextLengthExceeded, InvalidInput, InvalidParameter
from shardline.runtimes.generation import Engine, SamplingParams, TokenEvent

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
PROMPT = "The quarterly report says revenue grew"


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


class Recorder:
    """An on_event that keeps every event and says when the last one came."""

    def __init__(self) -> None:
        self.events: list[TokenEvent] = []
        self.finished = threading.Event()

    def __call__(self, event: TokenEvent) -> None:
        self.events.append(event)
        if event.finish_reason is not None:
            self.finished.set()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)


class EngineConformance:
    """What every generation engine must do, checked on the engines its subclass provides."""

    @pytest.fixture
    def engine(self) -> Engine:
        raise NotImplementedError("an engine's conformance tests provide the engine fixture")

    @pytest.fixture
    def new_engine(self) -> Callable[[], Engine]:
        raise NotImplementedError("an engine's conformance tests provide the new_engine fixture")

    @pytest.fixture
    def fresh(self, new_engine: Callable[[], Engine]) -> Iterator[Engine]:
        """An engine of its own, not started; closed at the end of the test."""
        made = new_engine()
        yield made
        made.close()

    # -- determinism -----------------------------------------------------------------------------

    def test_greedy_generation_is_deterministic_and_fills_max_tokens(self, engine: Engine) -> None:
        first = engine.generate(engine.tokenize(PROMPT), GREEDY)
        second = engine.generate(engine.tokenize(PROMPT), GREEDY)
        assert first == second
        assert first.text.strip() and first.finish_reason == "length"
        assert (first.completion_tokens, len(first.token_ids)) == (24, 24)
        assert first.prompt_tokens == len(engine.tokenize(PROMPT))

    def test_the_same_seed_gives_the_same_text_and_other_seeds_differ(self, engine: Engine) -> None:
        ids = engine.tokenize(PROMPT)
        seeded = [engine.generate(ids, SamplingParams(max_tokens=16, temperature=1.0, seed=seed)) for seed in (7, 7, 8)]
        assert seeded[0] == seeded[1]
        assert seeded[0].token_ids != seeded[2].token_ids
        assert seeded[0].token_ids != engine.generate(ids, GREEDY).token_ids[:16]

    def test_top_p_zero_keeps_only_the_most_likely_token(self, engine: Engine) -> None:
        ids = engine.tokenize(PROMPT)
        nucleus = engine.generate(ids, SamplingParams(max_tokens=24, temperature=1.0, top_p=0.0, seed=3))
        assert nucleus.token_ids == engine.generate(ids, GREEDY).token_ids
        narrow = [engine.generate(ids, SamplingParams(max_tokens=16, temperature=1.5, top_p=0.5, seed=s)) for s in (1, 1)]
        assert narrow[0] == narrow[1]

    def test_the_text_is_the_text_of_the_tokens(self, engine: Engine) -> None:
        done = engine.generate(engine.tokenize(PROMPT), GREEDY)
        assert done.finish_reason == "length" and done.text == engine.detokenize(done.token_ids)

    # -- a stream --------------------------------------------------------------------------------

    def test_tokens_stream_in_order_and_one_finish_reason_comes_last(self, engine: Engine) -> None:
        ids = engine.tokenize(PROMPT)
        recorder = Recorder()
        engine.submit(ids, GREEDY, recorder)
        assert recorder.finished.wait(30)
        whole = engine.generate(ids, GREEDY)
        finishes = [e.finish_reason for e in recorder.events if e.finish_reason is not None]
        assert finishes == ["length"] and recorder.events[-1].finish_reason == "length"
        counts = [e.completion_tokens for e in recorder.events]
        assert counts == sorted(counts) and counts[-1] == 24 == sum(len(e.token_ids) for e in recorder.events)
        assert tuple(t for e in recorder.events for t in e.token_ids) == whole.token_ids
        assert recorder.text == whole.text
        assert {e.prompt_tokens for e in recorder.events} == {len(ids)}
        assert sum(bool(e.text) for e in recorder.events) > 1  # streamed as it goes, not all at the end

    def test_a_stop_string_ends_the_text_before_it(self, engine: Engine) -> None:
        ids = engine.tokenize(PROMPT)
        baseline = engine.generate(ids, SamplingParams(max_tokens=32, temperature=0.0))
        words = baseline.text.split()
        stop = next(w for w in words[3:] if len(w) >= 3 and baseline.text.count(w) == 1)
        at = baseline.text.index(stop)
        recorder = Recorder()
        engine.submit(ids, SamplingParams(max_tokens=32, temperature=0.0, stop=("never appears", stop)), recorder)
        assert recorder.finished.wait(10)
        assert recorder.text == baseline.text[:at]
        assert recorder.events[-1].finish_reason == "stop"
        assert recorder.events[-1].completion_tokens < 32
        assert all(stop not in e.text for e in recorder.events)

    def test_max_tokens_and_a_full_context_end_a_sequence_with_length(self, engine: Engine) -> None:
        short = engine.generate(engine.tokenize(PROMPT), SamplingParams(max_tokens=5, temperature=0.0))
        assert (short.completion_tokens, len(short.token_ids), short.finish_reason) == (5, 5, "length")
        context = engine.config.max_context
        prompt = engine.tokenize("word " * context)[:context - 4]  # room for 4 tokens
        full = engine.generate(prompt, SamplingParams(max_tokens=100, temperature=0.0))
        assert (full.prompt_tokens, full.completion_tokens, full.finish_reason) == (context - 4, 4, "length")

    def test_cancel_ends_the_request_with_one_cancelled_event_and_frees_it(self, engine: Engine) -> None:
        recorder = Recorder()
        handle = engine.submit(engine.tokenize(PROMPT), SamplingParams(max_tokens=400, temperature=0.0), recorder)
        wait_until(lambda: len(recorder.events) >= 3)
        assert engine.stats()["slots_busy"] == 1
        handle.cancel()
        assert recorder.finished.wait(10)
        wait_until(lambda: engine.stats()["slots_busy"] == 0)
        finals = [e for e in recorder.events if e.finish_reason is not None]
        assert [e.finish_reason for e in finals] == ["cancelled"] and recorder.events[-1] is finals[0]
        assert finals[0].completion_tokens < 400
        handle.cancel()  # harmless after the end
        assert engine.generate(engine.tokenize(PROMPT), GREEDY).finish_reason == "length"  # the engine goes on

    # -- prompts ---------------------------------------------------------------------------------

    def test_the_prompt_check_refuses_empty_over_context_and_unknown_token_prompts(self, engine: Engine) -> None:
        most = engine.max_prompt_tokens
        assert most == engine.config.max_context - 1
        ids = engine.tokenize(PROMPT)
        assert engine.check_prompt(ids) == ids
        long = engine.tokenize("word " * (most + 1))
        with pytest.raises(ContextLengthExceeded) as refused:
            engine.check_prompt(long)
        assert (refused.value.prompt_tokens, refused.value.most) == (len(long), most)
        assert str(refused.value).startswith(f"the prompt is {len(long)} tokens; this model takes at most {most}")
        with pytest.raises(InvalidInput, match="no tokens"):
            engine.check_prompt([])
        with pytest.raises(InvalidInput, match="vocabulary"):
            engine.check_prompt([ids[0], 10**7])

    def test_a_refused_prompt_is_refused_before_anything_is_queued_or_sent(self, engine: Engine) -> None:
        long = engine.tokenize("word " * engine.config.max_context)
        before = engine.stats()
        with pytest.raises(ContextLengthExceeded):
            engine.submit(long, GREEDY, Recorder())
        with pytest.raises(ContextLengthExceeded):
            engine.generate_many([engine.tokenize(PROMPT), long], GREEDY)  # the good one is not sent either
        with pytest.raises(InvalidInput, match="no tokens"):
            engine.generate([], GREEDY)
        assert engine.stats() == before

    def test_chat_messages_become_the_prompt_through_the_bundles_template(self, engine: Engine) -> None:
        messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
        assert engine.chat_prompt(messages) == "system: Be brief.\nuser: Hi\nassistant:"
        with pytest.raises(InvalidParameter, match=r"messages\[0\]\.role"):
            engine.chat_prompt([{"role": "wizard", "content": "b"}])

    # -- several at once -------------------------------------------------------------------------

    def test_generate_many_answers_each_prompt_as_alone_in_order_with_its_usage(self, engine: Engine) -> None:
        prompts = [engine.tokenize(f"{PROMPT} in region {i}" * (i + 1)) for i in range(4)]
        params = SamplingParams(max_tokens=8, temperature=0.0)
        together = engine.generate_many(prompts, params)
        assert together == [engine.generate(prompt, params) for prompt in prompts]
        assert [c.prompt_tokens for c in together] == [len(p) for p in prompts]
        assert all(c.completion_tokens == len(c.token_ids) == 8 for c in together)
        assert len({c.token_ids for c in together}) > 1
        assert engine.generate_many([], params) == []

    def test_stats_count_the_tokens_generated_and_the_requests_running(self, engine: Engine) -> None:
        before = engine.stats()
        done = engine.generate(engine.tokenize(PROMPT), SamplingParams(max_tokens=6, temperature=0.0))
        after = engine.stats()
        assert after["tokens_generated"] - before["tokens_generated"] == done.completion_tokens == 6
        assert after["slots_busy"] == 0

    # -- start and close -------------------------------------------------------------------------

    def test_close_cancels_what_runs_and_refuses_more(self, fresh: Engine) -> None:
        with pytest.raises(RuntimeError, match="start"):
            fresh.submit([1, 2, 3], GREEDY, Recorder())
        fresh.start()
        recorders = [Recorder() for _ in range(2)]
        for recorder in recorders:
            fresh.submit(fresh.tokenize(PROMPT), SamplingParams(max_tokens=400, temperature=0.0), recorder)
        wait_until(lambda: all(r.events for r in recorders))
        fresh.close()
        fresh.close()  # twice is harmless
        assert all(r.finished.wait(10) for r in recorders)
        assert [r.events[-1].finish_reason for r in recorders] == ["cancelled", "cancelled"]
        assert all(sum(e.finish_reason is not None for e in r.events) == 1 for r in recorders)
        with pytest.raises(RuntimeError, match="close"):
            fresh.submit(fresh.tokenize(PROMPT), GREEDY, Recorder())
