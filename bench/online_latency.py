"""Online latency: `shardline serve` against a bare Starlette floor and LitServe, open loop.

All three serve the same small classifier (the breast-cancer classifier of
``shardline.build.examples``, gradient-boosted trees by default, ``--model logreg`` for the
logistic regression; one ``model.onnx``), one row per request, onnxruntime on the CPU,
each in its own process(es), in the request layouts clients send (``--layouts``, all by default):

- scalar: one ``[1]`` input per feature column (30 of them), the model packaged from
  scikit-learn with its feature names (``breast-cancer``);
- nk: one ``[1, 30]`` input, what tritonclient and KServe clients send for an ONNX model
  with a 2-D input, the same ONNX file packaged from the file alone (``breast-cancer-nk``:
  one ``fixed_size_list<float32>[30]`` column);
- nested: the nk input with its data a list a row (``[[...]]``), as KServe's documents write it;
- binary, binary-nk: the same two as binary tensors after a JSON header
  (``Inference-Header-Content-Length``), binary outputs asked for: what tritonclient's
  HTTP client sends when its caller leaves ``binary_data`` at its default;
- v1: KServe's V1 protocol, ``{"instances": [[...30 values]]}`` to ``/v1/models/{name}:predict``
  (the scalar layout's model), what KServe's scikit-learn and XGBoost servers take.

The servers:

- platform: ``shardline serve`` exactly as a user runs it: a tenants file, a storage
  home, a port, and nothing else: no ``SHARDLINE_*`` tuning variable and no tuning flag
  (every ``SHARDLINE_*`` variable of this shell is dropped but the storage home), so it
  runs on the defaults the code picks from the machine's cores; the effective settings
  are read back from its start-up log line and printed. Tenants, API key, KServe V2,
  access log and metrics on. Both layouts go to this one server, one after the other.
- capture: the same platform with request capture on (``SHARDLINE_ONLINE_CAPTURE_RATE``,
  a feature, not a tuning knob; ``--capture-rate``, 1.0 by default: every request's rows
  and answer go to Parquet, the harshest case), scalar layout only; its ratio to the
  platform is printed. Not in ``--quick`` unless named in ``--servers``.
- traced: the same platform with OpenTelemetry tracing on (``OTEL_TRACES_EXPORTER=otlp`` to a sink on
  loopback in this process, ``parentbased_traceidratio`` at ``--trace-ratio``, 1% by default), scalar
  layout only; its ratio to the platform (tracing off, the default) is printed.
- floor, litserve: see bench/online_peers.py (the floor: one bare Starlette worker that
  decodes the same body as the platform gets, in each layout, and calls the session on
  the event loop, one intra-op thread; LitServe with its defaults, in its own virtual
  environment under bench/.peers/, made on first use, fed its natural body, the same
  for both layouts).

Targets (issue 35), for each layout: platform p50 at 500 req/s (``--p50-rate``, always in the
ladder) <= 1.1x the floor's; the highest rate held at p99 <= 10 ms >= 0.8x the floor's and >= 4x
LitServe's.

The load generator (bench/loadgen.py) is open loop, in its own process: request i is
due at ``t0 + i / rate``, its latency counted from that time; the rates alternate
between the servers and layouts, so a change in the machine's load hits all alike.

    .venv/bin/python bench/online_latency.py            # 100..25600 req/s doubling + 2 refinements: 10-15 min
    .venv/bin/python bench/online_latency.py --quick    # 100, 500, 1600, 3200 req/s, short steps: ~3-4 min
    .venv/bin/python bench/online_latency.py --servers floor,litserve --rates 500,1000

Data (bundles, registry, tenants file, server logs, last-run.json with every step's
figures) lives under bench/.data/online/ (git-ignored).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import NOISY, P99_TARGET_MS, PEERS_NOISY, held  # noqa: E402
from online_peers import MODEL, MODEL_NK, open_session  # noqa: E402

from shardline.cli.common import OFF_THE_NETWORK  # noqa: E402 (the CLI's own list)
from shardline.local_ports import reserve_port  # noqa: E402

for _key, _value in OFF_THE_NETWORK.items():
    os.environ.setdefault(_key, _value)

HERE = Path(__file__).resolve().parent
DATA = HERE / ".data" / "online"
PEER_ENV = HERE / ".peers" / "litserve"
API_KEY = "shardline-bench-key"
P50_RATIO_TARGET = 1.1  # platform p50 at --p50-rate (500/s) <= 1.1 x the floor's (issue 35)
FLOOR_RATIO_TARGET = 0.8  # platform's highest held rate >= 0.8 x the floor's (issue 35)
PEER_RATIO_TARGET = 4.0  # ... and >= 4 x LitServe's
SERVERS = ("platform", "capture", "traced", "floor", "litserve")
PLATFORMS = ("platform", "capture", "traced")  # `shardline serve`, on its defaults but for the one feature named
QUICK_SERVERS = ("platform", "floor", "litserve")
LAYOUTS = {"scalar": "30 inputs of shape [1]", "nk": "one input of shape [1, 30]",
           "nested": "one input of shape [1, 30], its data a list a row ([[...]], as KServe's documents write it)",
           "binary": "30 binary inputs of shape [1], binary outputs (tritonclient's defaults)",
           "binary-nk": "one binary input of shape [1, 30], binary outputs (tritonclient's defaults)",
           "v1": "KServe V1, {\"instances\": [[30 values]]} to /v1/models/{name}:predict"}
SUFFIXES = {"scalar": "", "nk": "-nk", "nested": "-nest", "binary": "-bin", "binary-nk": "-bin-nk",
            "v1": "-v1"}  # of the series' names
NK_LAYOUTS = {"nk", "nested", "binary-nk"}  # sent to the model packaged from the ONNX file alone (MODEL_NK)
DATA_KEYS = {"scalar": "v2"}  # the key of each layout's bodies in prepare()'s data, where not the layout's name
FLOOR_THREADS = 1  # the floor's and LitServe's intra-op threads: the fastest for one row of this model
KEPT_VARIABLES = ("SHARDLINE_STORAGE_HOME",)  # the only SHARDLINE_* variable the platform gets (and capture's rate)


# --------------------------------------------------------------------------- data and servers


def prepare(kind: str = "gbt") -> dict[str, Any]:
    """Bundle, registry (breast-cancer@prod), tenants file and request bodies under bench/.data/online."""
    import shutil

    import numpy as np
    import yaml

    from shardline.build.examples import breast_cancer, package_breast_cancer
    from shardline.build.packaging import package_onnx
    from shardline.storage.registry import ModelRegistry

    bundle, home = DATA / "bundle", DATA / "home"
    shutil.rmtree(bundle, ignore_errors=True)
    shutil.rmtree(home, ignore_errors=True)
    package_breast_cancer(bundle, name=MODEL, kind=kind)
    registry = ModelRegistry(str(home / "registry"))
    pushed = registry.push(bundle)
    registry.set_alias(MODEL, "prod", pushed.version or 1, reason="bench")
    nk_bundle = DATA / "bundle-nk"  # the same ONNX file, packaged from the file alone: one [N, 30] input
    shutil.rmtree(nk_bundle, ignore_errors=True)
    package_onnx(bundle / "model.onnx", nk_bundle, name=MODEL_NK)
    pushed = registry.push(nk_bundle)
    registry.set_alias(MODEL_NK, "prod", pushed.version or 1, reason="bench")
    nk_input = json.loads((nk_bundle / "manifest.json").read_text())["signature"]["inputs"][0]["name"]
    manifest = json.loads((bundle / "manifest.json").read_text())
    columns: list[str] = manifest["runtime_config"]["tensor_inputs"][0]["columns"]
    (DATA / "columns.json").write_text(json.dumps(columns))
    tenants = {"tenants": [{
        "name": "bench", "api_keys_sha256": [hashlib.sha256(API_KEY.encode()).hexdigest()],
        "models": [f"{MODEL}@prod", f"{MODEL_NK}@prod"], "priority": "high",
        "rate": {"requests_per_second": 100_000, "burst": 100_000}, "max_concurrent": 10_000,
    }]}
    (DATA / "tenants.yaml").write_text(yaml.safe_dump(tenants, sort_keys=False))
    data = breast_cancer()
    picks = np.random.default_rng(0).choice(len(data.features), 64, replace=False)
    rows = [[float(f"{v:.6g}") for v in data.features[i]] for i in picks]
    v2 = [json.dumps({"inputs": [{"name": c, "shape": [1], "datatype": "FP32", "data": [v]}
                                 for c, v in zip(columns, row)]}, separators=(",", ":")) for row in rows]
    nk = [json.dumps({"inputs": [{"name": nk_input, "shape": [1, len(row)], "datatype": "FP32", "data": row}]},
                     separators=(",", ":")) for row in rows]
    nested = [json.dumps({"inputs": [{"name": nk_input, "shape": [1, len(row)], "datatype": "FP32", "data": [row]}]},
                         separators=(",", ":")) for row in rows]
    natural = [json.dumps({"input": row}, separators=(",", ":")) for row in rows]
    v1 = [json.dumps({"instances": [row]}, separators=(",", ":")) for row in rows]
    binary = [binary_body([{"name": c, "shape": [1]} for c in columns], np.asarray(row, np.float32)) for row in rows]
    binary_nk = [binary_body([{"name": nk_input, "shape": [1, len(row)]}], np.asarray(row, np.float32)) for row in rows]
    session = open_session(str(bundle / "model.onnx"), 1)
    label, probabilities = session.run(None, {"X": np.asarray(rows[:1], dtype=np.float32)})
    return {"model": str(bundle / "model.onnx"), "columns": str(DATA / "columns.json"),
            "tenants": str(DATA / "tenants.yaml"), "home": str(home), "v2": v2, "nk": nk, "nested": nested, "natural": natural,
            "binary": binary, "binary-nk": binary_nk, "v1": v1,
            "expected": (int(label[0]), [float(p) for p in probabilities[0]])}


def ensure_peer_env() -> Path:
    """LitServe's own virtual environment under bench/.peers/litserve, made once and reused."""
    python = PEER_ENV / "bin" / "python"
    probe = [str(python), "-c", "import litserve, onnxruntime, numpy"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"making LitServe's environment in {PEER_ENV} (once: pip install litserve onnxruntime numpy)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(PEER_ENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "litserve", "onnxruntime", "numpy"], check=True)
    return python


def versions(python: str, packages: list[str]) -> str:
    """'name version, ...' of packages as ``python`` sees them."""
    code = ("from importlib import metadata as m\nfor p in %r:\n    try: print(p, m.version(p))\n"
            "    except m.PackageNotFoundError: pass") % (packages,)
    out = subprocess.run([python, "-c", code], capture_output=True, text=True).stdout
    return ", ".join(out.split("\n")[:-1])


def platform_help() -> str | None:
    """Why `shardline serve` cannot run here, or None."""
    done = subprocess.run([sys.executable, "-m", "shardline.cli", "serve", "--help"], capture_output=True, text=True)
    if done.returncode != 0:
        return "`shardline serve --help` failed: " + (done.stderr or done.stdout)[-300:]
    return None


def http(port: int, path: str, body: str | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One blocking request with the bench's key (or ``headers``); returns (status, parsed JSON or text). A body of
    binary tensors (``binary_body``) is sent as such, and a binary answer read into the JSON form."""
    length = header_length(body) if body is not None else None
    kind = {"Content-Type": "application/json"} if length is None else {
        "Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(length)}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body.encode("latin-1") if body is not None else None,
        headers={**(headers or {"Authorization": f"Bearer {API_KEY}"}), **kind})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            status, raw = answer.status, answer.read()
            binary = answer.headers.get("Inference-Header-Content-Length")
            if binary is not None:
                return status, binary_answer(raw, int(binary))
            text = raw.decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def binary_body(inputs: list[dict[str, Any]], values: Any) -> str:
    """A V2 body of binary FP32 tensors as tritonclient makes it (its header, then each input's bytes; binary outputs
    asked for), as a latin-1 string (the bench's bodies are strings); its header's length is ``header_length``'s."""
    size = values.nbytes // len(inputs)
    header = json.dumps({"inputs": [{**i, "datatype": "FP32", "parameters": {"binary_data_size": size}} for i in inputs],
                         "parameters": {"binary_data_output": True}}, separators=(",", ":"))
    return header + values.tobytes().decode("latin-1")


def header_length(body: str) -> int | None:
    """The length of a binary body's JSON header (``binary_body``), None for a JSON body."""
    if "binary_data_size" not in body:
        return None
    return json.JSONDecoder().raw_decode(body)[1]


def binary_answer(raw: bytes, length: int) -> dict[str, Any]:
    """A V2 answer of binary outputs as the JSON form (``data`` lists), for ``answer_of``."""
    import numpy as np

    doc = json.loads(raw[:length])
    offset = length
    for output in doc.get("outputs", []):
        size = output.get("parameters", {}).get("binary_data_size")
        if size is not None:
            dtype = {"INT64": "<i8", "FP32": "<f4", "FP64": "<f8", "INT32": "<i4"}[output["datatype"]]
            output["data"] = np.frombuffer(raw[offset:offset + size], dtype).tolist()
            offset += size
    return doc


class Server:
    """One server under test: a child process in its own session, its output in a log file."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], port: int, path: str, ready: str) -> None:
        self.name, self.command, self.env, self.port, self.path, self.ready = name, command, env, port, path, ready
        self.log = DATA / "logs" / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, probe_body: str, timeout: float = 120.0) -> float:
        """Start it and wait until it answers an inference request; returns seconds to ready."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        while time.perf_counter() - started < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited {self.proc.returncode} while starting:\n{self.tail()}")
            try:
                status, _ = http(self.port, self.ready)
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
                continue
            if status == 200 or http(self.port, self.path, probe_body)[0] == 200:  # may load the model
                return time.perf_counter() - started
            time.sleep(0.2)
        raise SystemExit(f"{self.name} was not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def tail_lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines() if self.log.exists() else []

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return


class Target:
    """One measured series: a server and a request layout (several may share a server process)."""

    def __init__(self, name: str, server: Server, layout: str, path: str, bodies: list[str]) -> None:
        self.name, self.server, self.layout, self.path, self.bodies = name, server, layout, path, bodies


def check_answer(target: Target, expected: tuple[int, list[float]]) -> None:
    """Stop the bench unless the target answers the first row as the model does."""
    status, answer = http(target.server.port, target.path, target.bodies[0])
    got = answer_of(answer)
    if status != 200 or got is None or got[0] != expected[0] or max(
            abs(a - b) for a, b in zip(got[1], expected[1])) > 1e-5:
        raise SystemExit(f"{target.name} answered {status} {str(answer)[:300]}; expected label {expected[0]}, "
                         f"probabilities {expected[1]}")


def answer_of(body: Any) -> tuple[int, list[float]] | None:
    """(label, probabilities) from a V2 answer, a V1 answer or LitServe's dict; None if none of them."""
    if isinstance(body, dict) and isinstance(body.get("predictions"), list) and body["predictions"]:
        body = body["predictions"][0]  # V1: a row's outputs by name
    if isinstance(body, dict) and "outputs" in body:
        outputs = {o["name"]: o["data"] for o in body["outputs"]}
        if "label" in outputs and "probabilities" in outputs:
            return int(outputs["label"][0]), [float(p) for p in outputs["probabilities"]][:2]
    if isinstance(body, dict) and "label" in body:
        return int(body["label"]), [float(p) for p in body["probabilities"]]
    return None


def user_environment(home: str) -> dict[str, str]:
    """The environment a user's shell gives ``shardline serve``: this one without any SHARDLINE_* variable
    (a tuning variable left in the shell would make the figures not the defaults') but the storage home."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLINE_")}
    env.pop("PYTHONPATH", None)
    return dict(env, **OFF_THE_NETWORK, SHARDLINE_STORAGE_HOME=home)


def layout_targets(name: str, server: Server, data: dict[str, Any], layouts: list[str]) -> list[Target]:
    """The series of one server (the platform's or the floor's), one per request layout."""
    return [Target(f"{name}{SUFFIXES[layout]}", server, layout, infer_path(layout), data[DATA_KEYS.get(layout, layout)])
            for layout in layouts]


def infer_path(layout: str) -> str:
    """Where a layout's requests go: the model packaged with its feature names, or from the ONNX file alone."""
    if layout == "v1":
        return f"/v1/models/{MODEL}:predict"
    return f"/v2/models/{MODEL_NK if layout in NK_LAYOUTS else MODEL}/infer"


def parse_layouts(parser: argparse.ArgumentParser, given: str) -> list[str]:
    """``--layouts``: some of ``LAYOUTS``, comma-separated (this bench's and router_overhead.py's)."""
    layouts = [n.strip() for n in given.split(",") if n.strip()]
    if not layouts or set(layouts) - set(LAYOUTS):
        parser.error(f"--layouts takes some of {', '.join(LAYOUTS)}")
    return layouts


def make_servers(names: list[str], data: dict[str, Any], args: argparse.Namespace) -> tuple[list[Server], list[Target]]:
    """The server processes and the series measured against them (platform and floor: each of ``args.layouts``)."""
    env = user_environment(data["home"])
    peers, servers, targets = str(HERE / "online_peers.py"), [], []
    scalar = f"/v2/models/{MODEL}/infer"
    for name in names:
        port = reserve_port()
        if name in PLATFORMS:
            command = [sys.executable, "-m", "shardline.cli", "serve", "--port", str(port), "--tenants", data["tenants"],
                       "--metrics-port", str(reserve_port())]  # metrics on, on a listener of their own
            server_env = env
            if name == "capture":
                server_env = dict(env, SHARDLINE_ONLINE_CAPTURE_RATE=str(args.capture_rate))
            elif name == "traced":
                server_env = dict(env, OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=args.otlp_endpoint,
                                  OTEL_TRACES_SAMPLER="parentbased_traceidratio",
                                  OTEL_TRACES_SAMPLER_ARG=str(args.trace_ratio))
            server = Server(name, command, server_env, port, scalar, "/v2/health/ready")
            if name == "platform":
                targets += layout_targets(name, server, data, args.layouts)
            else:
                targets.append(Target(f"{name}", server, "scalar", scalar, data["v2"]))
        elif name == "floor":
            command = [sys.executable, peers, "floor", str(port), data["model"], data["columns"], str(FLOOR_THREADS)]
            server = Server(name, command, env, port, scalar, "/v2/health/ready")
            targets += layout_targets(name, server, data, args.layouts)
        else:
            command = [str(args.peer_python), peers, "litserve", str(port), data["model"], str(FLOOR_THREADS),
                       str(args.litserve_batch), str(args.litserve_batch_timeout)]
            server = Server(name, command, dict(env, SHARDLINE_BENCH_LITSERVE="1"), port, "/predict", "/health")
            targets.append(Target(name, server, "natural", "/predict", data["natural"]))
        servers.append(server)
    return servers, targets


def effective_settings(server: Server, wait_s: float = 3.0) -> dict[str, Any] | None:
    """The settings `shardline serve` logged at start-up (its 'serving settings' line), or None."""
    deadline = time.perf_counter() + wait_s
    while True:
        for line in server.tail_lines():
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("msg") == "serving settings":
                    return {k: v for k, v in record.items() if k not in ("ts", "time", "level", "logger", "msg",
                                                                         "request_id")}
        if time.perf_counter() > deadline:
            return None
        time.sleep(0.1)  # the log is written by a thread, a moment after the line


def content_headers(body: str) -> str:
    """A request's Content-Type header, and for binary tensors the length of its JSON header."""
    length = header_length(body)
    if length is None:
        return "Content-Type: application/json\r\n"
    return f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {length}\r\n"


def run_ladder(targets: list[Target], args: argparse.Namespace) -> dict[str, list[Any]]:
    """Run the load generator's process against the targets; returns each one's steps."""
    return generate_steps([{
        "name": t.name, "port": t.server.port, "pid": t.server.proc.pid,  # type: ignore[union-attr]
        "requests": [f"POST {t.path} HTTP/1.1\r\nHost: 127.0.0.1:{t.server.port}\r\n"
                     f"Authorization: Bearer {API_KEY}\r\n{content_headers(b)}"
                     f"Content-Length: {len(b)}\r\n\r\n{b}" for b in t.bodies],
    } for t in targets], args, DATA / "generator.json")


def generate_steps(spec_targets: list[dict[str, Any]], args: argparse.Namespace, spec_file: Path) -> dict[str, list[Any]]:
    """The load generator (bench/loadgen.py) in its own process over ``spec_targets`` (name, port, pid, raw
    requests) with the ladder of ``args``; each step printed as it comes; returns each target's steps."""
    spec = {"targets": spec_targets, "ladder": args.ladder, "warmup": args.warmup, "seconds": args.seconds,
            "prewarm": args.prewarm, "refine": args.refine, "connections": getattr(args, "connections", 256),
            "drain": getattr(args, "drain", 5.0), "retries": args.retries}
    spec_file.write_text(json.dumps(spec))
    gen = subprocess.Popen([sys.executable, str(HERE / "loadgen.py"), str(spec_file)],
                           stdout=subprocess.PIPE, text=True)
    steps: dict[str, list[Any]] = {t["name"]: [] for t in spec_targets}
    for line in gen.stdout:  # type: ignore[union-attr]
        step = json.loads(line)
        steps[step["server"]].append(step)
        print(f"  {step['rate']:>6,.0f} req/s  {step['server']:<15} p50 {step['p50_ms']:7.2f} ms  p99 "
              f"{step['p99_ms']:8.2f} ms  achieved {step['achieved']:7,.0f}/s  {'held' if held(step) else 'NOT held'}",
              flush=True)
    if gen.wait() != 0:
        raise SystemExit(f"the load generator failed (exit {gen.returncode})")
    return steps

# --------------------------------------------------------------------------- report


def _fmt(value: float, spec: str) -> str:
    return "inf" if math.isinf(value) else format(value, spec)


def report_steps(name: str, steps: list[dict[str, Any]]) -> None:
    print(f"\n{name}")
    header = (f"{'rate/s':>8}{'achieved/s':>11}{'p50 ms':>8}{'p99 ms':>9}{'max ms':>9}{'errors':>8}"
              f"{'srv CPU':>8}{'busiest':>8}{'gen CPU':>8}{'gen us/req':>11}{'lag p99':>8}{'rest':>6}{'conns':>6}"
              f"{'tries':>6}  held")
    print(header)
    print("-" * len(header))
    for s in sorted(steps, key=lambda s: s["rate"]):
        errors = sum(s["errors"].values())
        print(f"{s['rate']:>8,.0f}{s['achieved']:>11,.0f}{_fmt(s['p50_ms'], '.2f'):>8}{_fmt(s['p99_ms'], '.2f'):>9}"
              f"{_fmt(s['max_ms'], '.1f'):>9}{errors:>8}{s['server_cpu']:>8.0%}{s['server_busiest']:>8.0%}"
              f"{s['gen_cpu']:>8.0%}{s['gen_us_per_req']:>11.0f}{s['lag_p99_ms']:>8.2f}"
              f"{format(s['other_cpu'], '.0%') + ('!' if s['other_cpu'] > NOISY else ''):>6}"
              f"{s['connections']:>6}{s.get('tries', 1):>6}  "
              f"{'yes' if held(s) else 'no'}")
        if s["errors"]:
            print(f"{'':>8}errors: {s['errors']}")


def summarize(steps: list[dict[str, Any]], light: float) -> dict[str, Any]:
    """p50 at the light rate, the highest rate held, and what the first failed step above it shows."""
    at_light = next((s for s in steps if s["rate"] == light), None)
    good = [s["rate"] for s in steps if held(s)]
    top = max(good, default=0.0)
    failed = sorted((s for s in steps if not held(s) and s["rate"] > top), key=lambda s: s["rate"])
    limit = "held every rate tried"
    if failed:
        f = failed[0]
        procs = " + ".join(f"{c:.0%}" for c in f["server_top"]) + (" + ..." if f["server_procs"] > 3 else "")
        at = f"at {f['rate']:,.0f}/s (p99 {_fmt(f['p99_ms'], '.1f')} ms): server CPU {procs} of a core"
        cores = os.cpu_count() or 1
        machine = f["server_cpu"] + f["gen_cpu"] + f["other_cpu"]
        if f["server_busiest"] >= 0.85:
            limit = f"{at}: its busiest process is saturated"
        elif machine >= 0.85 * cores:
            limit = f"{at}, generator {f['gen_cpu']:.0%}, rest {f['other_cpu']:.0%}: the cores are full"
        elif machine <= 0.6 * cores:
            limit = f"{at}: CPU to spare, so waiting (hand-offs, timers, locks), not computing"
        else:
            limit = f"{at}, generator {f['gen_cpu']:.0%}, rest {f['other_cpu']:.0%}: no one process saturated"
    return {"p50": at_light["p50_ms"] if at_light else math.nan, "held": top, "limit": limit, "capped": not failed}


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, light: float) -> dict[str, Any]:
    """Print each server's steps and the summary; returns the summary by server."""
    labels = {**{f"platform{SUFFIXES[k]}": f"platform (shardline serve on its defaults), {v}" for k, v in LAYOUTS.items()},
              **{f"floor{SUFFIXES[k]}": f"floor (bare Starlette, 1 uvicorn worker), {v}" for k, v in LAYOUTS.items()},
              "capture": f"platform with capture (capture_rate {args.capture_rate:g}), {LAYOUTS['scalar']}",
              "traced": f"platform with tracing (OTLP, sampled at {args.trace_ratio:g}), {LAYOUTS['scalar']}",
              "litserve": f"LitServe (1 API server + 1 inference worker, max_batch_size {args.litserve_batch}), "
                          "its own {\"input\": [30 floats]}"}
    for name, steps in results.items():
        report_steps(labels[name], steps)
    print("\nrate/s: the schedule; achieved/s: 200 answers completed inside the measured window per second;\n"
          "p50/p99/max: from each request's intended send time (errors and unanswered count as infinite);\n"
          "srv CPU: the server's process tree, in cores; busiest: its busiest process; gen CPU, gen us/req:\n"
          "the load generator's own process; lag p99: how late the generator sent (ms); rest: the rest of the\n"
          f"machine (kernel, interrupts, other processes; '!': over {NOISY:g} core even at the best of the tries,\n"
          f"a noisy figure); conns: connections open; tries: windows measured (again when the rest used over\n"
          f"{NOISY:g} core, or the other servers under test over {PEERS_NOISY:g}: the quietest kept).")
    summary = {name: summarize(steps, light) for name, steps in results.items()}
    w = max(12, *map(len, summary))
    print(f"\n{'server':<{w}}{'p50 ms @ ' + format(light, ',.0f') + '/s':>16}{'held at p99<10ms':>18}  limited by")
    for name, s in summary.items():
        print(f"{name:<{w}}{_fmt(s['p50'], '.2f'):>16}{s['held']:>16,.0f}/s  {s['limit']}")
    return summary


def _held_ratio(platform: dict[str, Any], other: dict[str, Any], name: str, target: float, layout: str) -> bool:
    """Print platform / other for the highest rate held, saying when a ladder's top bounds it."""
    if not other["held"]:
        met = bool(platform["held"])  # the platform held a rate the other held none of: met; neither: not judged
        print(f"  rate held at p99<{P99_TARGET_MS:.0f}ms platform / {name:<8} = {'inf' if met else 'n/a':>5}   "
              f"({name} held no rate tried{'' if met else ', nor did the platform: not judged (a noisy run?)'})")
        return met
    ratio = platform["held"] / other["held"]
    met = ratio >= target
    bound = []
    if platform["capped"]:
        bound.append("the platform held every rate tried, so it is a lower bound")
    if other["capped"]:
        bound.append(f"{name} held every rate tried, so it is an upper bound")
    print(f"  rate held at p99<{P99_TARGET_MS:.0f}ms platform / {name:<8} = {ratio:5.2f}x  (target >= {target}x: "
          f"{'met' if met else 'MISSED'}){'; ' + ', '.join(bound) + ': add higher --rates' if bound else ''}")
    return met


def ratios(summary: dict[str, dict[str, Any]], light: float, layouts: list[str]) -> bool:
    """Print the issue's targets for each layout; returns whether every one that could be computed was met."""
    ok = True
    for layout in layouts:
        suffix = SUFFIXES[layout]
        platform, floor, peer = (summary.get(n) for n in (f"platform{suffix}", f"floor{suffix}", "litserve"))
        print(f"\nlayout {layout} ({LAYOUTS[layout]}):")
        if platform is None:
            print("  targets: not computed (the platform was not run)")
            continue
        if floor is not None:
            p50 = platform["p50"] / floor["p50"]
            met = p50 <= P50_RATIO_TARGET
            print(f"  p50 at {light:,.0f}/s           platform / floor    = {p50:5.2f}x  (target <= {P50_RATIO_TARGET}x: "
                  f"{'met' if met else 'MISSED'})")
            ok &= met
            ok &= _held_ratio(platform, floor, "floor", FLOOR_RATIO_TARGET, layout)
        if peer is not None:
            ok &= _held_ratio(platform, peer, "LitServe", PEER_RATIO_TARGET, layout)
    return ok


def feature_ratios(results: dict[str, list[dict[str, Any]]], summary: dict[str, dict[str, Any]], light: float,
                   name: str, label: str) -> bool:
    """Print what a feature (capture, tracing) changes against the same platform without it: p50 at each rate
    both held, and the highest rate held (no target: a report). False when the series did not run."""
    if name not in summary or "platform" not in summary:
        return False
    on, off = summary[name], summary["platform"]
    by_rate = {s["rate"]: s for s in results["platform"] if held(s)}
    pairs = [(s["p50_ms"], by_rate[s["rate"]]["p50_ms"], s["rate"]) for s in results[name]
             if held(s) and s["rate"] in by_rate]
    print(f"\n{label} on / off, same platform:")
    print(f"  p50 at {light:,.0f}/s: {on['p50'] / off['p50']:.2f}x ({_fmt(on['p50'], '.2f')} vs {_fmt(off['p50'], '.2f')} ms)")
    for p_on, p_off, r in sorted(pairs, key=lambda p: p[2])[1:]:
        print(f"  p50 at {r:,.0f}/s: {p_on / p_off:.2f}x ({p_on:.2f} vs {p_off:.2f} ms)")
    held_ratio = on["held"] / off["held"] if off["held"] else math.nan
    print(f"  rate held at p99<{P99_TARGET_MS:.0f}ms: {held_ratio:.2f}x ({on['held']:,.0f} vs {off['held']:,.0f}/s)")
    return True


def captured_rows() -> int:
    """Rows the capture run wrote under the bench's storage home."""
    import pyarrow.parquet as pq

    from shardline.storage.capture import capture_files

    return sum(pq.read_metadata(path).num_rows
               for _, path in capture_files(str(DATA / "home" / "capture"), MODEL, tier="online"))


class SpanSink:
    """An OTLP/HTTP endpoint on loopback that takes the traced server's spans and counts them (a collector's
    cost is not the server's)."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        sink = self
        self.posts = self.spans_bytes = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                size = int(self.headers.get("content-length", 0))
                self.rfile.read(size)
                sink.posts += 1
                sink.spans_bytes += size
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with the defaults of full and quick runs filled in."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100, 500, 1600, 3200 req/s, short steps, one refinement, no capture: ~3-4 minutes")
    parser.add_argument("--servers", help="comma-separated subset of platform,capture,traced,floor,litserve (default: all; "
                        "quick: platform,floor,litserve); platform and floor are measured in each of --layouts")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma-separated request layouts of the platform and the floor (default: all, {', '.join(LAYOUTS)})")
    parser.add_argument("--rates",
                        help="the ladder, req/s, comma-separated (default 100..25600 doubling; quick 100,1600,3200; the --p50-rate is added to either)")
    parser.add_argument("--seconds", type=float, help="measured window per rate (default 5, quick 2)")
    parser.add_argument("--warmup", type=float, help="seconds at each rate before the window (default 1, quick 0.5)")
    parser.add_argument("--prewarm", type=float,
                        help="seconds at 4x the lightest rate against each series before the ladder, not counted "
                        "(a process's first requests pay for lazy set-up; default 3, quick 1.5)")
    parser.add_argument("--refine", type=int, help="bisection steps between the highest held and lowest failed rate "
                        "(default 2, quick 1)")
    parser.add_argument("--retries", type=int, help="measure a step again, up to this many times, when the rest of "
                        f"the machine used over {NOISY:g} core during it, or the other servers under test over "
                        f"{PEERS_NOISY:g} (default 2, quick 1)")
    parser.add_argument("--model", choices=("gbt", "logreg"), default="gbt",
                        help="the breast-cancer classifier: gradient-boosted trees (default) or logistic regression")
    parser.add_argument("--connections", type=int, default=256, help="most keep-alive connections per server")
    parser.add_argument("--litserve-batch", type=int, default=1,
                        help="LitServe max_batch_size (default 1: its default)")
    parser.add_argument("--litserve-batch-timeout", type=float, default=0.0, help="LitServe batch_timeout, seconds")
    parser.add_argument("--capture-rate", type=float, default=1.0,
                        help="capture_rate of the 'capture' server (default 1.0: every request, the harshest case)")
    parser.add_argument("--trace-ratio", type=float, default=0.01,
                        help="the 'traced' server's sampling ratio (parentbased_traceidratio; default 0.01)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--p50-rate", type=float, default=500.0,
                        help="the rate whose p50 is compared with the floor's (default 500 req/s; added to the ladder)")
    args = parser.parse_args(argv)
    args.ladder = [float(r) for r in args.rates.split(",")] if args.rates else (
        [100.0, 1600.0, 3200.0] if args.quick else [100.0 * 2**k for k in range(9)])  # full: 100 .. 25,600
    args.ladder = sorted(set(args.ladder) | {args.p50_rate})
    args.retries = args.retries if args.retries is not None else (1 if args.quick else 2)
    args.seconds = args.seconds or (2.0 if args.quick else 5.0)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 1.0)
    args.refine = args.refine if args.refine is not None else (1 if args.quick else 2)
    args.prewarm = args.prewarm if args.prewarm is not None else (1.5 if args.quick else 3.0)
    args.drain = 5.0
    servers = args.servers or ",".join(QUICK_SERVERS if args.quick else SERVERS)
    args.names = [n.strip() for n in servers.split(",") if n.strip()]
    args.layouts = parse_layouts(parser, args.layouts)
    unknown = set(args.names) - set(SERVERS)
    if unknown:
        parser.error(f"unknown server(s) {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Prepare the model, start the servers, run the ladder against them in turn, print the tables and ratios."""
    args = parse_args(argv)
    names = args.names
    if set(PLATFORMS) & set(names):
        missing = platform_help()
        if missing:
            print(f"note: skipping the platform: {missing}", flush=True)
            names = args.names = [n for n in names if n not in PLATFORMS]
    if "litserve" in names:
        args.peer_python = ensure_peer_env()

    DATA.mkdir(parents=True, exist_ok=True)
    data = prepare(args.model)  # (a fresh storage home: no capture from an earlier run)
    light = args.p50_rate
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} cores (load average {load:.2f}); ladder {', '.join(f'{r:,.0f}' for r in args.ladder)} "
          f"req/s, {args.warmup:g} s warm-up + {args.seconds:g} s measured each, {args.refine} refinement(s); "
          f"one row per request; model: breast-cancer {args.model}; floor and LitServe: {FLOOR_THREADS} onnxruntime "
          "intra-op thread; the platform: its own defaults", flush=True)
    print(f"  this venv: {versions(sys.executable, ['uvicorn', 'starlette', 'uvloop', 'httptools', 'onnxruntime'])}")
    if "litserve" in names:
        peers = ["litserve", "uvicorn", "fastapi", "uvloop", "httptools", "onnxruntime"]
        print(f"  LitServe's venv: {versions(str(args.peer_python), peers)}")
    if load > 0.5:
        print("  warning: something else is using the CPUs; the figures will be noisy", flush=True)

    sink = SpanSink()
    args.otlp_endpoint = sink.endpoint
    servers, targets = make_servers(names, data, args)
    try:
        for server in servers:  # all up at once (idle, each uses ~0% CPU); the rates alternate between them
            ready = server.start(next(t.bodies[0] for t in targets if t.server is server))
            for target in (t for t in targets if t.server is server):
                check_answer(target, data["expected"])
            print(f"  {server.name}: ready in {ready:.1f} s, answers as the model does", flush=True)
            if server.name in PLATFORMS:
                settings = effective_settings(server)
                shown = ", ".join(f"{k} {v}" for k, v in settings.items()) if settings else "(no 'serving settings' line)"
                print(f"    effective settings, from its start-up log: {shown}", flush=True)
        results = run_ladder(targets, args)
    finally:
        for server in servers:
            server.stop()
        sink.close()
    summary = report(results, args, light)
    (DATA / "last-run.json").write_text(json.dumps({"steps": results, "summary": summary}, indent=1))
    met = ratios(summary, light, args.layouts)
    if feature_ratios(results, summary, light, "capture", f"capture (capture_rate {args.capture_rate:g})"):
        print(f"  rows captured to Parquet: {captured_rows():,}")
    if feature_ratios(results, summary, light, "traced", f"tracing (sampled at {args.trace_ratio:g}, OTLP to loopback)"):
        print(f"  spans exported: {sink.spans_bytes:,} bytes in {sink.posts:,} posts")
    return 1 if args.strict and not met else 0


if __name__ == "__main__":
    sys.exit(main())
