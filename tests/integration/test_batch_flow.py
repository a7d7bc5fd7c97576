"""The batch flow end to end on a real LocalCluster under Prefect's test harness."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from shardline.flows.batch_inference import batch_inference
from shardline.storage.capture import scan_capture

from shardline.storage.registry import ModelRegistry

from tests.classifier_models import REVIEWS, review_classifier
from tests.conftest import BuiltModel


def run(input_uri: Path | str, output_uri: Path | str, model: str = "breast-cancer@prod", **kwargs):  # type: ignore[no-untyped-def]
    return batch_inference(model=model, input_uri=str(input_uri), output_uri=str(output_uri), return_state=True, **kwargs)


def scored_table(output: Path) -> pa.Table:
    return ds.dataset(output, format="parquet").to_table()


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_every_row_scored_once_with_sklearns_prediction(
    input_shards: Path, tmp_path: Path, breast_cancer_model: BuiltModel
) -> None:
    out = tmp_path / "out"
    state = run(input_shards, out, tenant="acme")

    assert state.is_completed() and state.name == "Completed"
    summary = state.result()
    assert (summary["shards"], summary["shards_committed"], summary["shards_quarantined"]) == (6, 6, 0)
    assert summary["rows_in"] == summary["rows_out"] == 12_000

    inputs = ds.dataset(input_shards).to_table().sort_by("id")
    scored = scored_table(out).sort_by("id")
    assert scored.num_rows == 12_000
    assert scored.column("id").to_pylist() == inputs.column("id").to_pylist()
    labels, probabilities = breast_cancer_model.expected(inputs)
    assert np.array_equal(scored.column("label").to_numpy(), labels)
    got = np.stack(scored.column("probabilities").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(got, probabilities, atol=1e-5)

    # one part per shard, named after it; the manifest lists each with its rows
    assert sorted(p.name for p in out.glob("*.parquet")) == sorted(p.name for p in input_shards.glob("*.parquet"))
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["tenant"] == "acme" and manifest["model"]["pinned"] == "breast-cancer:1"
    assert sum(p["rows"] for p in manifest["parts"]) == 12_000 and manifest["quarantined"] == []
    assert (out / "_SUCCESS").exists() and not (out / "_staging").exists()
    # passthrough by default: the id, not the features
    assert scored.column_names == ["id", "label", "probabilities"]


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_decimal_columns_as_a_warehouse_exports_them_are_scored_as_their_floats(
    input_shards: Path, tmp_path: Path, breast_cancer_model: BuiltModel, shardline_home: Path
) -> None:
    # Spark, Snowflake and BigQuery write DECIMAL columns to Parquet as decimal128: cast to the model's floats, as
    # scikit-learn casts pandas' Decimal objects (the bundle has a reference profile: its data contract runs too)
    exported = tmp_path / "exported"
    exported.mkdir()
    for shard in sorted(input_shards.glob("*.parquet"))[:1]:
        table = pq.read_table(shard)
        for name in ("mean radius", "worst area"):
            index = table.schema.get_field_index(name)
            table = table.set_column(index, name, table.column(name).cast(pa.decimal128(16, 6)))
        pq.write_table(table, exported / shard.name)

    state = run(exported, tmp_path / "out")

    assert state.is_completed() and state.name == "Completed", state.message
    inputs = ds.dataset(exported).to_table().sort_by("id")
    as_floats = inputs.set_column(inputs.schema.get_field_index("mean radius"), "mean radius",
                                  inputs.column("mean radius").cast(pa.float64()))
    as_floats = as_floats.set_column(as_floats.schema.get_field_index("worst area"), "worst area",
                                     as_floats.column("worst area").cast(pa.float64()))
    labels, _ = breast_cancer_model.expected(as_floats)
    scored = scored_table(tmp_path / "out").sort_by("id")
    assert scored.num_rows == inputs.num_rows and np.array_equal(scored.column("label").to_numpy(), labels)
    # capture keeps what the model read, so drift checks compare floats with the reference profile's floats
    captured = scan_capture(str(shardline_home / "capture"), "breast-cancer").collect()
    assert captured.height > 0 and str(captured.schema["mean radius"]) == "Float32"


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_the_run_graph_links_each_step_to_the_one_whose_plan_it_takes(input_shards: Path, tmp_path: Path) -> None:
    # The plan goes to each task whole (``tasks.arguments.whole``: Prefect does not walk its records), and the
    # Prefect UI's graph still shows plan -> validate -> infer-shards -> commit.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    state = run(input_shards, tmp_path / "out")
    assert state.is_completed()
    with get_client(sync_client=True) as client:
        flow_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        runs = client.read_task_runs(flow_run_filter=flow_run)
    by_name = {r.name.rsplit("-", 1)[0]: r for r in runs}
    assert {"plan", "validate", "infer-shards", "commit"} <= set(by_name), sorted(by_name)
    for step, upstream in (("validate", "plan"), ("infer-shards", "validate"), ("commit", "infer-shards")):
        linked = {getattr(i, "id", None) for i in by_name[step].task_inputs["plan"]}
        assert linked == {by_name[upstream].id}, (step, by_name[step].task_inputs)


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_second_run_commits_nothing_new(input_shards: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run(input_shards, out).is_completed()
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")}

    again = run(input_shards, out).result()

    assert again["shards_skipped"] == 6 and again["rows_scored"] == 0
    assert again["rows_out"] == 12_000
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")} == before


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_changed_shard_is_scored_again_and_others_skipped(input_shards: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run(input_shards, out)
    shard = input_shards / "part-00002.parquet"
    table = pq.read_table(shard).slice(0, 700)
    pq.write_table(table, shard)

    summary = run(input_shards, out).result()

    assert summary["shards_skipped"] == 5 and summary["rows_scored"] == 700
    assert pq.read_metadata(out / "part-00002.parquet").num_rows == 700
    assert scored_table(out).num_rows == 10_700


@pytest.fixture(scope="module")
def review_bundles(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The text model with a reference profile (its jobs check a data contract) and without one."""
    folder = tmp_path_factory.mktemp("reviews")
    return [review_classifier(folder, "reviews", profiled=True),
            review_classifier(folder, "reviews-unprofiled", profiled=False)]


