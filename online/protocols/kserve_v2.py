"""Open Inference Protocol (KServe V2) over REST: decode the request, call the data plane, encode.

Paths (``{version}`` is a registry version number; without it the tenant's reference
for the model, e.g. ``name@prod``, picks the version):

    GET  /v2/health/live, /v2/health/ready          no key (Kubernetes probes)
    GET  /v2                                        server metadata
    GET  /v2/models/{name}[/versions/{version}]     model metadata (inputs, outputs)
    GET  /v2/models/{name}[/versions/{version}]/ready   200 loaded, 503 scaled to zero
    POST /v2/models/{name}[/versions/{version}]/infer

A request carries one input per signature input column; the binary tensor data
extension is read when ``Inference-Header-Content-Length`` splits the body into the
JSON header and the tensors, and outputs are sent binary when the request asks
(``parameters.binary_data_output`` or an output's ``parameters.binary_data``).
Content-Type is not required (tritonclient's JSON mode sends none). Errors are
``{"error": "..."}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from shardline import __version__
from shardline.errors import InvalidInput
from shardline.online.dataplane import DataPlane, input_schema
from shardline.online.edge import authenticate, endpoint, json_response, note_model, read_body
from shardline.online.protocols.v2_tensors import column_to_tensor, describe, tensor_to_column, to_binary
from shardline.signature import Signature

PROTOCOL = "v2"
HEADER_LENGTH = "Inference-Header-Content-Length"
EXTENSIONS = ["binary_tensor_data"]


def error_body(message: str, status: int) -> dict[str, Any]:
    """The protocol's error form."""
    return {"error": message}


@dataclass
class InferRequest:
    """A decoded inference request: the rows, and what the answer should hold."""

    table: pa.Table
    request_id: str | None
    outputs: list[str]
    binary: dict[str, bool]
    checked: bool = False  # the table has the signature's input schema and no nulls (the fast path built it)


def _json_header(body: bytes, header_length: str | None) -> tuple[Any, memoryview]:
    if header_length is None:
        json_part, binary = body, memoryview(b"")
    else:
        if not header_length.strip().isdigit():
            raise InvalidInput(f"header {HEADER_LENGTH} is {header_length!r}, not a number of bytes")
        size = int(header_length)
        if size > len(body):
            raise InvalidInput(f"header {HEADER_LENGTH} says {size} bytes of JSON, the body has only {len(body)}")
        json_part, binary = body[:size], memoryview(body)[size:]
    try:
        doc = orjson.loads(json_part)
    except orjson.JSONDecodeError as e:
        raise InvalidInput(f"the request body is not valid JSON ({e}); send an object such as {{\"inputs\": [...]}}") from e
    if not isinstance(doc, dict):
        raise InvalidInput(f"the request body is a JSON {type(doc).__name__}, not an object with 'inputs'")
    return doc, binary


def _tensor_fields(tensor: Any, i: int) -> tuple[str, str, list[int], dict[str, Any]]:
    if not isinstance(tensor, dict):
        raise InvalidInput(f"inputs[{i}] is not an object with name, datatype, shape and data")
    name = tensor.get("name")
    if not isinstance(name, str):
        raise InvalidInput(f"inputs[{i}].name is missing or not a string")
    datatype = tensor.get("datatype")
    if not isinstance(datatype, str):
        raise InvalidInput(f"input {name!r}: 'datatype' is missing or not a string (e.g. \"FP32\", \"BYTES\")")
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not shape or any(type(d) is not int or d < 0 for d in shape):
        raise InvalidInput(f"input {name!r}: 'shape' is {shape!r}; it must be a list of whole numbers such as [N] or [N, k]")
    parameters = tensor.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput(f"input {name!r}: 'parameters' is not an object")
    return name, datatype, shape, parameters


