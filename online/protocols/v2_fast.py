"""The V2 fast path: the commonest inference requests decoded straight into the float arrays a model is fed.

It takes the signatures that have a ``FloatLayout`` (``shardline.rows``): every input a float32
(or float64) column, sent as one ``[N]`` tensor per column (the arrays are one ``(N, columns)``
matrix); or inputs that are float columns and ``fixed_size_list<float>[k]`` columns, each sent as
one ``[N]`` or ``[N, k]`` tensor (a model's ``[-1, k]`` inputs, as tritonclient sends them; one
array per input). ``fast_rows`` takes JSON bodies (data of JSON numbers, flat or, for an ``[N, k]`` input,
a list a row: floats, and ints the column's type holds exactly, as JavaScript and Go write 3.0; the declared
datatype and shape; no ``binary_data_size``), and ``fast_binary_rows`` bodies of binary tensors (a JSON header whose inputs carry only
``binary_data_size``, then their bytes: what tritonclient sends by default). Both leave everything
else to the general path of ``kserve_v2``, which names what is wrong (and builds the same arrays
from JSON or binary tensors these did not take).
The rows are refused as the kernel's row check refuses them (``float_rows``: NaN or infinity, a
JSON number past float32's range included, in a column that does not take them).
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from shardline.rows import Rows, float_rows
from shardline.signature import Signature

_NAME, _DATA, _SHAPE, _DATATYPE = (attrgetter(k) for k in ("name", "data", "shape", "datatype"))
_FLOAT = {float}
FLOAT_DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64"}
_NUMBER = {float, int}
# The largest whole number each float type holds exactly, with every one below it: a JSON int within it is the
# same value whichever way it is converted (the general path casts an int64 array), so the fast path takes it.
_EXACT_INT = {np.dtype(np.float32): 2**24, np.dtype(np.float64): 2**53}


def _numbers(values: list[Any], dtype: np.dtype[Any]) -> bool:
    """Whether ``values`` are JSON floats, or ints (whole numbers: what JavaScript, Go and hand-written JSON send
    for 3.0) that ``dtype`` holds exactly; bools and anything else are the general path's."""
    types = set(map(type, values))
    if types == _FLOAT:
        return True
    if not types or not types <= _NUMBER:
        return False
    bound = _EXACT_INT[dtype]
    return all(-bound <= v <= bound for v in values if type(v) is int)


_Input = TypeVar("_Input")


class _Tensor(msgspec.Struct, forbid_unknown_fields=True):
    """An input as the fast path takes it: flat JSON numbers (ints stay ints: ``_numbers`` decides)."""

    name: str
    datatype: str
    shape: list[int]
    data: list[int | float | list[int | float]]  # flat, or nested a row a list (KServe's documents write [[...]])
    parameters: dict[str, Any] | None = None  # as the general path, which reads only binary_data_size (see _bare)


class _BinaryParameters(msgspec.Struct, forbid_unknown_fields=True):
    binary_data_size: int


class _BinaryTensor(msgspec.Struct, forbid_unknown_fields=True):
    """An input whose values follow the JSON header as bytes, and nothing else about it."""

    name: str
    datatype: str
    shape: list[int]
    parameters: _BinaryParameters


class _Request(msgspec.Struct, Generic[_Input]):
    """A request as the fast path takes it (its inputs JSON or binary tensors); the rest is read as the general
    path reads it."""

    inputs: list[_Input]
    id: Any = None
    outputs: Any = None
    parameters: Any = None


_FAST_DECODER = msgspec.json.Decoder(_Request[_Tensor], strict=True)
_BINARY_DECODER = msgspec.json.Decoder(_Request[_BinaryTensor], strict=True)


def _bare(tensor: _Tensor) -> bool:
    """Whether a JSON input's parameters, if any, leave its ``data`` to be read as it is: no ``binary_data_size``
    (by which the general path reads the values from the binary part instead). Others, such as MLServer's
    ``content_type``, change nothing for a float input, on either path."""
    return not tensor.parameters or "binary_data_size" not in tensor.parameters


_IN_ORDER: list[int] = []  # ``_column_order``: the inputs came in the signature's order


def _column_order(inputs: list[_Tensor] | list[_BinaryTensor], signature: Signature) -> list[int] | None:
    """Each input's column in the signature, where they name every column once (``_IN_ORDER`` when in the
    signature's order); None where they do not."""
    plan = signature.plan
    names = tuple(map(_NAME, inputs))
    if names == plan.input_names:
        return _IN_ORDER
    try:
        order = list(map(plan.positions.__getitem__, names))
    except KeyError:
        return None
    return order if len(order) == len(plan.input_names) == len(set(order)) else None


