"""The V2 fast path: the commonest inference requests decoded straight into the matrix a model is fed.

Two layouts (the signatures ``MatrixRows`` and ``ListRows`` build tables for): every input a
float32 (or float64) column, sent as one ``[N]`` tensor per column; or one
``fixed_size_list<float>[k]`` input, sent as one ``[N, k]`` tensor (a model's ``[-1, k]``
input, as tritonclient sends it). ``fast_rows`` takes JSON bodies (flat data of JSON floats,
the declared datatype and shape, no parameters) and leaves the rest to the general path of
``kserve_v2``, which names what is wrong; ``tensor_matrix`` turns the general path's rows of
the second layout (binary tensors included) into the matrix without a copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from shardline.online.dataplane import input_schema
from shardline.online.matrix_rows import ListRows, Matrix, MatrixRows
from shardline.online.protocols.v2_tensors import datatype_of
from shardline.signature import Signature, leaf_type

_FAST: dict[int, tuple[Signature, "FastPlan | None"]] = {}
_NAME, _DATA, _SHAPE, _DATATYPE, _PARAMETERS = (attrgetter(k) for k in ("name", "data", "shape", "datatype", "parameters"))
_FLOAT = {float}


class _Tensor(msgspec.Struct, forbid_unknown_fields=True):
    """An input as the fast path takes it: flat JSON numbers (ints stay ints: the general path reads them)."""

    name: str
    datatype: str
    shape: list[int]
    data: list[int | float]
    parameters: Any = None


class _Request(msgspec.Struct):
    """A request as the fast path takes it; the rest is read as the general path reads it."""

    inputs: list[_Tensor]
    id: Any = None
    outputs: Any = None
    parameters: Any = None


_FAST_DECODER = msgspec.json.Decoder(_Request, strict=True)


@dataclass(frozen=True)
class FastPlan:
    """How the fast path reads requests for one signature (worked out once per signature)."""

    names: list[str]  # the signature's inputs, in order
    positions: dict[str, int]
    builder: MatrixRows | ListRows
    finite_only: bool  # float32 columns, not all declaring NaN: a JSON number past float32's range is inf
    datatype: str  # FP32 or FP64: the one datatype every input takes
    width: int = 0  # for one fixed_size_list<float>[k] input (a [N, k] tensor): k; 0 for float columns


def fast_plan(signature: Signature) -> FastPlan | None:
    """For a signature whose inputs are all float32 (or all float64) primitive columns, or whose one
    input is a ``fixed_size_list`` of float32 (or float64): the column positions by name and the table
    builder; None for any other signature."""
    hit = _FAST.get(id(signature))
    if hit is not None and hit[0] is signature:
        return hit[1]
    types = {c.arrow_type for c in signature.inputs}
    plan = None
    names = [c.name for c in signature.inputs]
    only = next(iter(types))
    finite_only = leaf_type(only) == pa.float32() and not all(c.non_finite for c in signature.inputs)
    if len(types) == 1 and only in (pa.float32(), pa.float64()):
        plan = FastPlan(names, {n: i for i, n in enumerate(names)}, MatrixRows(input_schema(signature)), finite_only,
                        datatype_of(only))
    elif len(names) == 1 and pa.types.is_fixed_size_list(only) and only.value_type in (pa.float32(), pa.float64()):
        plan = FastPlan(names, {names[0]: 0}, ListRows(input_schema(signature)), finite_only, datatype_of(only),
                        only.list_size)
    if len(_FAST) > 1024:
        _FAST.clear()
    _FAST[id(signature)] = (signature, plan)
    return plan


def _fast_columns(inputs: list[_Tensor], plan: FastPlan) -> np.ndarray | None:
    """One input per float column: the (rows, columns) matrix in the signature's order, or None."""
    width = len(plan.names)
    if len(inputs) != width:
        return None
    names = list(map(_NAME, inputs))
    data = list(map(_DATA, inputs))
    shapes = list(map(_SHAPE, inputs))
    order = None
    if names != plan.names:
        try:
            order = list(map(plan.positions.__getitem__, names))
        except KeyError:
            return None
        if len(set(order)) != width:
            return None
    rows = len(data[0])
    if (rows == 0 or set(map(_DATATYPE, inputs)) != {plan.datatype}
            or set(map(len, data)) != {rows}
            or shapes.count([rows]) != width
            or any(map(_PARAMETERS, inputs))
            or set(map(type, chain.from_iterable(data))) != _FLOAT):
        return None
    # Python floats straight to the column type: numpy rounds each double once, as a float64 array's cast would.
    dtype = plan.builder.dtype
    if rows == 1:  # the commonest online request: one row, the values in one pass
        given = np.fromiter(chain.from_iterable(data), dtype, width)
    else:
        given = np.array(data, dtype=dtype)  # (inputs, rows) in the request's order
    if plan.finite_only and not math.isfinite(given.sum(dtype=np.float64)):  # (JSON holds no NaN; float64 cannot overflow)
        return None  # the general path names the input (or the sum overflowed, and it finds nothing)
    if order is not None:
        matrix = np.empty_like(given)
        matrix[order] = given
        given = matrix
    return given.reshape(1, width) if rows == 1 else np.ascontiguousarray(given.T)  # (rows, columns)