def _text_column(texts: list[str], layout: str) -> pa.Array:
    if layout == "string_view":  # as pyarrow writes a string_view array
        return pa.array(texts).cast(pa.string_view())
    if layout == "dictionary":  # as pandas writes a `category` column
        return pa.array(texts).dictionary_encode().cast(pa.dictionary(pa.int16(), pa.string()))
    raise AssertionError(layout)


@pytest.mark.parametrize("layout", ["string_view", "dictionary"])
@pytest.mark.parametrize("model", ["reviews@prod", "reviews-unprofiled@prod"])
@pytest.mark.usefixtures("on_cluster")
def test_text_in_another_arrow_layout_is_scored_as_string(
    local_registry: ModelRegistry, review_bundles: list[Path], shardline_home: Path, tmp_path: Path, layout: str,
    model: str,
) -> None:
    # The schema check takes these columns: the data contract, the row check and capture read them as strings
    # (capture's sample once failed every shard of a job without a profile, and the contract quarantined a job
    # with one for "column 'text' holds str, the model takes one of ['str', 'object']"; a dictionary was
    # quarantined as "column 'text' is dictionary<values=string, indices=int16>, the model expects string").
    for bundle in review_bundles:
        pushed = local_registry.push(bundle)
        local_registry.set_alias(pushed.name, "prod", pushed.version or 1)
    texts = (REVIEWS * 63)[:500]
    shards = tmp_path / "in"
    shards.mkdir()
    pq.write_table(pa.table({"id": np.arange(500), "text": _text_column(texts, layout)}), shards / "reviews.parquet")
    out = tmp_path / "out"

    state = run(shards, out, model=model)

    assert state.is_completed() and state.name == "Completed", state.message
    summary = state.result()
    assert (summary["rows_in"], summary["rows_out"], summary["shards_quarantined"]) == (500, 500, 0)
    import onnxruntime as ort

    session = ort.InferenceSession(str(review_bundles[0] / "model.onnx"), providers=["CPUExecutionProvider"])
    labels = session.run(["output_label"], {"text": np.array(texts, dtype=object).reshape(-1, 1)})[0]
    scored = scored_table(out).sort_by("id")
    assert scored.column("output_label").to_pylist() == labels.tolist()
    captured = ds.dataset(shardline_home / "capture", format="parquet").to_table()
    assert captured.num_rows == 500 and captured.column("text").to_pylist()[:3] == texts[:3]


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_by_default_the_first_shards_other_columns_are_every_parts_and_a_shard_without_them_is_quarantined(
    input_shards: Path, tmp_path: Path
) -> None:
    # one job writes one set of columns: parts of differing columns in one folder read as one dataset with nulls
    # (and a later job with another --passthrough is refused for exactly that)
    table = pq.read_table(input_shards / "part-00000.parquet")
    shards = tmp_path / "in"
    shards.mkdir()
    pq.write_table(table.slice(0, 500), shards / "a.parquet")
    pq.write_table(table.slice(500, 500).drop_columns(["id"]), shards / "b.parquet")
    pq.write_table(table.slice(1_000, 500).append_column("site", pa.array(["north"] * 500)), shards / "c.parquet")
    moved = table.slice(1_500, 500)
    pq.write_table(moved.select([*moved.column_names[1:], "id"]), shards / "d.parquet")  # the same, in another order
    out = tmp_path / "out"

    state = run(shards, out)

    assert state.name == "Quarantined", state.message
    summary = state.result()
    assert (summary["rows_in"], summary["rows_out"], summary["rows_quarantined"]) == (2_000, 1_000, 1_000)
    reasons = {Path(q["shard"]).name: q["reason"]
               for q in json.loads((out / "_manifest.json").read_text())["quarantined"]}
    assert reasons == {
        "b.parquet": "SchemaMismatch: the shard's columns besides the model's are [], the job's (from its first "
                     "shard a.parquet) are ['id']; one job's parts hold one set of columns: name the columns to keep "
                     "with --passthrough (they have none in common), or score these shards in a job of their own",
        "c.parquet": "SchemaMismatch: the shard's columns besides the model's are ['id', 'site'], the job's (from its "
                     "first shard a.parquet) are ['id']; one job's parts hold one set of columns: name the columns to "
                     "keep with --passthrough (both have ['id']), or score these shards in a job of their own",
    }
    assert {pq.read_schema(p).names[0] for p in out.glob("*.parquet")} == {"id"}
    scored = scored_table(out)
    assert scored.column_names == ["id", "label", "probabilities"]
    assert sorted(scored.column("id").to_pylist()) == sorted([*range(0, 500), *range(1_500, 2_000)])


