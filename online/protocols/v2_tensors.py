"""Open Inference Protocol (V2) tensors <-> Arrow columns, both ways, JSON and binary.

A signature column maps to one V2 tensor: a primitive column to shape ``[N]``,
``fixed_size_list<T>[k]`` to ``[N, k]`` (nested fixed-size lists to ``[N, a, b]``),
``list<T>`` to ``[N, k]``, a string column to ``BYTES``. A request is read as the protocol
says: each input of exactly the datatype and rank the metadata advertises (``FP32`` for a
``float32`` column, not ``INT32`` or ``FP64``; ``[N]`` for ``[-1]``, not ``[N, 1]``), as
Triton reads it. Binary tensor data (the ``binary_data`` extension) is the
tensor's values, row-major, little-endian; ``BYTES`` elements are each a 4-byte
little-endian length followed by the bytes. Every refusal is an ``InvalidInput`` that
names the input; so does ``out_of_range``, for a JSON body holding a number past a double's range
(``1e400``: valid JSON, which the JSON parser does not read).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np
import pyarrow as pa

from shardline.errors import InferenceFailed, InvalidInput
from shardline.online.errors import shown
from shardline.rows import ColumnPlan, blank_text
from shardline.signature import ColumnSpec, leaf_type, row_shape, type_name

DATATYPES: dict[str, pa.DataType] = {
    "BOOL": pa.bool_(),
    "UINT8": pa.uint8(), "UINT16": pa.uint16(), "UINT32": pa.uint32(), "UINT64": pa.uint64(),
    "INT8": pa.int8(), "INT16": pa.int16(), "INT32": pa.int32(), "INT64": pa.int64(),
    "FP16": pa.float16(), "FP32": pa.float32(), "FP64": pa.float64(),
    "BYTES": pa.string(),
}
_BY_ARROW = {t: name for name, t in DATATYPES.items()} | {pa.large_string(): "BYTES", pa.string_view(): "BYTES"}
_NUMPY = {name: np.dtype(t.to_pandas_dtype()) for name, t in DATATYPES.items() if name != "BYTES"}
_LENGTH = struct.Struct("<I")


def datatype_of(dtype: pa.DataType) -> str:
    """The V2 datatype of a column's values (``FP32`` for ``fixed_size_list<float32>[384]``)."""
    value = leaf_type(dtype)
    try:
        return _BY_ARROW[value]
    except KeyError as e:
        raise InferenceFailed(f"Arrow type {value} has no Open Inference Protocol datatype") from e


def shape_of(dtype: pa.DataType) -> list[int]:
    """The V2 shape of a column, -1 where it varies: ``[-1]``, ``[-1, k]`` (``[-1, a, b]`` for nested
    fixed-size lists) or ``[-1, -1]``."""
    return [-1, *row_shape(dtype)]


def describe(spec: ColumnSpec) -> dict[str, Any]:
    """A signature column as V2 tensor metadata: name, datatype, shape."""
    return {"name": spec.name, "datatype": datatype_of(spec.arrow_type), "shape": shape_of(spec.arrow_type)}


def _flatten(data: list[Any], name: str, shape: list[int]) -> list[Any]:
    """The values of ``data``, flat or nested at most as deep as ``shape`` has dimensions (a loop, not a
    recursion: a client chooses the depth)."""
    depth = 1
    while data and isinstance(data[0], list):
        depth += 1
        if depth > len(shape):
            raise InvalidInput(
                f"input {name!r}: 'data' is nested deeper than its shape {shape} has dimensions; send the values "
                "flat, or nested as the shape says"
            )
        flat: list[Any] = []
        for row in data:
            if not isinstance(row, list):
                raise _mixed(name)
            flat.extend(row)
        data = flat
    return data


def _mixed(name: str) -> InvalidInput:
    return InvalidInput(f"input {name!r}: 'data' mixes lists and single values; send it flat or nested evenly")


_V2_OF = {type_name(t): name for t, name in _BY_ARROW.items()}  # "float32" -> "FP32"


def _datatype(plan: ColumnPlan) -> str:
    """The one V2 datatype an input takes (what the metadata advertises for its column)."""
    try:
        return _V2_OF[plan.value_name]
    except KeyError:
        return datatype_of(plan.value_type)  # (raises InferenceFailed: a type V2 has no datatype for)


