"""The tracing switch and the traceparent parsing (the spans themselves: tests/e2e/test_tracing.py)."""

from __future__ import annotations

import pytest

from shardline.observability import tracing


@pytest.mark.parametrize("environ", [{}, {"OTEL_TRACES_EXPORTER": "none"}, {"OTEL_TRACES_EXPORTER": ""},
                                     {"OTEL_TRACES_EXPORTER": " , "}, {"OTEL_TRACES_EXPORTER": "otlp,none"},
                                     {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}])
def test_tracing_is_off_unless_an_exporter_is_named(environ: dict[str, str]) -> None:
    assert tracing.configure("test", environ) is False
    assert tracing.ENABLED is False


def test_an_exporter_this_build_lacks_leaves_it_off_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    assert tracing.configure("test", {"OTEL_TRACES_EXPORTER": "zipkin"}) is False
    assert "OTEL_TRACES_EXPORTER: zipkin is not one this build exports to (otlp, console): tracing stays off" in (
        caplog.text)
    assert tracing.configure("test", {"OTEL_TRACES_EXPORTER": "zipkin, jaeger"}) is False
    assert "zipkin, jaeger are not one this build exports to" in caplog.text


def test_the_exporters_of_a_comma_separated_list_each_once_in_order() -> None:
    assert tracing.exporter_names(" OTLP , console,otlp,, ") == ["otlp", "console"]
    assert tracing.exporter_names("") == []


@pytest.mark.parametrize(("header", "trace_id"), [
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "4bf92f3577b34da6a3ce929d0e0e4736"),
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", "4bf92f3577b34da6a3ce929d0e0e4736"),
    ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", ""),  # all zeros: invalid
    ("00-4bf92f3577b34da6a3ce929d0e0e47zz-00f067aa0ba902b7-01", ""),
    ("garbage", ""), (None, ""),
])
def test_the_trace_id_of_a_traceparent(header: str | bytes | None, trace_id: str) -> None:
    assert tracing.trace_id_of(header) == trace_id
