"""A Llama forward pass in plain torch over a static slot cache: what the CPU engine (``engine.py``) runs.

It reads a Hugging Face Llama checkpoint (``config.json`` and ``model.safetensors``, the parameter
names of ``LlamaForCausalLM``) and computes what transformers computes for it: RMSNorm, rotary
position embeddings (``rotate_half``), grouped-query attention, a SwiGLU MLP and an untied
``lm_head``, in float32. transformers is not imported; torch and safetensors are, when this module
is (only ``GenerationEngine.start`` imports it).

The K/V cache is preallocated per layer as ``[max_batch, kv_heads, max_context, head_dim]``. A
prompt is prefilled on its own into one slot; a decode step runs all ``max_batch`` slots at once
over the whole ``max_context``, masked by each slot's position, so every decode step has the same
shapes whatever is running and a slot's numbers never depend on the other slots.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from shardline.errors import InvalidBundle
from shardline.runtimes.generation.base import CONFIG_FILE

WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Hugging Face Llama ``config.json`` that the forward pass reads."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @classmethod
    def read(cls, model_dir: Path) -> LlamaConfig:
        """Read ``config.json`` from a model folder.

        Raises:
            InvalidBundle: the file is missing, is not JSON, lacks a field, or describes shapes
                that do not fit together.
        """
        path = model_dir / CONFIG_FILE
        try:
            raw = json.loads(path.read_text())
            rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
            if rope.get("rope_type", rope.get("type", "default")) != "default":
                raise ValueError(f"rope scaling {rope!r} is not supported; only plain rotary embeddings are")
            config = cls(
                vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]), num_attention_heads=int(raw["num_attention_heads"]),
                num_key_value_heads=int(raw.get("num_key_value_heads", raw["num_attention_heads"])),
                intermediate_size=int(raw["intermediate_size"]),
                max_position_embeddings=int(raw["max_position_embeddings"]),
                head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"])),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidBundle(f"{CONFIG_FILE} at {path} is not a readable Llama config ({type(e).__name__}: {e}); "
                                "re-package the model (shardline.build.llm_build.package_tiny_llm writes one)") from e
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if (min(config.vocab_size, config.hidden_size, config.num_hidden_layers, heads, kv_heads,
                config.intermediate_size, config.max_position_embeddings, config.head_dim) < 1
                or heads % kv_heads or config.head_dim % 2):
            raise InvalidBundle(f"{CONFIG_FILE} at {path} describes {heads} attention heads of width "
                                f"{config.head_dim} over {kv_heads} key/value heads; every size must be positive, "
                                "the head width even, and the attention heads whole groups of the key/value heads")
        return config


def _expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config.vocab_size, hidden),
    }
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        shapes.update({
            layer + "self_attn.q_proj.weight": (config.num_attention_heads * head_dim, hidden),
            layer + "self_attn.k_proj.weight": (config.num_key_value_heads * head_dim, hidden),
            layer + "self_attn.v_proj.weight": (config.num_key_value_heads * head_dim, hidden),
            layer + "self_attn.o_proj.weight": (hidden, config.num_attention_heads * head_dim),
            layer + "mlp.gate_proj.weight": (config.intermediate_size, hidden),
            layer + "mlp.up_proj.weight": (config.intermediate_size, hidden),
            layer + "mlp.down_proj.weight": (hidden, config.intermediate_size),
            layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
        })
    return shapes


def read_weights(model_dir: Path, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in float32, checked against the shapes the config implies.

    Raises:
        InvalidBundle: ``model.safetensors`` is missing or unreadable, or a tensor is missing or
            has another shape.
    """
    path = model_dir / WEIGHTS_FILE
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError, ValueError, RuntimeError) as e:
        raise InvalidBundle(f"{WEIGHTS_FILE} at {path} is not readable safetensors ({type(e).__name__}: {e}); "
                            "re-fetch the bundle or package it again") from e
    if "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # tied embeddings
    wrong = [f"{name} {tuple(tensors[name].shape) if name in tensors else 'missing'} (expected {shape})"
             for name, shape in _expected_shapes(config).items()
             if name not in tensors or tuple(tensors[name].shape) != shape]
    if wrong:
        raise InvalidBundle(f"{WEIGHTS_FILE} at {path} does not match {CONFIG_FILE}: {'; '.join(wrong[:5])}"
                            f"{' ...' if len(wrong) > 5 else ''}; package the weights and config together")
    return {name: tensors[name].to(torch.float32).contiguous() for name in _expected_shapes(config)}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """A loaded Llama checkpoint and its slot cache: ``prefill`` one prompt, ``decode`` every slot."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], max_batch: int,
                 max_context: int, device: str = "cpu") -> None:
        self.config = config
        self.max_batch = max_batch
        self.max_context = max_context
        self.device = torch.device(device)
        on = self.device
        self._w = {name: tensor.to(on) for name, tensor in weights.items()}
        shape = (max_batch, config.num_key_value_heads, max_context, config.head_dim)
        self._k = [torch.zeros(shape, device=on) for _ in range(config.num_hidden_layers)]
        self._v = [torch.zeros(shape, device=on) for _ in range(config.num_hidden_layers)]
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        freqs = torch.outer(torch.arange(max_context, dtype=torch.float32), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = angles.cos().to(on), angles.sin().to(on)
        self._slots = torch.arange(max_batch, device=on)
        self._columns = torch.arange(max_context, device=on)

    @classmethod
    def load(cls, model_dir: Path, max_batch: int, max_context: int, device: str = "cpu") -> LlamaModel:
        """Read a checkpoint folder and allocate the cache for ``max_batch`` slots of ``max_context`` tokens on
        ``device`` (a torch device: 'cpu', 'cuda', 'cuda:1'); the logits come back on the CPU either way."""
        config = LlamaConfig.read(model_dir)
        return cls(config, read_weights(model_dir, config), max_batch, max_context, device)

    def _layer(self, i: int, x: torch.Tensor, attend: Any) -> torch.Tensor:
        """One decoder layer on ``x`` ``[batch, tokens, hidden]``; ``attend(q, k, v)`` does attention."""
        w, eps, c = self._w, self.config.rms_norm_eps, self.config
        layer = f"model.layers.{i}."
        h = _rms_norm(x, w[layer + "input_layernorm.weight"], eps)
        batch, tokens, _ = h.shape
        q = torch.nn.functional.linear(h, w[layer + "self_attn.q_proj.weight"])
        k = torch.nn.functional.linear(h, w[layer + "self_attn.k_proj.weight"])
        v = torch.nn.functional.linear(h, w[layer + "self_attn.v_proj.weight"])
        q = q.view(batch, tokens, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = k.view(batch, tokens, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = v.view(batch, tokens, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        out = attend(i, q, k, v)  # [batch, tokens, heads * head_dim]
        x = x + torch.nn.functional.linear(out, w[layer + "self_attn.o_proj.weight"])
        h = _rms_norm(x, w[layer + "post_attention_layernorm.weight"], eps)
        gate = torch.nn.functional.silu(torch.nn.functional.linear(h, w[layer + "mlp.gate_proj.weight"]))
        up = torch.nn.functional.linear(h, w[layer + "mlp.up_proj.weight"])
        return x + torch.nn.functional.linear(gate * up, w[layer + "mlp.down_proj.weight"])

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        x = _rms_norm(x, self._w["model.norm.weight"], self.config.rms_norm_eps)
        return torch.nn.functional.linear(x, self._w["lm_head.weight"])

    def _grouped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` ``[b, heads, t, d]`` over ``k``/``v`` ``[b, kv_heads, s, d]`` where ``allowed``
        (``[b or 1, t, s]``) is true; query heads share key/value heads in groups, as ``repeat_kv`` does."""
        batch, heads, tokens, dim = q.shape
        kv_heads = k.shape[1]
        q = q.reshape(batch, kv_heads, heads // kv_heads * tokens, dim)
        scores = torch.matmul(q, k.transpose(-1, -2)) * dim ** -0.5
        scores = scores.view(batch, kv_heads, heads // kv_heads, tokens, -1)
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(batch, kv_heads, heads // kv_heads * tokens, -1)
        out = torch.matmul(probs, v).view(batch, heads, tokens, dim)
        return out.transpose(1, 2).reshape(batch, tokens, heads * dim)

    def prefill(self, slot: int, ids: list[int]) -> torch.Tensor:
        """Run a prompt alone, writing its K/V into ``slot`` at positions ``0..len(ids)-1``.

        Returns:
            The logits for the token after the prompt, ``[vocab]``.
        """
        return self._causal(ids, slot)[-1]

    def _causal(self, ids: list[int], slot: int | None) -> torch.Tensor:
        """A causal forward over ``ids`` from position 0: the logits at every position, ``[len(ids), vocab]``, on
        the CPU; with a ``slot``, its K/V are written there."""
        tokens = len(ids)
        cos, sin = self._cos[:tokens], self._sin[:tokens]
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=self.device).tril()[None]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if slot is not None:
                self._k[i][slot, :, :tokens] = k[0]
                self._v[i][slot, :, :tokens] = v[0]
            return self._grouped(q, k, v, causal)

        with torch.inference_mode():
            x = self._w["model.embed_tokens.weight"][torch.tensor(ids, device=self.device)][None]
            for i in range(self.config.num_hidden_layers):
                x = self._layer(i, x, attend)
            return self._head(x[0] if slot is None else x[0, -1:]).cpu()  # (sampling is on the CPU: a no-op there)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One step for every slot: slot ``b`` reads ``tokens[b]`` at ``positions[b]``, writes its K/V
        there, and attends to its positions ``0..positions[b]``. Free slots pass token 0 at position 0.

        Args:
            tokens: ``[max_batch]`` int64.
            positions: ``[max_batch]`` int64, each below ``max_context``.

        Returns:
            The logits of each slot's next token, ``[max_batch, vocab]``.
        """
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        cos, sin = self._cos[positions][:, None, None], self._sin[positions][:, None, None]
        allowed = (self._columns[None] <= positions[:, None])[:, None]  # [b, 1, max_context]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self._k[i][self._slots, :, positions] = k[:, :, 0]
            self._v[i][self._slots, :, positions] = v[:, :, 0]
            return self._grouped(q, self._k[i], self._v[i], allowed)

        with torch.inference_mode():
            x = self._w["model.embed_tokens.weight"][tokens][:, None]
            for i in range(self.config.num_hidden_layers):
                x = self._layer(i, x, attend)
            return self._head(x[:, 0]).cpu()

    def logits(self, ids: list[int]) -> torch.Tensor:
        """The logits at every position of ``ids`` (a plain causal forward that leaves the cache alone),
        ``[len(ids), vocab]``: for checking the checkpoint against another implementation."""
        return self._causal(ids, None)
