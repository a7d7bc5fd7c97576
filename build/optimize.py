"""Precision variants of an ONNX model: int8 for CPUs, fp16 for GPUs.

- ``quantize_int8``: onnxruntime's dynamic quantization, int8 weights (QInt8, one
  scale per output channel) and activations quantized per call. Per-channel scales
  keep all-MiniLM-L6-v2's embeddings at cosine >= 0.98 of fp32's where one scale per
  tensor drops to 0.92 (bench/quantization.py). It rewrites MatMul, Conv, Attention and LSTM
  nodes only; a Gemm with constant weights (torch exports ``nn.Linear`` as one) is first
  written as the MatMul (and Add of its bias) it computes (``_gemm_as_matmul``), so it is
  quantized too. A model without any of them (a tree ensemble or a linear model as skl2onnx
  writes them) would come out unchanged, so it is refused: int8 brings it nothing.
  Beware: the activations' scale is taken per call over the whole batch, so an int8
  row's output depends on the rows batched with it (the breast-cancer MLP: up to 0.09
  of probability between a row scored alone and in a batch of 4,096). fp32 and fp16
  do not have this; a static (calibrated) quantization would not either.
- ``convert_fp16``: weights and arithmetic in float16 for tensor-core GPUs, with the
  graph's inputs and outputs kept in their own types (``keep_io_types``), so the
  signature and the runtime's bindings do not change. Ops without a float16 kernel
  (onnxruntime's block list: the ``ai.onnx.ml`` ops, ...) stay in float32; a model
  with no MatMul/Gemm/Conv/attention left in float16 is refused.

The file transforms need only onnx and onnxruntime (imported inside them). Making,
scoring and recording a variant in the registry is ``shardline.quality.variants``.
"""

from __future__ import annotations

import logging
import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Literal

from shardline.bundle import Artifact, Manifest, describe_artifact
from shardline.errors import InvalidBundle, RuntimeUnavailable

Precision = Literal["int8", "fp16"]
# precision -> (the device it is meant for, the variant file's name in a bundle)
VARIANT_KINDS: dict[str, tuple[Literal["cpu", "cuda"], str]] = {
    "int8": ("cpu", "model.int8.onnx"),
    "fp16": ("cuda", "model.fp16.onnx"),
}
# Ops that dynamic quantization rewrites (Gemm once written as MatMul: ``_gemm_as_matmul``), and what it rewrites
# them into.
_INT8_TARGETS = frozenset({"MatMul", "Gemm", "Conv", "Attention", "LSTM"})
_INT8_RESULTS = frozenset(
    {"MatMulInteger", "ConvInteger", "QAttention", "DynamicQuantizeLSTM", "DynamicQuantizeMatMul", "MatMulIntegerToFloat"}
)
# Ops whose cost float16 cuts on a GPU (tensor cores); the rest only moves bytes.
_FP16_COMPUTE = frozenset(
    {"MatMul", "Gemm", "Conv", "ConvTranspose", "Attention", "MultiHeadAttention", "Einsum", "LSTM", "GRU", "FusedMatMul"}
)


def model_file(manifest: Manifest) -> Artifact:
    """The one ONNX model artifact of an ONNX bundle.

    Raises:
        InvalidBundle: the bundle is not run by the ONNX runtime or has no single .onnx model file.
    """
    if manifest.runtime != "onnx":
        raise InvalidBundle(
            f"{manifest.reference} runs on {manifest.runtime!r}; precision variants are made for ONNX "
            "bundles only (package the model as ONNX to get int8 or fp16 variants)"
        )
    files = [a for a in manifest.artifacts if a.role == "model" and a.path.endswith(".onnx")]
    if len(files) != 1:
        raise InvalidBundle(
            f"{manifest.reference} lists {[a.path for a in files]} as ONNX model files; a variant "
            "replaces exactly one"
        )
    return files[0]


def _op_counts(model: Any) -> Counter[str]:
    return Counter(node.op_type for node in model.graph.node)


