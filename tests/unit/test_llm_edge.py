"""Text generation at the edge, without a model: OpenAI's request fields checked one by one, the tenants' LLM
quotas (streams in flight, tokens per minute), and the router's placement key and metered relay."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import orjson
import pytest

from shardline.errors import InvalidInput, RateLimited
from shardline.online.admission import TokenBucket
from shardline.online.generation import LlmGate
from shardline.openai_wire import parse_generation_request
from shardline.online.router.streams import affinity, metered, stop_chunk, tokens_of
from shardline.online.tenants import Tenant


def _body(**fields: object) -> bytes:
    return orjson.dumps({"model": "tiny", **fields})


def test_a_chat_request_is_read_with_every_field_the_openai_client_sends() -> None:
    parsed = parse_generation_request(_body(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        stream=True, stream_options={"include_usage": True}, max_completion_tokens=7, max_tokens=99, stop="\n",
        temperature=0.5, top_p=0.9, seed=3, user="u-1", n=1), chat=True)

    assert parsed.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (parsed.stream, parsed.include_usage, parsed.max_tokens, parsed.stop) == (True, True, 7, ("\n",))
    assert (parsed.temperature, parsed.top_p, parsed.seed, parsed.user) == (0.5, 0.9, 3, "u-1")
    completion = parse_generation_request(_body(prompt=["once upon"], max_tokens=5), chat=False)
    assert (completion.prompt, completion.max_tokens, completion.stream, completion.temperature) == ("once upon", 5,
                                                                                                   False, 1.0)


@pytest.mark.parametrize("fields, chat, named", [
    ({"messages": []}, True, "field 'messages'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, True, "field 'messages[0].role'"),
    ({"messages": [{"role": "user", "content": 3}]}, True, "field 'messages[0].content'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, True, "text only"),
    ({"prompt": [1, 2, 3]}, False, "field 'prompt'"),
    ({"prompt": "x", "temperature": 3}, False, "field 'temperature'"),
    ({"prompt": "x", "top_p": -0.1}, False, "field 'top_p'"),
    ({"prompt": "x", "max_tokens": 0}, False, "field 'max_tokens'"),
    ({"prompt": "x", "n": 2}, False, "field 'n'"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, False, "field 'stop'"),
    ({"prompt": "x", "seed": "7"}, False, "field 'seed'"),
    ({"prompt": "x", "stream": "yes"}, False, "field 'stream'"),
    ({"prompt": "x", "logprobs": 2}, False, "'logprobs'"),
    ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, False,
     "field 'stream_options.include_usage' is 'yes'; send true or false"),
])
def test_a_wrong_field_is_a_400_naming_it(fields: dict[str, object], chat: bool, named: str) -> None:
    with pytest.raises(InvalidInput, match=named.replace("[", r"\[").replace("]", r"\]")):
        parse_generation_request(_body(**fields), chat)


@pytest.mark.parametrize("field, value, why", [
    ("tools", [{"type": "function", "function": {"name": "f"}}], "tool calls are not supported"),
    ("tool_choice", "auto", "tool calls are not supported"),
    ("parallel_tool_calls", True, "tool calls are not supported"),
    ("functions", [{"name": "f"}], "function calls are not supported"),
    ("function_call", "auto", "function calls are not supported"),
    ("response_format", {"type": "json_object"}, "without JSON mode or schemas"),
    ("logit_bias", {"42": 100}, "logit bias is not supported"),
    ("presence_penalty", 0.5, "penalties are not supported"),
    ("frequency_penalty", -1, "penalties are not supported"),
    ("suffix", "the end", "a suffix (insertion) is not supported"),
    ("logprobs", True, "log probabilities are not offered"),
    ("top_logprobs", 3, "log probabilities are not offered"),
    ("echo", True, "echoing the prompt is not offered"),
    ("best_of", 3, "this server generates one choice per request"),
])
def test_what_is_not_built_is_refused_by_name_with_its_param(field: str, value: object, why: str) -> None:
    """Accepted and ignored, a client relying on them would get text it did not ask for: each is a 400 naming it
    (OpenAI's ``param``), on both endpoints, while the value that asks for nothing passes."""
    from shardline.openai_wire import error_object

    for chat, fields in ((True, {"messages": [{"role": "user", "content": "hi"}]}), (False, {"prompt": "hi"})):
        with pytest.raises(InvalidInput) as refused:
            parse_generation_request(_body(**fields, **{field: value}), chat)
        assert str(refused.value).startswith(f"field '{field}' is ") and f"{why}: leave it out" in str(refused.value)
        assert error_object(str(refused.value), 400)["error"]["param"] == field
    quiet = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": {},
             "presence_penalty": 0, "frequency_penalty": 0.0, "suffix": None, "logprobs": False, "echo": False,
             "best_of": 1}
    assert parse_generation_request(_body(prompt="hi", **quiet), False).prompt == "hi"