@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_named_passthrough_columns_are_copied(input_shards: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    state = run(input_shards, out, passthrough=["id", "mean radius"], batch_rows=300)
    scored = scored_table(out).sort_by("id")
    inputs = ds.dataset(input_shards).to_table().sort_by("id")
    assert state.is_completed()
    assert scored.column_names == ["id", "mean radius", "label", "probabilities"]
    assert scored.column("mean radius").equals(inputs.column("mean radius"))


@pytest.mark.parametrize("footers", ["read by the flow", "left to the workers"])
@pytest.mark.usefixtures("on_cluster", "local_registry")
def test_an_input_column_named_like_an_output_is_told_and_the_parts_hold_the_models(
    input_shards: Path, tmp_path: Path, breast_cancer_model: BuiltModel, footers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A `label` of known answers in the input: auto passthrough leaves it out (the part holds the model's label),
    # and the run says so once, in its summary, whether the flow reads the footers (small jobs) or not (large ones).
    if footers == "left to the workers":
        monkeypatch.setattr("shardline.tasks.batch.FLOW_FOOTER_CHECK_MAX", 0)
    shards = tmp_path / "in"
    shards.mkdir()
    for shard in sorted(input_shards.glob("*.parquet"))[:2]:
        table = pq.read_table(shard)
        pq.write_table(table.append_column("label", pa.array(np.full(table.num_rows, 7), pa.int64())), shards / shard.name)
    out = tmp_path / "out"

    summary = run(shards, out).result()

    assert summary["shadowed_columns"] == ["label"] and summary["rows_out"] == 4_000
    scored = scored_table(out).sort_by("id")
    inputs = ds.dataset(shards).to_table().sort_by("id")
    assert scored.column_names == ["id", "label", "probabilities"]
    labels, _ = breast_cancer_model.expected(inputs)
    assert np.array_equal(scored.column("label").to_numpy(), labels) and 7 not in set(labels.tolist())

    # named passthrough columns: nothing is left out that was not asked for, so nothing to tell
    named = run(shards, tmp_path / "named", passthrough=["id"]).result()
    assert named["shadowed_columns"] == []

    if footers == "read by the flow":  # every footer read: a column only a later shard has is told too
        later = tmp_path / "later"
        later.mkdir()
        for i, shard in enumerate(sorted(input_shards.glob("*.parquet"))[:2]):
            table = pq.read_table(shard)
            if i == 1:
                table = table.append_column("label", pa.array(np.full(table.num_rows, 7), pa.int64()))
            pq.write_table(table, later / shard.name)
        assert run(later, tmp_path / "later-out").result()["shadowed_columns"] == ["label"]
