"""Shard listing and reading, and the per-shard scoring that runs on Dask workers."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardline.errors import EmptyInput, InvalidInput, InvalidSetting
from shardline.runtimes import RuntimeOptions
from shardline.storage.job_identity import job_id, job_key, summarize
from shardline.storage.output import OutputLayout, PartRecord, check_part_names, part_name, split_done
from shardline.storage.registry import ModelRegistry
from shardline.storage.scoring import ScoringJob, ShardCapture, check_passthrough_present, score_shard
from shardline.storage.shards import ShardInfo, dictionary_columns, iter_batches, list_shards, read_footer
from tests.conftest import BuiltModel


def test_listing_skips_hidden_and_foreign_files(tmp_path: Path, input_shards: Path) -> None:
    (input_shards / "_SUCCESS").write_text("")
    (input_shards / ".part-x.parquet.crc").write_text("")
    (input_shards / "notes.txt").write_text("")
    (input_shards / "_tmp").mkdir()
    (input_shards / "_tmp" / "half.parquet").write_bytes(b"")
    (input_shards / "2024").mkdir()
    pq.write_table(pa.table({"id": [1]}), input_shards / "2024" / "late.pq")

    shards = list_shards(str(input_shards))

    assert [s.relative for s in shards] == ["2024/late.pq"] + [f"part-{i:05d}.parquet" for i in range(6)]
    assert all(s.uri.startswith("file://") and s.size > 0 for s in shards)
    single = list_shards(str(input_shards / "part-00001.parquet"))
    assert [s.relative for s in single] == ["part-00001.parquet"]


def test_empty_and_missing_inputs_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(EmptyInput, match="holds no shard .*point --input at the folder"):
        list_shards(str(tmp_path))
    with pytest.raises(InvalidSetting, match="does not exist; check the path"):
        list_shards(str(tmp_path / "nope"))
    with pytest.raises(InvalidSetting, match="cannot be opened|not installed"):
        list_shards("nosuchscheme://bucket/x")


def test_batches_are_bounded_and_complete(input_shards: Path) -> None:
    parquet = pq.ParquetFile(input_shards / "part-00000.parquet")
    sizes = [b.num_rows for b in iter_batches(parquet, ["id"], 300)]
    assert max(sizes) <= 300 and sum(sizes) == 2_000
    ids = [i for b in iter_batches(parquet, ["id"], 300, prefetch=0) for i in b.column("id").to_pylist()]
    assert ids == list(range(2_000))


def test_readers_stopped_early_let_their_thread_go_and_the_next_shard_reuses_it(input_shards: Path) -> None:
    parquet = pq.ParquetFile(input_shards / "part-00000.parquet")
    for _ in range(30):  # a shard quarantined after its first batch, thirty times
        batches = iter_batches(parquet, ["id"], 100)  # 20 batches: the reader is blocked on the full queue
        assert next(batches).num_rows == 100
        batches.close()

    readers = [t for t in threading.enumerate() if t.name.startswith("shard-read")]
    assert 1 <= len(readers) < 5  # kept and reused: not one a shard, none blocked for good
    whole = [i for b in iter_batches(parquet, ["id"], 300) for i in b.column("id").to_pylist()]
    assert whole == list(range(2_000))


def test_reader_errors_reach_the_consumer(tmp_path: Path) -> None:
    class Exploding:
        def iter_batches(self, **kwargs):  # type: ignore[no-untyped-def]
            yield pa.record_batch({"a": [1]})
            raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        list(iter_batches(Exploding(), ["a"], 10))  # type: ignore[arg-type]


def test_part_names_follow_shards_and_collisions_are_refused() -> None:
    assert part_name("2024/a.pq") == "2024/a.parquet"
    shards = [ShardInfo("file:///x/a.pq", "a.pq", 1, "f"), ShardInfo("file:///x/a.parquet", "a.parquet", 1, "f")]
    with pytest.raises(InvalidInput, match="would both write 'a.parquet'; rename one"):
        check_part_names(shards)


def _record(relative: str, status: str = "committed", key: str = "k", fp: str = "f", rows: int = 10) -> PartRecord:
    return PartRecord(
        shard=relative, relative=relative, fingerprint=fp, job_key=key, status=status,  # type: ignore[arg-type]
        rows_in=rows, rows_out=rows if status == "committed" else 0,
        rows_quarantined=rows if status == "quarantined" else 0, seconds=1.0,
    )


def test_split_done_trusts_only_matching_records_with_present_parts() -> None:
    shards = [ShardInfo(f"u/{n}", n, 1, "f") for n in ("a.parquet", "b.parquet", "c.parquet", "d.parquet", "e.parquet")]
    ledger = {
        "a.parquet": _record("a.parquet"),
        "b.parquet": _record("b.parquet", key="other-model"),
        "c.parquet": _record("c.parquet", fp="changed"),
        "d.parquet": _record("d.parquet"),  # its part was deleted
        "e.parquet": _record("e.parquet", status="quarantined"),
    }
    todo, done = split_done(shards, ledger, "k", {"a.parquet", "b.parquet", "c.parquet"})
    assert [s.relative for s in todo] == ["b.parquet", "c.parquet", "d.parquet"]
    assert [r.relative for r in done] == ["a.parquet", "e.parquet"]


def test_job_identity_and_summary_arithmetic() -> None:
    shards = [ShardInfo("u/a", "a", 1, "f1")]
    key = job_key("digest", None)
    assert key != job_key("digest", ["id"]) and key != job_key("other", None)
    assert job_id(key, shards) != job_id(key, [ShardInfo("u/a", "a", 1, "f2")])
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    new = [_record("a", rows=100), _record("b", rows=300), _record("q", status="quarantined", rows=50)]
    new[0].settled_at, new[1].settled_at = t0 + timedelta(seconds=1), t0 + timedelta(seconds=4)
    summary = summarize(job_id="j", model="m:1", tenant="t", output="o", total_shards=4, new=new, skipped=[_record("s", rows=7)])
    assert (summary.rows_in, summary.rows_out, summary.rows_quarantined) == (457, 407, 50)
    assert summary.rows_in == summary.rows_out + summary.rows_quarantined
    assert summary.rows_scored == 400 and summary.steady_seconds == pytest.approx(4.0)
    assert summary.steady_rows_per_second == pytest.approx(100.0)
    assert summary.quarantined == {"q": ""}


@pytest.fixture
def scoring_job(breast_cancer_model: BuiltModel, tmp_path: Path) -> ScoringJob:
    registry = ModelRegistry(str(tmp_path / "registry"))
    registry.push(breast_cancer_model.bundle_dir)
    model = registry.resolve("breast-cancer:1")
    return ScoringJob(
        job_key=job_key(model.outputs_digest, None), model=model, output_uri=str(tmp_path / "out"),
        passthrough=None, batch_rows=700, cache_dir=str(tmp_path / "cache"), runtime=RuntimeOptions("cpu", 1),
    )


def _shard(path: Path) -> ShardInfo:
    return list_shards(str(path))[0]


def test_score_shard_commits_a_part_and_records_it(
    scoring_job: ScoringJob, input_shards: Path, breast_cancer_model: BuiltModel
) -> None:
    record = score_shard(scoring_job, _shard(input_shards / "part-00003.parquet"))

    assert (record.status, record.rows_in, record.rows_out) == ("committed", 2_000, 2_000)
    part = pq.read_table(record.part.removeprefix("file://"))
    labels, _ = breast_cancer_model.expected(pq.read_table(input_shards / "part-00003.parquet"))
    assert np.array_equal(part.column("label").to_numpy(), labels)
    assert pq.ParquetFile(record.part.removeprefix("file://")).metadata.num_row_groups >= 1
    layout = OutputLayout(scoring_job.output_uri)
    assert layout.read_ledger()["part-00003.parquet"].status == "committed"
    assert layout.present_parts() == {"part-00003.parquet"}
    assert not list(Path(layout.staging_dir).glob("*"))


def test_batches_stacked_into_the_workers_kept_matrices_score_as_their_own_rows(
    scoring_job: ScoringJob, breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    """A worker thread stacks every batch into one of two matrices it keeps from batch to batch and shard to shard
    of a task (``MatrixScratch``), while the batch before is still being written: each part holds its own rows'
    answers, as scikit-learn gives them, over shards of several batches and of one. The task lets them go."""
    from shardline.build.examples import write_shards
    from shardline.storage import scoring
    from shardline.tasks.dispatch import score_group

    write_shards(tmp_path / "in", 2, 6_000, row_group_rows=500)
    for path in write_shards(tmp_path / "short", 3, 1_500, row_group_rows=500, seed=9):
        path.rename(tmp_path / "in" / f"short-{path.name}")
    job = dataclasses.replace(scoring_job, batch_rows=1_500)  # past the 1,024 rows from which batches are stacked
    shards = list_shards(str(tmp_path / "in"))  # part-00000, part-00001, then short-part-00000 ... 00002
    settled = score_group(job, shards)
    assert getattr(scoring._SCRATCH, "matrices", None) is None  # let go with the task
    for shard, (record, error) in zip(shards, settled):
        assert error is None and record is not None and record.status == "committed"
        part = pq.read_table(record.part.removeprefix("file://"))
        labels, probabilities = breast_cancer_model.expected(pq.read_table(shard.uri.removeprefix("file://")))
        assert np.array_equal(part.column("label").to_numpy(), labels)
        scored = np.stack(part.column("probabilities").to_numpy(zero_copy_only=False))
        np.testing.assert_allclose(scored, probabilities, atol=1e-5)


def _write(path: Path, table: pa.Table) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("nulls", "NullValues: columns \\['mean radius'\\] hold nulls .*fill or drop those rows"),
        ("nan", "NonFiniteValues: columns \\['mean radius'\\] hold NaN or infinite values .*declares non_finite"),
        ("inf", "NonFiniteValues: columns \\['mean radius'\\] hold NaN or infinite values \\(\\{'mean radius': 2\\}"),
        ("string", "SchemaMismatch: column 'mean area' is string, the model 'breast-cancer:1' expects float32"),
        ("missing", "SchemaMismatch: column 'worst symmetry' is missing"),
        ("truncated", "CorruptShard: .*re-export it"),
        ("pages", "CorruptShard: .*has data that cannot be read \\(Corrupt snappy compressed data.\\)"),
        ("header", "CorruptShard: .*has data that cannot be read \\(Couldn't deserialize thrift: .* Deserializing page "
                   "header failed. \\); re-export it"),
    ],
)
def test_bad_shards_are_quarantined_with_their_reason(
    scoring_job: ScoringJob, input_shards: Path, tmp_path: Path, damage: str, reason: str
) -> None:
    table = pq.read_table(input_shards / "part-00000.parquet")
    bad = tmp_path / "bad" / "bad.parquet"
    if damage in ("nulls", "nan", "inf"):
        column = table.column("mean radius").to_pylist()
        column[1500] = {"nulls": None, "nan": float("nan"), "inf": float("inf")}[damage]
        column[1501] = column[1500] if damage == "inf" else column[1501]
        _write(bad, table.set_column(table.schema.get_field_index("mean radius"), "mean radius", pa.array(column)))
    elif damage == "string":
        index = table.schema.get_field_index("mean area")
        _write(bad, table.set_column(index, "mean area", table.column("mean area").cast(pa.string())))
    elif damage == "missing":
        _write(bad, table.drop_columns(["worst symmetry"]))
    elif damage == "truncated":
        data = (input_shards / "part-00000.parquet").read_bytes()
        bad.parent.mkdir()
        bad.write_bytes(data[: len(data) // 2])
    else:  # the footer is fine, a data page in the third row group is not (or its header: a three-line error)
        data = bytearray((input_shards / "part-00000.parquet").read_bytes())
        column = pq.read_metadata(input_shards / "part-00000.parquet").row_group(2).column(5)
        start = column.data_page_offset + (40 if damage == "pages" else 0)
        data[start : start + 200] = bytes(200) if damage == "pages" else b"\xff" * 200
        bad.parent.mkdir()
        bad.write_bytes(bytes(data))

    record = score_shard(scoring_job, _shard(bad))

    assert record.status == "quarantined" and record.part is None
    import re

    assert re.search(reason, record.reason or ""), record.reason
    assert "\n" not in (record.reason or "")  # one line (pyarrow's own messages may span several)
    expected_rows = None if damage == "truncated" else 2_000
    assert record.rows_in == expected_rows and record.rows_quarantined == (expected_rows or 0)
    layout = OutputLayout(scoring_job.output_uri)
    assert layout.present_parts() == set()  # nothing half-written is visible
    assert layout.read_ledger()["bad.parquet"].status == "quarantined"


class _Contract:
    """A data contract that keeps the samples it is given and fails every one when ``fail``."""

    def __init__(self, fail: bool = False) -> None:
        self.samples: list[pa.Table] = []
        self.fail = fail

    def __call__(self, sample: pa.Table) -> list[str]:
        self.samples.append(sample)
        return ["column 'mean radius' fails expect_column_values_to_be_between"] if self.fail else []


@pytest.mark.parametrize("passthrough", [None, ("id",)])
def test_a_carried_column_in_the_shard_twice_is_quarantined_saying_so(
    scoring_job: ScoringJob, input_shards: Path, tmp_path: Path, passthrough: tuple[str, ...] | None
) -> None:
    table = pq.read_table(input_shards / "part-00002.parquet")
    twice = pa.Table.from_arrays([table.column("id"), *table.columns], names=["id", *table.column_names])
    shard = _write(tmp_path / "twice" / "part-00002.parquet", twice)

    record = score_shard(dataclasses.replace(scoring_job, passthrough=passthrough), _shard(shard))

    assert (record.status, record.rows_in, record.rows_quarantined) == ("quarantined", 2_000, 2_000)
    assert record.reason == ("SchemaMismatch: 'id' is in the data more than once; keep one column of each name the "
                             "output carries")


@pytest.mark.parametrize("batch_rows", [300, 700, 5_000])
def test_the_contract_checks_the_shards_first_rows_and_every_row_is_scored_once(
    scoring_job: ScoringJob, input_shards: Path, batch_rows: int
) -> None:
    """The contract's sample is the first 1,000 rows of the read that scores the shard (held until it passes:
    over several batches, within one, or one batch of the whole shard), and no held row is lost or scored twice."""
    contract = _Contract()
    job = dataclasses.replace(scoring_job, batch_rows=batch_rows, sample_check=contract)

    record = score_shard(job, _shard(input_shards / "part-00002.parquet"))

    assert (record.status, record.rows_in, record.rows_out) == ("committed", 2_000, 2_000)
    shard = pq.read_table(input_shards / "part-00002.parquet")
    names = job.model.manifest.signature.input_names
    [sample] = contract.samples
    assert sample.column_names == names and sample.equals(shard.select(names).slice(0, 1_000))
    part = pq.read_table(record.part.removeprefix("file://"))
    assert part.column("id").to_pylist() == shard.column("id").to_pylist()


def test_a_shard_in_ranges_is_checked_once_on_its_first_ranges_rows(scoring_job: ScoringJob,
                                                                     input_shards: Path) -> None:
    contract = _Contract()
    job = dataclasses.replace(scoring_job, sample_check=contract, checkpoint_bytes=1)  # a range a row group

    record = score_shard(job, _shard(input_shards / "part-00002.parquet"))

    assert (record.status, record.rows_out, record.ranges) == ("committed", 2_000, 4)
    [sample] = contract.samples  # the first range's 500 rows (one row group here; ~1 GiB by default)
    names = job.model.manifest.signature.input_names
    assert sample.equals(pq.read_table(input_shards / "part-00002.parquet", columns=names).slice(0, 500))


def test_a_batch_held_for_the_contract_is_let_go_once_it_is_handed_on(scoring_job: ScoringJob,
                                                                       input_shards: Path) -> None:
    """The batches held until the contract passes are not kept for the rest of the shard (a 1M-row shard's first
    batch is ~16 MB a worker): once the scorer has moved past one, Arrow has freed it."""
    import pyarrow.compute as pc

    from shardline.storage.scoring import _contract_checked, _open_shard

    checked: list[int] = []  # rows of each sample (keeping the sample would keep its batch's buffers)
    job = dataclasses.replace(scoring_job, sample_check=lambda sample: checked.append(sample.num_rows) or [])
    names = job.model.manifest.signature.input_names
    ones = pa.array(np.ones(50_000))

    def fresh_batches() -> Iterator[pa.RecordBatch]:  # each allocated from Arrow's pool, as a read's are
        for _ in range(4):
            yield pa.record_batch([pc.multiply(ones, 2.0) for _ in names], names=names)

    size = 50_000 * 8 * len(names)
    with _open_shard(job, _shard(input_shards / "part-00000.parquet")) as opened:
        before = pa.total_allocated_bytes()
        in_use = []  # Arrow's bytes in use while the third batch is in hand
        for i, batch in enumerate(_contract_checked(job, opened, fresh_batches())):
            if i == 2:
                in_use.append(pa.total_allocated_bytes() - before)
            del batch
    assert checked == [1_000]
    assert in_use and in_use[0] < 1.5 * size  # the batch in hand, not the first one too


@pytest.mark.parametrize("checkpoint_bytes", [1 << 30, 1], ids=["one-pass", "ranges"])
def test_a_shard_failing_its_contract_is_quarantined_with_nothing_written(
    scoring_job: ScoringJob, input_shards: Path, checkpoint_bytes: int
) -> None:
    job = dataclasses.replace(scoring_job, sample_check=_Contract(fail=True), checkpoint_bytes=checkpoint_bytes)

    record = score_shard(job, _shard(input_shards / "part-00001.parquet"))

    assert record.status == "quarantined" and record.part is None
    rows = 1_000 if checkpoint_bytes > 1 else 500
    assert record.reason == (
        f"DataContract: the first {rows} rows fail 1 expectation(s) of breast-cancer:1's data contract: column "
        "'mean radius' fails expect_column_values_to_be_between; fix the data or check the model's reference profile"
    )
    layout = OutputLayout(job.output_uri)
    assert layout.present_parts() == set() and layout.read_ledger()["part-00001.parquet"].status == "quarantined"
    assert not list(Path(job.output_uri).rglob("*.parquet"))  # no staged part, no range's chunk


def test_footer_reader_says_the_file_is_not_parquet(tmp_path: Path) -> None:
    from shardline.errors import CorruptShard

    (tmp_path / "x.parquet").write_bytes(b"PAR1 but not really")
    with pytest.raises(CorruptShard, match="is not a readable Parquet file"):
        read_footer(str(tmp_path / "x.parquet"))


def test_a_part_dictionary_encodes_labels_and_text_not_floats_or_carried_ids() -> None:
    schema = pa.schema([
        ("id", pa.int64()), ("country", pa.string()), ("weight", pa.float64()), ("tags", pa.dictionary(pa.int8(), pa.string())),
        ("label", pa.int64()), ("name", pa.string()), ("score", pa.float32()),
        ("probabilities", pa.list_(pa.float32(), 2)), ("embedding", pa.list_(pa.float32())),
    ])

    chosen = dictionary_columns(schema, carried=["id", "country", "weight", "tags"])

    assert chosen == ["country", "tags", "label", "name"]


def test_a_shards_capture_sample_holds_its_own_rows_not_the_batch_it_came_from() -> None:
    from shardline.storage.scoring import _Sample

    batch = pa.record_batch({"x": np.arange(65_536, dtype=np.float64), "y": np.ones(65_536)})
    answers = pa.record_batch({"label": np.zeros(65_536, dtype=np.int64)})
    sample = _Sample(1_000)
    shard = ShardInfo("memory://in/a.parquet", "a.parquet", 0, "f")
    sample.take(batch, answers, shard)
    sample.take(batch, answers, shard)  # full: nothing more is kept

    assert sample.rows == 1_000 and [b.num_rows for b in sample.inputs] == [1_000]
    assert sample.inputs[0].column("x").to_pylist() == list(range(1_000))
    # kept while the task's other shards are scored: a slice would hold the whole batch's buffers (1.5 MB here)
    assert sample.inputs[0].get_total_buffer_size() <= 2 * 8 * 1_000 + 64
    assert sample.outputs[0].get_total_buffer_size() <= 8 * 1_000 + 64


def test_a_capture_sample_that_cannot_be_taken_is_logged_and_dropped_never_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from shardline.storage.scoring import _Sample

    # Arrow has no take kernel for string_view: capture serves drift checks, and must not fail the shard's scoring
    batch = pa.record_batch({"text": pa.array(["a", "b", "c"]).cast(pa.string_view())})
    answers = pa.record_batch({"label": np.zeros(3, dtype=np.int64)})
    sample = _Sample(2)
    with caplog.at_level("WARNING", logger="shardline.scoring"):
        sample.take(batch, answers, ShardInfo("memory://in/a.parquet", "a.parquet", 0, "f"))
        sample.take(batch, answers, ShardInfo("memory://in/a.parquet", "a.parquet", 0, "f"))

    assert (sample.rows, sample.inputs, sample.outputs) == (0, [], [])
    assert [r.getMessage() for r in caplog.records] == [
        "capture of shard a.parquet failed (ArrowNotImplementedError: Function 'array_take' has no kernel matching "
        "input types (string_view, int32)); the shard is scored without a capture sample"]


def test_a_worker_scores_and_captures_without_importing_pandas(
    scoring_job: ScoringJob, input_shards: Path, tmp_path: Path
) -> None:
    """pyarrow imports pandas at its first conversion of numpy or Python values (~27 MB of each worker's memory);
    the row check, the answers and the capture samples make their Arrow arrays from buffers instead, on both row
    paths: batches of 1,500 rows (stacked into one matrix) and the shards' last 500 (Arrow columns). The job is
    shipped pickled, as Dask ships it, to a fresh interpreter."""
    job = dataclasses.replace(scoring_job, batch_rows=1_500,
                              capture=ShardCapture(str(tmp_path / "capture"), 300, "acme", "j1"))
    shipped = tmp_path / "job.pickle"
    shipped.write_bytes(pickle.dumps((job, list_shards(str(input_shards))[:3])))
    script = ("import pickle, sys; from shardline.tasks.dispatch import score_group; "
              f"job, shards = pickle.loads(open({str(shipped)!r}, 'rb').read()); "
              "settled = score_group(job, shards); "
              "print(sorted(r.status for r, _ in settled), 'pandas' in sys.modules)")
    found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout

    assert found.split() == ["['committed',", "'committed',", "'committed']", "False"]
    captured = pq.read_table(next((tmp_path / "capture").rglob("*.parquet")))
    assert captured.num_rows == 900 and set(captured.column("_tenant").to_pylist()) == {"acme"}
    assert captured.column("_tier").to_pylist() == ["batch"] * 900
    assert set(captured.column("_source").to_pylist()) == {"j1"}


def test_passthrough_columns_missing_from_the_first_shard_are_a_wrong_request_naming_its_columns() -> None:
    few = pa.schema([("id", pa.int64()), ("age", pa.float32())])
    check_passthrough_present(["id"], "part-00000.parquet", few)
    with pytest.raises(InvalidInput, match=r"passthrough columns \['idd'\] are not in the input's first shard "
                                           r"part-00000.parquet \(its columns: id, age\); check the names"):
        check_passthrough_present(["id", "idd"], "part-00000.parquet", few)
    many = pa.schema([(f"c{i}", pa.float32()) for i in range(40)])
    with pytest.raises(InvalidInput, match=r"its columns: c0, c1, .*, c11, \.\.\. \(40 in all\)\)"):
        check_passthrough_present(["id"], "a/b.parquet", many)