def test_a_tool_message_is_refused_for_tool_calls_as_the_chat_template_would() -> None:
    from shardline.runtimes.generation.requests import CHAT_ROLES

    with pytest.raises(InvalidInput, match=r"field 'messages\[1\].role' is 'tool'; tool and function calls are not"):
        parse_generation_request(_body(messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "4"}]),
                                 chat=True)
    roles = [{"role": role, "content": "x"} for role in CHAT_ROLES]  # every role the wire takes, the template takes
    assert [m["role"] for m in parse_generation_request(_body(messages=roles), chat=True).messages or []] == list(
        CHAT_ROLES)


@pytest.mark.parametrize("raw, field, message", [
    (b'"seed": 1180591620717411303424', "seed",
     "field 'seed' is out of range; send a whole number from -9223372036854775808 to 9223372036854775807"),
    (b'"max_tokens": 1000000000000000000000000000000', "max_tokens",
     "field 'max_tokens' is out of range; send a whole number from 1 to 9223372036854775807"),
    (b'"seed": 9223372036854775808', "seed", "field 'seed' is out of range"),
    (b'"seed": 1.5', "seed", "field 'seed' is 1.5; send a whole number"),
    (b'"max_tokens": 0', "max_tokens", "field 'max_tokens' is 0; send a whole number of at least 1"),
])
def test_a_whole_number_past_64_bits_is_out_of_range_not_a_float(raw: bytes, field: str, message: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        parse_generation_request(b'{"model": "tiny", "prompt": "x", ' + raw + b"}", chat=False)
    assert str(refused.value) == message or str(refused.value).startswith(message)
    assert "e+" not in str(refused.value)


def _tenant(tpm: int | None = None, streams: int | None = None) -> Tenant:
    return Tenant(name="acme", priority="normal", models={}, tokens_per_minute=tpm, max_streams=streams)


def test_streams_in_flight_are_bounded_and_given_back() -> None:
    gate = LlmGate(_tenant(streams=2), lambda: 0.0)
    gate.open(5)
    gate.open(5)
    with pytest.raises(RateLimited, match="2 generations in flight, its max_streams"):
        gate.open(5)
    gate.close()
    gate.open(5)
    assert gate.streams == 2


def test_the_token_quota_is_checked_before_a_stream_and_spent_during_it() -> None:
    now = [0.0]
    gate = LlmGate(_tenant(tpm=600), lambda: now[0])  # 10 tokens a second, at most 600 at once
    gate.open(500)
    assert gate.spend(90) and not gate.spend(20)  # 10 left: the stream that asked for 20 must stop
    gate.close()
    with pytest.raises(RateLimited) as waited:
        gate.open(50)  # the 20 were used all the same: 10 in debt, so 50 tokens come back in 6 s (not 5)
    assert waited.value.retry_after == 6
    now[0] = 6.0
    gate.open(50)
    with pytest.raises(InvalidInput, match="more than the whole quota of tenant 'acme', 600 tokens per minute"):
        gate.open(601)
    unlimited = LlmGate(_tenant(), lambda: 0.0)
    unlimited.open(10**6)
    assert unlimited.spend(10**6)


def test_tokens_used_past_the_bucket_are_owed_as_the_shared_store_owes_them() -> None:
    # A router charges an answer's tokens once it has them: a bucket that stopped at zero forgave the rest, and a
    # tenant of 300 tokens a minute used 1,166 in 10 s through the router (each answer admitted on one token).
    now = [0.0]
    gate = LlmGate(_tenant(tpm=300), lambda: now[0])  # 5 tokens a second
    gate.open(0)
    assert not gate.spend(404)  # the bucket held 300: 104 owed
    gate.close()
    now[0] = 3.0  # 15 back: still 89 owed
    with pytest.raises(RateLimited) as waited:
        gate.open(0)
    assert waited.value.retry_after == 18  # (89 + 1) / 5 s until one token is there
    bucket = TokenBucket(1.0, 10)
    assert not bucket.spend(0.0, 50) and bucket.tokens == -10  # never more than a burst in debt


def test_a_bucket_tells_how_long_until_tokens_are_there_without_taking_them() -> None:
    bucket = TokenBucket(2.0, 4)
    assert bucket.wait(0.0, 3) == 0.0 and bucket.tokens == 4.0
    assert bucket.take(0.0, 4) == 0.0 and bucket.wait(0.0, 1) == pytest.approx(0.5)
    assert bucket.take(1.0, 10) == float("inf")


def test_placement_affinity_follows_the_route_key_then_the_user_then_the_prompts_prefix() -> None:
    system = {"role": "system", "content": "You answer questions about the attached 40-page contract. " * 20}
    a = affinity({"messages": [system, {"role": "user", "content": "who signs?"}]}, None)
    b = affinity({"messages": [system, {"role": "user", "content": "when does it end?"}]}, None)
    other = affinity({"messages": [{"role": "system", "content": "You write poems."},
                                   {"role": "user", "content": "who signs?"}]}, None)

    assert a == b and a.startswith("prefix:") and other != a  # the same long system prompt: the same replica
    assert affinity({"prompt": "x", "user": "u-7"}, None) == "user:u-7"
    assert affinity({"prompt": "x", "user": "u-7"}, "k") == "key:k"


def _collect(stream: AsyncIterator[bytes]) -> bytes:
    async def run() -> bytes:
        return b"".join([piece async for piece in stream])

    return asyncio.run(run())


async def _pieces(*pieces: bytes) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


def _chunk(text: str) -> bytes:
    doc = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny:1",
           "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def test_the_relay_drops_token_comments_and_passes_every_event_split_anywhere() -> None:
    events = b": tokens 1\n\n" + _chunk("Hel") + b": tokens 2\n\n" + _chunk("lo") + b"data: [DONE]\n\n"
    gate = LlmGate(_tenant(tpm=600), lambda: 0.0)
    gate.open(0)
    ended: list[bool] = []

    out = _collect(metered(_pieces(events[:7], events[7:40], events[40:]), gate, 4, True, lambda: ended.append(True)))

    assert out == _chunk("Hel") + _chunk("lo") + b"data: [DONE]\n\n"
    assert gate.bucket is not None and gate.bucket.tokens == pytest.approx(600 - 4 - 3)
    assert ended == [True] and tokens_of(b": tokens 12") == 12 and tokens_of(b"data: {}") is None


def test_a_stream_past_the_quota_is_stopped_cleanly_with_the_reason() -> None:
    events = b"".join(b": tokens 4\n\n" + _chunk(str(i)) for i in range(5))
    gate = LlmGate(_tenant(tpm=10), lambda: 0.0)  # 10 tokens: the prompt's 2, then two pieces of 4
    gate.open(0)
    closed: list[bool] = []

    async def upstream() -> AsyncIterator[bytes]:
        try:
            yield events
        finally:
            closed.append(True)  # the replica's connection closes: it cancels the generation

    out = _collect(metered(upstream(), gate, 2, True, lambda: None))

    blocks = out.split(b"\n\n")
    assert blocks[:2] == [_chunk("0")[:-2], _chunk("1")[:-2]]
    final = orjson.loads(blocks[2][6:])
    assert final["id"] == "chatcmpl-1" and final["choices"][0]["finish_reason"] == "length"
    assert "tenant 'acme' used its 10 tokens per minute" in final["choices"][0]["stop_reason"]
    assert blocks[3] == b"data: [DONE]" and closed == [True]
    assert orjson.loads(stop_chunk(None, False, "why")[6:])["choices"][0]["text"] == ""


def test_a_stream_closed_before_its_first_piece_still_gives_its_slots_back_and_closes_the_replica() -> None:
    # the client went away before the router sent a byte: an async generator closed before its first step
    # skips its clean-up, so the layers are Relays, whose close always runs it
    from shardline.online.router.upstream import Relay

    calls: list[str] = []

    async def replica_pieces() -> AsyncIterator[bytes]:
        yield _chunk("never read")

    async def replica_closed(ended: bool) -> None:
        calls.append(f"replica connection {'released' if ended else 'closed'}")

    gate = LlmGate(_tenant(tpm=600, streams=1), lambda: 0.0)
    gate.open(0)
    def done() -> None:
        gate.close()
        calls.append("quota slot back")

    relay = metered(Relay(replica_pieces(), replica_closed), gate, 3, True, done)

    asyncio.run(relay.aclose())
    asyncio.run(relay.aclose())  # twice is harmless

    assert calls == ["replica connection closed", "quota slot back"] and gate.streams == 0
