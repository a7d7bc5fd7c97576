"""OpenAI-style REST: ``POST /v1/embeddings``, ``GET /v1/models`` and ``GET /v1/models/{model}``; text generation
is ``openai_llm``.

An embedding model is one whose signature reads one string column and writes one
list of floats (``fixed_size_list<float32>[k]``), like the MiniLM bundle. ``model`` in
a request is a model name the tenant may call (its reference picks the version),
``name@alias`` or ``name:version``. ``encoding_format`` ``float`` (the default) or
``base64`` (little-endian float32, what the official client asks for). Errors are
``{"error": {"message", "type", "param", "code"}}`` as OpenAI's clients expect.

``/v1/completions`` and ``/v1/chat/completions`` (streamed or not) are in ``openai_llm``. The body's
checks and the answer's shape are the kernel's (``shardline.openai_wire``), shared with OpenAI Batch files.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from shardline.errors import InvalidInput
from shardline.openai_wire import embedding_answer, embedding_io, parse_embedding_request
from shardline.online.dataplane import DataPlane
from shardline.online.edge import authenticate, endpoint, json_response, note_model, read_body
from shardline.online.models import ServedModel
from shardline.online.protocols import openai_llm
from shardline.online.protocols.forms import openai_error_body
from shardline.online.tenants import not_available

PROTOCOL = "openai"


def embedding_columns(served: ServedModel) -> tuple[str, str, int]:
    """The text input, the embedding output and its size, if the model is an embedding model.

    Raises:
        InvalidInput: the model reads or writes something else.
    """
    found = embedding_io(served.signature)
    if found is not None:
        return found
    signature = served.signature
    raise InvalidInput(
        f"field 'model': {served.pinned} is not an embedding model (it reads {signature.input_names[:3]}"
        f"{'...' if len(signature.inputs) > 3 else ''} and writes {signature.output_names}); call it on "
        f"/v2/models/{served.name}/infer"
    )


embedding_response = embedding_answer  # the name this module's callers know


def _model_object(name: str) -> dict[str, object]:
    """A model as OpenAI's ``/v1/models`` describes one."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "shardline"}


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
        with plane.admit(tenant):  # every authenticated request counts against the tenant's quotas
            listed = [_model_object(name) for name in sorted(tenant.models)]
        return json_response({"object": "list", "data": listed})

    @wrap
    async def model(request: Request) -> Response:
        """OpenAI's ``GET /v1/models/{model}`` (the client's ``models.retrieve``): one of the tenant's models, with
        KServe V1's ``name`` and ``ready`` (its clients' ``is_model_ready`` reads this path): as V2's ready path says,
        loading nothing."""
        tenant = authenticate(request, plane)
        name = request.path_params["model"]
        with plane.admit(tenant):
            if tenant.reference_for(name) is None:
                raise not_available(tenant, name)  # the same 404 whether or not the model exists
            status = await plane.model_status(tenant, name)
        return json_response({**_model_object(name), "name": name, "ready": status.ready})

    async def health(request: Request) -> Response:
        """vLLM's ``GET /health`` (LLM load clients and gateways probe it first): 200, no body, while serving."""
        return Response(status_code=200 if plane.ready else 503)

    return [
        Route("/health", health, methods=["GET"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model}", model, methods=["GET"]),
        *openai_llm.routes(plane),
    ]
