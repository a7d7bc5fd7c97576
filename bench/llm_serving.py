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

Data and logs: bench/.data/llm/ (git-ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
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


def prepare() -> dict[str, Any]:
    """The tiny bundle pushed as tiny@prod in a fresh home, and a tenants file allowing it."""
    from shardline.build.llm_build import package_tiny_llm
    from shardline.online.tenants import hash_api_key
    from shardline.storage.registry import ModelRegistry

    shutil.rmtree(DATA, ignore_errors=True)
    DATA.mkdir(parents=True)
    home = DATA / "home"
    package_tiny_llm(DATA / "tiny-bundle", name="tiny")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="where the hf-generate peer runs (cpu or cuda)")
    args = parser.parse_args(argv)
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
