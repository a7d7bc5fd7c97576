"""`shardline model ...` as an ML engineer drives it: package, push, promote, show, roll back."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq
import pytest

from shardline.build.examples import breast_cancer, golden_table, split

from tests.conftest import BuiltModel

Shardline = Callable[..., subprocess.CompletedProcess[str]]


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_package_push_promote_show_and_roll_back(shardline: Shardline, breast_cancer_model: BuiltModel, tmp_path: Path) -> None:
    train, held_out = split(breast_cancer())
    pq.write_table(golden_table(train), tmp_path / "train.parquet")
    pq.write_table(golden_table(held_out), tmp_path / "golden.parquet")
    onnx_file = breast_cancer_model.bundle_dir / "model.onnx"

    packaged = _ok(shardline(
        "model", "package", str(onnx_file), "--name", "churn", "--signature-from", str(tmp_path / "train.parquet"),
        "--exclude", "target", "--golden", str(tmp_path / "golden.parquet"), "--threshold", "0.9",
        "--source-commit", "abc123", "--tag", "team=risk", "--out", str(tmp_path / "churn-bundle"),
    ))
    assert "packaged churn" in packaged and "out: label:int64, probabilities:fixed_size_list<float32>[2]" in packaged

    assert "pushed churn:1" in _ok(shardline("model", "push", str(tmp_path / "churn-bundle")))
    promoted = _ok(shardline("model", "promote", "churn:1", "--to", "staging", "--reason", "first cut"))
    assert "gate evaluation" in promoted and "churn@staging -> churn:1" in promoted

    shown = json.loads(_ok(shardline("model", "show", "churn@staging")))
    assert shown["version"] == 1 and shown["aliases"] == ["staging"]
    assert shown["lineage"]["source_commit"] == "abc123" and len(shown["lineage"]["training_data_digest"]) == 64
    assert {a["role"] for a in shown["artifacts"]} == {"model", "golden", "profile"}
    assert all(len(a["sha256"]) == 64 for a in shown["artifacts"])
    assert shown["evaluation"]["metric"] == "accuracy" and shown["tags"] == {"team": "risk"}
    assert "python" in shown["environment"]

    assert "churn:1" in _ok(shardline("model", "search", "--tag", "team=risk"))

    # staging is protected: once set, `alias` cannot move it
    refused = shardline("model", "alias", "churn", "staging", "1")
    assert refused.returncode == 2 and "moves only through `shardline model promote" in refused.stderr

    # a second version with a stricter threshold than the model reaches is refused by its gate
    _ok(shardline(
        "model", "package", str(onnx_file), "--name", "churn", "--signature-from", str(tmp_path / "train.parquet"),
        "--exclude", "target", "--golden", str(tmp_path / "golden.parquet"), "--threshold", "0.9999",
        "--out", str(tmp_path / "strict"),
    ))
    assert "pushed churn:2" in _ok(shardline("model", "push", str(tmp_path / "strict")))
    strict = shardline("model", "promote", "churn:2", "--to", "staging")
    assert strict.returncode == 1 and "gate evaluation refused" in strict.stderr

    # with a reachable bar it goes through; rollback returns to :1; history tells it all
    _ok(shardline(
        "model", "package", str(onnx_file), "--name", "churn", "--signature-from", str(tmp_path / "train.parquet"),
        "--exclude", "target", "--golden", str(tmp_path / "golden.parquet"), "--threshold", "0.93",
        "--out", str(tmp_path / "v3"),
    ))
    assert "pushed churn:3" in _ok(shardline("model", "push", str(tmp_path / "v3")))
    assert "churn@staging -> churn:3 (was churn:1)" in _ok(shardline("model", "promote", "churn:3", "--to", "staging"))
    rolled = _ok(shardline("model", "rollback", "churn", "--alias", "staging", "--reason", "latency"))
    assert "churn@staging -> churn:1 (was churn:3)" in rolled
    history = _ok(shardline("model", "history", "churn@staging")).splitlines()  # as a reference is written too
    assert [line.split()[3:5] for line in history] == [["promote", "churn:1"], ["promote", "churn:3"], ["rollback", "churn:1"]]
    assert "first cut" in history[0] and "latency" in history[2]
    again = shardline("model", "rollback", "churn", "--alias", "dev")
    assert again.returncode == 2 and "churn@dev was never set" in again.stderr
    # the runbooks' `shardline model rollback MODEL@prod`; a version or two aliases are one line
    assert "churn@dev was never set" in shardline("model", "rollback", "churn@dev").stderr
    for words, said in [(["churn:3"], "'churn:3' names a version; this command takes an alias: give the model as "
                                      "churn or churn@ALIAS"),
                        (["churn@staging", "--alias", "dev"], "'churn@staging' and --alias dev name two aliases")]:
        wrong = shardline("model", "rollback", *words)
        assert wrong.returncode == 2 and wrong.stderr.strip() == f"error: {said}" + ("; give one" if "two" in said else "")


def test_a_refused_package_writes_nothing(shardline: Shardline, breast_cancer_model: BuiltModel, tmp_path: Path) -> None:
    # A name the registry refuses came back as pydantic's traceback, after model.onnx was copied into the folder: the
    # second try then said the folder was not empty.
    onnx_file = breast_cancer_model.bundle_dir / "model.onnx"
    refused = shardline("model", "package", str(onnx_file), "--name", "Churn_Bad", "--out", str(tmp_path / "b"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "error: model name 'Churn_Bad' is not allowed; use 1-64 lower-case letters, digits, '.', '_' or '-', "
        "starting with a letter or digit"]
    assert not (tmp_path / "b").exists()
    pq.write_table(golden_table(breast_cancer()), tmp_path / "sample.parquet")
    typo = shardline("model", "package", str(onnx_file), "--name", "churn", "--signature-from",
                     str(tmp_path / "sample.parquet"), "--exclude", "targt", "--out", str(tmp_path / "b"))
    assert typo.returncode == 2 and len(typo.stderr.strip().splitlines()) == 1, typo.stderr
    assert "error: --exclude 'targt' is not a column of the sample (did you mean 'target'?" in typo.stderr
    assert not (tmp_path / "b").exists()

    # refused after the model was copied in (a golden set without its label column): the new folder goes too
    pq.write_table(golden_table(breast_cancer()).drop(["target"]), tmp_path / "golden.parquet")
    late = shardline("model", "package", str(onnx_file), "--name", "churn", "--golden", str(tmp_path / "golden.parquet"),
                     "--out", str(tmp_path / "b"))
    assert late.returncode == 2 and "the golden set has no column ['target']" in late.stderr, late.stderr
    assert not (tmp_path / "b").exists()
    assert "packaged churn" in _ok(shardline("model", "package", str(onnx_file), "--name", "churn",
                                             "--out", str(tmp_path / "b")))


def test_a_golden_set_that_cannot_feed_the_model_is_refused_at_package_and_at_promote(
        shardline: Shardline, breast_cancer_model: BuiltModel, tmp_path: Path) -> None:
    """Packaging refuses a golden set the model cannot read (one line, exit 2); a bundle made without that check
    (an older Shardline, or by hand) is refused by promote's evaluation gate, in one line and without a
    traceback."""
    from shardline.bundle import describe_artifact, read_manifest, write_manifest

    onnx_file = breast_cancer_model.bundle_dir / "model.onnx"
    train, held_out = split(breast_cancer())
    pq.write_table(golden_table(train), tmp_path / "train.parquet")
    pq.write_table(golden_table(held_out).drop(["mean radius"]), tmp_path / "unfit.parquet")
    refused = shardline("model", "package", str(onnx_file), "--name", "churn", "--signature-from",
                        str(tmp_path / "train.parquet"), "--exclude", "target", "--golden", str(tmp_path / "unfit.parquet"),
                        "--out", str(tmp_path / "unfit"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "error: the golden set cannot feed the model: column 'mean radius' is missing; the model 'churn' needs it "
        "(float32); add it or pick the model this data was made for (a golden set holds the model's input columns, "
        "as its signature names them, and the label)"]
    assert not (tmp_path / "unfit").exists()

    folder = breast_cancer_model.bundle_dir.parent / "unfit-by-hand"
    shutil.copytree(breast_cancer_model.bundle_dir, folder)
    pq.write_table(pq.read_table(folder / "golden.parquet").drop(["mean radius"]), folder / "golden.parquet")
    manifest = read_manifest(folder)
    write_manifest(folder, manifest.model_copy(update={"artifacts": [
        describe_artifact(folder, "golden.parquet", role="golden") if a.role == "golden" else a
        for a in manifest.artifacts]}))
    assert "pushed" in _ok(shardline("model", "push", str(folder)))
    promoted = shardline("model", "promote", "breast-cancer:1", "--to", "staging")
    assert promoted.returncode == 1 and "Traceback" not in promoted.stderr, promoted.stderr
    error = [line for line in promoted.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and "gate evaluation refused" in error[0], promoted.stderr
    assert "golden set 'golden.parquet' cannot feed the model: column 'mean radius' is missing" in error[0]


def test_a_pickle_or_other_bytes_given_as_the_model_is_one_line(shardline: Shardline, tmp_path: Path) -> None:
    """A pickled estimator (named .pkl, or .onnx) or bytes that are no ONNX model: one `error:` line and exit 2, not
    onnx's protobuf traceback."""
    import pickle

    (tmp_path / "model.pkl").write_bytes(pickle.dumps({"a": 1}, protocol=4))
    (tmp_path / "disguised.onnx").write_bytes(pickle.dumps({"a": 1}, protocol=5))
    (tmp_path / "hello.onnx").write_bytes(b"hello")
    for model, message in (
            ("model.pkl", "model.pkl is a pickle, which bundles never hold (loading one runs its code); export the "
                          "model to ONNX (scikit-learn: skl2onnx's to_onnx; PyTorch: torch.onnx.export)"),
            ("disguised.onnx", "disguised.onnx is a pickle, which bundles never hold"),
            ("hello.onnx", "hello.onnx is not an ONNX model (Error parsing message with type 'onnx.ModelProto'")):
        refused = shardline("model", "package", str(tmp_path / model), "--name", "ct", "--out", str(tmp_path / "ct"))
        assert refused.returncode == 2, refused.stderr
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], refused.stderr
        assert not (tmp_path / "ct").exists()