def _in_signature_order(given: np.ndarray, order: list[int]) -> np.ndarray:
    """Values by input (the first axis) in the request's order, put in the signature's (``_column_order``)."""
    if order is _IN_ORDER:
        return given
    matrix = np.empty_like(given)
    matrix[order] = given
    return matrix


def _fast_columns(inputs: list[_Tensor], signature: Signature) -> tuple[np.ndarray, ...] | None:
    """One ``[N]`` input per float column: the (rows, columns) matrix in the signature's order, or None."""
    plan = signature.plan
    layout = plan.layout
    assert layout is not None
    width = len(plan.input_names)
    order = _column_order(inputs, signature)
    if order is None:
        return None
    data = list(map(_DATA, inputs))
    shapes = list(map(_SHAPE, inputs))
    rows = len(data[0])
    dtype = layout.dtypes[0]
    if (rows == 0 or set(map(_DATATYPE, inputs)) != {FLOAT_DATATYPES[dtype]}
            or set(map(len, data)) != {rows}
            or shapes.count([rows]) != width
            or not all(map(_bare, inputs))):
        return None
    values = list(chain.from_iterable(data))
    if not _numbers(values, dtype):
        return None
    # Python floats straight to the column type: numpy rounds each double once, as a float64 array's cast would.
    with np.errstate(over="ignore"):  # past float32's range: inf, refused by float_rows
        if rows == 1:  # the commonest online request: one row, the values in one pass
            given = np.fromiter(values, dtype, width)
        else:
            given = np.array(data, dtype=dtype)  # (inputs, rows) in the request's order
    given = _in_signature_order(given, order)
    return (given.reshape(1, width) if rows == 1 else np.ascontiguousarray(given.T),)  # (rows, columns)


def _rows_flat(data: list[Any], rank: int) -> list[Any] | None:
    """``data`` nested one level (a list a row, as KServe's documents write a ``[1, k]`` input), flat, where
    the shape has the rank for it and every item is a list; None for anything else (the general path flattens
    it as deep as the shape allows and names what is wrong). The rows' lengths are the caller's to check by the
    total, as the general path checks them."""
    if rank < 2 or not all(type(row) is list for row in data):
        return None
    return list(chain.from_iterable(data))


def _list_slot(tensor: _Tensor | _BinaryTensor, rows: int, signature: Signature, arrays: list[np.ndarray | None]
               ) -> tuple[int, int, np.dtype[Any], int] | None:
    """Where one input of a float signature with list columns goes (``_fast_tensors``, ``_binary_tensors``): its
    column's position, width (0: one value a row) and type, and the request's rows (the first input's, ``rows``
    below 0 before it), where it names a column no input before it did, with the column's datatype and shape
    (``[rows]`` or ``[rows, width]``); None where it does not."""
    plan = signature.plan
    layout = plan.layout
    assert layout is not None
    i, shape = plan.positions.get(tensor.name), tensor.shape
    if i is None or arrays[i] is not None or not shape:
        return None
    width, dtype = layout.widths[i], layout.dtypes[i]
    rows = shape[0] if rows < 0 else rows
    if (tensor.datatype != FLOAT_DATATYPES[dtype] or rows <= 0 or shape[0] != rows
            or shape[1:] != ([width] if width else [])):
        return None
    return i, width, dtype, rows


def _fast_tensors(inputs: list[_Tensor], signature: Signature) -> tuple[np.ndarray, ...] | None:
    """One ``[N]`` or ``[N, k]`` input per column of a float signature with list columns: their arrays, or None."""
    layout = signature.plan.layout
    assert layout is not None
    if len(inputs) != len(layout.widths):
        return None
    arrays: list[np.ndarray | None] = [None] * len(inputs)
    rows = -1
    for tensor in inputs:
        slot = _list_slot(tensor, rows, signature, arrays)
        if slot is None:
            return None
        i, width, dtype, rows = slot
        data = (_rows_flat(tensor.data, len(tensor.shape)) if tensor.data and type(tensor.data[0]) is list
                else tensor.data)
        if data is None or not _bare(tensor) or len(data) != rows * (width or 1) or not _numbers(data, dtype):
            return None
        with np.errstate(over="ignore"):  # past float32's range: inf, refused by float_rows
            values = np.array(data, dtype=dtype)
        arrays[i] = values.reshape(rows, width) if width else values
    return tuple(arrays)  # type: ignore[arg-type]


