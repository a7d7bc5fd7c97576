"""An OTLP/HTTP trace receiver on loopback: what a collector is to the processes under test.

``OtlpReceiver`` answers ``POST /v1/traces`` (protobuf, gzip or not) as a collector does and keeps every
span it was sent, decoded, so that a test can assert the trace a real request made across processes.
"""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    kind: int  # the OTLP enum: 2 server, 3 client, 1 internal
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    links: list[str] = field(default_factory=list)  # linked span ids


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class OtlpReceiver:
    """A threaded HTTP server on 127.0.0.1 keeping the spans sent to ``endpoint``; a context manager."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._take(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        """The value for ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _take(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource in request.resource_spans:
            service = next((_value(a.value) for a in resource.resource.attributes if a.key == "service.name"), "")
            for scope in resource.scope_spans:
                for span in scope.spans:
                    spans.append(ReceivedSpan(
                        service, span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                        span.kind, span.start_time_unix_nano, span.end_time_unix_nano,
                        {a.key: _value(a.value) for a in span.attributes}, [link.span_id.hex() for link in span.links]))
        with self._lock:
            self.spans.extend(spans)

    def wait_for(self, found: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 20) -> list[ReceivedSpan]:
        """The spans received once ``found`` holds of them (processes export in batches, every few seconds)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            if found(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)
