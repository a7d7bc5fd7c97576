"""Open Inference Protocol (KServe V2) over REST: decode the request, call the data plane, encode.

Paths (``{version}`` is a registry version number; without it the tenant's reference
for the model, e.g. ``name@prod``, picks the version):

    GET  /v2/health/live, /v2/health/ready          no key (Kubernetes probes)
    GET  /v2                                        server metadata
    POST /v2/repository/index                       the tenant's models and their state (Triton's repository index)
    GET  /v2/models/{name}[/versions/{version}]     model metadata (inputs, outputs)
    GET  /v2/models/{name}[/versions/{version}]/ready   200 a request would be served (state: loaded or unloaded), 503 not
    GET  /v2/models/{name}[/versions/{version}]/config  Triton's model configuration (``model_config``)
    POST /v2/models/{name}[/versions/{version}]/infer

A request carries one input per signature input column, of exactly the datatype and
rank the model metadata advertises for it (a ``fixed_size_list<float32>[k]`` column is
one FP32 input of shape ``[N, k]``, as Triton takes a model's ``[-1, k]`` input), or, for a
signature with ``input_tensor``, that one ``[N, k]`` input, the columns stacked
(``SignaturePlan.tensor_view``); the binary tensor data
extension is read when ``Inference-Header-Content-Length`` splits the body into the
JSON header and the tensors, and outputs are sent binary when the request asks
(``parameters.binary_data_output`` or an output's ``parameters.binary_data``). An output asked
with ``parameters.classification`` k (Triton's classification extension, tritonclient's
``class_count``) is answered as its k top classes a row, ``BYTES`` ``"value:index"``, shape ``[N, k]``.
Content-Type is not required (tritonclient's JSON mode sends none). Errors are
``{"error": "..."}``.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from shardline import __version__
from shardline.errors import InvalidInput, NonFiniteValues, ShardlineError, number_out_of_range
from shardline.online.bodies import byte_count
from shardline.online.dataplane import DataPlane
from shardline.online.edge import (
    ClientGone,
    authenticate,
    endpoint,
    error_answer,
    json_response,
    note_model,
    read_body,
)
from shardline.online.errors import shown
from shardline.online.headers import TENANT_HEADER
from shardline.online.logs import current
from shardline.online.models import ServedModel
from shardline.online.protocols.forms import v2_error_body
from shardline.online.protocols.v2_fast import fast_binary_rows, fast_rows
from shardline.online.protocols.v2_tensors import (
    array_to_tensor,
    column_to_tensor,
    describe,
    out_of_range,
    refuse_blank_texts,
    tensor_to_array,
    tensor_to_column,
    to_binary,
)
from shardline.rows import Rows, check_rows, float_rows
from shardline.signature import Signature, row_shape

PROTOCOL = "v2"
HEADER_LENGTH = "Inference-Header-Content-Length"
_HEADER_LENGTH_KEY = HEADER_LENGTH.lower().encode()
_TENANT_KEY = TENANT_HEADER.encode()
JSON = b"application/json"
GZIP_MIN_BYTES = 1024  # answers this large are gzipped for clients that accept it (as GZipMiddleware does)
# 6.3 MB of JSON answer (floats, labels) measured: level 1 0.12 s -> 2.62 MB, 5 0.30 s -> 2.37 MB, 9 4.4 s -> 2.29 MB.
GZIP_LEVEL = 1  # what answers are gzipped with (app.py's GZipMiddleware uses it too): level 9 cost 37x the CPU for 13% smaller
EXTENSIONS = ["binary_tensor_data", "classification"]


@dataclass
class InferRequest:
    """A decoded inference request: its rows, checked against the signature, and what the answer should hold.

    ``rows`` are float arrays for a signature with a float layout (JSON or binary tensors alike),
    else an Arrow table; either way ``Rows`` of the signature's plan, so the data plane does not
    check them again.
    """

    rows: Rows
    request_id: str | None
    outputs: list[str]
    binary: dict[str, bool]
    classes: dict[str, int] | None = None  # outputs answered as their top classes (the classification extension)

    @property
    def table(self) -> pa.Table:
        """The rows as a table of the signature's input columns (made from the arrays if need be)."""
        table = self.rows.table()
        return table if isinstance(table, pa.Table) else pa.Table.from_batches([table])


