"""Hostile client input to the online decoders: every refusal is an InvalidInput (a 400), never a crash.

Socket-free: the V2 and OpenAI decoders, the body decoder (gzip members, bombs), the model
name and version checks, NaN refusal, and the batcher's byte bound as a pure decision.
"""

from __future__ import annotations

import asyncio
import gzip
import struct
import zlib
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardline.bundle import check_model_name, version_number
from shardline.errors import InvalidInput, InvalidSetting, Overloaded, PayloadTooLarge
from shardline.online.batcher import Batcher, BatchLimits, admits_bytes, rows_nbytes
from shardline.online.bodies import MAX_GZIP_MEMBERS, decode_body
from shardline.online.edge import runs_off_loop
from shardline.online.protocols.kserve_v2 import decode_infer_request
from shardline.online.protocols.openai import parse_embedding_request
from shardline.rows import check_rows
from shardline.signature import ColumnSpec, Signature

SIGNATURE = Signature(
    inputs=[ColumnSpec(name="a", type="float32"), ColumnSpec(name="b", type="float32")],
    outputs=[ColumnSpec(name="label", type="int64")],
)
TAKES_NAN = Signature(
    inputs=[ColumnSpec(name="a", type="float32", non_finite=True), ColumnSpec(name="b", type="float32", non_finite=True)],
    outputs=[ColumnSpec(name="label", type="int64")],
)
MIXED = Signature(
    inputs=[ColumnSpec(name="s", type="string"), ColumnSpec(name="v", type="fixed_size_list<float64>[2]"),
            ColumnSpec(name="i", type="int8")],
    outputs=[ColumnSpec(name="label", type="int64")],
)
NESTED = b"[" * 1000 + b"1.0" + b"]" * 1000  # orjson reads it (its limit is 1024); a recursion would not


def request(**first: Any) -> bytes:
    tensor = {"name": "a", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0], **first}
    return orjson.dumps({"inputs": [tensor, {"name": "b", "datatype": "FP32", "shape": [2], "data": [3.0, 4.0]}]})


def refused(body: bytes, header_length: str | None = None, signature: Signature = SIGNATURE) -> str:
    with pytest.raises(InvalidInput) as e:
        decode_infer_request(body, header_length, signature, "m:1")
    return str(e.value)


# -- item 6: the samples of the issue -------------------------------------------------------------
def test_a_version_that_is_not_ascii_digits_or_is_absurdly_long_is_no_version() -> None:
    assert version_number("12") == 12 and version_number("007") == 7
    for text in ("²", "١٢", "9" * 5000, "", "-1", "1.0", " 1", "1\n"):
        assert version_number(text) is None, text


def test_a_model_name_with_a_trailing_newline_is_refused() -> None:
    assert check_model_name("breast-cancer") == "breast-cancer"
    for name in ("breast-cancer\n", "a\n", "\nb", "x" * 65, "Upper"):
        with pytest.raises(InvalidSetting, match="is not allowed"):
            check_model_name(name)


def test_an_inference_header_length_that_is_not_ascii_digits_is_400_naming_the_header() -> None:
    for value in ("\xb2", "²", "9" * 5000, "-3", "1e3", ""):
        message = refused(request(), value)
        assert "Inference-Header-Content-Length" in message and "ASCII digits" in message, value


def test_data_nested_up_to_orjsons_limit_is_400_not_a_recursion_error() -> None:
    for depth in (990, 1000, 1020):  # (with the request's own 3 levels: up to orjson's 1024)
        body = b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": ' + b"[" * depth + b"1.0" + b"]" * depth + b"}]}"
        assert "input 'a': 'data' is nested deeper than its shape [1] has dimensions" in refused(body)
    # deep elsewhere in the request (msgspec's fast path has its own depth limit): still a 400 or an answer
    for field in ("parameters", "id", "outputs"):
        body = orjson.loads(request())
        body[field] = "X"
        raw = orjson.dumps(body).replace(b'"X"', NESTED)
        try:
            decode_infer_request(raw, None, SIGNATURE, "m:1")
        except InvalidInput:
            pass


# -- item 6: the class of bug ---------------------------------------------------------------------
HOSTILE: list[Any] = [
    None, True, 0, -1, 2**63, -(2**63), 1.5, float("1e308"), "", "²", "x" * 5000, [], [[]], [None], [True], ["1"],
    [1, [2]], [[1, 2], 3], [[1], [[2]]], {"a": 1}, [{"a": 1}], [2**64 - 1, -1], [1e308, -1e308], [[1.0] * 3] * 2,
]


