"""``OTEL_TRACES_EXPORTER`` as a comma-separated list (the OpenTelemetry specification's form): each span goes to
every exporter listed, here OTLP to a loopback receiver and the console, from a process of its own (a process
has one tracer provider)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.otlp_receiver import OtlpReceiver

SCRIPT = """
from shardline.observability import tracing
assert tracing.configure("exporters-test")
tracing.end(tracing.start("shardline.test.span", attributes={"shardline.test": 1}))
tracing.shutdown()
"""


def test_a_list_of_exporters_sends_each_span_to_each(tmp_path: object) -> None:
    with OtlpReceiver() as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(OTEL_TRACES_EXPORTER="otlp, console", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)
        done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        [sent] = [s for s in receiver.wait_for(lambda spans: any(s.name == "shardline.test.span" for s in spans))
                  if s.name == "shardline.test.span"]
    assert sent.service == "exporters-test" and sent.attributes["shardline.test"] == 1
    printed = json.loads(done.stdout)  # the console exporter's JSON of the same span
    assert printed["name"] == "shardline.test.span" and printed["context"]["trace_id"] == f"0x{sent.trace_id}"
    assert "tracing stays off" not in done.stderr