def _binary_columns(inputs: list[_BinaryTensor], binary: memoryview, signature: Signature) -> tuple[np.ndarray, ...] | None:
    """One binary ``[N]`` input per float column, their bytes making up the whole binary part: the (rows,
    columns) matrix in the signature's order (a copy: the body's bytes are read-only and unaligned), or None."""
    plan = signature.plan
    layout = plan.layout
    assert layout is not None
    width = len(plan.input_names)
    order = _column_order(inputs, signature)
    if order is None:
        return None
    dtype = layout.dtypes[0]
    shape = inputs[0].shape
    rows = shape[0] if len(shape) == 1 else 0
    size = rows * dtype.itemsize
    if (rows <= 0 or set(map(_DATATYPE, inputs)) != {FLOAT_DATATYPES[dtype]}
            or list(map(_SHAPE, inputs)).count(shape) != width
            or {t.parameters.binary_data_size for t in inputs} != {size} or len(binary) != width * size):
        return None
    given = np.frombuffer(binary, dtype, width * rows).reshape(width, rows)  # (inputs, rows) in the request's order
    return (np.array(_in_signature_order(given, order).T, order="C"),)


def _binary_tensors(inputs: list[_BinaryTensor], binary: memoryview, signature: Signature) -> tuple[np.ndarray, ...] | None:
    """One binary ``[N]`` or ``[N, k]`` input per column of a float signature with list columns, their bytes
    making up the whole binary part, in the order of the inputs: their arrays (copies), or None."""
    layout = signature.plan.layout
    assert layout is not None
    if len(inputs) != len(layout.widths):
        return None
    arrays: list[np.ndarray | None] = [None] * len(inputs)
    rows, offset = -1, 0
    for tensor in inputs:
        slot = _list_slot(tensor, rows, signature, arrays)
        if slot is None:
            return None
        i, width, dtype, rows = slot
        count = rows * (width or 1)
        size = tensor.parameters.binary_data_size
        if size != count * dtype.itemsize or offset + size > len(binary):
            return None
        values = np.frombuffer(binary, dtype, count, offset)
        arrays[i] = (values.reshape(rows, width) if width else values).copy()
        offset += size
    return tuple(arrays) if offset == len(binary) else None  # type: ignore[arg-type]


def fast_binary_rows(body: bytes, header_length: int, signature: Signature,
                     model: str) -> tuple[Rows, Any, Any, Any] | None:
    """``fast_rows`` for a body of binary tensors whose JSON header is ``header_length`` bytes: every input
    of the declared datatype and shape with only ``binary_data_size`` for parameters, the sizes adding up to
    the bytes after the header. None for anything else (the general path names what is wrong).

    Raises:
        NonFiniteValues: as the kernel's row check (``float_rows``).
    """
    plan = signature.plan
    layout = plan.layout
    if layout is None or header_length > len(body):
        return None
    view = memoryview(body)
    try:
        request = _BINARY_DECODER.decode(view[:header_length])
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None
    binary = view[header_length:]
    arrays = (_binary_columns(request.inputs, binary, signature) if layout.stacked
              else _binary_tensors(request.inputs, binary, signature))
    if arrays is None:
        return None
    return float_rows(plan, arrays, model), request.id, request.outputs, request.parameters


def fast_rows(body: bytes, signature: Signature, model: str) -> tuple[Rows, Any, Any, Any] | None:
    """The rows of a JSON request the fast path takes, as float ``Rows`` of the signature, with the
    request's ``id``, ``outputs`` and ``parameters`` (read as the general path reads them); None for
    anything else, invalid JSON included.

    ``msgspec`` decodes the body straight into typed structs (the types checked in C as it reads); what is
    left is a few ``map`` and ``set`` calls. The values are what the general path gives: the JSON numbers,
    rounded once by numpy to the column's type (an int taken is exact, ``_numbers``).

    Raises:
        NonFiniteValues: as the kernel's row check (``float_rows``).
    """
    plan = signature.plan
    layout = plan.layout
    if layout is None:
        return None
    try:
        request = _FAST_DECODER.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):  # (msgspec's own depth limit)
        return None
    arrays = _fast_columns(request.inputs, signature) if layout.stacked else _fast_tensors(request.inputs, signature)
    if arrays is None:
        return None
    return float_rows(plan, arrays, model), request.id, request.outputs, request.parameters
