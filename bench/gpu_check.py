"""The GPU path, run once where a GPU is: one prepared script, under 5 minutes.

Two steps, because a GPU machine lent to a session can fetch nothing:

    .venv/bin/python bench/gpu_check.py --prepare     # here: builds the models into bench/.data/gpu/ (~1 min)
    python bench/gpu_check.py                         # on the GPU machine (carry bench/.data/gpu)

The run needs numpy, onnxruntime (the GPU build) and torch; pyarrow, pydantic, safetensors and tokenizers are
imported where present (the checks that need them say so when they are not). It prints, each against the CPU on
the same machine:

1. ONNX on CUDA: onnxruntime's CUDA provider chosen and really used (``session.get_providers()``), rows/s of the
   breast-cancer GBT and an MLP at batches of 1, 64 and 4,096 rows, CUDA against CPU.
2. fp16: the MLP's fp16 variant (``build/optimize.convert_fp16``) on CUDA: rows/s and its agreement with fp32
   (labels equal, largest probability difference).
3. The ``llm`` engine (``shardline.runtimes.generation``) on CUDA: output tokens/s at 1 and 8 streams, greedy,
   CUDA against CPU, and the same tokens from both.
4. A real out-of-memory: onnxruntime's CUDA arena capped (``gpu_mem_limit``) below what a 65,536-row batch needs;
   ``split_out_of_memory`` (both tiers score through it) splits the batch until it fits and every row is answered
   as with memory to spare.

Without a GPU it says so and runs the CPU side only (what CI can check of it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
DATA = HERE / ".data" / "gpu"
sys.path.insert(0, str(HERE.parent))  # the checkout's rooms, where shardline is not installed (the GPU machine)
for key, value in {"DO_NOT_TRACK": "1", "ORT_DISABLE_TELEMETRY": "1"}.items():
    os.environ.setdefault(key, value)

BATCHES = (1, 64, 4096)
SECONDS = 3.0  # per measurement


# --------------------------------------------------------------------------- prepare (here)


def prepare() -> None:
    """Build the models and the rows the run scores, into bench/.data/gpu/ (the run imports no builder)."""
    import numpy as np
    from sklearn.neural_network import MLPClassifier

    from shardline.build.examples import breast_cancer, package_breast_cancer, split
    from shardline.build.llm_build import package_tiny_llm
    from shardline.build.optimize import convert_fp16
    from shardline.build.packaging import package_sklearn

    DATA.mkdir(parents=True, exist_ok=True)
    package_breast_cancer(DATA / "gbt", "breast-cancer", "gbt")
    train, _ = split(breast_cancer())
    mlp = MLPClassifier(hidden_layer_sizes=(256, 256), max_iter=300, random_state=0).fit(train.features, train.labels)
    manifest = package_sklearn(mlp, DATA / "mlp", name="mlp", feature_names=train.names)
    convert_fp16(manifest, DATA / "mlp", DATA / "mlp" / "model.fp16.onnx")
    rng = np.random.default_rng(0)
    rows = train.features[rng.integers(0, len(train.features), 65_536)].astype(np.float32)
    np.save(DATA / "rows.npy", rows)
    package_tiny_llm(DATA / "llm", name="gpu-llm", layers=4, hidden=256, heads=4, kv_heads=2, intermediate=688,
                     max_positions=1024)
    _shrink_weights(DATA / "llm" / "model.safetensors")
    print(f"prepared {DATA}: gbt, mlp (+fp16), llm, rows.npy ({rows.shape[0]:,} rows)")


def _shrink_weights(path: Path) -> None:
    """Tie the head to the embeddings and store float16 (the engine reads float32 either way): what is carried
    to a GPU machine is at most 64 MiB a call."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    tensors.pop("lm_head.weight", None)
    save_file({name: tensor.to(torch.float16).contiguous() for name, tensor in tensors.items()}, str(path))


# --------------------------------------------------------------------------- run (on the GPU machine)


def _rate(score: Callable[[], Any], rows: int) -> float:
    """Rows/s of ``score`` over about SECONDS (after one warm-up call)."""
    score()
    calls, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < SECONDS:
        score()
        calls += 1
    return calls * rows / elapsed


