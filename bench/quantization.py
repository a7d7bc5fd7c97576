"""Quantization: fp32 against its int8 variant on this machine's CPU, through the platform.

Two models, each packaged, pushed to a registry, given an int8 variant with
``shardline.quality.variants.make_variant`` (scored against fp32 on its golden set) and
loaded through the model cache, as the batch workers and the HTTP tier load them:

- classifier: an MLP (two hidden layers, 128 and 64) on scikit-learn's breast-cancer
  data, trained on 80% of the rows, the other 20% its golden set (accuracy); scored
  on ``--rows`` noisy rows drawn from the data set.
- embedding: all-MiniLM-L6-v2 (``shardline.build.embedding.package_minilm``), its golden
  set the fp32 embeddings of 256 sentences (cosine_min); scored on ``--texts``
  sentences taken from the docstrings of Python's standard library (real English,
  no download). Skipped with a note when the package or its build extras are missing.

Printed per model: rows/s of fp32 and int8 over the whole input in batches (best of
``--repeats``), p50/p99 per call at batch sizes 1/64/4096 (``shardline.build.profiling``),
the int8/fp32 ratios, and what int8 costs in accuracy: the golden-set delta recorded
on the variant, label agreement (classifier), min/mean cosine similarity between the
fp32 and int8 embeddings (embedding).

    .venv/bin/python bench/quantization.py            # ~1-2 minutes on 2 cores
    .venv/bin/python bench/quantization.py --quick    # small sizes, ~30 s
    .venv/bin/python bench/quantization.py --skip-embedding

Data lives under bench/.data/quantization/ (git-ignored); the MiniLM bundle made
there is reused, the registry is made afresh on every run.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from shardline.bundle import read_manifest  # noqa: E402
from shardline.errors import GateFailed, ShardlineError  # noqa: E402
from shardline.build.examples import breast_cancer, golden_table, shard_table, split  # noqa: E402
from shardline.quality.variants import make_variant  # noqa: E402
from shardline.build.packaging import GoldenSet, finish_bundle, package_sklearn  # noqa: E402
from shardline.build.profiling import profile_model  # noqa: E402
from shardline.machines import machine_kind, usable_cores  # noqa: E402
from shardline.runtimes import Runtime, RuntimeOptions  # noqa: E402
from shardline.storage.model_cache import ModelCache  # noqa: E402
from shardline.storage.registry import ModelRegistry, Variant  # noqa: E402

DATA = Path(__file__).resolve().parent / ".data" / "quantization"
PROFILE_SIZES = (1, 64, 4096)


def best_rate(model: Runtime, table: pa.Table, batch_rows: int, repeats: int) -> float:
    """Rows/s over the whole table in batches of ``batch_rows``, best of ``repeats`` passes."""
    model.predict(table.slice(0, min(batch_rows, table.num_rows)))  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for batch in table.to_batches(max_chunksize=batch_rows):
            model.predict(batch)
        best = min(best, time.perf_counter() - start)
    return table.num_rows / best


def print_profiles(fp32: dict[str, Any], int8: dict[str, Any]) -> None:
    print(f"  {'batch':>6} {'fp32 p50 ms':>12} {'fp32 p99 ms':>12} {'int8 p50 ms':>12} {'int8 p99 ms':>12} "
          f"{'fp32 rows/s':>12} {'int8 rows/s':>12} {'int8/fp32':>10}")
    for a, b in zip(fp32["batches"], int8["batches"]):
        print(f"  {a['batch_size']:>6} {a['p50_ms']:>12.3f} {a['p99_ms']:>12.3f} {b['p50_ms']:>12.3f} "
              f"{b['p99_ms']:>12.3f} {a['rows_per_s']:>12,.0f} {b['rows_per_s']:>12,.0f} "
              f"{b['rows_per_s'] / a['rows_per_s']:>10.2f}")


def describe_variant(variant: Variant, allowed: float) -> str:
    if variant.score is None or variant.baseline is None:
        return "int8 variant recorded unscored (no golden set)"
    return (f"golden set {variant.metric}: fp32 {variant.baseline:.4f}, int8 {variant.score:.4f}, "
            f"delta {variant.delta:+.4f} (max_variant_delta {allowed})")


def load_pair(registry: ModelRegistry, name: str, cache: ModelCache, threads: int) -> tuple[Runtime, Runtime]:
    resolved = registry.resolve(f"{name}:1")
    options = RuntimeOptions("cpu", threads)
    return cache.get(resolved, options), cache.get(resolved.variant("int8"), options)


def classifier(registry: ModelRegistry, cache: ModelCache, rows: int, repeats: int, seconds: float) -> None:
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    data = breast_cancer()
    train, held_out = split(data)
    estimator = make_pipeline(StandardScaler(), MLPClassifier((128, 64), max_iter=1000, random_state=0))
    estimator.fit(train.features, train.labels)
    folder = DATA / "mlp"
    shutil.rmtree(folder, ignore_errors=True)
    golden = GoldenSet(golden_table(held_out), "target", "accuracy", "label", 0.9)
    package_sklearn(estimator, folder, name="mlp", feature_names=data.names, golden=golden)
    registry.push(folder)
    print(f"\nclassifier: MLP (128, 64) on breast cancer, {rows:,} rows, {held_out.labels.size} golden rows")
    try:
        variant = make_variant(registry, "mlp:1", "int8", cache_dir=cache.cache_dir)
    except GateFailed as e:
        print(f"  int8 refused: {e}")
        return
    print(f"  {describe_variant(variant, golden.max_variant_delta)}")
    fp32, int8 = load_pair(registry, "mlp", cache, usable_cores())
    table = shard_table(data, rows, 0, seed=1)
    for batch_rows in (4_096, 65_536):
        a, b = best_rate(fp32, table, batch_rows, repeats), best_rate(int8, table, batch_rows, repeats)
        print(f"  batches of {batch_rows:>6,}: fp32 {a:>12,.0f} rows/s, int8 {b:>12,.0f} rows/s, int8/fp32 {b / a:.2f}")
    labels = [m.predict(table).column("label").to_numpy() for m in (fp32, int8)]
    probabilities = [np.stack(m.predict(table).column("probabilities").to_numpy(zero_copy_only=False)) for m in (fp32, int8)]
    print(f"  int8 labels agree with fp32 on {np.mean(labels[0] == labels[1]):.4%} of the rows; "
          f"largest probability change {np.abs(probabilities[0] - probabilities[1]).max():.4f}")
    sample = table.slice(0, 4_096)
    print_profiles(profile_model(fp32, sample, PROFILE_SIZES, seconds), profile_model(int8, sample, PROFILE_SIZES, seconds))


def stdlib_sentences(count: int) -> list[str]:
    """``count`` distinct sentences from the docstrings of Python's standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: dict[str, None] = {}
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                for sentence in " ".join(doc.split()).split(". "):
                    if 30 <= len(sentence) <= 300:
                        found.setdefault(sentence.rstrip(".") + ".")
                if len(found) >= count:
                    return list(found)[:count]
    return list(found)


