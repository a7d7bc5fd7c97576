"""Precision variants of real models, scored on their golden sets, and measured profiles.

The model that int8 and fp16 apply to is a small multi-layer perceptron on the
breast-cancer data (skl2onnx writes its layers as MatMul); the gradient-boosted
trees of the shared fixture are the model they do not apply to.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pyarrow as pa
import pytest

from shardline.bundle import Evaluation, Manifest
from shardline.errors import GateFailed, InvalidBundle, InvalidSetting, ModelNotFound
from shardline.build.examples import Dataset, breast_cancer
from shardline.build.optimize import convert_fp16, quantize_int8
from shardline.quality.variants import make_variant
from shardline.build.packaging import GoldenSet, package_sklearn
from shardline.placement import OnlineWorkload, candidates_from_profiles, choose_placement
from shardline.build.profiling import profile_model
from shardline.machines import machine_kind
from shardline.quality.model_profiles import profile_version
from shardline.quality.evaluation import evaluate, metric_value, read_golden
from shardline.runtimes import RuntimeOptions, create_runtime
from shardline.storage.model_cache import ModelCache
from shardline.storage.registry import ModelRegistry

from tests.conftest import BuiltModel

ACCURACY = Evaluation(golden="golden.parquet", label_column="target", metric="accuracy",
                      prediction_column="label", threshold=0.95)


def mlp_golden_table(data: Dataset) -> pa.Table:
    """Every row of the data set, its features as float32, with the label and its one-hot probabilities."""
    columns: dict[str, Any] = {n: data.features[:, j].astype(np.float32) for j, n in enumerate(data.names)}
    columns["target"] = data.labels.astype(np.int64)
    one_hot = np.eye(2, dtype=np.float32)[data.labels]
    columns["expected_probabilities"] = pa.FixedSizeListArray.from_arrays(pa.array(one_hot.ravel()), 2)
    return pa.table(columns)


@pytest.fixture(scope="module")
def mlp() -> Any:
    """An MLP classifier (one hidden layer of 32) fitted on the breast-cancer data, once for the module."""
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    data = breast_cancer()
    return make_pipeline(StandardScaler(), MLPClassifier((32,), max_iter=1000, random_state=0)).fit(data.features, data.labels)


def package_mlp(estimator: Any, tmp_path: Path, evaluation: Evaluation | None) -> Path:
    """Bundle the MLP, with the whole data set as its golden set under ``evaluation``."""
    data = breast_cancer()
    golden = None if evaluation is None else GoldenSet(
        mlp_golden_table(data), evaluation.label_column, evaluation.metric, evaluation.prediction_column,
        evaluation.threshold, evaluation.max_variant_delta,
    )
    folder = tmp_path / f"mlp-{uuid.uuid4().hex[:8]}"
    package_sklearn(estimator, folder, name="mlp", feature_names=data.names, golden=golden)
    return folder


def registry_with(bundle: Path) -> ModelRegistry:
    registry = ModelRegistry(f"memory://registry-{uuid.uuid4().hex}")
    registry.push(bundle)
    return registry


def test_int8_variant_keeps_accuracy_and_loads_through_the_cache(mlp: Any, tmp_path: Path) -> None:
    registry = registry_with(package_mlp(mlp, tmp_path, ACCURACY))

    variant = make_variant(registry, "mlp:1", "int8", cache_dir=tmp_path / "build-cache")

    assert (variant.name, variant.precision, variant.device, variant.metric) == ("int8", "int8", "cpu", "accuracy")
    assert variant.score is not None and variant.baseline is not None and variant.delta is not None
    assert variant.baseline >= 0.97 and abs(variant.delta) <= ACCURACY.max_variant_delta
    resolved = registry.resolve("mlp:1")
    int8 = resolved.variant("int8")
    assert int8.reference == "mlp:1#int8" and int8.outputs_digest != resolved.outputs_digest
    cache = ModelCache(tmp_path / "serving-cache")
    model = cache.get(int8, RuntimeOptions("cpu", 1))
    ops = Counter(n.op_type for n in onnx.load(cache.local_dir(int8) / "model.int8.onnx").graph.node)
    assert ops["MatMulInteger"] == 2 and ops["MatMul"] == 0  # both layers really run in int8
    golden = read_golden(cache.local_dir(int8), int8.manifest)
    assert evaluate(model, int8.manifest, golden) == variant.score
    fp32 = cache.get(resolved, RuntimeOptions("cpu", 1))
    same = fp32.predict(golden).column("label").to_numpy() == model.predict(golden).column("label").to_numpy()
    assert same.mean() >= 0.99
    # dynamic quantization scales activations per call: an int8 row depends on its batch, fp32 does not
    changed = {}
    for name, m in (("fp32", fp32), ("int8", model)):
        batched = m.predict(golden).column("probabilities").to_pylist()[:50]
        changed[name] = sum(m.predict(golden.slice(i, 1)).column("probabilities")[0].as_py() != batched[i] for i in range(50))
    assert changed["fp32"] == 0 and changed["int8"] > 0
    assert make_variant(registry, "mlp:1", "int8") == variant  # a variant is made once


def test_a_torch_mlps_linear_layers_exported_as_gemm_are_quantized_and_gated(tmp_path: Path) -> None:
    """torch exports nn.Linear as Gemm, which dynamic quantization does not rewrite: each is written as the MatMul
    and Add it computes first, so the variant runs in int8, and it is scored against fp32 on the golden set."""
    import torch

    from shardline.build.frameworks import package_torch

    data = breast_cancer()
    features = ((data.features - data.features.mean(0)) / data.features.std(0)).astype(np.float32)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(features.shape[1], 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    x, y = torch.from_numpy(features), torch.from_numpy(data.labels.astype(np.float32))
    for _ in range(200):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x).squeeze(-1), y).backward()
        optimizer.step()

    class Regressor(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, rows: torch.Tensor) -> torch.Tensor:
            return self.net(rows).squeeze(-1)

    table = pa.table({**{n: features[:, j] for j, n in enumerate(data.names)},
                      "target": data.labels.astype(np.float32)})
    folder = tmp_path / "torch-mlp"
    package_torch(Regressor(), folder, name="torch-mlp", sample=table.drop(["target"]), feature_names=data.names,
                  golden=GoldenSet(table, "target", "rmse", "output", 0.3))
    fp32_ops = Counter(n.op_type for n in onnx.load(folder / "model.onnx").graph.node)
    assert fp32_ops["Gemm"] == 2
    registry = registry_with(folder)

    variant = make_variant(registry, "torch-mlp:1", "int8", cache_dir=tmp_path / "build-cache")

    assert variant.score is not None and variant.baseline is not None and variant.baseline < 0.3
    assert abs(variant.score - variant.baseline) <= 0.01  # within the gate's max_variant_delta
    int8 = registry.resolve("torch-mlp:1").variant("int8")
    cache = ModelCache(tmp_path / "serving-cache")
    cache.get(int8, RuntimeOptions("cpu", 1))
    ops = Counter(n.op_type for n in onnx.load(cache.local_dir(int8) / "model.int8.onnx").graph.node)
    assert ops["MatMulInteger"] == 2 and ops["Gemm"] == 0 and ops["MatMul"] == 0  # both layers run in int8


def test_a_variant_that_moves_the_score_too_far_is_refused(mlp: Any, tmp_path: Path) -> None:
    strict = Evaluation(golden="golden.parquet", label_column="expected_probabilities", metric="rmse",
                        prediction_column="probabilities", threshold=0.5, max_variant_delta=1e-6)
    registry = registry_with(package_mlp(mlp, tmp_path, strict))

    with pytest.raises(GateFailed) as caught:
        make_variant(registry, "mlp:1", "int8")

    assert caught.value.gate == "variant-accuracy"
    assert str(caught.value).startswith("the int8 variant of mlp:1 scores rmse ")
    assert "more than the max_variant_delta 1e-06 its manifest allows; it was not recorded" in str(caught.value)
    assert registry.list_variants("mlp", 1) == {}
    with pytest.raises(ModelNotFound, match="mlp:1 has no variant 'int8'"):
        registry.resolve("mlp:1").variant("int8")


def test_fp16_variant_keeps_the_signature_and_is_scored(mlp: Any, tmp_path: Path) -> None:
    registry = registry_with(package_mlp(mlp, tmp_path, ACCURACY))

    variant = make_variant(registry, "mlp:1", "fp16")

    assert (variant.precision, variant.device, variant.artifact.path) == ("fp16", "cuda", "model.fp16.onnx")
    assert variant.delta is not None and abs(variant.delta) <= ACCURACY.max_variant_delta
    cache = ModelCache(tmp_path / "cache")
    fp16 = registry.resolve("mlp:1").variant("fp16")
    cache.get(fp16, RuntimeOptions("cpu", 1))
    graph = onnx.load(cache.local_dir(fp16) / "model.fp16.onnx").graph
    weights = {t.name: t.data_type for t in graph.initializer}
    matmul_weights = [weights[n.input[1]] for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    assert matmul_weights and set(matmul_weights) == {onnx.TensorProto.FLOAT16}
    io = [(v.name, v.type.tensor_type.elem_type) for v in [*graph.input, *graph.output]]
    assert io == [("X", onnx.TensorProto.FLOAT), ("label", onnx.TensorProto.INT64),
                  ("probabilities", onnx.TensorProto.FLOAT)]


def test_a_variant_without_evaluation_is_recorded_unscored(mlp: Any, tmp_path: Path) -> None:
    registry = registry_with(package_mlp(mlp, tmp_path, None))

    variant = make_variant(registry, "mlp:1", "int8")

    assert (variant.metric, variant.score, variant.baseline) == (None, None, None)
    assert registry.list_variants("mlp", 1)["int8"].artifact == variant.artifact


@pytest.mark.parametrize("precision", ["int8", "fp16"])
def test_precision_brings_nothing_for_tree_ensembles(
    precision: str, breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    build = {"int8": quantize_int8, "fp16": convert_fp16}[precision]
    with pytest.raises(InvalidBundle, match=f"{precision} brings nothing for breast-cancer: .*TreeEnsembleClassifier"):
        build(breast_cancer_model.manifest, breast_cancer_model.bundle_dir, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()
    registry = registry_with(breast_cancer_model.bundle_dir)
    with pytest.raises(InvalidBundle, match=f"{precision} brings nothing for breast-cancer:1"):
        make_variant(registry, "breast-cancer:1", precision)  # type: ignore[arg-type]
    assert registry.list_variants("breast-cancer", 1) == {}


def test_fp16_brings_nothing_for_an_xgboost_regressor_whose_graph_has_only_ai_onnx_ml_ops(tmp_path: Path) -> None:
    """An XGBRegressor's graph imports only the ai.onnx.ml opset: the converter's Casts made shape inference fail
    (InferenceError: No opset import for domain ''), a traceback instead of the refusal."""
    from shardline.build.frameworks import package_xgboost
    from tests.framework_models import fitted, training_rows

    manifest = package_xgboost(fitted("xgboost-regressor"), tmp_path / "xgb", name="dia-xgb",
                               sample=training_rows()[3])
    assert {o.domain for o in onnx.load(str(tmp_path / "xgb" / "model.onnx")).opset_import} == {"ai.onnx.ml"}

    with pytest.raises(InvalidBundle, match="fp16 brings nothing for dia-xgb: .*TreeEnsembleRegressor.*tree "
                                            "ensembles, ai.onnx.ml ops.*serve it in fp32"):
        convert_fp16(manifest, tmp_path / "xgb", tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_int8_brings_nothing_for_a_linear_model(tmp_path: Path) -> None:
    from shardline.build.examples import package_breast_cancer

    manifest, _ = package_breast_cancer(tmp_path / "logreg", kind="logreg")
    with pytest.raises(InvalidBundle, match="int8 brings nothing .*LinearClassifier x1.*serve this model in fp32") as none:
        quantize_int8(manifest, tmp_path / "logreg", tmp_path / "out.onnx")
    assert "tree ensembles" not in str(none.value)
    with pytest.raises(InvalidSetting, match="precision 'int4' is not one Shardline makes"):
        make_variant(ModelRegistry("memory://nothing"), "x:1", "int4")  # type: ignore[arg-type]


def test_a_refusals_list_of_ops_says_when_it_is_cut_short() -> None:
    from shardline.build.optimize import _describe

    assert _describe(Counter({"Add": 3, "Mul": 2})) == "Add x3, Mul x2"
    assert _describe(Counter({f"Op{i}": 10 - i for i in range(8)})) == (
        "Op0 x10, Op1 x9, Op2 x8, Op3 x7, Op4 x6, Op5 x5, ...")


def test_metrics() -> None:
    assert metric_value("accuracy", np.array([1, 0, 1, 1]), np.array([1, 1, 1, 1])) == 0.75
    assert metric_value("rmse", np.array([1.0, 3.0]), np.array([0.0, 0.0])) == pytest.approx(np.sqrt(5))
    vectors = np.array([[1.0, 0.0], [0.0, 2.0]])
    assert metric_value("cosine_min", vectors, np.array([[2.0, 0.0], [1.0, 1.0]])) == pytest.approx(np.sqrt(0.5))
    with pytest.raises(InvalidBundle, match="cosine_min compares vectors of equal length"):
        metric_value("cosine_min", np.array([1.0]), np.array([1.0]))


def test_a_golden_set_that_does_not_fit_is_refused(mlp: Any, tmp_path: Path) -> None:
    folder = package_mlp(mlp, tmp_path, ACCURACY)
    manifest = Manifest.from_json((folder / "manifest.json").read_bytes(), "test")
    model = create_runtime(folder, manifest, RuntimeOptions("cpu", 1))
    model.load()
    table = read_golden(folder, manifest)
    assert evaluate(model, manifest, table) >= 0.97
    with pytest.raises(InvalidBundle, match="has no label column 'truth' .*make evaluation.label_column name"):
        evaluate(model, manifest.model_copy(update={"evaluation": ACCURACY.model_copy(update={"label_column": "truth"})}), table)
    with pytest.raises(InvalidBundle, match="column 'mean radius' is missing"):
        evaluate(model, manifest, table.drop_columns(["mean radius"]))
    with pytest.raises(InvalidBundle, match="has no rows"):
        evaluate(model, manifest, table.slice(0, 0))
    with pytest.raises(InvalidBundle, match="declares no evaluation"):
        evaluate(model, manifest.model_copy(update={"evaluation": None}), table)


def test_profile_model_computes_latency_and_throughput(mlp: Any, tmp_path: Path) -> None:
    folder = package_mlp(mlp, tmp_path, None)
    manifest = Manifest.from_json((folder / "manifest.json").read_bytes(), "test")
    runtime = create_runtime(folder, manifest, RuntimeOptions("cpu", 1))
    runtime.load()
    ticks = iter(np.arange(0, 10, 0.002))  # a clock that moves 2 ms each time it is read

    profile = profile_model(runtime, mlp_golden_table(breast_cancer()).slice(0, 10), (1, 64), 0.05,
                            clock=lambda: float(next(ticks)))

    assert (profile["device"], profile["threads"], profile["machine"]) == ("cpu", 1, machine_kind("cpu"))
    for row, size in zip(profile["batches"], (1, 64)):
        assert row["batch_size"] == size and row["calls"] == 10  # 5 calls at least, then until 50 ms have passed
        assert (row["p50_ms"], row["p99_ms"]) == (pytest.approx(2.0), pytest.approx(2.0))
        assert row["rows_per_s"] == pytest.approx(size / 0.002)
    with pytest.raises(InvalidSetting, match="batch sizes must be whole numbers of at least 1"):
        profile_model(runtime, mlp_golden_table(breast_cancer()), (0,))


def test_profiles_are_stored_per_machine_kind_and_variant_and_feed_placement(mlp: Any, tmp_path: Path) -> None:
    registry = ModelRegistry(str(tmp_path / "registry"))
    registry.push(package_mlp(mlp, tmp_path, ACCURACY))
    make_variant(registry, "mlp:1", "int8")

    fp32 = profile_version(registry, "mlp:1", batch_sizes=(1, 64), seconds_per_size=0.05,
                           options=RuntimeOptions("cpu", 1))
    int8 = profile_version(registry, "mlp:1", "int8", batch_sizes=(1, 64), seconds_per_size=0.05,
                           options=RuntimeOptions("cpu", 1))

    here = machine_kind("cpu")
    stored = registry.profiles("mlp", 1)
    assert sorted(stored) == [here, f"{here}.int8"]
    assert (stored[here]["variant"], stored[here]["precision"], stored[f"{here}.int8"]["variant"]) == (None, "fp32", "int8")
    for profile in (fp32, int8):
        assert [b["batch_size"] for b in profile["batches"]] == [1, 64] and profile["threads"] == 1
        assert all(0 < b["p50_ms"] <= b["p99_ms"] and b["rows_per_s"] > 0 for b in profile["batches"])
    candidates = candidates_from_profiles(stored, lambda machine: 0.1)
    assert {(c.variant, c.batch_size) for c in candidates} == {("fp32", 1), ("fp32", 64), ("int8", 1), ("int8", 64)}
    placement = choose_placement(OnlineWorkload(p99_ms=1_000, rps=10), candidates)
    assert placement.candidate.device == "cpu" and placement.replicas == 1
    with pytest.raises(ModelNotFound, match="has no variant 'fp16'"):
        profile_version(registry, "mlp:1", "fp16", seconds_per_size=0.01)


def test_asking_for_a_missing_variant_says_how_to_make_it_and_when_there_is_none(
        breast_cancer_model: BuiltModel) -> None:
    registry = registry_with(breast_cancer_model.bundle_dir)  # a tree ensemble: optimize makes neither variant

    with pytest.raises(ModelNotFound) as missing:
        registry.resolve("breast-cancer:1").variant("fp16")

    assert str(missing.value) == (
        "breast-cancer:1 has no variant 'fp16' (it has: none); make one with `shardline model optimize "
        "breast-cancer:1 --quantize fp16`, where the model has ops it speeds up (a tree ensemble or a linear model "
        "has none: use the fp32 model, asking for no variant)")


def test_machine_kinds_are_stable_names() -> None:
    assert machine_kind("cpu", cores=2, arch="x86_64") == "cpu-x86_64-2c"
    assert machine_kind("cuda", gpu="NVIDIA H200") == "cuda-nvidia-h200"
    assert machine_kind("cuda", gpu="NVIDIA H200 mig 1g.18gb") == "cuda-nvidia-h200-mig-1g.18gb"
    with pytest.raises(InvalidSetting, match="device 'tpu' has no machine kind"):
        machine_kind("tpu")


def _faster(profile: dict[str, Any], variant: str, precision: str) -> dict[str, Any]:
    """``profile`` as if ``variant`` had run it 100 times faster: placement would pick it, were it allowed to."""
    batches = [{**b, "rows_per_s": b["rows_per_s"] * 100} for b in profile["batches"]]
    return {**profile, "batches": batches, "variant": variant, "precision": precision}


def test_placement_never_picks_an_unscored_variant(mlp: Any, tmp_path: Path) -> None:
    from shardline.tasks.batch_survey import choose_variant

    registry = ModelRegistry(str(tmp_path / "registry"))
    registry.push(package_mlp(mlp, tmp_path, None))  # no golden set: the int8 variant is recorded unscored
    make_variant(registry, "mlp:1", "int8")
    rows = mlp_golden_table(breast_cancer()).slice(0, 64)
    fp32 = profile_version(registry, "mlp:1", sample_table=rows, batch_sizes=(64,), seconds_per_size=0.05,
                           options=RuntimeOptions("cpu", 1))
    here = machine_kind("cpu")
    registry.put_profile("mlp", 1, f"{here}.int8", _faster(fp32, "int8", "int8"))
    resolved = registry.resolve("mlp:1")

    chosen, note = choose_variant(registry, resolved, "auto", local=True, price=lambda machine: 0.1)

    assert chosen.variant_name == "" and note is not None  # the fp32 model
    assert note.endswith("; int8 left out: never scored against fp32 (no golden set)") and "fp32" in note
    with pytest.raises(InvalidSetting, match=r"mlp:1 has no golden set to take sample rows from; .*"
                                             r"`shardline model profile --sample ROWS.parquet`"):
        profile_version(registry, "mlp:1", "int8", seconds_per_size=0.01)


def test_a_gpu_variant_is_not_profiled_on_a_cpu_nor_placed_on_one(mlp: Any, tmp_path: Path) -> None:
    from shardline.placement import BatchWorkload, placeable

    registry = ModelRegistry(str(tmp_path / "registry"))
    registry.push(package_mlp(mlp, tmp_path, ACCURACY))
    make_variant(registry, "mlp:1", "fp16")
    assert registry.list_variants("mlp", 1)["fp16"].device == "cuda"

    with pytest.raises(InvalidSetting, match="the variant fp16 of mlp:1 is made for GPUs, and this machine runs it on "
                                             "cpu, where placement never picks it; profile it on a GPU machine"):
        profile_version(registry, "mlp:1", "fp16", batch_sizes=(64,), seconds_per_size=0.01,
                        options=RuntimeOptions("cpu", 1))
    here = machine_kind("cpu")
    assert f"{here}.fp16" not in registry.profiles("mlp", 1)

    fp32 = profile_version(registry, "mlp:1", batch_sizes=(64,), seconds_per_size=0.05, options=RuntimeOptions("cpu", 1))
    registry.put_profile("mlp", 1, f"{here}.fp16", _faster(fp32, "fp16", "fp16"))  # as one measured before this fix
    measured = candidates_from_profiles(registry.profiles("mlp", 1), lambda machine: 0.1)
    kept, notes = placeable(measured, registry.resolve("mlp:1").variants)

    assert {c.variant for c in measured} == {"fp32", "fp16"} and {c.variant for c in kept} == {"fp32"}
    assert notes == ["fp16 left out on CPUs: made for GPUs"]
    assert choose_placement(BatchWorkload(rows_per_s=1_000), kept).candidate.variant == "fp32"
