"""The protocol adapters' decode and encode, with no server: V2 (JSON and binary) and OpenAI embeddings.

Requests are made and responses read by tritonclient's own (socket-free) helpers, so
the wire format is the one Triton's clients speak.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pytest
import tritonclient.http as triton

from shardline.errors import InvalidInput, NonFiniteValues
from shardline.online.protocols.kserve_v2 import decode_infer_request, encode_infer_response, model_metadata, top_classes
from shardline.online.protocols.openai import embedding_response, parse_embedding_request
from shardline.signature import ColumnSpec, Signature

SIGNATURE = Signature(
    inputs=[
        ColumnSpec(name="a", type="float32"),
        ColumnSpec(name="b", type="int64"),
        ColumnSpec(name="text", type="string"),
        ColumnSpec(name="vec", type="fixed_size_list<float32>[3]"),
    ],
    outputs=[
        ColumnSpec(name="label", type="int64"),
        ColumnSpec(name="probs", type="fixed_size_list<float32>[2]"),
        ColumnSpec(name="name", type="string"),
    ],
)
A = np.array([0.5, -1.25], np.float32)
B = np.array([3, 4], np.int64)
TEXT = np.array(["héllo", ""], dtype=object)
VEC = np.arange(6, dtype=np.float32).reshape(2, 3)


def v2_inputs(binary: bool, **replace: tuple[str, np.ndarray]) -> list[triton.InferInput]:
    tensors = {"a": ("FP32", A), "b": ("INT64", B), "text": ("BYTES", TEXT), "vec": ("FP32", VEC), **replace}
    inputs = []
    for name, (datatype, values) in tensors.items():
        tensor = triton.InferInput(name, list(values.shape), datatype)
        tensor.set_data_from_numpy(values, binary_data=binary)
        inputs.append(tensor)
    return inputs


def request_bytes(inputs: list[triton.InferInput], outputs: list[Any] | None = None) -> tuple[bytes, str | None]:
    body, json_size = triton.InferenceServerClient.generate_request_body(inputs, outputs=outputs, request_id="r-1")
    return body, None if json_size is None else str(json_size)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_tritonclient_request_decodes_to_the_signature_columns(binary: bool) -> None:
    body, header = request_bytes(v2_inputs(binary))
    decoded = decode_infer_request(body, header, SIGNATURE, "toy:1")

    assert decoded.table.schema.names == ["a", "b", "text", "vec"]
    assert decoded.table.column("a").type == pa.float32() and decoded.table.column("a").to_pylist() == [0.5, -1.25]
    assert decoded.table.column("b").to_pylist() == [3, 4]
    assert decoded.table.column("text").to_pylist() == ["héllo", ""]
    assert decoded.table.column("vec").to_pylist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert decoded.request_id == "r-1"
    assert decoded.outputs == ["label", "probs", "name"] and all(decoded.binary.values())  # binary_data_output


def output_table() -> pa.Table:
    probs = pa.FixedSizeListArray.from_arrays(pa.array([0.25, 0.75, 1.0, 0.0], pa.float32()), 2)
    return pa.table({"label": pa.array([1, 0], pa.int64()), "probs": probs, "name": ["x", "ÿ"]})


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_response_reads_back_in_tritonclient(binary: bool) -> None:
    outputs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("probs", "name", "label")]
    body, header = request_bytes(v2_inputs(binary), outputs)
    decoded = decode_infer_request(body, header, SIGNATURE, "toy:1")
    payload, header_length = encode_infer_response("toy", 1, decoded, output_table())

    assert (header_length is not None) == binary
    result = triton.InferenceServerClient.parse_response_body(payload, header_length=header_length)
    response = result.get_response()
    assert (response["model_name"], response["model_version"], response["id"]) == ("toy", "1", "r-1")
    assert [o["name"] for o in response["outputs"]] == ["probs", "name", "label"]
    np.testing.assert_array_equal(result.as_numpy("label"), [1, 0])
    probs = result.as_numpy("probs").reshape(2, 2) if binary else result.as_numpy("probs")
    np.testing.assert_array_equal(probs.reshape(2, 2), [[0.25, 0.75], [1.0, 0.0]])
    names = [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy("name").ravel()]
    assert names == ["x", "ÿ"]
    assert next(o for o in response["outputs"] if o["name"] == "probs")["shape"] == [2, 2]


def test_metadata_lists_v2_datatypes_and_shapes() -> None:
    doc = model_metadata("toy", [1, 2], "onnx", SIGNATURE)
    assert doc["versions"] == ["1", "2"] and doc["platform"] == "onnxruntime_onnx"
    assert doc["inputs"] == [
        {"name": "a", "datatype": "FP32", "shape": [-1]}, {"name": "b", "datatype": "INT64", "shape": [-1]},
        {"name": "text", "datatype": "BYTES", "shape": [-1]}, {"name": "vec", "datatype": "FP32", "shape": [-1, 3]},
    ]
    assert doc["outputs"][1] == {"name": "probs", "datatype": "FP32", "shape": [-1, 2]}


def json_request(**changes: Any) -> bytes:
    inputs = {
        "a": {"name": "a", "datatype": "FP32", "shape": [2], "data": [0.5, 1]},
        "b": {"name": "b", "datatype": "INT64", "shape": [2], "data": [3, 4]},
        "text": {"name": "text", "datatype": "BYTES", "shape": [2], "data": ["x", "y"]},
        "vec": {"name": "vec", "datatype": "FP32", "shape": [2, 3], "data": [[1, 2, 3], [4, 5, 6]]},
    }
    for name, change in changes.items():
        if change is None:
            del inputs[name]
        else:
            inputs[name] = {**inputs.get(name, {"name": name}), **change}
    return orjson.dumps({"inputs": list(inputs.values())})


@pytest.mark.parametrize(
    ("body", "header", "message"),
    [
        (b"{not json", None, r"not valid JSON"),
        (b"[1, 2]", None, r"JSON list, not an object with 'inputs'"),
        (b'{"inputs": {}}', None, r"field 'inputs' is missing, empty or not a list"),
        (json_request(a={"shape": [3]}), None, r"input 'a' holds 2 values; its shape \[3\] holds 3"),
        (json_request(vec={"shape": [2]}), None,
         r"input 'vec' has shape \[2\] \(rank 1\), the model takes \[-1, 3\] \(rank 2\): send shape \[N, 3\]"),
        (json_request(a={"datatype": "BYTES", "data": ["x", "y"]}), None,
         r"input 'a' is BYTES, the model takes FP32: send datatype FP32"),
        (json_request(b={"datatype": "FP32", "data": [1.5, 2]}), None, r"input 'b' is FP32, the model takes INT64: send datatype INT64"),
        (json_request(b={"data": [1.5, 2]}), None, r"input 'b' is declared INT64 but its data holds floating-point values"),
        (json_request(a={"data": ["x", 1]}), None, r"input 'a' is declared FP32 but its data holds string values"),
        # numpy read a bool among numbers as 1 or 0, where all bools were refused
        (json_request(a={"data": [True, 5.0]}), None, r"input 'a' is declared FP32 but its data holds bool values"),
        (json_request(b={"data": [True, 0]}), None, r"input 'b' is declared INT64 but its data holds bool values"),
        (json_request(b={"data": [2**63, -1]}), None, r"input 'b' is declared INT64 but its data holds integers outside"),
        (json_request(b={"data": [2**63, 1]}), None, r"input 'b' is declared INT64 but its data holds integers outside"),
        (json_request(a={"datatype": "FP8"}), None, r"input 'a': datatype 'FP8' is not a V2 datatype"),
        (json_request(a={"shape": "2"}), None, r"input 'a': 'shape' is '2'"),
        (json_request(text=None), None, r"inputs missing: the model 'toy:1' needs 'text' \(BYTES, shape \[-1\]\)"),
        (json_request(extra={"datatype": "FP32", "shape": [2], "data": [1, 2]}), None,
         r"input 'extra' is not an input of the model 'toy:1'; it takes \['a', 'b', 'text', 'vec'\]"),
        (json_request(b={"shape": [1], "data": [3]}), None, r"inputs disagree on the number of rows"),
        (json_request(a={"data": None}), None, r"input 'a': 'data' is a NoneType, not a list"),
        (json_request(), "99999", r"Inference-Header-Content-Length says 99999 bytes of JSON"),
        (json_request(), "x", r"Inference-Header-Content-Length is 'x'"),
        (json_request() + b"\x00\x01", str(len(json_request())), r"2 bytes of binary data that no input claims"),
        (json_request(a={"parameters": {"binary_data_size": 8}, "data": None}), None,
         r"input 'a': binary_data_size 8 runs past the end of the body"),
        (orjson.dumps({**orjson.loads(json_request()), "outputs": [{"name": "nope"}]}), None, r"output 'nope' is not an output of the model 'toy:1'"),
        (orjson.dumps({**orjson.loads(json_request()), "outputs": [{"name": "probs"}, {"name": "probs"}]}), None,
         r"output 'probs' is asked for twice in 'outputs'; name each output once"),
        (orjson.dumps({**orjson.loads(json_request()), "id": 5}), None,
         r"field 'id' is int, not a string; send the id as a JSON string"),
        (json_request(a={"shape": None}), None, r"input 'a': 'shape' is missing; send it as a list of whole numbers"),
        (json_request(text={"data": [1, 2]}), None,
         r"input 'text' is declared BYTES but its data holds integer values \(such as 1\); send each value as a JSON"),
        # Triton's classification extension ranks numbers: a text output has no top classes
        (orjson.dumps({**orjson.loads(json_request()), "outputs": [{"name": "name", "parameters": {"classification": 2}}]}),
         None, r"output 'name' is string, not a score a class: the classification extension ranks numbers"),
        (orjson.dumps({**orjson.loads(json_request()), "outputs": [{"name": "probs", "parameters": {"classification": -1}}]}),
         None, r"output 'probs': 'classification' is -1; send the number of top classes to answer, 1 or more"),
        (orjson.dumps({**orjson.loads(json_request()), "parameters": [1]}), None, r"field 'parameters' is \[1\], not an object"),
        # binary tensors sent without the header that says where the JSON ends: not "not valid JSON (... char 0)"
        (json_request(a={"parameters": {"binary_data_size": 8}, "data": None}) + b"\x00\xd8" * 4, None,
         r"the body holds binary tensors \(an input has a binary_data_size parameter\) but no "
         r"Inference-Header-Content-Length header says where its JSON ends"),
        (json_request(a={"parameters": {"binary_data_size": 8}, "data": None}) + b"\x00\xd8" * 4,
         str(len(json_request(a={"parameters": {"binary_data_size": 8}, "data": None})) + 3),
         r"header Inference-Header-Content-Length says the JSON part is \d+ bytes, but those bytes are not a JSON object"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 20 else None,
)
def test_each_bad_request_is_refused_naming_the_field(body: bytes, header: str | None, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        decode_infer_request(body, header, SIGNATURE, "toy:1")


def test_nan_and_infinity_as_pythons_json_writes_them_reach_the_row_check_not_a_parse_error() -> None:
    """``json.dumps``, and so tritonclient's JSON requests, write NaN and Infinity bare: not JSON, but what they mean is
    clear. A column that takes finite numbers only is refused naming it; one that declares ``non_finite`` gets
    them; a body that is not JSON for another reason is still refused as such."""
    doc = orjson.loads(json_request())
    doc["inputs"][0]["data"] = [float("nan"), float("-inf")]
    body = json.dumps(doc).encode()
    assert b"NaN" in body and b"-Infinity" in body
    with pytest.raises(NonFiniteValues, match=r"columns \['a'\] hold NaN or infinite values \(\{'a': 2\} in 2 rows\)"):
        decode_infer_request(body, None, SIGNATURE, "toy:1")
    takes = Signature(inputs=[ColumnSpec(name="a", type="float32", non_finite=True), *SIGNATURE.inputs[1:]],
                      outputs=SIGNATURE.outputs)
    a = decode_infer_request(body, None, takes, "toy:1").table.column("a").to_numpy()
    assert np.isnan(a[0]) and a[1] == -np.inf
    for broken in (body[:-1], body.replace(b'"text"', b"text", 1), b'{"inputs": [NaNa]}'):
        with pytest.raises(InvalidInput, match=r"the request body is not valid JSON \("):
            decode_infer_request(broken, None, SIGNATURE, "toy:1")


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_an_n_by_1_input_is_taken_for_a_column_of_one_value_a_row(binary: bool) -> None:
    """An ONNX model's ``[N, 1]`` input becomes a column of one value a row (described as ``[-1]``); its clients
    send the ONNX shape, ``[N, 1]``, which is read as ``[N]``. Any other second dimension is refused."""
    as_rows = {"a": ("FP32", A.reshape(2, 1)), "b": ("INT64", B.reshape(2, 1)), "text": ("BYTES", TEXT.reshape(2, 1))}
    decoded = decode_infer_request(*request_bytes(v2_inputs(binary, **as_rows)), SIGNATURE, "toy:1").table
    assert decoded.column("a").to_pylist() == A.tolist() and decoded.column("b").to_pylist() == B.tolist()
    assert decoded.column("text").to_pylist() == TEXT.tolist()
    assert decoded.equals(decode_infer_request(*request_bytes(v2_inputs(binary)), SIGNATURE, "toy:1").table)
    with pytest.raises(InvalidInput, match=r"input 'a' has shape \[1, 2\] \(rank 2\), the model takes \[-1\]"):
        decode_infer_request(*request_bytes(v2_inputs(binary, a=("FP32", A.reshape(1, 2)))), SIGNATURE, "toy:1")


def test_binary_tensors_of_the_wrong_size_or_bad_text_are_refused() -> None:
    inputs = v2_inputs(True)
    inputs[0].set_data_from_numpy(np.zeros(2, np.float32))
    body, header = request_bytes(inputs)
    short = body[:-1]  # one byte of 'vec' missing
    with pytest.raises(InvalidInput, match="input 'vec': binary_data_size 24 runs past the end"):
        decode_infer_request(short, header, SIGNATURE, "toy:1")
    bad_text = np.array([b"\xff\xfe", b"ok"], dtype=object)
    body, header = request_bytes(v2_inputs(True, text=("BYTES", bad_text)))
    with pytest.raises(InvalidInput, match="input 'text': element 0 is not UTF-8 text"):
        decode_infer_request(body, header, SIGNATURE, "toy:1")


def test_an_empty_outputs_list_asks_for_every_output_as_triton_takes_it() -> None:
    # it answered no output at all
    decoded = decode_infer_request(orjson.dumps({**orjson.loads(json_request()), "outputs": [], "id": "r1"}), None,
                                   SIGNATURE, "toy:1")
    assert decoded.outputs == SIGNATURE.output_names and decoded.request_id == "r1"


def test_flat_json_data_for_a_two_dimensional_input_is_read_row_major() -> None:
    decoded = decode_infer_request(json_request(vec={"data": [1, 2, 3, 4, 5, 6]}), None, SIGNATURE, "toy:1")
    assert decoded.table.column("vec").to_pylist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]


# -- OpenAI embeddings ----------------------------------------------------------------------------
def test_an_embeddings_request_reads_a_string_or_a_list() -> None:
    assert parse_embedding_request(b'{"model": "minilm", "input": "hi"}') == ("minilm", ["hi"], "float", None)
    body = orjson.dumps({"model": "minilm@prod", "input": ["a", "b"], "encoding_format": "base64", "dimensions": 384})
    assert parse_embedding_request(body) == ("minilm@prod", ["a", "b"], "base64", 384)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"input": "x"}, "field 'model' is missing"),
        ({"model": "m"}, "field 'input' must be a string or a non-empty list"),
        ({"model": "m", "input": []}, "field 'input' must be a string or a non-empty list"),
        ({"model": "m", "input": [[1, 2]]}, r"field 'input\[0\]' is token ids; this server embeds text"),
        ({"model": "m", "input": ["a", None]}, r"field 'input\[1\]' is a JSON null"),
        ({"model": "m", "input": [["a"]]}, r"field 'input\[0\]' is a JSON array; this server embeds text"),
        ({"model": "m", "input": ""}, r"field 'input' is an empty string; send the text to embed"),
        ({"model": "m", "input": ["a", "b", "c", ""]}, r"field 'input\[3\]' is an empty string"),
        ({"model": "m", "input": "a", "encoding_format": "int8"}, "field 'encoding_format' is 'int8'"),
        ({"model": "m", "input": "a", "dimensions": 0}, "field 'dimensions' is 0"),
        ({"model": "m", "input": ["a"] * 2049}, "holds 2049 texts; send at most 2048"),
    ],
)
def test_a_bad_embeddings_request_names_the_field(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        parse_embedding_request(orjson.dumps(doc))


def test_base64_embeddings_are_little_endian_float32() -> None:
    vectors = np.array([[0.5, -2.0], [1e-3, 3.0]], np.float32)
    doc = orjson.loads(orjson.dumps(embedding_response("minilm:1", vectors, "base64", 7), option=orjson.OPT_SERIALIZE_NUMPY))
    got = np.frombuffer(base64.b64decode(doc["data"][1]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(got, vectors[1])
    assert doc["usage"] == {"prompt_tokens": 7, "total_tokens": 7} and doc["object"] == "list"
    floats = orjson.loads(orjson.dumps(embedding_response("minilm:1", vectors, "float", 7), option=orjson.OPT_SERIALIZE_NUMPY))
    assert floats["data"][0] == {"object": "embedding", "index": 0, "embedding": [0.5, -2.0]}


def test_top_classes_rank_each_row_highest_first_as_triton_writes_them() -> None:
    scores = np.array([[0.1, 0.7, 0.2], [0.4, 0.2, 0.4]], np.float32)
    assert top_classes(scores.ravel(), 2, 2) == ([2, 2], ["0.700000:1", "0.200000:2", "0.400000:0", "0.400000:2"])
    assert top_classes(scores.ravel(), 2, 5)[0] == [2, 3]  # all the classes a row has, where it has fewer
    assert top_classes(np.array([3, 1], np.uint8), 2, 1) == ([2, 1], ["3.000000:0", "1.000000:0"])  # one value a row
    assert top_classes(np.array([], np.float32), 0, 3) == ([0, 3], [])
