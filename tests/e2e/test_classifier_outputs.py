"""A scikit-learn classifier converted with skl2onnx's defaults, as a user first converts one: string class labels,
probabilities through a ZipMap. `shardline model package` unwraps the ZipMap (saying so), the golden set's string
answers gate the promotion, and `shardline batch run` writes the species and the probabilities to the parts."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from tests.classifier_models import species_classifier

Shardline = Callable[..., subprocess.CompletedProcess[str]]


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_a_default_converted_classifier_of_string_labels_is_packaged_promoted_and_scored(
        shardline: Shardline, tmp_path: Path) -> None:
    model = species_classifier(tmp_path / "model")

    packaged = _ok(shardline("model", "package", str(model.onnx_file), "--name", "species", "--signature-from",
                             str(model.rows), "--exclude", "species", "--golden", str(model.rows), "--label", "species",
                             "--prediction", "output_label", "--threshold", "0.9", "--out", str(tmp_path / "bundle")))
    assert ("note: output 'output_probability' was a ZipMap (a map a row): packaged as its probability tensor, a column "
            "a class in the order setosa, versicolor, virginica") in packaged
    assert "out: output_label:string, output_probability:fixed_size_list<float32>[3]" in packaged

    _ok(shardline("model", "push", str(tmp_path / "bundle")))
    promoted = _ok(shardline("model", "promote", "species:1", "--to", "prod"))
    assert "gate evaluation" in promoted and "species@prod -> species:1" in promoted
    # the excluded label is profiled too (drift compares it where current data has it), and counted apart
    assert ("4 inputs and 4 output columns profiled over 150 rows, besides 1 column the model does not read "
            "('species')") in promoted

    shards = tmp_path / "in"
    shards.mkdir()
    for i, part in enumerate(np.array_split(np.arange(len(model.features)), 2)):
        pq.write_table(pa.table({"id": part, **{n: model.features[part, j] for j, n in enumerate(model.names)}}),
                       shards / f"part-{i}.parquet")
    _ok(shardline("batch", "run", "--model", "species@prod", "--input", str(shards), "--output", str(tmp_path / "out")))

    scored = ds.dataset(tmp_path / "out", format="parquet").to_table().sort_by("id")
    assert scored.schema.field("output_label").type == pa.string()
    assert scored.column("output_label").to_pylist() == model.estimator.predict(model.features).tolist()
    probabilities = np.array(scored.column("output_probability").to_pylist())
    np.testing.assert_allclose(probabilities, model.estimator.predict_proba(model.features), atol=1e-5)


def test_a_golden_set_comparing_an_output_the_model_lacks_names_the_one_to_pass(
        shardline: Shardline, tmp_path: Path) -> None:
    model = species_classifier(tmp_path / "model")
    package = ["model", "package", str(model.onnx_file), "--name", "species", "--signature-from", str(model.rows),
               "--exclude", "species", "--golden", str(model.rows), "--label", "species", "--out",
               str(tmp_path / "bundle")]

    refused = shardline(*package)  # --prediction left at its default, 'label'; skl2onnx names it output_label

    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        "error: the golden set compares output 'label', which the model does not have (its outputs: 'output_label', "
        "'output_probability'); pass --prediction output_label, the output that holds its answers"]
    assert not (tmp_path / "bundle").exists()
    _ok(shardline(*package, "--prediction", "output_label"))  # what it said to do works
