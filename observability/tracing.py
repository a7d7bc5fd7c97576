"""Traces with OpenTelemetry: off by default, set by the standard ``OTEL_*`` variables.

``configure(service)`` is called once per process (``shardline serve``, ``shardline router``, a batch
flow, a Dask worker). Tracing is on only when ``OTEL_TRACES_EXPORTER`` names an exporter, or several
separated by commas as the specification allows (``otlp``: OTLP over HTTP to ``OTEL_EXPORTER_OTLP_ENDPOINT``
/ ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; ``console``; ``otlp,console``: each span to both); unset, ``none``
(also in a list: "no exporter", as the SDKs read it), or ``OTEL_SDK_DISABLED=true`` leaves it off. A name
this build lacks is warned about and left out. The sampler is the SDK's
(``OTEL_TRACES_SAMPLER``, e.g. ``parentbased_traceidratio`` with ``OTEL_TRACES_SAMPLER_ARG=0.01``), the
resource's service name ``OTEL_SERVICE_NAME`` or ``service``.

Off, the hot paths test one module attribute (``ENABLED``) and make no span; a W3C ``traceparent`` that
comes in is still passed on unchanged and its trace id written in the log lines, so a caller's trace
can be followed through the logs either way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)

ENABLED = False  # read on every request: one attribute lookup when tracing is off
TRACEPARENT = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACER: trace.Tracer = trace.NoOpTracer()
_EXPORTERS = ("otlp", "console")


def configure(service: str, environ: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on for this process if the ``OTEL_*`` variables ask for it; True when it is on.

    Idempotent: a second call (a forked worker, a test) keeps the first provider."""
    global ENABLED, _TRACER
    env = os.environ if environ is None else environ
    exporters = exporter_names(env.get("OTEL_TRACES_EXPORTER", ""))
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or not exporters or "none" in exporters:
        return False
    lacking = [name for name in exporters if name not in _EXPORTERS]
    exporters = [name for name in exporters if name in _EXPORTERS]
    if lacking:
        log.warning("OTEL_TRACES_EXPORTER: %s %s not one this build exports to (%s): %s", ", ".join(lacking),
                    "is" if len(lacking) == 1 else "are", ", ".join(_EXPORTERS),
                    f"spans go to {' and '.join(exporters)} only" if exporters else "tracing stays off")
    if not exporters:
        return False
    if ENABLED:
        return True
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or service}))
    for name in exporters:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    trace.set_tracer_provider(provider)
    _TRACER = provider.get_tracer("shardline")
    ENABLED = True
    log.info("tracing on: spans of %s go to the %s exporter%s", env.get("OTEL_SERVICE_NAME") or service,
             " and ".join(exporters), "s" if len(exporters) > 1 else "")
    return True


def exporter_names(value: str) -> list[str]:
    """The exporters an ``OTEL_TRACES_EXPORTER`` value names: comma-separated, lower case, each once, in order."""
    return list(dict.fromkeys(name.strip().lower() for name in value.split(",") if name.strip()))


def _exporter(name: str) -> SpanExporter:
    """The span exporter called ``name`` (one of ``_EXPORTERS``)."""
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    return ConsoleSpanExporter()


def shutdown() -> None:
    """Export the spans still buffered (a process's graceful stop)."""
    provider = trace.get_tracer_provider()
    if ENABLED and hasattr(provider, "shutdown"):
        provider.shutdown()


def flush(timeout_ms: int = 5_000) -> None:
    """Export the spans buffered so far (a Dask task's, before the worker may be closed); nothing when off."""
    provider = trace.get_tracer_provider()
    if ENABLED and hasattr(provider, "force_flush"):
        provider.force_flush(timeout_ms)


def trace_id_of(traceparent: str | bytes | None) -> str:
    """The 32-hex trace id of a W3C ``traceparent`` value, or "" when it is absent or malformed."""
    if traceparent is None:
        return ""
    text = traceparent.decode("latin-1") if isinstance(traceparent, bytes) else traceparent
    parts = text.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or parts[1] == "0" * 32:
        return ""
    try:
        int(parts[1], 16)
    except ValueError:
        return ""
    return parts[1]


def parent_from(traceparent: str | bytes | None) -> Context | None:
    """The context a W3C ``traceparent`` names (the remote parent of a server span), or None."""
    if not traceparent:
        return None
    text = traceparent.decode("latin-1") if isinstance(traceparent, bytes) else traceparent
    return _PROPAGATOR.extract({TRACEPARENT: text})


def start(name: str, *, kind: SpanKind = SpanKind.INTERNAL, parent: Context | None = None,
          attributes: Mapping[str, Any] | None = None, links: Iterable[Link] = (),
          start_time: int | None = None) -> Span:
    """A started span (a child of ``parent``, or of the current span; begun at ``start_time`` ns since the epoch,
    or now); the caller ends it."""
    return _TRACER.start_span(name, context=parent, kind=kind, attributes=attributes, links=list(links),
                              start_time=start_time)


def recording() -> bool:
    """Whether the current span records (a sampled trace): a child is made only then, so a request its trace's
    sampler left out costs its one non-recording server span and nothing more."""
    return trace.get_current_span().is_recording()


def traceparent_of(span: Span) -> str:
    """The ``traceparent`` value that makes a callee's span a child of ``span``."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


def context_of(span: Span) -> Context:
    """A context whose current span is ``span`` (to start a child of it elsewhere)."""
    return trace.set_span_in_context(span)


def hex_trace_id(span: Span) -> str:
    """``span``'s trace id as 32 hex digits ("" for a span that is not recording)."""
    context = span.get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else ""


def end(span: Span, status: int | None = None, error: BaseException | None = None) -> None:
    """End ``span`` with the HTTP status (5xx: an error, as the HTTP conventions say for a server) or error."""
    if status is not None:
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
    if error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
    span.end()
