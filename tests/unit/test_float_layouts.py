"""Every float layout reaches the runtime as float arrays, without Arrow: one ``[N]`` input per float column,
one ``[N, k]`` tensor, and several ``[N, k_i]`` tensors; JSON and binary tensors alike (each on its fast path),
with the same answer, bit for bit, as the same rows through Arrow, and the same messages."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import numpy as np
import orjson
import pytest

from shardline.errors import InvalidInput
from shardline.online.protocols.kserve_v2 import decode_infer_request
from shardline.online.protocols.v2_fast import fast_binary_rows
from shardline.build.packaging import package_onnx
from shardline.runtimes import Runtime, RuntimeOptions, create_runtime

from tests.tensor_models import two_tensor_model

A = np.arange(12, dtype=np.float32).reshape(4, 3) / 7
B = (np.arange(8, dtype=np.float32).reshape(4, 2) - 3) / 11


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runtime]:
    folder = tmp_path_factory.mktemp("two-tensors")
    manifest = package_onnx(two_tensor_model(folder / "two.onnx"), folder / "bundle", name="two")
    runtime = create_runtime(folder / "bundle", manifest, RuntimeOptions("cpu", 1))
    runtime.load()
    yield runtime
    runtime.close()


def json_body(a: np.ndarray = A, b: np.ndarray = B, **b_fields: object) -> bytes:
    return orjson.dumps({"inputs": [
        {"name": "a", "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()},
        {"name": "b", "datatype": "FP32", "shape": list(b.shape), "data": b.ravel().tolist(), **b_fields}]})


def binary_body(a: np.ndarray = A, b: np.ndarray = B) -> tuple[bytes, str]:
    header = orjson.dumps({"inputs": [
        {"name": n, "datatype": "FP32", "shape": list(v.shape), "parameters": {"binary_data_size": v.nbytes}}
        for n, v in (("a", a), ("b", b))]})
    return header + a.tobytes() + b.tobytes(), str(len(header))


def test_the_signature_of_two_list_inputs_has_a_float_layout_of_one_array_per_input(two: Runtime) -> None:
    layout = two.manifest.signature.plan.layout
    assert layout is not None and not layout.stacked and layout.widths == (3, 2)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_several_2d_inputs_are_scored_from_arrays_exactly_like_their_arrow_rows(two: Runtime, binary: bool) -> None:
    signature = two.manifest.signature
    if binary:
        body, header = binary_body()
        assert fast_binary_rows(body, int(header), signature, "two:1") is not None  # tritonclient's default: fast too
        decoded = decode_infer_request(body, header, signature, "two:1")
    else:
        decoded = decode_infer_request(json_body(), None, signature, "two:1")
    arrays = decoded.rows.arrays
    assert arrays is not None and decoded.rows.plan is signature.plan
    assert arrays[0].tobytes() == A.tobytes() and arrays[1].tobytes() == B.tobytes()

    fast = two.predict(decoded.rows)
    through_arrow = two.predict(decoded.table)

    assert isinstance(fast, dict)
    for name in through_arrow.schema.names:
        want = through_arrow.column(name)
        values = want.flatten() if hasattr(want, "flatten") and want.type.num_fields else want
        assert fast[name].tobytes() == values.to_numpy().tobytes(), name  # bit for bit


@pytest.mark.parametrize("b, fields, message", [
    (B.reshape(4, 2, 1), {}, "input 'b' has shape [4, 2, 1] (rank 3), the model takes [-1, 2] (rank 2): send shape [N, 2]"),
    (np.ones((4, 3), np.float32), {}, "input 'b' has shape [4, 3] (rank 2), the model takes [-1, 2] (rank 2): send shape [N, 2]"),
    (B, {"datatype": "FP64"}, "input 'b' is FP64, the model takes FP32: send datatype FP32"),
    (np.ones((3, 2), np.float32), {}, "inputs disagree on the number of rows: {'a': 4, 'b': 3}"),
])
def test_bad_shapes_and_datatypes_are_refused_with_the_general_paths_message(
    two: Runtime, b: np.ndarray, fields: dict[str, object], message: str
) -> None:
    signature = two.manifest.signature
    with pytest.raises(InvalidInput, match=re.escape(message)):
        decode_infer_request(json_body(b=b, **fields), None, signature, "two:1")
    if not fields:  # the same fault sent as binary tensors: the same message
        with pytest.raises(InvalidInput, match=re.escape(message)):
            decode_infer_request(*binary_body(b=np.ascontiguousarray(b)), signature, "two:1")


def test_nan_in_one_of_several_inputs_is_refused_with_the_kernels_message(two: Runtime) -> None:
    bad = B.copy()
    bad[2, 1] = np.nan
    signature = two.manifest.signature
    with pytest.raises(InvalidInput) as fast:
        decode_infer_request(json_body(b=np.where(np.isnan(bad), 1e39, bad.astype(np.float64))), None, signature, "two:1")
    with pytest.raises(InvalidInput) as binary:
        decode_infer_request(*binary_body(b=bad), signature, "two:1")
    assert str(fast.value) == str(binary.value)
    assert str(binary.value).startswith("columns ['b'] hold NaN or infinite values ({'b': 1} in 4 rows)")


def test_a_float_signature_packaged_in_a_tmp_bundle_keeps_its_manifest(tmp_path: Path) -> None:
    first = package_onnx(two_tensor_model(tmp_path / "two.onnx"), tmp_path / "one", name="two")
    again = package_onnx(two_tensor_model(tmp_path / "two.onnx"), tmp_path / "other", name="two")
    assert first.signature == again.signature and first.outputs_digest == again.outputs_digest