@pytest.mark.parametrize("field", ["name", "datatype", "shape", "data", "parameters"])
def test_every_field_of_an_input_refuses_hostile_values_with_a_400(field: str) -> None:
    for value in HOSTILE:
        try:
            decode_infer_request(request(**{field: value}), None, SIGNATURE, "m:1")
        except InvalidInput as e:
            assert len(str(e)) < 1000, (field, value)  # a message quotes a client's value cut short
        for signature in (MIXED, TAKES_NAN):
            try:
                decode_infer_request(request(**{field: value}), None, signature, "m:1")
            except InvalidInput:
                pass


@pytest.mark.parametrize("field", ["id", "outputs", "parameters", "inputs"])
def test_every_field_of_a_request_refuses_hostile_values_with_a_400(field: str) -> None:
    for value in [*HOSTILE, [{"name": v} for v in HOSTILE], {"binary_data_output": [1]}]:
        doc = orjson.loads(request())
        doc[field] = value
        try:
            decode_infer_request(orjson.dumps(doc), None, SIGNATURE, "m:1")
        except InvalidInput:
            pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=20,
))
def test_fuzzed_json_requests_are_answered_or_refused_with_a_400(value: Any) -> None:
    for doc in ({"inputs": value}, {"inputs": [{"name": "a", "datatype": "FP32", "shape": [2], "data": value}]},
                {"inputs": [{"name": "s", "datatype": "BYTES", "shape": value, "data": value}]}, value):
        try:
            body = orjson.dumps(doc)
        except (TypeError, orjson.JSONEncodeError):
            continue  # (NaN and big integers have no JSON form)
        for signature in (SIGNATURE, MIXED):
            for header_length in (None, str(len(body))):
                try:
                    decode_infer_request(body, header_length, signature, "m:1")
                except InvalidInput:
                    pass


def test_binary_tensors_with_hostile_sizes_are_400() -> None:
    header = orjson.dumps({"inputs": [{"name": "s", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 8}}]})
    for blob in (struct.pack("<I", 2**32 - 1) + b"abcd", b"\xff\xff", struct.pack("<I", 4) + b"\xff\xfe\xfd\xfc"):
        with pytest.raises(InvalidInput):
            decode_infer_request(header + blob.ljust(8, b"\0")[:8], str(len(header)), MIXED, "m:1")


def test_embedding_requests_refuse_hostile_fields_with_a_400() -> None:
    for value in HOSTILE:
        for field in ("model", "input", "encoding_format", "dimensions"):
            doc: dict[str, Any] = {"model": "minilm", "input": ["a"], field: value}
            try:
                parse_embedding_request(orjson.dumps(doc))
            except InvalidInput as e:
                assert len(str(e)) < 1000
    with pytest.raises(InvalidInput):
        parse_embedding_request(b'{"model": "m", "input": ' + NESTED + b"}")


# -- item 10: NaN and infinity --------------------------------------------------------------------
def binary_request(a: np.ndarray, b: np.ndarray) -> tuple[bytes, str]:
    header = orjson.dumps({"inputs": [
        {"name": n, "datatype": "FP32", "shape": [len(v)], "parameters": {"binary_data_size": v.nbytes}}
        for n, v in (("a", a), ("b", b))]})
    return header + a.tobytes() + b.tobytes(), str(len(header))


def test_nan_and_infinity_are_refused_naming_the_input_unless_the_signature_declares_them() -> None:
    a = np.array([1.0, np.nan, np.inf], np.float32)
    body, length = binary_request(np.ones(3, np.float32), a)
    message = refused(body, length)
    assert "columns ['b'] hold NaN or infinite values ({'b': 2} in 3 rows)" in message and "non_finite" in message
    taken = decode_infer_request(body, length, TAKES_NAN, "m:1").table
    assert np.isnan(taken.column("b").to_numpy()[1])


def test_a_json_number_past_float32s_range_is_infinite_and_refused_on_the_fast_path_too() -> None:
    fast = refused(request(data=[1.0, 1e39]))
    assert "columns ['a'] hold NaN or infinite values ({'a': 1} in 2 rows)" in fast
    assert refused(request(data=[1, -1e39])) == fast  # an int in the data: the general path, the same message
    assert decode_infer_request(request(data=[1.0, 3e38]), None, SIGNATURE, "m:1").rows.arrays is not None  # still fast
    assert decode_infer_request(request(data=[1.0, 1e39]), None, TAKES_NAN, "m:1").table.column("a")[1].as_py() == float("inf")