def _session(path: Path, provider: str, options: dict[str, Any] | None = None) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    providers: list[Any] = [(provider, options or {}), "CPUExecutionProvider"] if provider != "CPUExecutionProvider" \
        else ["CPUExecutionProvider"]
    return ort.InferenceSession(str(path), sess_options=so, providers=providers)


def _feeds(session: Any, rows: Any) -> dict[str, Any]:
    """The model's inputs from a float matrix: one [N, k] input, or one [N] or [N, 1] input per feature."""
    inputs = session.get_inputs()
    if len(inputs) == 1:
        return {inputs[0].name: rows}
    return {i.name: (rows[:, j:j + 1] if len(i.shape) == 2 else rows[:, j]) for j, i in enumerate(inputs)}


def onnx_checks(cuda: bool, report: dict[str, Any]) -> None:
    """1 and 2: CUDA against CPU, fp16 against fp32."""
    import numpy as np

    rows = np.load(DATA / "rows.npy")
    for name, path in (("gbt", DATA / "gbt" / "model.onnx"), ("mlp", DATA / "mlp" / "model.onnx"),
                       ("mlp-fp16", DATA / "mlp" / "model.fp16.onnx")):
        for provider in (["CUDAExecutionProvider"] if cuda else []) + ["CPUExecutionProvider"]:
            if name == "mlp-fp16" and provider == "CPUExecutionProvider":
                continue  # fp16 is for GPUs (the packaging says so); on a CPU it is emulated
            session = _session(path, provider)
            used = session.get_providers()[0]
            for batch in BATCHES:
                feeds = _feeds(session, rows[:batch])
                rate = _rate(lambda: session.run(None, feeds), batch)
                report.setdefault("onnx", []).append({"model": name, "provider": used, "asked": provider,
                                                      "batch": batch, "rows_per_s": round(rate)})
                print(f"  {name:9s} {used:22s} batch {batch:5d}: {rate:>13,.0f} rows/s", flush=True)
    if cuda:
        fp32 = _session(DATA / "mlp" / "model.onnx", "CUDAExecutionProvider")
        fp16 = _session(DATA / "mlp" / "model.fp16.onnx", "CUDAExecutionProvider")
        a, b = fp32.run(None, _feeds(fp32, rows[:4096])), fp16.run(None, _feeds(fp16, rows[:4096]))
        labels_equal = float((np.asarray(a[0]) == np.asarray(b[0])).mean())
        probabilities = [np.asarray(o, dtype=np.float64) for o in (a[1], b[1])] if len(a) > 1 else None
        worst = float(np.abs(probabilities[0] - probabilities[1]).max()) if probabilities else float("nan")
        report["fp16"] = {"labels_equal": labels_equal, "max_probability_difference": worst}
        print(f"  fp16 against fp32 on CUDA, 4,096 rows: labels equal {labels_equal:.2%}, "
              f"largest probability difference {worst:.2e}", flush=True)