def _json_header(body: bytes, header_length: str | None) -> tuple[Any, memoryview]:
    if header_length is None:
        json_part, binary = body, memoryview(b"")
    else:
        size = byte_count(header_length)
        if size is None:
            raise InvalidInput(f"header {HEADER_LENGTH} is {shown(header_length)}, not a number of bytes; send the "
                               "length of the JSON part of the body in ASCII digits")
        if size > len(body):
            raise InvalidInput(f"header {HEADER_LENGTH} says {size} bytes of JSON, the body has only {len(body)}")
        json_part, binary = body[:size], memoryview(body)[size:]
    return parse_json_object(json_part, "inputs", header_length), binary


def parse_json_object(json_part: bytes, field: str, header_length: str | None = None) -> dict[str, Any]:
    """A request's JSON object (whose main field is ``field``), ``NaN`` and ``Infinity`` read as Python writes them.

    Raises:
        InvalidInput: the body is not JSON, or not an object (see ``_with_non_finite``).
    """
    try:
        doc = orjson.loads(json_part)
    except orjson.JSONDecodeError as e:
        doc = _with_non_finite(json_part, e, header_length, field)
    if not isinstance(doc, dict):
        raise InvalidInput(f"the request body is a JSON {type(doc).__name__}, not an object with '{field}'")
    return doc


_NON_FINITE = re.compile(rb"(?<![\w\"])(?:-?Infinity|NaN)(?![\w\"])")  # as Python's json writes them


def _with_non_finite(json_part: bytes, error: orjson.JSONDecodeError, header_length: str | None = None,
                     field: str = "inputs") -> Any:
    """A body that is JSON but for ``NaN`` or ``Infinity`` (what Python's ``json.dumps`` writes for them, and so
    tritonclient's JSON requests and any client sending its output), read as the floats they name: the row check then
    says which input holds them, and a column that declares ``non_finite`` takes them. Any other invalid JSON is
    refused with the parser's words.

    Raises:
        InvalidInput: the body is not JSON, even with NaN and Infinity; where it names ``binary_data_size``, said as
            binary tensors whose JSON part ``Inference-Header-Content-Length`` does not mark; it is JSON holding a
            number past a double's range (``1e400``), said as out of range for the input's datatype.
    """
    if number_out_of_range(error):  # valid JSON: a number no double holds
        raise out_of_range(json_part, error) from error
    if _NON_FINITE.search(json_part):
        try:
            return json.loads(bytes(json_part))
        except (ValueError, RecursionError):
            pass
    if b'"binary_data_size"' in json_part:  # binary tensors after the JSON: the parser's words would mislead
        if header_length is None:
            raise InvalidInput(f"the body holds binary tensors (an input has a binary_data_size parameter) but no "
                               f"{HEADER_LENGTH} header says where its JSON ends; send that header with the JSON "
                               "part's length in bytes, as tritonclient does") from error
        raise InvalidInput(f"header {HEADER_LENGTH} says the JSON part is {header_length} bytes, but those bytes "
                           f"are not a JSON object ({error}); send the JSON part's length in bytes") from error
    raise InvalidInput(f"the request body is not valid JSON ({error}); send an object such as {{\"{field}\": [...]}}") \
        from error


def _tensor_fields(tensor: Any, i: int) -> tuple[str, str, list[int], dict[str, Any]]:
    if not isinstance(tensor, dict):
        raise InvalidInput(f"inputs[{i}] is not an object with name, datatype, shape and data")
    name = tensor.get("name")
    if not isinstance(name, str):
        raise InvalidInput(f"inputs[{i}].name is missing or not a string")
    datatype = tensor.get("datatype")
    if not isinstance(datatype, str):
        raise InvalidInput(f"input {shown(name)}: 'datatype' is missing or not a string (e.g. \"FP32\", \"BYTES\")")
    shape = tensor.get("shape")
    if shape is None:
        raise InvalidInput(f"input {shown(name)}: 'shape' is missing; send it as a list of whole numbers such as [N] "
                           "or [N, k]")
    if (not isinstance(shape, list) or not shape or len(shape) > _MAX_RANK
            or any(type(d) is not int or d < 0 for d in shape)):
        raise InvalidInput(f"input {shown(name)}: 'shape' is {shown(shape)}; it must be a list of whole numbers "
                           "such as [N] or [N, k]")
    parameters = tensor.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput(f"input {shown(name)}: 'parameters' is not an object")
    return name, datatype, shape, parameters