def _fast_tensor(inputs: list[_Tensor], plan: FastPlan) -> np.ndarray | None:
    """The one input of a ``fixed_size_list<float>[k]`` signature, shape ``[N, k]``: the (N, k) matrix, or None."""
    if len(inputs) != 1:
        return None
    tensor = inputs[0]
    shape, data, width = tensor.shape, tensor.data, plan.width
    if (tensor.name != plan.names[0] or tensor.datatype != plan.datatype or len(shape) != 2 or shape[1] != width
            or shape[0] <= 0 or len(data) != shape[0] * width or tensor.parameters
            or set(map(type, data)) != _FLOAT):
        return None
    values = np.array(data, dtype=plan.builder.dtype).reshape(shape[0], width)
    if plan.finite_only and not math.isfinite(values.sum(dtype=np.float64)):
        return None  # the general path names the input
    return values


def fast_rows(body: bytes, signature: Signature) -> tuple[Matrix, Any, Any, Any] | None:
    """The rows of a JSON request the fast path takes, as a ``Matrix`` in the signature's order and type,
    with the request's ``id``, ``outputs`` and ``parameters`` (read as the general path reads them); None
    for anything else, invalid JSON included.

    ``msgspec`` decodes the body straight into typed structs (the types checked in C as it reads); what is
    left is a few ``map`` and ``set`` calls. The values are what the general path gives: the JSON floats,
    rounded once by numpy to the column's type.
    """
    plan = fast_plan(signature)
    if plan is None:
        return None
    try:
        request = _FAST_DECODER.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):  # (msgspec's own depth limit)
        return None
    values = _fast_tensor(request.inputs, plan) if plan.width else _fast_columns(request.inputs, plan)
    if values is None:
        return None
    return Matrix(values, plan.builder), request.id, request.outputs, request.parameters


def tensor_matrix(table: pa.Table, signature: Signature) -> Matrix | None:
    """For a signature of one ``fixed_size_list<float>[k]`` column, its decoded rows (binary tensors, or JSON
    the fast path did not take) as the (N, k) matrix the runtime is fed, without a copy; None otherwise.
    (Such a column decoded from V2 holds no nulls, and its NaN were refused as the column says.)"""
    plan = fast_plan(signature)
    if plan is None or not plan.width or table.num_rows == 0:
        return None
    column = table.column(0).chunk(0)
    values = column.values.to_numpy(zero_copy_only=False)
    return Matrix(values.reshape(len(column), plan.width), plan.builder)