def minilm_bundle(registry: ModelRegistry, texts: list[str]) -> bool:
    """Package all-MiniLM-L6-v2 once (reused), with the fp32 embeddings of 256 sentences as its golden set."""
    try:
        from shardline.build.embedding import package_minilm
    except ImportError as e:
        print(f"\nembedding: skipped, shardline.build.embedding.package_minilm is not there ({e})")
        return False
    folder = DATA / "minilm"
    if not (folder / "manifest.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        try:
            package_minilm(folder)
        except ShardlineError as e:
            print(f"\nembedding: skipped, the model could not be packaged here ({e})")
            return False
    manifest = read_manifest(folder)
    if manifest.evaluation is None:
        from shardline.runtimes import create_runtime

        model = create_runtime(folder, manifest, RuntimeOptions("cpu", usable_cores()))
        model.load()
        golden = pa.table({"text": texts[:256]})
        golden = golden.append_column("expected", model.predict(golden).column("embedding"))
        # int8 moves MiniLM's least cosine by ~0.015: the default 0.01 would refuse it.
        finish_bundle(folder, manifest, GoldenSet(golden, "expected", "cosine_min", "embedding", 0.99, 0.03))
    registry.push(folder)
    return True


def embedding(registry: ModelRegistry, cache: ModelCache, count: int, repeats: int, seconds: float) -> None:
    texts = stdlib_sentences(count)
    if not minilm_bundle(registry, texts):
        return
    print(f"\nembedding: all-MiniLM-L6-v2, {len(texts):,} sentences from the standard library's docstrings")
    try:
        variant = make_variant(registry, "minilm:1", "int8", cache_dir=cache.cache_dir)
    except GateFailed as e:
        print(f"  int8 refused: {e}")
        return
    print(f"  {describe_variant(variant, 0.03)}")
    fp32, int8 = load_pair(registry, "minilm", cache, usable_cores())
    table = pa.table({"text": texts})
    for batch_rows in (1, 64):
        part = table.slice(0, 200) if batch_rows == 1 else table
        a, b = best_rate(fp32, part, batch_rows, repeats), best_rate(int8, part, batch_rows, repeats)
        print(f"  batches of {batch_rows:>3}: fp32 {a:>8,.0f} texts/s, int8 {b:>8,.0f} texts/s, int8/fp32 {b / a:.2f}")
    vectors = [np.stack(m.predict(table).column("embedding").to_numpy(zero_copy_only=False)) for m in (fp32, int8)]
    cosines = np.einsum("ij,ij->i", *vectors) / (np.linalg.norm(vectors[0], axis=1) * np.linalg.norm(vectors[1], axis=1))
    print(f"  cosine(fp32, int8) over {len(texts):,} sentences: min {cosines.min():.4f}, mean {cosines.mean():.4f}, "
          f"p1 {np.percentile(cosines, 1):.4f}")
    print_profiles(profile_model(fp32, table, (1, 64), seconds), profile_model(int8, table, (1, 64), seconds))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="classifier rows to score")
    parser.add_argument("--texts", type=int, default=2_000, help="sentences to embed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0, help="profiling time per batch size")
    parser.add_argument("--quick", action="store_true", help="200k rows, 500 texts, 1 repeat, 0.3 s per size")
    parser.add_argument("--skip-embedding", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.texts, args.repeats, args.seconds = 200_000, 500, 1, 0.3
    load = os.getloadavg()[0]
    print(f"{machine_kind('cpu')} (load average {load:.2f}); onnxruntime with {usable_cores()} intra-op threads")
    if load > 0.5:
        print("  warning: something else is using the CPUs; the figures will be noisy")
    registry_dir = DATA / "registry"
    shutil.rmtree(registry_dir, ignore_errors=True)
    DATA.mkdir(parents=True, exist_ok=True)
    registry = ModelRegistry(str(registry_dir))
    cache = ModelCache(DATA / "cache", capacity=4)
    try:
        classifier(registry, cache, args.rows, args.repeats, args.seconds)
        cache.clear()
        if args.skip_embedding:
            print("\nembedding: skipped (--skip-embedding)")
        else:
            embedding(registry, cache, args.texts, args.repeats, args.seconds)
    finally:
        cache.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