def decode_infer_request(body: bytes, header_length: str | None, signature: Signature, model: str) -> InferRequest:
    """Turn a V2 inference request into rows for the model, checking every input against its signature (for a
    signature with ``input_tensor``: its one ``[N, k]`` input, whose array is the columns' stacked matrix).

    Raises:
        InvalidInput: naming the field or input that is wrong.
    """
    view = signature.plan.tensor_view
    if view is None:
        return _decode(body, header_length, signature, model)
    decoded = _decode(body, header_length, view, model)
    assert decoded.rows.arrays is not None  # the view is a float signature: its rows are arrays
    try:
        decoded.rows = float_rows(signature.plan, decoded.rows.arrays, model)  # the columns' own finite check
    except NonFiniteValues as e:  # named by the columns of the bundle's rows: say which input the client sent
        raise NonFiniteValues(f"input {view.inputs[0].name!r} (the model's columns in order): {e}", e.columns) from e
    return decoded


def _decode(body: bytes, header_length: str | None, signature: Signature, model: str) -> InferRequest:
    fast = _fast_request(body, header_length, signature, model)
    if fast is not None:
        return fast
    doc, binary = _json_header(body, header_length)
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidInput("field 'inputs' is missing, empty or not a list; send one input per model input")
    plan = signature.plan
    layout = plan.layout
    columns: dict[str, Any] = {}
    offset = 0
    for i, tensor in enumerate(inputs):
        name, datatype, shape, parameters = _tensor_fields(tensor, i)
        if name in columns:
            raise InvalidInput(f"input {name!r} appears twice")
        column = plan.by_name.get(name)
        if column is None:
            raise InvalidInput(f"input {shown(name)} is not an input of the model {model!r}; it takes {list(plan.input_names)}")
        size = parameters.get("binary_data_size")
        if size is not None:
            if type(size) is not int or size < 0:
                raise InvalidInput(f"input {name!r}: binary_data_size is {shown(size)}, not a number of bytes")
            if offset + size > len(binary):
                raise InvalidInput(
                    f"input {name!r}: binary_data_size {size} runs past the end of the body "
                    f"({len(binary) - offset} bytes of binary data left); send {HEADER_LENGTH} and the tensors"
                )
            values: Any = binary[offset:offset + size]
            offset += size
        elif "data" in tensor:
            values = tensor["data"]
        else:
            raise InvalidInput(f"input {name!r} has neither 'data' nor a binary_data_size parameter")
        if layout is not None:  # a float signature: numpy arrays, no Arrow
            columns[name] = tensor_to_array(name, datatype, shape, values, column)
        else:
            columns[name] = tensor_to_column(name, datatype, shape, values, column)
    if offset != len(binary):
        raise InvalidInput(f"the body holds {len(binary) - offset} bytes of binary data that no input claims")
    missing = [describe(c) for c in signature.inputs if c.name not in columns]
    if missing:
        needs = ", ".join(f"{m['name']!r} ({m['datatype']}, shape {m['shape']})" for m in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise InvalidInput(f"inputs missing: the model {model!r} needs {needs}{more}")
    counts = {name: len(column) for name, column in columns.items()}
    if len(set(counts.values())) > 1:
        raise InvalidInput(f"inputs disagree on the number of rows: {counts}; send the same N for every input")
    ordered = [columns[n] for n in plan.input_names]
    if layout is None:
        if plan.embedding is not None:
            refuse_blank_texts(plan.input_names[0], ordered[0])
        rows = check_rows(pa.Table.from_arrays(ordered, schema=plan.input_schema), signature, model)
    elif layout.stacked:
        rows = float_rows(plan, (np.column_stack(ordered) if ordered[0].size else
                                 np.empty((0, len(ordered)), layout.dtypes[0]),), model)
    else:
        rows = float_rows(plan, tuple(ordered), model)
    return InferRequest(rows, _request_id(doc.get("id")), *_requested_outputs(doc, signature, model))


_MAX_RANK = 8  # a shape longer than this is refused before anything reads it (models take [N] or [N, k])


def _fast_request(body: bytes, header_length: str | None, signature: Signature, model: str) -> InferRequest | None:
    """The commonest requests (``v2_fast``), decoded and checked in one pass: one input per input of a float
    signature (datatype and shape as the metadata says), as JSON (flat ``data`` of JSON numbers, no
    ``binary_data_size``) or as binary tensors (``binary_data_size`` their only parameter). None (and the
    general path decides, with its errors) for anything else."""
    if header_length is None:
        fast = fast_rows(body, signature, model)
    else:
        size = byte_count(header_length)
        fast = None if size is None else fast_binary_rows(body, size, signature, model)
    if fast is None:
        return None
    rows, request_id, requested, parameters = fast
    return InferRequest(rows, _request_id(request_id),
                        *_requested_outputs({"outputs": requested, "parameters": parameters}, signature, model))


def _request_id(value: Any) -> str | None:
    """The request's ``id``, echoed in the answer: a string (the protocol's type), or none. Another type was dropped
    from the answer without a word."""
    if value is None or isinstance(value, str):
        return value
    raise InvalidInput(f"field 'id' is {type(value).__name__}, not a string; send the id as a JSON string")


def _requested_outputs(doc: dict[str, Any], signature: Signature, model: str
                       ) -> tuple[list[str], dict[str, bool], dict[str, int] | None]:
    """The outputs the answer holds, whether each is binary, and the top-k classes asked of some (None: none)."""
    parameters = doc.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput(f"field 'parameters' is {shown(parameters)}, not an object; send an object such as "
                           "{\"binary_data_output\": true}")
    default = bool(parameters.get("binary_data_output", False))
    requested = doc.get("outputs")
    if requested is None or requested == []:  # every output (most requests; [] as Triton takes it): read-only
        every = signature.plan.every_output[default]
        return signature.plan.output_names, every, None
    if not isinstance(requested, list):
        raise InvalidInput("field 'outputs' is not a list of {\"name\": ...} objects")
    names: list[str] = []
    binary: dict[str, bool] = {}
    classes: dict[str, int] = {}
    for i, output in enumerate(requested):
        name = output.get("name") if isinstance(output, dict) else None
        if not isinstance(name, str):
            raise InvalidInput(f"outputs[{i}] has no name")
        if name not in signature.output_names:
            raise InvalidInput(f"output {shown(name)} is not an output of the model {model!r}; it gives {signature.output_names}")
        if name in binary:  # (the answer held it twice)
            raise InvalidInput(f"output {shown(name)} is asked for twice in 'outputs'; name each output once")
        own = output.get("parameters") or {}
        if isinstance(own, dict) and own.get("classification") is not None:
            classes[name] = _class_count(name, own["classification"], signature)
        names.append(name)
        binary[name] = bool(own.get("binary_data", default)) if isinstance(own, dict) else default
    return names, binary, classes or None


def _class_count(name: str, count: Any, signature: Signature) -> int:
    """The classification extension's count for an output (tritonclient's ``class_count``): a positive number, of
    an output of numbers (a score a class a row, or one number a row)."""
    if type(count) is not int or count < 1:
        raise InvalidInput(f"output {name!r}: 'classification' is {shown(count)}; send the number of top classes "
                           "to answer, 1 or more")
    spec = next(c for c in signature.outputs if c.name == name)
    kind = spec.arrow_type.value_type if pa.types.is_fixed_size_list(spec.arrow_type) else spec.arrow_type
    if not (pa.types.is_floating(kind) or pa.types.is_integer(kind)):  # (a list of lists: its values are lists)
        raise InvalidInput(f"output {name!r} is {spec.type}, not a score a class: the classification extension "
                           "ranks numbers; leave out its 'classification' parameter")
    return count


def top_classes(values: Any, rows: int, count: int) -> tuple[list[int], list[str]]:
    """The classification extension's answer, as Triton gives it: each of the ``rows`` rows' ``count`` highest values
    (all of them where it has fewer), highest first (ties: the lower index), each ``"value:index"`` (the value as C's
    ``%f`` writes it); the shape ``[rows, count]`` and the strings, row after row."""
    if not rows:
        return [0, count], []
    scores = np.asarray(values).reshape(rows, -1)
    count = min(count, scores.shape[1])
    order = np.argsort(-scores.astype(np.float64, copy=False), axis=1, kind="stable")[:, :count]
    ranked = np.take_along_axis(scores, order, axis=1)
    return [rows, count], [f"{v:f}:{i}" for v, i in zip(ranked.ravel().tolist(), order.ravel().tolist())]


def encode_infer_response(
    model: str, version: int, request: InferRequest, output: pa.Table | pa.RecordBatch | dict[str, np.ndarray]
) -> tuple[bytes, int | None]:
    """The V2 response body, and the JSON header's length when binary tensors follow it.

    ``output``: the model's rows, or its columns as numpy arrays (``DataPlane.infer`` of float rows).
    """
    docs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    arrays = output if isinstance(output, dict) else None
    classes = request.classes
    for name in request.outputs:
        if arrays is not None:
            datatype, shape, values = array_to_tensor(arrays[name])
        else:
            datatype, shape, values = column_to_tensor(output.column(name))  # type: ignore[union-attr]
        if classes is not None and name in classes:
            datatype = "BYTES"
            shape, values = top_classes(values, shape[0], classes[name])
        doc: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
        if request.binary[name]:
            raw = to_binary(datatype, values)
            doc["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            doc["data"] = values
        docs.append(doc)
    response: dict[str, Any] = {"model_name": model, "model_version": str(version), "outputs": docs}
    if request.request_id is not None:
        response["id"] = request.request_id
    header = orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, None
    return header + b"".join(blobs), len(header)


def output_bytes(output: pa.Table | pa.RecordBatch | dict[str, np.ndarray]) -> int:
    """Bytes of a model's answer as it is held (the JSON that encodes it is a few times larger)."""
    if isinstance(output, dict):
        return sum(values.nbytes for values in output.values())
    return int(output.nbytes)


def model_metadata(name: str, versions: list[int], runtime: str, signature: Signature) -> dict[str, Any]:
    """The V2 model metadata document."""
    return {
        "name": name,
        "versions": [str(v) for v in versions],
        "platform": _platform(runtime),
        "inputs": [describe(c) for c in (signature.plan.tensor_view or signature).inputs],
        "outputs": [describe(c) for c in signature.outputs],
    }


def _platform(runtime: str) -> str:
    """A bundle's runtime as Triton names the platform (its metadata and its model configuration)."""
    return "onnxruntime_onnx" if runtime == "onnx" else runtime


def model_config(served: ServedModel) -> dict[str, Any]:
    """Triton's model configuration (``GET .../config``, tritonclient's ``get_model_config``; perf_analyzer reads it
    first): a batched model (``max_batch_size``, the rows the batcher puts in one batch; a request may carry more),
    each tensor's ``data_type`` and its ``dims`` a row, a column of one value a row as Triton writes it (``dims
    [1]``, ``reshape {shape: []}``: ``[N]`` in the metadata), and the dynamic batcher's wait."""
    signature = served.signature
    limits = served.batcher.limits
    runtime = served.resolved.manifest.runtime

    def tensor(spec: Any) -> dict[str, Any]:
        datatype = describe(spec)["datatype"]
        dims = row_shape(spec.arrow_type)
        doc: dict[str, Any] = {"name": spec.name, "data_type": "TYPE_" + ("STRING" if datatype == "BYTES" else datatype),
                               "dims": dims or [1]}
        if not dims:
            doc["reshape"] = {"shape": []}
        return doc

    return {
        "name": served.name,
        "platform": _platform(runtime),
        "backend": "onnxruntime" if runtime == "onnx" else runtime,
        "version_policy": {"specific": {"versions": [served.version]}},
        "max_batch_size": limits.max_batch_size,
        "input": [tensor(c) for c in (signature.plan.tensor_view or signature).inputs],
        "output": [tensor(c) for c in signature.outputs],
        "dynamic_batching": {"max_queue_delay_microseconds": round(limits.max_wait_s * 1e6)},
    }


def infer_path_params(path: str) -> dict[str, str] | None:
    """``{"name"[, "version"]}`` of an inference path (``/v2/models/{name}[/versions/{version}]/infer``), else None."""
    parts = path.split("/")
    if len(parts) == 5 and parts[4] == "infer" and parts[1] == "v2" and parts[2] == "models" and parts[3]:
        return {"name": parts[3]}
    if (len(parts) == 7 and parts[6] == "infer" and parts[4] == "versions" and parts[1] == "v2"
            and parts[2] == "models" and parts[3] and parts[5]):
        return {"name": parts[3], "version": parts[5]}
    return None


class InferEndpoint:
    """``POST /v2/models/{name}[/versions/{version}]/infer`` as a plain ASGI app: the hot path. (KServe V1's
    ``:predict`` is the same app with V1's ``decode`` and ``encode``: ``kserve_v1.PredictEndpoint``.)

    It does what a Starlette endpoint wrapped by ``edge.endpoint`` does (the tenant from the
    key, its quota, the version, the body within the size limit, decode, infer, encode,
    errors by the one table, gzip for large answers when the client accepts it), without a
    Request or Response object per request. ``scope["path_params"]`` holds the name (and version).
    """

    protocol = PROTOCOL

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    def decode(self, body: bytes, headers: dict[bytes, bytes], served: ServedModel) -> tuple[Rows, Any]:
        """The request's rows, and what its answer needs of it (here the decoded request: ids, outputs asked)."""
        decoded = decode_infer_request(body, _text(headers, _HEADER_LENGTH_KEY), served.signature, served.pinned)
        return decoded.rows, decoded

    def encode(self, served: ServedModel, decoded: Any, output: pa.Table | pa.RecordBatch | dict[str, np.ndarray]
               ) -> tuple[bytes, int | None]:
        """The answer's body, and the JSON header's length when binary tensors follow it."""
        return encode_infer_response(served.name, served.version, decoded, output)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one inference request."""
        headers = dict(reversed(scope["headers"]))  # the first of a repeated header wins, as in Starlette
        content_type = JSON
        extra: list[tuple[bytes, bytes]] = []
        try:
            payload, header_length = await self._infer(scope, receive, headers)
            status = 200
            if header_length is not None:
                content_type = b"application/octet-stream"
                extra.append((HEADER_LENGTH.lower().encode(), str(header_length).encode()))
        except ClientGone:
            return  # nobody is left to answer
        except Exception as e:  # noqa: BLE001 - answered by the one table (a bug: 500, logged)
            status, body, error_headers = error_answer(e, v2_error_body)
            payload = orjson.dumps(body)
            extra.extend((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error_headers.items())
        if len(payload) >= GZIP_MIN_BYTES and b"gzip" in headers.get(b"accept-encoding", b""):
            payload = await self._gzipped(payload)
            extra += [(b"content-encoding", b"gzip"), (b"vary", b"Accept-Encoding")]
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-length", str(len(payload)).encode()), (b"content-type", content_type), *extra]})
        await send({"type": "http.response.body", "body": payload})

    async def _gzipped(self, payload: bytes) -> bytes:
        if len(payload) >= self.plane.settings.offload_min_bytes and self.plane.started:
            return await self.plane.off_loop(lambda: gzip.compress(payload, compresslevel=GZIP_LEVEL))
        return gzip.compress(payload, compresslevel=GZIP_LEVEL)

    async def _infer(self, scope: Scope, receive: Receive, headers: dict[bytes, bytes]) -> tuple[bytes, int | None]:
        plane = self.plane
        info = current()
        if info is not None:
            info.protocol = self.protocol
        authorization = headers.get(b"authorization")
        behalf = headers.get(_TENANT_KEY)
        tenant = plane.authenticate(authorization.decode("latin-1") if authorization is not None else None,
                                    behalf.decode("latin-1") if behalf is not None else None)
        if info is not None:
            info.tenant = tenant.name
        params = scope["path_params"]
        with plane.admit(tenant):
            served = await plane.model(tenant, params["name"], params.get("version"))  # + X-Shardline-Variant
            note_model(served)
            body = await read_body(receive, _text(headers, b"content-length"), _text(headers, b"content-encoding"), plane)
            large = len(body) >= plane.settings.offload_min_bytes
            if large:  # decoded on a codec thread: the loop answers others meanwhile
                rows, decoded = await plane.off_loop(lambda: self.decode(body, headers, served))
            else:
                rows, decoded = self.decode(body, headers, served)
            output = await plane.infer(tenant, served, rows)
        if large or output_bytes(output) >= plane.settings.offload_min_bytes // 4:  # JSON: ~4x the binary size
            return await plane.off_loop(lambda: self.encode(served, decoded, output))
        return self.encode(served, decoded, output)


def _text(headers: dict[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return value.decode("latin-1") if value is not None else None


def routes(plane: DataPlane) -> list[BaseRoute]:
    """The V2 routes over a data plane."""
    wrap = endpoint(PROTOCOL, v2_error_body)

    @wrap
    async def live(request: Request) -> Response:
        return json_response({"live": True})

    @wrap
    async def ready(request: Request) -> Response:
        return json_response({"ready": plane.ready}, 200 if plane.ready else 503)

    @wrap
    async def server_metadata(request: Request) -> Response:
        with plane.admit(authenticate(request, plane)):  # every authenticated request counts against the quotas
            return json_response({"name": "shardline", "version": __version__, "extensions": EXTENSIONS})

    @wrap
    async def metadata(request: Request) -> Response:
        tenant = authenticate(request, plane)
        name = request.path_params["name"]
        with plane.admit(tenant):
            served = await plane.model(tenant, name, request.path_params.get("version"))
            note_model(served)
            versions = await plane.versions(tenant, name)
        answer = model_metadata(name, versions, served.resolved.manifest.runtime, served.signature)
        answer["parameters"] = {"state": "loaded" if plane.is_loaded(served) else "unloaded"}
        return json_response(answer)

    @wrap
    async def config(request: Request) -> Response:
        tenant = authenticate(request, plane)
        with plane.admit(tenant):
            served = await plane.model(tenant, request.path_params["name"], request.path_params.get("version"))
            note_model(served)
        return json_response(model_config(served))

    @wrap
    async def repository_index(request: Request) -> Response:
        """Triton's repository index (tritonclient's ``get_model_repository_index``): the tenant's models, each at the
        version its reference means, ``READY`` where a request would be served, else ``UNAVAILABLE`` with the reason
        (``{"ready": true}`` in the body: the ready ones only)."""
        tenant = authenticate(request, plane)
        with plane.admit(tenant):
            body = await read_body(request.receive, request.headers.get("content-length"),
                                   request.headers.get("content-encoding"), plane)
            asked = parse_json_object(body, "ready") if body.strip() else {}
            only_ready = asked.get("ready") is True
            listed = []
            for name in sorted(tenant.models):
                try:
                    status = await plane.model_status(tenant, name)
                except ShardlineError as e:  # the reference resolves to no version now: listed, not served
                    listed.append({"name": name, "state": "UNAVAILABLE", "reason": str(e)})
                    continue
                entry = {"name": name, "version": str(status.served.version),
                         "state": "READY" if status.ready else "UNAVAILABLE", "reason": status.problem or ""}
                listed.append(entry)
        return json_response([e for e in listed if e["state"] == "READY" or not only_ready])

    @wrap
    async def model_ready(request: Request) -> Response:
        tenant = authenticate(request, plane)
        with plane.admit(tenant):  # ready: a request would be served (an unloaded model loads on it)
            status = await plane.model_status(tenant, request.path_params["name"], request.path_params.get("version"))
        served = status.served
        note_model(served)
        answer = {"name": served.name, "version": str(served.version), "ready": status.ready, "state": status.state}
        if status.problem is not None:
            answer["reason"] = status.problem
        return json_response(answer, 200 if status.ready else 503)

    infer = InferEndpoint(plane)  # plain ASGI; app.py also sends POSTs straight to it, past the router
    base = "/v2/models/{name}"
    versioned = base + "/versions/{version}"
    return [  # infer first: the router tries routes in order, and no other path overlaps these two
        Route(base + "/infer", infer, methods=["POST"]),
        Route(versioned + "/infer", infer, methods=["POST"]),
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2", server_metadata, methods=["GET"]),
        Route("/v2/repository/index", repository_index, methods=["POST"]),
        Route(base, metadata, methods=["GET"]),
        Route(versioned, metadata, methods=["GET"]),
        Route(base + "/ready", model_ready, methods=["GET"]),
        Route(versioned + "/ready", model_ready, methods=["GET"]),
        Route(base + "/config", config, methods=["GET"]),
        Route(versioned + "/config", config, methods=["GET"]),
    ]