_DESCRIBED_OPS = 6  # kinds of node a message names before '...'


def _describe(counts: Counter[str]) -> str:
    shown = ", ".join(f"{op} x{n}" for op, n in counts.most_common(_DESCRIBED_OPS)) or "no nodes"
    return shown + (", ..." if len(counts) > _DESCRIBED_OPS else "")


def _gemm_as_matmul(model: Any) -> int:
    """Rewrite, in place, each Gemm whose B is a constant (alpha and beta 1, A not transposed) as the MatMul by B
    (transposed once, into a new weight, when ``transB``) and the Add of its C that it computes: dynamic quantization
    rewrites MatMul and not Gemm, and torch exports ``nn.Linear`` as Gemm. Returns how many it rewrote."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    nodes, rewritten = [], 0
    for node in graph.node:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or node.input[1] not in weights
                or attributes.get("alpha", 1.0) != 1.0 or attributes.get("beta", 1.0) != 1.0
                or attributes.get("transA", 0)):
            nodes.append(node)
            continue
        b = numpy_helper.to_array(weights[node.input[1]])
        weight = f"{node.input[1]}_as_matmul_{rewritten}"
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(b.T if attributes.get("transB", 0) else b),
                                                         weight))
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        product = f"{node.output[0]}_matmul" if bias else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], weight], [product], name=f"{node.name}_matmul"))
        if bias:
            nodes.append(helper.make_node("Add", [product, bias], [node.output[0]], name=f"{node.name}_bias"))
        rewritten += 1
    if rewritten:
        del graph.node[:]
        graph.node.extend(nodes)
        used = {name for node in graph.node for name in node.input}
        kept = [t for t in graph.initializer if t.name in used]
        del graph.initializer[:]
        graph.initializer.extend(kept)
    return rewritten


def _output_artifact(out_file: Path) -> Artifact:
    return describe_artifact(out_file.parent, out_file.name, role="model")


@contextmanager
def _quiet_preprocessing_hint() -> Iterator[None]:
    """Drop onnxruntime's 'consider pre-processing' hint, logged on the root logger per call."""

    def keep(record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


def quantize_int8(manifest: Manifest, bundle_dir: str | Path, out_file: str | Path) -> Artifact:
    """Write an int8 (dynamic quantization, per-channel QInt8 weights) copy of the bundle's model.

    Args:
        manifest: the bundle's manifest.
        bundle_dir: the local bundle folder holding its verified files.
        out_file: where to write the variant; its file name becomes the artifact path.

    Returns:
        The variant's artifact (role 'model'), to replace the model file.

    Raises:
        InvalidBundle: int8 brings nothing for this model (no MatMul, Gemm, Conv, Attention
            or LSTM node that dynamic quantization rewrites), or quantization failed.
        RuntimeUnavailable: onnx or onnxruntime is not installed.
    """
    onnx, _ = _onnx_modules()
    from onnxruntime.quantization import QuantType, quantize_dynamic

    source = Path(bundle_dir) / model_file(manifest).path
    out = Path(out_file)
    model = onnx.load(str(source))
    before = _op_counts(model)
    if not before.keys() & _INT8_TARGETS:
        raise InvalidBundle(
            f"int8 brings nothing for {manifest.reference}: dynamic quantization rewrites "
            f"{sorted(_INT8_TARGETS)} nodes and its graph has none ({_describe(before)}): serve this model in fp32"
        )
    try:
        with _quiet_preprocessing_hint(), tempfile.TemporaryDirectory(prefix="shardline-int8-") as scratch:
            if _gemm_as_matmul(model):
                source = Path(scratch) / "model.onnx"
                onnx.save(model, str(source))
            quantize_dynamic(source, out, weight_type=QuantType.QInt8, per_channel=True)
    except Exception as e:  # onnxruntime raises ValueError, RuntimeError, onnx errors
        out.unlink(missing_ok=True)
        raise InvalidBundle(
            f"onnxruntime could not quantize {manifest.reference} to int8 ({type(e).__name__}: {e}); "
            "serve it in fp32, or re-export the model with a recent opset"
        ) from e
    after = _op_counts(onnx.load(str(out)))
    if not after.keys() & _INT8_RESULTS:
        out.unlink(missing_ok=True)
        raise InvalidBundle(
            f"int8 brings nothing for {manifest.reference}: quantization left no integer MatMul or Conv "
            f"({_describe(after)}), e.g. because no such node has constant weights; serve it in fp32"
        )
    return _output_artifact(out)


def _onnx_modules() -> tuple[Any, Any]:
    try:
        import onnx
        import onnxruntime
    except ImportError as e:
        raise RuntimeUnavailable(
            f"making a precision variant needs onnx and onnxruntime ({e.name} is missing); "
            "pip install 'shardline[cpu,package]'"
        ) from e
    return onnx, onnxruntime


def _elem_types(model: Any) -> dict[str, int]:
    """Tensor name -> ONNX element type, from shape inference, inputs, outputs and weights."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    types.update({t.name: t.data_type for t in graph.initializer})
    return types


def convert_fp16(manifest: Manifest, bundle_dir: str | Path, out_file: str | Path) -> Artifact:
    """Write a float16 copy of the bundle's model for GPUs, its inputs and outputs unchanged.

    Raises:
        InvalidBundle: fp16 brings nothing (no MatMul, Gemm, Conv or attention node
            computes in float16 after conversion), or the converted graph is not valid.
        RuntimeUnavailable: onnx or onnxruntime is not installed.
    """
    onnx, _ = _onnx_modules()
    from onnxruntime.transformers.float16 import convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel

    source = Path(bundle_dir) / model_file(manifest).path
    model = onnx.load(str(source))
    if not _FP16_COMPUTE & set(_op_counts(model)):  # before converting: a graph of ai.onnx.ml ops only (XGBoost's
        raise _fp16_brings_nothing(manifest, model)  # trees) gets Casts its opsets cannot even infer
    io_before = [(v.name, v.type.tensor_type.elem_type) for v in [*model.graph.input, *model.graph.output]]
    half = convert_float_to_float16(model, keep_io_types=True)
    OnnxModel.graph_topological_sort(half.graph, is_deterministic=True)  # the converter appends its casts
    io_after = [(v.name, v.type.tensor_type.elem_type) for v in [*half.graph.input, *half.graph.output]]
    if io_after != io_before:
        raise InvalidBundle(
            f"fp16 conversion of {manifest.reference} changed the graph's inputs/outputs from {io_before} "
            f"to {io_after}; the signature would no longer hold, so no fp16 variant is made"
        )
    types = _elem_types(half)
    in_half = Counter(
        n.op_type for n in half.graph.node
        if n.op_type in _FP16_COMPUTE and any(types.get(i) == onnx.TensorProto.FLOAT16 for i in n.input)
    )
    if not in_half:
        raise _fp16_brings_nothing(manifest, half)
    try:
        onnx.checker.check_model(half, full_check=True)
    except Exception as e:  # onnx raises ValidationError / InferenceError
        raise InvalidBundle(
            f"the fp16 conversion of {manifest.reference} is not a valid ONNX graph ({e}); serve it in fp32"
        ) from e
    out = Path(out_file)
    onnx.save(half, str(out))
    return _output_artifact(out)


def _fp16_brings_nothing(manifest: Manifest, model: Any) -> InvalidBundle:
    return InvalidBundle(
        f"fp16 brings nothing for {manifest.reference}: no MatMul, Gemm, Conv or attention node "
        f"computes in float16 after conversion ({_describe(_op_counts(model))}); its ops have no float16 "
        "kernel (tree ensembles, ai.onnx.ml ops): serve it in fp32"
    )


BUILDERS = {"int8": quantize_int8, "fp16": convert_fp16}