def test_the_signature_writes_non_finite_only_when_set_so_old_digests_hold() -> None:
    assert "non_finite" not in SIGNATURE.model_dump(mode="json")["inputs"][0]
    assert TAKES_NAN.model_dump(mode="json")["inputs"][0]["non_finite"] is True
    assert Signature.model_validate(TAKES_NAN.model_dump(mode="json")) == TAKES_NAN


# -- item 10: gzip members and bombs --------------------------------------------------------------
def test_every_gzip_member_is_decoded_as_gzip_tools_do() -> None:
    assert decode_body(gzip.compress(b"ab") + gzip.compress(b"cd"), "gzip", 1 << 20) == b"abcd"
    assert decode_body(gzip.compress(b"ab") + b"\0" * 10, "gzip", 1 << 20) == b"ab"  # zero padding
    assert decode_body(zlib.compress(b"ab"), "deflate", 1 << 20) == b"ab"
    raw = zlib.compressobj(wbits=-15)
    assert decode_body(raw.compress(b"ab") + raw.flush(), "deflate", 1 << 20) == b"ab"
    with pytest.raises(InvalidInput, match="not valid gzip data .* after its first member"):
        decode_body(gzip.compress(b"ab") + b"trailing", "gzip", 1 << 20)
    with pytest.raises(InvalidInput, match="goes on after 1 compressed stream"):
        decode_body(zlib.compress(b"ab") + b"trailing", "deflate", 1 << 20)
    with pytest.raises(InvalidInput, match=f"goes on after {MAX_GZIP_MEMBERS} compressed members"):
        decode_body(gzip.compress(b"") * (MAX_GZIP_MEMBERS + 1), "gzip", 1 << 20)


def test_a_gzip_bomb_split_across_members_is_bounded_by_the_limit_in_all() -> None:
    member = gzip.compress(b" " * 600)
    assert len(decode_body(member * 3, "gzip", 1800)) == 1800
    with pytest.raises(PayloadTooLarge, match="inflates to more than the limit of 1799 bytes"):
        decode_body(member * 3, "gzip", 1799)


def test_large_bodies_are_worked_on_off_the_loop_and_small_ones_on_it() -> None:
    assert not runs_off_loop(1500, False, 256 * 1024)
    assert runs_off_loop(256 * 1024, False, 256 * 1024)
    assert runs_off_loop(8 * 1024, True, 256 * 1024) and not runs_off_loop(1024, True, 256 * 1024)
    assert runs_off_loop(1, False, 0)


# -- item 10: the batcher's byte bound --------------------------------------------------------------
def test_the_queue_takes_rows_up_to_its_bytes_by_priority_and_always_takes_a_first_request() -> None:
    mib = 1 << 20
    assert admits_bytes(0, 10 * mib, mib, "low")  # alone in the queue: taken (the body limit bounds it)
    assert admits_bytes(mib // 4, mib // 4, mib, "low") and not admits_bytes(mib // 4, mib // 4 + 1, mib, "low")
    assert admits_bytes(mib // 2, mib // 4, mib, "normal") and not admits_bytes(mib // 2, mib // 3, mib, "normal")
    assert admits_bytes(mib // 2, mib // 2, mib, "high") and not admits_bytes(mib // 2, mib // 2 + 1, mib, "high")


def test_a_batcher_full_in_bytes_sheds_with_a_message_naming_the_setting() -> None:
    one_float = Signature(inputs=[ColumnSpec(name="x", type="float64")], outputs=[ColumnSpec(name="y", type="float64")])
    table = check_rows(pa.table({"x": pa.array(np.zeros(1000), pa.float64())}), one_float, "m:1")  # 8,000 bytes
    assert rows_nbytes(table) == 8000

    async def scenario() -> str:
        release = asyncio.Event()

        async def predict(inputs: Any) -> pa.RecordBatch:
            await release.wait()
            return pa.record_batch({"y": pa.array(np.zeros(inputs.num_rows))})

        batcher = Batcher("m:1", BatchLimits(1, 0.0, 100, queue_bytes=20_000), predict)
        running = batcher.submit(table, "high")  # taken into a batch at once: the queue is empty again
        queued = [batcher.submit(table, "high"), batcher.submit(table, "high")]  # 16,000 bytes queued
        with pytest.raises(Overloaded) as shed:
            batcher.submit(table, "high")
        release.set()
        await asyncio.gather(running, *queued)
        batcher.submit(table, "high")  # drained: taken again
        await batcher.close(Overloaded("closing", 1))
        return str(shed.value)

    message = asyncio.run(scenario())
    assert "16000 bytes of rows queued" in message and "SHARDLINE_ONLINE_QUEUE_BYTES" in message