def llm_checks(cuda: bool, report: dict[str, Any]) -> None:
    """3: the llm engine's output tokens/s on CUDA against the CPU, and the same greedy tokens from both."""
    try:
        from shardline.runtimes.generation import EngineConfig, SamplingParams
        from shardline.runtimes.generation.engine import GenerationEngine
    except ImportError as e:
        print(f"  skipped: {e} (the engine needs pydantic, safetensors and tokenizers)")
        return
    import threading

    config = EngineConfig(max_batch=8, max_context=512)
    tokens: dict[str, tuple[int, ...]] = {}
    for device in (["cuda"] if cuda else []) + ["cpu"]:
        engine = GenerationEngine(DATA / "llm", config, threads=0, device=device)
        engine.start()
        try:
            prompt = engine.tokenize("the quick brown fox jumps over the lazy dog " * 4)
            greedy = SamplingParams(max_tokens=64, temperature=0.0)
            tokens[device] = engine.generate(prompt, greedy).token_ids
            for streams in (1, 8):
                done: list[int] = []

                def one() -> None:
                    done.append(len(engine.generate(prompt, greedy).token_ids))

                started = time.perf_counter()
                threads = [threading.Thread(target=one) for _ in range(streams)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                rate = sum(done) / (time.perf_counter() - started)
                report.setdefault("llm", []).append({"device": device, "streams": streams,
                                                     "tokens_per_s": round(rate, 1)})
                print(f"  llm engine on {device:4s}, {streams} stream(s): {rate:>9,.1f} output tokens/s", flush=True)
        finally:
            engine.close()
    if cuda:
        same = tokens["cuda"] == tokens["cpu"]
        report["llm_same_tokens"] = same
        print(f"  greedy tokens on CUDA and CPU the same: {same}", flush=True)


class _Matrix:
    """Rows as ``split_out_of_memory`` takes them (num_rows, slice) over a float matrix."""

    def __init__(self, rows: Any) -> None:
        self.rows = rows
        self.num_rows = len(rows)

    def slice(self, offset: int, length: int) -> _Matrix:
        return _Matrix(self.rows[offset:offset + length])


def oom_check(cuda: bool, report: dict[str, Any]) -> None:
    """4: a real CUDA allocation failure (the arena capped) split until the batch fits, every row answered."""
    if not cuda:
        print("  skipped: no GPU")
        return
    import numpy as np

    from shardline.runtimes.base import split_out_of_memory

    rows = np.load(DATA / "rows.npy")
    roomy = _session(DATA / "mlp" / "model.onnx", "CUDAExecutionProvider")
    capped = _session(DATA / "mlp" / "model.onnx", "CUDAExecutionProvider",
                      {"gpu_mem_limit": 48 * 1024 * 1024, "arena_extend_strategy": "kSameAsRequested"})
    outputs = [o.name for o in capped.get_outputs()]
    splits: list[tuple[int, int]] = []

    def score(part: _Matrix) -> dict[str, Any]:
        return dict(zip(outputs, (np.asarray(o) for o in capped.run(None, _feeds(capped, part.rows)))))

    try:
        answer = split_out_of_memory(score, _Matrix(rows), lambda n, half: splits.append((n, half)))  # type: ignore[arg-type]
    except Exception as e:  # noqa: BLE001 - reported: what the check is for
        report["oom"] = {"handled": False, "error": f"{type(e).__name__}: {e}"[:300]}
        print(f"  NOT handled: {type(e).__name__}: {e}"[:400])
        return
    expected = roomy.run(None, _feeds(roomy, rows))[0]
    equal = bool((np.asarray(answer[outputs[0]]) == np.asarray(expected)).all())
    report["oom"] = {"handled": True, "splits": len(splits), "smallest": min((h for _, h in splits), default=len(rows)),
                     "answers_equal": equal}
    print(f"  65,536 rows under a 48 MiB arena: {len(splits)} split(s), down to "
          f"{report['oom']['smallest']:,} rows a call; answers equal to an uncapped session's: {equal}")


def run() -> int:
    try:
        import onnxruntime as ort
    except ImportError:
        print("onnxruntime is not installed here")
        return 2
    if not (DATA / "rows.npy").exists():
        print(f"no prepared models in {DATA}: run `bench/gpu_check.py --prepare` where the builders are installed, "
              "and carry bench/.data/gpu")
        return 2
    try:
        import torch

        cuda = torch.cuda.is_available()
        device = torch.cuda.get_device_name(0) if cuda else "none"
    except ImportError:
        torch, cuda, device = None, False, "torch not installed"
    cuda_ort = "CUDAExecutionProvider" in ort.get_available_providers()
    report: dict[str, Any] = {"gpu": device, "torch": getattr(torch, "__version__", None),
                              "onnxruntime": ort.__version__, "providers": ort.get_available_providers()}
    print(f"GPU: {device}; torch {report['torch']}; onnxruntime {ort.__version__} {report['providers']}")
    if not cuda:
        print("no GPU here: the CPU side only (the figures to compare with come from a GPU machine)")
    started = time.perf_counter()
    print("1-2. ONNX on CUDA and on the CPU; fp16", flush=True)
    onnx_checks(cuda and cuda_ort, report)
    print("3. the llm engine", flush=True)
    llm_checks(cuda, report)
    print("4. out of memory", flush=True)
    oom_check(cuda and cuda_ort, report)
    print(f"done in {time.perf_counter() - started:.0f} s")
    out = Path(os.environ.get("OUT", DATA))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true", help="build the models here (needs the dev setup)")
    args = parser.parse_args(argv)
    if args.prepare:
        prepare()
        return 0
    return run()


if __name__ == "__main__":
    sys.exit(main())