def _check_shape(name: str, shape: list[int], plan: ColumnPlan) -> list[int]:
    """The shape's rank is the model's, and each fixed dimension is its size (as Triton checks); returns the
    shape the column reads. ``[N, 1]`` is taken for a column of one value a row (read as ``[N]``): an ONNX
    model's ``[N, 1]`` input (skl2onnx's one text or number a row) becomes such a column, and its clients send
    the ONNX shape."""
    row = plan.shape
    if len(shape) == len(row) + 1 and all(w < 0 or s == w for s, w in zip(shape[1:], row)):
        return shape
    if not row and len(shape) == 2 and shape[1] == 1:
        return shape[:1]
    want = [-1, *row]
    send = ", ".join(["N", *("k" if w < 0 else str(w) for w in want[1:])])
    raise InvalidInput(
        f"input {name!r} has shape {shape} (rank {len(shape)}), the model takes {want} (rank {len(want)}): "
        f"send shape [{send}]"
    )


_KINDS = {"b": "bool", "i": "integer", "u": "integer", "f": "floating-point", "U": "string", "O": "null or mixed"}


def _from_json(name: str, datatype: str, data: Any, shape: list[int]) -> np.ndarray | pa.Array:
    if not isinstance(data, list):
        raise InvalidInput(f"input {name!r}: 'data' is a {type(data).__name__}, not a list of values")
    flat = _flatten(data, name, shape)
    if datatype == "BYTES":
        try:
            return pa.array(flat, type=pa.string())
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            other = next((v for v in flat if not isinstance(v, str)), None)
            kind = {bool: "bool", int: "integer", float: "number", dict: "object"}.get(type(other), "non-string")
            raise InvalidInput(f"input {name!r} is declared BYTES but its data holds {kind} values (such as "
                               f"{shown(other)}); send each value as a JSON string") from e
    kinds = set(map(type, flat))
    if datatype != "BOOL" and bool in kinds:  # numpy reads [true, 5.0] as [1.0, 5.0]: say it
        raise InvalidInput(f"input {name!r} is declared {datatype} but its data holds bool values (true or false); "
                           f"send {datatype} values")
    try:
        values = np.array(flat)
    except (ValueError, TypeError, OverflowError) as e:  # e.g. [1, [2]]: lists below single values
        raise _mixed(name) from e
    if values.size == 0:
        return values.astype(_NUMPY[datatype])
    kind = values.dtype.kind
    if datatype.startswith(("INT", "UINT")) and kinds <= {int} and (kind in "fO" or not _fits(values, datatype)):
        # (numpy fell back to floats past 64 bits; within them a cast would wrap: 2**63 as INT64 is -2**63)
        raise InvalidInput(f"input {name!r} is declared {datatype} but its data holds integers outside its range; "
                           f"send {datatype} values")
    if not (
        (datatype == "BOOL" and kind == "b")
        or (datatype.startswith(("INT", "UINT")) and kind in "iu")
        or (datatype.startswith("FP") and kind in "iuf")
    ):
        raise InvalidInput(
            f"input {name!r} is declared {datatype} but its data holds {_KINDS.get(kind, values.dtype.name)} "
            f"values; send {datatype} values"
        )
    return values


def _fits(values: np.ndarray, datatype: str) -> bool:
    """Whether integer ``values`` lie within ``datatype``'s range."""
    bounds = np.iinfo(_NUMPY[datatype])
    return bool(values.min() >= bounds.min and values.max() <= bounds.max)


