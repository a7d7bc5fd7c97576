"""OpenAI-style REST: ``POST /v1/embeddings`` and ``GET /v1/models``; the place for the LLM endpoints.

An embedding model is one whose signature reads one string column and writes one
list of floats (``fixed_size_list<float32>[k]``), like the MiniLM bundle. ``model`` in
a request is a model name the tenant may call (its reference picks the version),
``name@alias`` or ``name:version``. ``encoding_format`` ``float`` (the default) or
``base64`` (little-endian float32, what the official client asks for). Errors are
``{"error": {"message", "type", "param", "code"}}`` as OpenAI's clients expect.

``/v1/completions`` and ``/v1/chat/completions`` answer 501 until the LLM runtimes
come (a later issue adds them in ``llm_routes``).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from shardline.errors import InvalidInput, NotServed
from shardline.online.dataplane import DataPlane
from shardline.online.edge import authenticate, endpoint, json_response, note_model, read_body
from shardline.online.errors import shown
from shardline.online.models import ServedModel
from shardline.online.protocols.forms import openai_error_body

PROTOCOL = "openai"
MAX_INPUTS = 2048
def parse_embedding_request(body: bytes) -> tuple[str, list[str], str, int | None]:
    """(model, texts, encoding_format, dimensions) from an embeddings request body.

    Raises:
        InvalidInput: naming the field that is wrong.
    """
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise InvalidInput(f"the request body is not valid JSON ({e}); send {{\"model\": ..., \"input\": ...}}") from e
    if not isinstance(doc, dict):
        raise InvalidInput("the request body is not a JSON object with 'model' and 'input'")
    model = doc.get("model")
    if not isinstance(model, str) or not model.strip():
        raise InvalidInput("field 'model' is missing or not a string; name an embedding model you may call")
    texts = doc.get("input")
    if texts == "":
        raise InvalidInput("field 'input' is an empty string; send the text to embed")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts:
        raise InvalidInput("field 'input' must be a string or a non-empty list of strings")
    if len(texts) > MAX_INPUTS:
        raise InvalidInput(f"field 'input' holds {len(texts)} texts; send at most {MAX_INPUTS} per request")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            kind = "token ids" if isinstance(text, (int, list)) else type(text).__name__
            raise InvalidInput(f"field 'input[{i}]' is {kind}; this server embeds text: send strings")
        if not text:
            raise InvalidInput(f"field 'input[{i}]' is an empty string; send the text to embed or leave the entry out")
    encoding = doc.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise InvalidInput(f"field 'encoding_format' is {shown(encoding)}; use 'float' or 'base64'")
    dimensions = doc.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
        raise InvalidInput(f"field 'dimensions' is {shown(dimensions)}, not a positive whole number")
    return model.strip(), texts, encoding, dimensions


def embedding_columns(served: ServedModel) -> tuple[str, str, int]:
    """The text input, the embedding output and its size, if the model is an embedding model.

    Raises:
        InvalidInput: the model reads or writes something else.
    """
    signature = served.signature
    ins, outs = signature.inputs, signature.outputs
    if (len(ins) == 1 and pa.types.is_string(ins[0].arrow_type) and len(outs) == 1
            and pa.types.is_fixed_size_list(outs[0].arrow_type) and pa.types.is_floating(outs[0].arrow_type.value_type)):
        return ins[0].name, outs[0].name, outs[0].arrow_type.list_size
    raise InvalidInput(
        f"field 'model': {served.pinned} is not an embedding model (it reads {signature.input_names[:3]}"
        f"{'...' if len(ins) > 3 else ''} and writes {signature.output_names}); call it on "
        f"/v2/models/{served.name}/infer"
    )


def embedding_response(model: str, vectors: np.ndarray, encoding: str, tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings response for a (texts, dimensions) float32 matrix."""
    data: list[dict[str, Any]] = []
    for i, vector in enumerate(vectors):
        value: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode() if encoding == "base64" else vector
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def routes(plane: DataPlane) -> list[BaseRoute]:
    """The OpenAI-style routes over a data plane."""
    wrap = endpoint(PROTOCOL, openai_error_body)

    @wrap
    async def embeddings(request: Request) -> Response:
        tenant = authenticate(request, plane)
        with plane.admit(tenant):
            headers = request.headers
            body = await read_body(request.receive, headers.get("content-length"), headers.get("content-encoding"), plane)
            if len(body) >= plane.settings.offload_min_bytes:  # parsed on a codec thread: the loop goes on
                reference, texts, encoding, dimensions = await plane.off_loop(lambda: parse_embedding_request(body))
            else:
                reference, texts, encoding, dimensions = parse_embedding_request(body)
            served = await plane.model_for_reference(tenant, reference)
            note_model(served)
            text_column, embedding_column, size = embedding_columns(served)
            if dimensions is not None and dimensions != size:
                raise InvalidInput(
                    f"field 'dimensions' is {dimensions}; {served.pinned} makes {size}-dimensional embeddings and "
                    "cannot shorten them: leave 'dimensions' out"
                )
            answer = await plane.infer(tenant, served, pa.table({text_column: pa.array(texts, pa.string())}))
            tokens = await plane.count_tokens(served, texts)
        column = served.signature.plan.answer_table(answer).column(embedding_column).combine_chunks()
        vectors = column.flatten().to_numpy().astype(np.float32, copy=False).reshape(len(texts), size)
        if vectors.nbytes * 4 >= plane.settings.offload_min_bytes:  # the JSON: ~4x the floats' bytes
            return await plane.off_loop(lambda: json_response(embedding_response(served.pinned, vectors, encoding, tokens)))
        return json_response(embedding_response(served.pinned, vectors, encoding, tokens))

    @wrap
    async def models(request: Request) -> Response:
        tenant = authenticate(request, plane)
        listed = [{"id": name, "object": "model", "created": 0, "owned_by": "shardline"} for name in sorted(tenant.models)]
        return json_response({"object": "list", "data": listed})

    return [
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        *llm_routes(plane),
    ]


def llm_routes(plane: DataPlane) -> list[BaseRoute]:
    """The LLM endpoints' place: they answer 501 until an LLM runtime serves tokens (a later issue)."""
    wrap = endpoint(PROTOCOL, openai_error_body)

    @wrap
    async def not_yet(request: Request) -> Response:
        authenticate(request, plane)
        raise NotServed(
            f"{request.url.path} is not served yet: the LLM endpoints come with the LLM runtimes; "
            "this server offers /v1/embeddings and the Open Inference Protocol under /v2"
        )

    return [
        Route("/v1/completions", not_yet, methods=["POST"]),
        Route("/v1/chat/completions", not_yet, methods=["POST"]),
    ]
