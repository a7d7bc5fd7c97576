"""Sampled capture (storage/capture.py): bounded, thread-safe buffering, atomic files, scans by window."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardline.errors import InvalidInput, InvalidSetting
from shardline.settings import StorageSettings
from shardline.storage.capture import (
    CAPTURE_META,
    CaptureBuffer,
    CaptureSample,
    capture_root,
    scan_capture,
    write_capture,
    write_captures,
)

NEVER = 3600.0  # a flush interval no test waits for


def rows(n: int, start: float = 0.0) -> tuple[pa.RecordBatch, pa.RecordBatch]:
    """n input rows (a number and a category) and their outputs (a label and an id echoed back)."""
    inputs = pa.record_batch({"id": list(range(n)), "x": [float(start + i) for i in range(n)], "c": ["a", "b"][:1] * n})
    outputs = pa.record_batch({"label": [i % 2 for i in range(n)], "id": list(range(n))})
    return inputs, outputs


def wait_for(condition, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_rows_come_back_with_inputs_outputs_and_meta_columns(tmp_path: Path) -> None:
    with CaptureBuffer(str(tmp_path), "churn", 3, "online", flush_seconds=NEVER) as buffer:
        assert buffer.add(*rows(4), tenant="acme", source="req-1")
        assert buffer.add(*rows(2, start=10), tenant="zeta", source="req-2")
    assert buffer.written_rows == 6 and buffer.dropped == 0
    frame = scan_capture(str(tmp_path), "churn").collect()
    # inputs, then outputs not already among them (id is kept once), then the meta columns
    assert frame.columns == ["id", "x", "c", "label", *CAPTURE_META]
    assert frame["x"].to_list() == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0]
    assert frame["_tenant"].to_list() == ["acme"] * 4 + ["zeta"] * 2
    assert frame["_source"].to_list() == ["req-1"] * 4 + ["req-2"] * 2
    assert set(frame["_tier"].to_list()) == {"online"}
    assert str(frame.schema["_captured_at"]) == "Datetime(time_unit='us', time_zone='UTC')"
    files = list(tmp_path.rglob("*.parquet"))
    assert len(files) == 1
    relative = files[0].relative_to(tmp_path).parts
    assert relative[:3] == ("churn", "v3", "online") and relative[3].startswith("date=")


def test_many_threads_lose_no_row(tmp_path: Path) -> None:
    buffer = CaptureBuffer(str(tmp_path), "churn", 1, "online", flush_rows=300, flush_seconds=NEVER)
    threads, per_thread = 8, 200

    def work(t: int) -> None:
        for i in range(per_thread):
            assert buffer.add(*rows(1, start=t * 1000 + i), tenant=f"t{t}", source=f"{t}-{i}")

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    buffer.close()
    frame = scan_capture(str(tmp_path), "churn", version=1).collect()
    assert frame.height == threads * per_thread == buffer.written_rows
    assert frame["_source"].n_unique() == threads * per_thread
    assert buffer.written_files >= 2  # flush_rows made the writer thread write while the adds ran


def test_full_buffer_drops_and_counts_instead_of_blocking(tmp_path: Path) -> None:
    buffer = CaptureBuffer(str(tmp_path), "churn", 1, "online", max_pending_rows=10, flush_rows=1000,
                           flush_seconds=NEVER)
    assert buffer.add(*rows(5), tenant="t", source="a")
    assert buffer.add(*rows(5), tenant="t", source="b")
    assert not buffer.add(*rows(5), tenant="t", source="c")
    assert buffer.dropped == 5 and buffer.pending_rows == 10
    buffer.close()
    assert not buffer.add(*rows(1), tenant="t", source="late")  # closed: dropped, not raised
    assert buffer.dropped == 6
    assert scan_capture(str(tmp_path), "churn").collect()["_source"].to_list() == ["a"] * 5 + ["b"] * 5


def test_writer_thread_flushes_on_rows_and_on_time(tmp_path: Path) -> None:
    by_rows = CaptureBuffer(str(tmp_path), "churn", 1, "online", flush_rows=10, flush_seconds=NEVER)
    by_time = CaptureBuffer(str(tmp_path), "churn", 2, "online", flush_rows=10_000, flush_seconds=0.2)
    try:
        by_rows.add(*rows(10), tenant="t", source="s")
        by_time.add(*rows(3), tenant="t", source="s")
        assert wait_for(lambda: by_rows.written_rows == 10 and by_time.written_rows == 3)
        assert scan_capture(str(tmp_path), "churn", version=2).collect().height == 3
    finally:
        by_rows.close()
        by_time.close()


def test_close_flushes_and_is_idempotent(tmp_path: Path) -> None:
    buffer = CaptureBuffer(str(tmp_path), "churn", 1, "batch", flush_seconds=NEVER)
    buffer.add(*rows(7), tenant="t", source="job")
    assert buffer.written_rows == 0
    buffer.close()
    buffer.close()
    assert buffer.written_rows == 7 and buffer.pending_rows == 0
    assert scan_capture(str(tmp_path), "churn", tier="batch").collect().height == 7


def test_a_failed_write_keeps_its_rows_and_leaves_no_partial_file(tmp_path: Path) -> None:
    root = tmp_path / "capture"
    root.mkdir()
    (root / "churn").write_text("a file where the model's folder should be")  # the store refuses the write
    buffer = CaptureBuffer(str(root), "churn", 1, "online", flush_seconds=NEVER)
    buffer.add(*rows(4), tenant="t", source="s")
    with pytest.raises(OSError):
        buffer.flush()
    assert buffer.pending_rows == 4 and buffer.write_errors == 1
    (root / "churn").unlink()
    buffer.close()
    assert buffer.written_rows == 4
    assert [p.name for p in root.rglob("*") if p.is_file() and not p.name.endswith(".parquet")] == []
    assert pq.read_table(next(root.rglob("*.parquet"))).num_rows == 4


def test_scan_by_time_window_version_and_tier() -> None:
    root = "memory://capture-window"
    now = datetime.now(timezone.utc).replace(microsecond=0)
    for days, version, tier in [(3, 1, "batch"), (1, 2, "batch"), (0, 2, "online")]:
        url = write_capture(root, "churn", version, tier, *rows(2, start=days), tenant="t", source=f"d{days}",
                            captured_at=now - timedelta(days=days))
        assert url is not None and url.startswith("memory://") and f"/v{version}/{tier}/date=" in url
    assert scan_capture(root, "churn").collect().height == 6
    last_two_days = scan_capture(root, "churn", since=now - timedelta(days=2)).collect()
    assert sorted(set(last_two_days["_source"].to_list())) == ["d0", "d1"]
    window = scan_capture(root, "churn", since=now - timedelta(days=4), until=now - timedelta(hours=1)).collect()
    assert sorted(set(window["_source"].to_list())) == ["d1", "d3"]
    assert set(scan_capture(root, "churn", version=2, tier="online").collect()["_source"]) == {"d0"}
    naive = scan_capture(root, "churn", since=(now - timedelta(hours=1)).replace(tzinfo=None)).collect()
    assert set(naive["_source"]) == {"d0"}  # a naive datetime is read as UTC


def test_empty_scans_are_empty_frames_not_errors(tmp_path: Path) -> None:
    nothing = scan_capture(str(tmp_path), "churn").collect()
    assert nothing.height == 0 and nothing.columns == list(CAPTURE_META)
    write_capture(str(tmp_path), "churn", 1, "batch", *rows(2), tenant="t", source="s")
    assert scan_capture(str(tmp_path), "churn", version=9).collect().height == 0
    future = datetime.now(timezone.utc) + timedelta(days=2)
    assert scan_capture(str(tmp_path), "churn", since=future).collect().height == 0
    assert write_capture(str(tmp_path), "churn", 1, "batch", *rows(0), tenant="t", source="s") is None


def test_samples_written_together_are_one_file_per_schema_with_each_ones_time(tmp_path: Path) -> None:
    earlier = datetime(2026, 12, 4, 23, 59, 59, tzinfo=timezone.utc)
    later = earlier + timedelta(seconds=2)  # past midnight: the file's folder is the earliest row's date
    wide = pa.record_batch({"id": [7], "x": [1.0], "c": ["a"], "extra": [1]})
    urls = write_captures(str(tmp_path), "churn", 1, "batch", [
        CaptureSample(*rows(3), earlier), CaptureSample(*rows(2, start=10), later), CaptureSample(*rows(0), later),
        CaptureSample(wide, rows(1)[1], later),
    ], tenant="acme", source="job-1")

    assert len(urls) == 2 and "/batch/date=2026-12-04/" in urls[0] and "/batch/date=2026-12-05/" in urls[1]
    first = pq.read_table(urls[0].removeprefix("file://"))
    assert first.column("x").to_pylist() == [0.0, 1.0, 2.0, 10.0, 11.0]
    assert [t.astimezone(timezone.utc) for t in first.column("_captured_at").to_pylist()] == [earlier] * 3 + [later] * 2
    assert set(first.column("_tenant").to_pylist()) == {"acme"}
    assert set(first.column("_source").to_pylist()) == {"job-1"}
    assert pq.read_table(urls[1].removeprefix("file://")).column("extra").to_pylist() == [1]
    assert write_captures(str(tmp_path), "churn", 1, "batch", [CaptureSample(*rows(0), later)], tenant="t",
                          source="s") == []
    inputs, _ = rows(3)
    with pytest.raises(InvalidInput, match="3 input rows but 2 output rows"):
        write_captures(str(tmp_path / "other"), "churn", 1, "batch",
                       [CaptureSample(*rows(1), later), CaptureSample(inputs, rows(2)[1], later)],
                       tenant="t", source="s")
    assert not (tmp_path / "other").exists()  # nothing written when one sample is wrong


def test_bad_input_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    inputs, _ = rows(3)
    _, outputs = rows(2)
    with CaptureBuffer(str(tmp_path), "churn", 1, "online") as buffer:
        with pytest.raises(InvalidInput, match="3 input rows but 2 output rows"):
            buffer.add(inputs, outputs, tenant="t", source="s")
    with pytest.raises(InvalidSetting, match="tier"):
        CaptureBuffer(str(tmp_path), "churn", 1, "Online/..")
    with pytest.raises(InvalidSetting, match="version"):
        write_capture(str(tmp_path), "churn", 0, "batch", *rows(1), tenant="t", source="s")
    now = datetime.now(timezone.utc)
    with pytest.raises(InvalidInput, match="window is empty"):
        scan_capture(str(tmp_path), "churn", since=now, until=now - timedelta(hours=1))


def test_capture_root_follows_the_settings(tmp_path: Path) -> None:
    assert capture_root(StorageSettings(home=str(tmp_path))) == f"{tmp_path}/capture"
    assert capture_root(StorageSettings(home=str(tmp_path), capture_url="s3://bucket/cap")) == "s3://bucket/cap"


@pytest.mark.parametrize("layout", ["columns", "a list column"])
def test_float_samples_are_written_as_their_tables_would_be_among_table_samples(tmp_path: Path, layout: str) -> None:
    # What the online float path hands over (Rows.arrays and the runtime's numpy answer): the file holds what add()
    # of the same rows' tables writes, in the order they came, with table samples between them in files of their own.
    import numpy as np

    from shardline.rows import float_rows
    from shardline.signature import ColumnSpec, Signature

    if layout == "columns":
        inputs = [ColumnSpec(name="a", type="float32"), ColumnSpec(name="b", type="float32")]
    else:
        inputs = [ColumnSpec(name="v", type="fixed_size_list<float32>[3]")]
    signature = Signature(inputs=inputs, outputs=[ColumnSpec(name="label", type="int64"),
                                                  ColumnSpec(name="scores", type="fixed_size_list<float32>[2]")])
    plan = signature.plan
    rng = np.random.default_rng(3)

    def request(n: int) -> tuple[tuple[np.ndarray, ...], dict[str, np.ndarray]]:
        # float columns come as one (rows, columns) matrix; a list column as its (rows, k) array
        arrays = (rng.random((n, 2 if layout == "columns" else 3), dtype=np.float32),)
        return arrays, {"label": rng.integers(0, 2, n), "scores": rng.random((n, 2), dtype=np.float32)}

    sent = [request(n) for n in (1, 1, 3, 1)]
    with CaptureBuffer(str(tmp_path / "floats"), "churn", 1, "online", flush_seconds=NEVER) as floats, \
            CaptureBuffer(str(tmp_path / "tables"), "churn", 1, "online", flush_seconds=NEVER) as tables:
        for i, (arrays, answer) in enumerate(sent):
            assert floats.add_arrays(plan, arrays, answer, tenant="acme", source=f"req-{i}")
            checked = float_rows(plan, arrays, "churn")
            table = checked.table()
            tables.add(table if isinstance(table, pa.Table) else pa.Table.from_batches([table]),
                       plan.answer_table(answer), tenant="acme", source=f"req-{i}")
        assert floats.pending_rows == 6
        floats.add(*rows(2), tenant="zeta", source="req-t")  # a table sample between float ones: its own file
        floats.add_arrays(plan, *request(1), tenant="acme", source="req-5")
        with pytest.raises(InvalidInput, match="capture got 2 input rows but an answer of \\[1\\] rows"):
            floats.add_arrays(plan, request(2)[0], request(1)[1], tenant="acme", source="req-x")

    assert (floats.written_rows, floats.written_files, floats.dropped) == (9, 3, 0)
    written = sorted((tmp_path / "floats").rglob("*.parquet"), key=lambda p: p.name)
    first = pq.read_table(written[0])
    expected = pq.read_table(next((tmp_path / "tables").rglob("*.parquet")))
    assert first.schema.equals(expected.schema)
    data = [name for name in first.column_names if name != "_captured_at"]
    assert first.select(data).equals(expected.select(data))
    assert first.column("_source").to_pylist() == ["req-0", "req-1", "req-2", "req-2", "req-2", "req-3"]
    assert [pq.read_metadata(p).num_rows for p in written] == [6, 2, 1]