def _split_bytes(raw: bytes | bytearray | memoryview, name: str) -> list[str]:
    items: list[str] = []
    offset, end = 0, len(raw)
    while offset < end:
        if offset + 4 > end:
            raise InvalidInput(f"input {name!r}: binary BYTES data ends inside an element's 4-byte length")
        (length,) = _LENGTH.unpack_from(raw, offset)
        offset += 4
        if offset + length > end:
            raise InvalidInput(f"input {name!r}: element {len(items)} says {length} bytes, only {end - offset} are left")
        try:
            items.append(bytes(raw[offset:offset + length]).decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InvalidInput(f"input {name!r}: element {len(items)} is not UTF-8 text ({e})") from e
        offset += length
    return items


def _from_binary(
    name: str, datatype: str, raw: bytes | bytearray | memoryview, count: int, shape: list[int]
) -> np.ndarray | pa.Array:
    if datatype == "BYTES":
        return pa.array(_split_bytes(raw, name), type=pa.string())
    dtype = _NUMPY[datatype]
    if len(raw) != count * dtype.itemsize:
        raise InvalidInput(
            f"input {name!r} has {len(raw)} bytes of binary data; shape {shape} of {datatype} needs "
            f"{count * dtype.itemsize}; check binary_data_size"
        )
    return np.frombuffer(raw, dtype=dtype)


def _to_arrow(name: str, values: np.ndarray | pa.Array, plan: ColumnPlan) -> pa.Array:
    """Values as an Arrow array of the column's value type (numpy casts floats; Arrow checks the rest).
    NaN and infinity are left to the kernel's row check (``check_rows``), which refuses them in both tiers.

    Raises:
        InvalidInput: values that do not fit.
    """
    value_type = plan.value_type
    if isinstance(values, np.ndarray) and pa.types.is_floating(value_type) and values.dtype.kind in "iuf":
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is inf, refused by the row check
            converted = values.astype(value_type.to_pandas_dtype(), copy=False)
        return pa.array(converted)
    array = pa.array(values) if isinstance(values, np.ndarray) else values
    if array.type == value_type:
        return array
    try:
        return array.cast(value_type, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise InvalidInput(f"input {name!r}: its values do not fit {plan.spec.type} ({e})") from e


def _decoded(name: str, datatype: str, shape: list[int], values: Any,
             plan: ColumnPlan) -> tuple[np.ndarray | pa.Array, list[int]]:
    """The flat values of one V2 input, its datatype, shape and count checked against the column, and the
    shape the column reads them as (``_check_shape``)."""
    want = _datatype(plan)
    if datatype != want:
        if datatype not in DATATYPES:
            raise InvalidInput(
                f"input {name!r}: datatype {shown(datatype)} is not a V2 datatype; use one of {sorted(DATATYPES)}"
            )
        raise InvalidInput(f"input {name!r} is {datatype}, the model takes {want}: send datatype {want}")
    read_as = _check_shape(name, shape, plan)
    count = math.prod(shape)
    if isinstance(values, (bytes, bytearray, memoryview)):
        decoded = _from_binary(name, datatype, values, count, shape)
    else:
        decoded = _from_json(name, datatype, values, shape)
    if len(decoded) != count:
        raise InvalidInput(f"input {name!r} holds {len(decoded)} values; its shape {shape} holds {count}")
    return decoded, read_as


def tensor_to_array(name: str, datatype: str, shape: list[int], values: Any, plan: ColumnPlan) -> np.ndarray:
    """One V2 input of a float column (``FloatLayout``) as its numpy array, ``(N,)`` or ``(N, k)`` of the
    column's value type, checked as ``tensor_to_column`` checks it (the same messages), without Arrow.

    Raises:
        InvalidInput: wrong datatype or shape, or a wrong count.
    """
    decoded, shape = _decoded(name, datatype, shape, values, plan)
    array = np.asarray(decoded)
    dtype = np.dtype(plan.value_type.to_pandas_dtype())
    if array.dtype != dtype:  # JSON numbers (binary tensors are of the type already: no errstate per input)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is inf, refused by the row check
            array = array.astype(dtype)
    return array.reshape(shape[0], *plan.shape) if plan.shape else array


def tensor_to_column(name: str, datatype: str, shape: list[int], values: Any, plan: ColumnPlan) -> pa.Array:
    """One V2 input as the column its signature names (``plan``: the column's, from ``Signature.plan``).

    Args:
        values: the JSON ``data`` (a list, flat or nested) or the tensor's binary bytes.

    Raises:
        InvalidInput: wrong datatype or shape, values that do not fit, or a wrong count.
    """
    decoded, shape = _decoded(name, datatype, shape, values, plan)
    array = _to_arrow(name, decoded, plan)
    for level in range(len(shape) - 1, 0, -1):  # innermost first: [N, a, b] is N lists of a lists of b values
        size, lists = shape[level], math.prod(shape[:level])
        if plan.shape[level - 1] < 0:
            array = pa.ListArray.from_arrays(pa.array(np.arange(lists + 1, dtype=np.int32) * size), array)
        else:
            array = pa.FixedSizeListArray.from_arrays(array, size)
    return array


def column_to_tensor(column: pa.Array | pa.ChunkedArray) -> tuple[str, list[int], Any]:
    """An output column as (datatype, shape, values): values a flat numpy array, or a list of str for BYTES."""
    if isinstance(column, pa.ChunkedArray):
        column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    rows = len(column)
    dtype = column.type
    datatype = datatype_of(dtype)
    if pa.types.is_fixed_size_list(dtype) and not column.null_count:  # a model's usual (rows, k) output
        width = dtype.list_size  # .values, sliced, is .flatten() without its null handling
        values, shape = column.values.slice(column.offset * width, rows * width), [rows, width]
    elif pa.types.is_fixed_size_list(dtype) or pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
        values = column.flatten()
        width = dtype.list_size if pa.types.is_fixed_size_list(dtype) else (len(values) // rows if rows else 0)
        if not pa.types.is_fixed_size_list(dtype) and any(len(v) != width for v in column.value_lengths().to_pylist()):
            raise InferenceFailed("a list output has rows of different lengths; V2 tensors are rectangular")
        shape = [rows, width]
    else:
        values, shape = column, [rows]
    if datatype == "BYTES":
        return datatype, shape, values.to_pylist()
    return datatype, shape, values.to_numpy(zero_copy_only=False)


_BY_NUMPY = {dtype: name for name, dtype in _NUMPY.items()}


def array_to_tensor(values: np.ndarray) -> tuple[str, list[int], np.ndarray]:
    """An output column given as a numpy array ((rows,) or (rows, k), see ``Runtime.predict``)
    as (datatype, shape, flat values): what ``column_to_tensor`` gives for the same column."""
    try:
        datatype = _BY_NUMPY[values.dtype]
    except KeyError as e:
        raise InferenceFailed(f"numpy type {values.dtype} has no Open Inference Protocol datatype") from e
    return datatype, list(values.shape), values.ravel()


def to_binary(datatype: str, values: Any) -> bytes:
    """Tensor values as binary tensor data."""
    if datatype == "BYTES":
        encoded = [v.encode() for v in values]
        return b"".join(_LENGTH.pack(len(e)) + e for e in encoded)
    return np.ascontiguousarray(values, dtype=_NUMPY[datatype]).tobytes()


class _Huge:
    """A JSON number past a double's range, as it was written."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _huge_or_float(text: str) -> Any:
    value = float(text)
    return _Huge(text) if math.isinf(value) else value


def _first_huge(data: Any) -> str | None:
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, _Huge):
            return item.text
        if isinstance(item, list):
            stack.extend(reversed(item))
    return None


def _range_of(datatype: str) -> str | None:
    """The values a V2 datatype holds, said for a message ("at most ±3.4028235e+38"); None for no number type."""
    dtype = _NUMPY.get(datatype)
    if dtype is None or dtype.kind == "b":
        return None
    if dtype.kind == "f":
        return f"at most ±{float(np.finfo(dtype).max):.8g}"
    info = np.iinfo(dtype)
    return f"{info.min} to {info.max}"


def out_of_range(json_part: bytes | memoryview, error: Exception) -> InvalidInput:
    """The refusal of a request whose JSON holds a number past a double's range (``1e400``, which the JSON parser
    refuses, ``error``): it names the first input whose data holds one and what the input's datatype holds; else
    the number. Read again only on this error (never for a body the parser took)."""
    try:
        doc = json.loads(bytes(json_part), parse_float=_huge_or_float)
    except (ValueError, RecursionError):
        doc = None
    inputs = doc.get("inputs") if isinstance(doc, dict) else None
    for tensor in inputs if isinstance(inputs, list) else ():
        text = _first_huge(tensor.get("data")) if isinstance(tensor, dict) else None
        if text is None:
            continue
        name, datatype = tensor.get("name"), tensor.get("datatype")
        holds = _range_of(datatype) if isinstance(datatype, str) else None
        if holds is None:
            return InvalidInput(f"input {shown(name)}: the number {shown(text)} is past the range of any number type "
                                f"(a double's, ±1.8e+308), and the input is declared {shown(datatype)}; send values "
                                "of its datatype")
        return InvalidInput(f"input {shown(name)}: the number {shown(text)} is out of range for its datatype "
                            f"{datatype} ({holds}); send values within it")
    return InvalidInput(f"the request body holds a number past the range of a double, ±1.8e+308 ({error}); send "
                        "numbers within it")


def refuse_blank_texts(name: str, texts: pa.Array) -> None:
    """An embedding model's texts, each with something to embed (``blank_text``), as ``/v1/embeddings`` takes them.

    Raises:
        InvalidInput: naming the input and the first element that is empty or only whitespace.
    """
    for i, text in enumerate(texts.to_pylist()):
        if text is not None and (blank := blank_text(text)) is not None:
            raise InvalidInput(f"input {name!r}: element {i} is {blank}; send the text to embed in each element, or "
                               "leave that one out")