def test_optimize_profile_and_place(shardline: Shardline, tmp_path: Path) -> None:
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from shardline.build.packaging import GoldenSet, package_sklearn

    data = breast_cancer()
    mlp = make_pipeline(StandardScaler(), MLPClassifier((32,), max_iter=1000, random_state=0)).fit(data.features, data.labels)
    golden = GoldenSet(golden_table(data), "target", "accuracy", "label", 0.95, max_variant_delta=0.02)
    package_sklearn(mlp, tmp_path / "mlp", name="mlp", feature_names=data.names, golden=golden)
    _ok(shardline("model", "push", str(tmp_path / "mlp")))

    optimized = _ok(shardline("model", "optimize", "mlp:1", "--quantize", "int8"))
    assert optimized.startswith("mlp:1#int8: int8 for cpu") and "accuracy" in optimized and "vs fp32" in optimized
    refused = shardline("model", "optimize", "mlp:1", "--quantize", "int4")
    assert refused.returncode == 2 and "precision 'int4' is not one Shardline makes" in refused.stderr

    for variant in ([], ["--variant", "int8"]):
        profiled = _ok(shardline("model", "profile", "mlp:1", *variant, "--batch-sizes", "1,256", "--seconds", "0.1"))
        assert "batch      1:" in profiled and "rows/s" in profiled
    shown = json.loads(_ok(shardline("model", "show", "mlp:1")))
    assert set(shown["variants"]) == {"int8"} and len(shown["profiles"]) == 2

    placed = _ok(shardline("model", "place", "mlp:1", "--p99-ms", "50", "--rps", "100"))
    assert "cpu" in placed
    impossible = shardline("model", "place", "mlp:1", "--p99-ms", "0.000001", "--rps", "100")
    assert impossible.returncode == 2 and "error:" in impossible.stderr
    # priced by the one price table (`cost report`'s): twice the core-hour, half the rows/s per unit of cost
    per_cost = []
    for core_hour in (1.0, 2.0):
        table = tmp_path / f"prices-{core_hour}.yaml"
        table.write_text(f"currency: USD\nclasses:\n  cpu: {{unit: core, on-demand: {core_hour}}}\n")
        line = _ok(shardline("model", "place", "mlp:1", "--rows-per-s", "1000", "--prices", str(table)))
        found = re.search(r"([\d,]+) rows/s per unit of cost/h", line)
        assert found, line
        per_cost.append(float(found.group(1).replace(",", "")))
    assert per_cost[0] == pytest.approx(2 * per_cost[1], rel=0.01)
    gpus_only = tmp_path / "gpus.yaml"
    gpus_only.write_text("classes:\n  h200: {unit: gpu, on-demand: 4.0}\n")
    unpriced = shardline("model", "place", "mlp:1", "--rows-per-s", "1000", "--prices", str(gpus_only))
    assert unpriced.returncode == 2 and "no price for machine kind 'cpu-" in unpriced.stderr, unpriced.stderr
    assert len(unpriced.stderr.strip().splitlines()) == 1
