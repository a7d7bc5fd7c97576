"""KServe's V1 protocol (TensorFlow Serving's REST predict, row format): ``{"instances": [...]}`` in,
``{"predictions": [...]}`` out.

Paths (``{version}`` a registry version number; without it the tenant's reference picks the version, as on V2):

    POST /v1/models/{name}:predict
    POST /v1/models/{name}/versions/{version}:predict
    GET  /                                            ``{"status": "alive"}``, no key (V1's liveness)

V1's model readiness, ``GET /v1/models/{name}``, is OpenAI's model path, whose answer carries ``name`` and
``ready`` too (``openai.py``).

It is what KServe's scikit-learn, XGBoost and LightGBM servers speak by default, and what its
``InferenceRESTClient(RESTConfig(protocol="v1"))`` sends, so a client written for them needs only the URL.
An instance is one row:

- a list of the row's values in the order of the model's inputs (``GET /v2/models/{name}`` lists them), or,
  for a model of one input, that input's value itself (a number, a text, or a ``[k]`` list for a ``[N, k]``
  input: the feature vector of a model that takes one; ``[[k values]]``, the list of that one value, too);
- or an object of the row's values by input name (TensorFlow Serving's named row format).

Every instance has the same form. The rows are checked as the V2 path checks them (types, nulls, NaN and infinity
refused unless the signature's column declares ``non_finite``), so a request is scored whole or refused whole.
Predictions are one per instance: the output's value where the model has one output; an object of every output's
value by name where it has several (TensorFlow Serving's rule), e.g. ``{"label": 1, "probabilities": [0.1,
0.9]}``. Errors are ``{"error": "..."}``, as KServe's and TensorFlow Serving's are.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pyarrow as pa
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from shardline.errors import InvalidInput
from shardline.online.dataplane import DataPlane
from shardline.online.edge import json_response
from shardline.online.errors import shown
from shardline.online.models import ServedModel
from shardline.online.protocols.kserve_v2 import InferEndpoint, parse_json_object
from shardline.online.protocols.v2_tensors import refuse_blank_texts
from shardline.rows import Rows, check_rows, float_rows
from shardline.signature import Signature, type_name

PROTOCOL = "v1"
_HEAD, _TAIL = "/v1/models/", ":predict"  # of a predict path
MAX_INSTANCES = 1_000_000  # a list longer than this is refused before it is read into columns


def decode_instances(body: bytes, signature: Signature, model: str) -> Rows:
    """The rows of a V1 ``{"instances": [...]}`` body, checked against the signature.

    Raises:
        InvalidInput: naming the instance, the input or the field that is wrong.
    """
    doc = parse_json_object(body, "instances")
    instances = doc.get("instances")
    if not isinstance(instances, list) or not instances:
        hint = " (TensorFlow Serving's columnar 'inputs' is not read: send the rows as 'instances')" \
            if "inputs" in doc else ""
        raise InvalidInput(f"field 'instances' is missing, empty or not a list{hint}; send "
                           "{\"instances\": [row, ...]}, a row being the model's input values in order")
    if len(instances) > MAX_INSTANCES:
        raise InvalidInput(f"{len(instances)} instances in one request; send at most {MAX_INSTANCES}")
    plan = signature.plan
    names = plan.input_names
    matrix = _float_matrix(instances, signature)
    if matrix is not None:
        return float_rows(plan, (matrix,), model)
    columns = _columns(instances, names, model, len(names) == 1 and plan.columns[0].shape != ())
    arrays = []
    for spec, values in zip(signature.inputs, columns):
        try:
            arrays.append(pa.array(values, type=spec.arrow_type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, TypeError) as e:
            raise InvalidInput(f"input {spec.name!r}: its values are not all {type_name(spec.arrow_type)} ({e}); "
                               f"send {type_name(spec.arrow_type)} values") from e
    if plan.embedding is not None:  # as V2 and /v1/embeddings refuse them
        refuse_blank_texts(names[0], arrays[0])
    return check_rows(pa.Table.from_arrays(arrays, schema=plan.input_schema), signature, model)


def _float_matrix(instances: list[Any], signature: Signature) -> np.ndarray | None:
    """The instances as the one ``(N, k)`` array of a float signature that is fed one (a stacked signature's
    matrix, or a model's one ``[N, k]`` input) when each is a list of ``k`` numbers: the usual V1 request. None for
    anything else (the general path reads it and names what is wrong)."""
    layout = signature.plan.layout
    if layout is None or type(instances[0]) is not list or len(layout.widths) != 1 or layout.widths[0] < 1:
        return None
    try:
        matrix = np.array(instances)
    except (ValueError, TypeError):  # ragged, or values numpy cannot hold together
        return None
    if matrix.ndim != 2 or matrix.shape[1] != layout.widths[0] or matrix.dtype.kind not in "fiu":
        return None
    return matrix.astype(layout.dtypes[0], copy=False)


def _columns(instances: list[Any], names: tuple[str, ...], model: str, list_input: bool) -> list[list[Any]]:
    """The instances' values, one list an input in the signature's order (``list_input``: the model's one input
    takes a list a row)."""
    count = len(names)
    first = instances[0]
    if isinstance(first, dict):
        columns: list[list[Any]] = [[] for _ in names]
        wanted = set(names)
        for i, row in enumerate(instances):
            if not isinstance(row, dict) or row.keys() != wanted:
                raise InvalidInput(_named_mismatch(i, row, names, model))
            for j, name in enumerate(names):
                columns[j].append(row[name])
        return columns
    if count == 1:  # a model of one input: an instance is its value, or the list of that one value
        if any(isinstance(row, dict) for row in instances):
            raise InvalidInput("instances mix objects and values; send every instance in one form")
        if list_input:  # its value is a list itself: [v, ...] is the value, [[v, ...]] the list of it
            return [[row[0] if type(row) is list and len(row) == 1 and type(row[0]) is list else row
                     for row in instances]]
        return [[row[0] if type(row) is list and len(row) == 1 else row for row in instances]]
    for i, row in enumerate(instances):
        if not isinstance(row, list) or len(row) != count:
            given = f"a list of {len(row)} values" if isinstance(row, list) else f"a JSON {_json_type(row)}"
            raise InvalidInput(f"instances[{i}] is {given}; the model {model!r} takes {count} inputs, so send each "
                               f"instance as a list of {count} values in this order: {_listed(names)}, or as an "
                               "object of them by name")
    return [list(column) for column in zip(*instances)]


def _named_mismatch(i: int, row: Any, names: tuple[str, ...], model: str) -> str:
    if not isinstance(row, dict):
        return f"instances[{i}] is a JSON {_json_type(row)} where instances[0] is an object; send every instance in one form"
    missing = [n for n in names if n not in row]
    unknown = [k for k in row if k not in names]
    parts = []
    if missing:
        parts.append(f"lacks {_listed(missing)}")
    if unknown:
        parts.append(f"names {_listed([shown(k) for k in unknown], quote=False)}, not inputs of the model {model!r}")
    return f"instances[{i}] {' and '.join(parts)}; send an object of exactly its inputs: {_listed(names)}"


def _listed(names: Any, quote: bool = True) -> str:
    shown_names = [repr(n) if quote else n for n in list(names)[:8]]
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    return ", ".join(shown_names) + more


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def encode_predictions(signature: Signature, output: pa.Table | pa.RecordBatch | dict[str, np.ndarray]) -> bytes:
    """``{"predictions": [...]}``: each row's value of the one output, or an object of every output's value.

    Floats are written as the V2 path writes them (a float32 as its shortest float32 form, 0.9999181, not the
    double it widens to)."""
    names = signature.plan.output_names
    if isinstance(output, dict):
        values = [_writable(output[name]) for name in names]
    else:
        values = [_values(output.column(name)) for name in names]
    if len(names) == 1:
        return orjson.dumps({"predictions": values[0]}, option=orjson.OPT_SERIALIZE_NUMPY)
    return orjson.dumps({"predictions": [dict(zip(names, row)) for row in zip(*values)]},
                        option=orjson.OPT_SERIALIZE_NUMPY)


def _values(column: pa.ChunkedArray | pa.Array) -> Any:
    """A column's values a row: a numpy array for numbers without nulls (flat, or ``(N, k)`` for a fixed-size list of
    them), else Python values."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    kind = array.type
    if array.null_count == 0:
        if pa.types.is_integer(kind) or pa.types.is_floating(kind):
            return _writable(array.to_numpy(zero_copy_only=False))
        if pa.types.is_fixed_size_list(kind) and (pa.types.is_floating(kind.value_type)
                                                 or pa.types.is_integer(kind.value_type)) \
                and array.values.null_count == 0:
            return _writable(array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), kind.list_size))
    return array.to_pylist()


