"""The peers of bench/online_latency.py, each run as its own process: the floor and LitServe.

    python bench/online_peers.py floor PORT MODEL_FILE COLUMNS_FILE THREADS
    python bench/online_peers.py litserve PORT MODEL_FILE THREADS MAX_BATCH BATCH_TIMEOUT   # LitServe's venv

- floor: a Starlette endpoint, one uvicorn worker, that accepts the V2 JSON body in both
  layouts the platform is measured with, decodes it with ``json.loads`` and numpy, and
  calls the onnxruntime session on the event loop: no tenants, no batching, no metrics.
  ``/v2/models/breast-cancer/infer`` takes one ``[1]`` input per feature column (30 of
  them, in any order); ``/v2/models/breast-cancer-nk/infer`` takes one ``[N, 30]`` input
  (what tritonclient and KServe clients send for an ONNX model with a 2-D input). Either also
  as binary tensors (``Inference-Header-Content-Length``: tritonclient's default), answered
  with binary outputs, as tritonclient asks by default. ``/v1/models/breast-cancer:predict`` takes
  KServe V1's ``{"instances": [[30 values], ...]}`` and answers ``{"predictions": [...]}``.
- litserve: LitServe with its defaults (one API server process, one inference worker
  process), fed ``{"input": [30 floats]}``, its natural request format.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

MODEL = "breast-cancer"  # 30 scalar feature columns
MODEL_NK = "breast-cancer-nk"  # the same ONNX file, one [N, 30] input


def open_session(model_file: str, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model_file, options, providers=["CPUExecutionProvider"])


def serve_floor(port: int, model_file: str, columns_file: str, threads: int) -> int:
    """A bare Starlette endpoint over the same session: decode the V2 body, run, encode. Nothing else."""
    import numpy as np
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    sess = open_session(model_file, threads)
    tensor = sess.get_inputs()[0].name
    columns = json.loads(Path(columns_file).read_text())

    def answer(model: str, x: Any) -> Response:
        label, probabilities = sess.run(None, {tensor: x})
        return JSONResponse({"model_name": model, "outputs": [
            {"name": "label", "shape": [len(x)], "datatype": "INT64", "data": label.tolist()},
            {"name": "probabilities", "shape": [len(x), 2], "datatype": "FP32", "data": probabilities.ravel().tolist()},
        ]})

    def answer_binary(model: str, x: Any) -> Response:  # as tritonclient asks by default: binary outputs
        label, probabilities = sess.run(None, {tensor: x})
        raw = [label.astype("<i8").tobytes(), probabilities.astype("<f4").tobytes()]
        header = json.dumps({"model_name": model, "outputs": [
            {"name": "label", "shape": [len(x)], "datatype": "INT64", "parameters": {"binary_data_size": len(raw[0])}},
            {"name": "probabilities", "shape": [len(x), 2], "datatype": "FP32",
             "parameters": {"binary_data_size": len(raw[1])}}]}).encode()
        return Response(header + b"".join(raw), media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(len(header))})

    async def binary_request(request: Request) -> tuple[list[Any], bytes, int] | None:
        """The inputs and body of a request of binary tensors (tritonclient's default), else None."""
        length = request.headers.get("inference-header-content-length")
        if length is None:
            return None
        body = await request.body()
        return json.loads(body[:int(length)])["inputs"], body, int(length)

    async def infer(request: Request) -> Response:  # 30 inputs of shape [1], one per column
        binary = await binary_request(request)
        if binary is not None:
            inputs, body, offset = binary
            given = np.frombuffer(body, np.float32, len(inputs), offset)
            values = {i["name"]: given[j] for j, i in enumerate(inputs)}
            return answer_binary(MODEL, np.array([[values[c] for c in columns]], dtype=np.float32))
        doc = await request.json()
        values = {i["name"]: i["data"][0] for i in doc["inputs"]}
        return answer(MODEL, np.array([[values[c] for c in columns]], dtype=np.float32))

    async def infer_nk(request: Request) -> Response:  # one input of shape [N, 30]
        binary = await binary_request(request)
        if binary is not None:
            inputs, body, offset = binary
            shape = inputs[0]["shape"]
            return answer_binary(MODEL_NK, np.frombuffer(body, np.float32, shape[0] * shape[1], offset).reshape(shape))
        doc = await request.json()
        given = doc["inputs"][0]
        return answer(MODEL_NK, np.asarray(given["data"], dtype=np.float32).reshape(given["shape"]))

    async def predict(request: Request) -> Response:  # KServe V1: {"instances": [row, ...]}, a row a list of 30
        doc = await request.json()
        label, probabilities = sess.run(None, {tensor: np.asarray(doc["instances"], dtype=np.float32)})
        return JSONResponse({"predictions": [{"label": int(l), "probabilities": p}
                                             for l, p in zip(label.tolist(), probabilities.tolist())]})

    async def ready(request: Request) -> Response:
        return JSONResponse({"ready": True})

    app = Starlette(routes=[Route(f"/v2/models/{MODEL}/infer", infer, methods=["POST"]),
                            Route(f"/v2/models/{MODEL_NK}/infer", infer_nk, methods=["POST"]),
                            Route(f"/v1/models/{MODEL}:predict", predict, methods=["POST"]),
                            Route("/v2/health/ready", ready)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    return 0


def _lit_classifier() -> type:
    """The LitAPI over the same model file (built only in LitServe's environment)."""
    # LitServe pickles its LitAPI into a spawned worker process, which imports this file
    # again: the class must be a module global there too (see below).
    import litserve as ls
    import numpy as np

    class LitClassifier(ls.LitAPI):  # type: ignore[misc]
        def __init__(self, model_file: str, threads: int, max_batch: int, batch_timeout: float) -> None:
            super().__init__(max_batch_size=max_batch, batch_timeout=batch_timeout)
            self.model_file, self.threads, self.batched = model_file, threads, max_batch > 1

        def setup(self, device: str) -> None:
            self.session = open_session(self.model_file, self.threads)
            self.tensor = self.session.get_inputs()[0].name

        def decode_request(self, request):  # type: ignore[no-untyped-def]  # LitServe reads the annotation
            return np.asarray(request["input"], dtype=np.float32)

        def predict(self, x: Any) -> Any:
            rows = x.reshape(len(x), -1) if self.batched else x[None]
            label, probabilities = self.session.run(None, {self.tensor: rows})
            answers = [{"label": int(a), "probabilities": b.tolist()} for a, b in zip(label, probabilities)]
            return answers if self.batched else answers[0]

        def unbatch(self, output: Any) -> Any:
            return output

        def encode_response(self, output: Any) -> Any:
            return output

    LitClassifier.__qualname__, LitClassifier.__module__ = "LitClassifier", __name__
    return LitClassifier


# LitServe pickles its LitAPI into a spawned worker process, which imports this file
# again: the class must be a module global there too. The flag is set only for (and
# inherited from) the LitServe server process.
if os.environ.get("SHARDLINE_BENCH_LITSERVE") == "1":
    LitClassifier = _lit_classifier()


def serve_litserve(port: int, model_file: str, threads: int, max_batch: int, batch_timeout: float) -> int:
    """LitServe with its defaults over the same model; runs in the peer environment."""
    import litserve as ls

    api = LitClassifier(model_file, threads, max_batch, batch_timeout)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1)
    server.run(host="127.0.0.1", port=port, log_level="warning", generate_client_file=False)
    return 0


if __name__ == "__main__":
    kind, *rest = sys.argv[1:]
    if kind == "floor":
        sys.exit(serve_floor(int(rest[0]), rest[1], rest[2], int(rest[3])))
    sys.exit(serve_litserve(int(rest[0]), rest[1], int(rest[2]), int(rest[3]), float(rest[4])))