def decode_infer_request(body: bytes, header_length: str | None, signature: Signature, model: str) -> InferRequest:
    """Turn a V2 inference request into rows for the model, checking every input against its signature.

    Raises:
        InvalidInput: naming the field or input that is wrong.
    """
    doc, binary = _json_header(body, header_length)
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidInput("field 'inputs' is missing, empty or not a list; send one input per model input")
    if not binary:
        fast = _fast_float_table(inputs, signature)
        if fast is not None:
            outputs, binary_out = _requested_outputs(doc, signature, model)
            request_id = doc.get("id")
            return InferRequest(fast, request_id if isinstance(request_id, str) else None, outputs, binary_out, True)
    specs = {c.name: c for c in signature.inputs}
    columns: dict[str, pa.Array] = {}
    offset = 0
    for i, tensor in enumerate(inputs):
        name, datatype, shape, parameters = _tensor_fields(tensor, i)
        if name in columns:
            raise InvalidInput(f"input {name!r} appears twice")
        spec = specs.get(name)
        if spec is None:
            raise InvalidInput(f"input {name!r} is not an input of the model {model!r}; it takes {list(specs)}")
        size = parameters.get("binary_data_size")
        if size is not None:
            if type(size) is not int or size < 0:
                raise InvalidInput(f"input {name!r}: binary_data_size is {size!r}, not a number of bytes")
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
        columns[name] = tensor_to_column(name, datatype, shape, values, spec, model)
    if offset != len(binary):
        raise InvalidInput(f"the body holds {len(binary) - offset} bytes of binary data that no input claims")
    missing = [describe(c) for c in signature.inputs if c.name not in columns]
    if missing:
        needs = ", ".join(f"{m['name']!r} ({m['datatype']}, shape {m['shape']})" for m in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise InvalidInput(f"inputs missing: the model {model!r} needs {needs}{more}")
    rows = {name: len(column) for name, column in columns.items()}
    if len(set(rows.values())) > 1:
        raise InvalidInput(f"inputs disagree on the number of rows: {rows}; send the same N for every input")
    table = pa.Table.from_arrays([columns[c.name] for c in signature.inputs], schema=input_schema(signature))
    outputs, binary_out = _requested_outputs(doc, signature, model)
    request_id = doc.get("id")
    return InferRequest(table, request_id if isinstance(request_id, str) else None, outputs, binary_out)


_FLOAT_DATATYPES = frozenset({"FP16", "FP32", "FP64"})
_FAST: dict[int, tuple[Signature, tuple[dict[str, int], np.dtype, pa.Schema] | None]] = {}


def _fast_plan(signature: Signature) -> tuple[dict[str, int], np.dtype, pa.Schema] | None:
    """For a signature whose inputs are all float32 (or all float64) primitive columns: the column
    positions by name, the numpy type and the input schema; None for any other signature."""
    hit = _FAST.get(id(signature))
    if hit is not None and hit[0] is signature:
        return hit[1]
    types = {c.arrow_type for c in signature.inputs}
    plan = None
    if len(types) == 1 and next(iter(types)) in (pa.float32(), pa.float64()):
        dtype = np.dtype(next(iter(types)).to_pandas_dtype())
        plan = ({c.name: i for i, c in enumerate(signature.inputs)}, dtype, input_schema(signature))
    if len(_FAST) > 1024:
        _FAST.clear()
    _FAST[id(signature)] = (signature, plan)
    return plan


def _fast_float_table(inputs: list[Any], signature: Signature) -> pa.Table | None:
    """The rows of the commonest request, built in one go: one JSON input per float column, FP
    datatype, shape ``[N]`` or ``[N, 1]``, flat ``data`` of JSON floats, no parameters.

    Returns None (and the general path decides, with its errors) for anything else. The values
    are what the general path gives: float64 from JSON, cast by numpy to the column's type.
    """
    plan = _fast_plan(signature)
    if plan is None:
        return None
    positions, dtype, schema = plan
    width = len(positions)
    if len(inputs) != width:
        return None
    slots: list[Any] = [None] * width
    rows = -1
    one: list[int] = []
    column: list[int] = []
    for tensor in inputs:
        if type(tensor) is not dict:
            return None
        get = tensor.get
        name, shape, data = get("name"), get("shape"), get("data")
        if (type(name) is not str or type(shape) is not list or type(data) is not list or get("parameters")
                or get("datatype") not in _FLOAT_DATATYPES):
            return None
        j = positions.get(name)
        if j is None or slots[j] is not None:
            return None
        if rows < 0:
            rows = len(data)
            one, column = [rows], [rows, 1]
        elif len(data) != rows:
            return None
        if not (shape == one or shape == column) or type(shape[0]) is not int or type(shape[-1]) is not int:
            return None
        for v in data:
            if type(v) is not float:
                return None
        slots[j] = data
    if rows <= 0:
        return None
    flat = slots[0] if width == 1 else [v for data in slots for v in data]
    values = pa.array(np.array(flat, dtype=np.float64).astype(dtype, copy=False))
    columns = [values.slice(j * rows, rows) for j in range(width)] if width > 1 else [values]
    return pa.Table.from_arrays(columns, schema=schema)


def _requested_outputs(doc: dict[str, Any], signature: Signature, model: str) -> tuple[list[str], dict[str, bool]]:
    parameters = doc.get("parameters") or {}
    default = bool(parameters.get("binary_data_output", False)) if isinstance(parameters, dict) else False
    requested = doc.get("outputs")
    if requested is None:
        return signature.output_names, {n: default for n in signature.output_names}
    if not isinstance(requested, list):
        raise InvalidInput("field 'outputs' is not a list of {\"name\": ...} objects")
    names: list[str] = []
    binary: dict[str, bool] = {}
    for i, output in enumerate(requested):
        name = output.get("name") if isinstance(output, dict) else None
        if not isinstance(name, str):
            raise InvalidInput(f"outputs[{i}] has no name")
        if name not in signature.output_names:
            raise InvalidInput(f"output {name!r} is not an output of the model {model!r}; it gives {signature.output_names}")
        own = output.get("parameters") or {}
        names.append(name)
        binary[name] = bool(own.get("binary_data", default)) if isinstance(own, dict) else default
    return names, binary


def encode_infer_response(
    model: str, version: int, request: InferRequest, output: pa.Table
) -> tuple[bytes, int | None]:
    """The V2 response body, and the JSON header's length when binary tensors follow it."""
    docs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name in request.outputs:
        datatype, shape, values = column_to_tensor(output.column(name))
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


def model_metadata(name: str, versions: list[int], runtime: str, signature: Signature) -> dict[str, Any]:
    """The V2 model metadata document."""
    return {
        "name": name,
        "versions": [str(v) for v in versions],
        "platform": "onnxruntime_onnx" if runtime == "onnx" else runtime,
        "inputs": [describe(c) for c in signature.inputs],
        "outputs": [describe(c) for c in signature.outputs],
    }


def routes(plane: DataPlane) -> list[BaseRoute]:
    """The V2 routes over a data plane."""
    wrap = endpoint(PROTOCOL, error_body)

    @wrap
    async def live(request: Request) -> Response:
        return json_response({"live": True})

    @wrap
    async def ready(request: Request) -> Response:
        return json_response({"ready": plane.ready}, 200 if plane.ready else 503)

    @wrap
    async def server_metadata(request: Request) -> Response:
        authenticate(request, plane)
        return json_response({"name": "shardline", "version": __version__, "extensions": EXTENSIONS})

    @wrap
    async def metadata(request: Request) -> Response:
        tenant = authenticate(request, plane)
        name = request.path_params["name"]
        with plane.admit(tenant):
            served = await plane.model(tenant, name, request.path_params.get("version"))
            note_model(served)
            versions = await plane.versions(tenant, name)
        return json_response(model_metadata(name, versions, served.resolved.manifest.runtime, served.signature))

    @wrap
    async def model_ready(request: Request) -> Response:
        tenant = authenticate(request, plane)
        with plane.admit(tenant):
            served = await plane.model(tenant, request.path_params["name"], request.path_params.get("version"))
        note_model(served)
        loaded = plane.is_loaded(served)
        return json_response({"name": served.name, "version": str(served.version), "ready": loaded},
                             200 if loaded else 503)

    @wrap
    async def infer(request: Request) -> Response:
        tenant = authenticate(request, plane)
        with plane.admit(tenant):
            served = await plane.model(tenant, request.path_params["name"], request.path_params.get("version"))
            note_model(served)
            body = await read_body(request, plane.settings.max_body_bytes)
            decoded = decode_infer_request(body, request.headers.get(HEADER_LENGTH), served.signature, served.pinned)
            output = await plane.infer(tenant, served, decoded.table, checked=decoded.checked)
        payload, header_length = encode_infer_response(served.name, served.version, decoded, output)
        if header_length is None:
            return Response(payload, media_type="application/json")
        return Response(payload, headers={HEADER_LENGTH: str(header_length)}, media_type="application/octet-stream")

    base = "/v2/models/{name}"
    versioned = base + "/versions/{version}"
    return [  # infer first: the router tries routes in order, and no other path overlaps these two
        Route(base + "/infer", infer, methods=["POST"]),
        Route(versioned + "/infer", infer, methods=["POST"]),
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2", server_metadata, methods=["GET"]),
        Route(base, metadata, methods=["GET"]),
        Route(versioned, metadata, methods=["GET"]),
        Route(base + "/ready", model_ready, methods=["GET"]),
        Route(versioned + "/ready", model_ready, methods=["GET"]),
    ]