def _writable(values: np.ndarray) -> Any:
    """Floats as a C-ordered array (orjson writes no other, and writes float32 short); anything else as Python
    values (orjson writes no numpy ``longlong`` scalar, which a row of an int64 array is here)."""
    if values.dtype.kind == "f":
        return np.ascontiguousarray(values)
    return values.tolist()


class PredictEndpoint(InferEndpoint):
    """``POST /v1/models/{name}[/versions/{version}]:predict`` as a plain ASGI app: the V2 endpoint's request
    handling (key, quota, version, body, errors, gzip), with V1's body and answer."""

    protocol = PROTOCOL

    def decode(self, body: bytes, headers: dict[bytes, bytes], served: ServedModel) -> tuple[Rows, Any]:
        return decode_instances(body, served.signature, served.pinned), None

    def encode(self, served: ServedModel, decoded: Any, output: pa.Table | pa.RecordBatch | dict[str, np.ndarray]
               ) -> tuple[bytes, int | None]:
        return encode_predictions(served.signature, output), None


def predict_path_params(path: str) -> dict[str, str] | None:
    """``{"name"[, "version"]}`` of a predict path (``/v1/models/{name}[/versions/{version}]:predict``), else None."""
    if not (path.startswith(_HEAD) and path.endswith(_TAIL)):
        return None
    parts = path[len(_HEAD):-len(_TAIL)].split("/")
    if len(parts) == 1 and parts[0]:
        return {"name": parts[0]}
    if len(parts) == 3 and parts[1] == "versions" and parts[0] and parts[2]:
        return {"name": parts[0], "version": parts[2]}
    return None


def routes(plane: DataPlane) -> list[BaseRoute]:
    """The V1 predict routes over a data plane (``app.InferFirst`` sends their POSTs straight to the endpoint; these
    answer the other methods)."""
    predict = PredictEndpoint(plane)

    async def alive(request: Request) -> Response:
        """KServe V1's liveness (``GET /``, what its clients' ``is_server_live`` reads): no key, as V2's."""
        return json_response({"status": "alive"})

    return [
        Route("/v1/models/{name}:predict", predict, methods=["POST"]),
        Route("/v1/models/{name}/versions/{version}:predict", predict, methods=["POST"]),
        Route("/", alive, methods=["GET"]),
    ]
