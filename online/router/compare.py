"""Replicas' answers decoded for comparison (a shadow's against the primary's; the judging is
``shardline.agreement``).

An answer is decoded from what a replica sends: Open Inference Protocol v2 JSON, or its binary
extension (a JSON header of ``Inference-Header-Content-Length`` bytes, then each output with
``binary_data_size`` in order), gzip or deflate; or an OpenAI embeddings list.
"""

from __future__ import annotations

import base64
import gzip
import zlib

import numpy as np
import orjson

_DTYPES = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
    "FP32": np.float32, "FP64": np.float64,
}


def decode_answer(headers: list[tuple[bytes, bytes]], body: bytes) -> dict[str, np.ndarray]:
    """The outputs of a replica's answer by name (``embedding`` for an OpenAI embeddings list).

    Raises:
        ValueError: the body is not an answer this module reads.
    """
    found = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
    encoding = found.get("content-encoding", "").lower()
    if encoding == "gzip":
        body = gzip.decompress(body)
    elif encoding == "deflate":
        body = zlib.decompress(body)
    size = found.get("inference-header-content-length")
    head, tail = (body[: int(size)], body[int(size):]) if size else (body, b"")
    doc = orjson.loads(head)
    if isinstance(doc, dict) and isinstance(doc.get("outputs"), list):
        return _v2_outputs(doc["outputs"], tail)
    if isinstance(doc, dict) and doc.get("object") == "list" and isinstance(doc.get("data"), list):
        rows = sorted(doc["data"], key=lambda d: d.get("index", 0))
        vectors = [np.frombuffer(base64.b64decode(r["embedding"]), np.float32) if isinstance(r["embedding"], str)
                   else np.asarray(r["embedding"], np.float64) for r in rows]
        return {"embedding": np.vstack(vectors) if vectors else np.zeros((0, 0))}
    raise ValueError("not an inference answer")


def _v2_outputs(outputs: list[dict[str, object]], tail: bytes) -> dict[str, np.ndarray]:
    decoded: dict[str, np.ndarray] = {}
    offset = 0
    for output in outputs:
        name, datatype = str(output["name"]), str(output["datatype"])
        shape = [int(d) for d in output["shape"]]  # type: ignore[attr-defined]
        parameters = output.get("parameters") or {}
        size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
        if size is not None:
            raw, offset = tail[offset: offset + int(size)], offset + int(size)
            if datatype == "BYTES":
                values, at = [], 0
                while at < len(raw):
                    n = int.from_bytes(raw[at: at + 4], "little")
                    values.append(raw[at + 4: at + 4 + n])
                    at += 4 + n
                array = np.asarray(values, dtype=object)
            else:
                array = np.frombuffer(raw, _DTYPES[datatype])
        else:
            array = np.asarray(output["data"], dtype=object if datatype == "BYTES" else _DTYPES.get(datatype))
        decoded[name] = array.reshape(shape)
    return decoded
