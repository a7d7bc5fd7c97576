"""The metering ledger's writer: buckets, the split of shared device time, capacity rows, what a close writes."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import pyarrow.compute as pc
import pytest

from shardline.storage.ledger import UNATTRIBUTED, Holding, LedgerStore, LedgerWriter


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def writer(bucket_s: float = 60.0, start: float = 1_764_547_200.0) -> tuple[LedgerWriter, Clock, Clock]:
    """A writer over a fresh memory home, its clock at ``start`` (2025-12-01 00:00 UTC) and a CPU clock at 0."""
    clock, cpu = Clock(start), Clock(0.0)
    store = LedgerStore(f"memory://ledger-{uuid.uuid4().hex[:8]}")
    return LedgerWriter(store, Holding("online", "cpu", "spot", 4.0), bucket_s, clock=clock, cpu_clock=cpu,
                        writer="w1"), clock, cpu


def usage(store: LedgerStore, month: str = "2025-12") -> list[dict]:
    table = store.read(month)
    return table.filter(pc.equal(table["kind"], "usage")).to_pylist()


def test_shared_device_time_is_split_by_each_tenants_rows_of_the_bucket() -> None:
    w, clock, cpu = writer()
    w.add("acme", "churn", "3", requests=1, rows=30)
    w.add("globex", "churn", "3", requests=2, rows=10)
    w.add_shared("churn", "3", 8.0)
    w.add("acme", "llm", "1", requests=1, prompt_tokens=5, completion_tokens=7, device_seconds=1.5)
    cpu.now = 6.0
    clock.now += 61  # the bucket closed
    files = w.flush()
    assert len(files) == 1 and "/month=2025-12/20251201T000000-w1.parquet" in files[0]
    rows = {(r["tenant"], r["model"]): r for r in usage(w.store)}
    assert rows[("acme", "churn")]["device_seconds"] == pytest.approx(6.0)
    assert rows[("globex", "churn")]["device_seconds"] == pytest.approx(2.0)
    assert (rows[("acme", "churn")]["requests"], rows[("globex", "churn")]["requests"]) == (1, 2)
    assert (rows[("acme", "llm")]["prompt_tokens"], rows[("acme", "llm")]["completion_tokens"]) == (5, 7)
    assert all(r["capacity_type"] == "spot" and r["tier"] == "online" for r in rows.values())
    # the process's CPU time of the bucket, split by device-seconds (6 : 2 : 1.5 of 6 s)
    assert sum(r["cpu_seconds"] for r in rows.values()) == pytest.approx(6.0)
    assert rows[("acme", "llm")]["cpu_seconds"] == pytest.approx(6.0 * 1.5 / 9.5)


def test_every_closed_bucket_has_a_capacity_row_and_a_close_writes_the_open_one() -> None:
    w, clock, _ = writer(bucket_s=60)
    clock.now += 30  # 30 s into the first bucket
    w.add("acme", "churn", "3", requests=1, rows=1)
    clock.now += 100  # 130 s: two buckets closed, the third open
    assert len(w.flush()) == 2
    assert w.flush() == []  # nothing new closed
    w.add("acme", "churn", "3", requests=1, rows=1)
    clock.now += 5  # 135 s
    assert len(w.close()) == 3
    table = w.store.read("2025-12")
    capacity = table.filter(pc.equal(table["kind"], "capacity")).to_pylist()
    assert [c["reserved_seconds"] for c in capacity] == [60.0, 60.0, 15.0]  # the open bucket up to the stop
    assert {c["units"] for c in capacity} == {4.0}
    assert sum(r["requests"] for r in usage(w.store)) == 2


def test_device_time_with_no_rows_in_its_bucket_is_carried_then_written_unattributed_at_the_close() -> None:
    w, clock, _ = writer(bucket_s=60)
    w.add_shared("churn", "3", 2.0)  # the batch ended in this bucket, its requests' rows land in the next
    clock.now += 60
    w.add("acme", "churn", "3", requests=1, rows=4)
    clock.now += 60
    w.flush()
    assert [(r["tenant"], r["device_seconds"]) for r in usage(w.store)] == [("acme", 2.0)]
    w.add_shared("churn", "3", 1.0)
    w.close()
    assert (UNATTRIBUTED, 1.0) in [(r["tenant"], r["device_seconds"]) for r in usage(w.store)]


def test_a_month_is_read_whole_and_an_empty_one_is_an_empty_table() -> None:
    w, clock, _ = writer(bucket_s=60)
    for _ in range(3):
        w.add("acme", "churn", "3", requests=1, rows=2)
        clock.now += 60
    w.close()
    assert w.store.months() == ["2025-12"]
    assert sum(r["rows"] for r in usage(w.store)) == 6
    assert w.store.read("2026-01").num_rows == 0
    assert w.store.read("2025-12")["bucket_start"][0].as_py() == datetime(2025, 12, 1, tzinfo=timezone.utc)


def test_a_bucket_the_store_refuses_is_kept_and_written_at_the_next_try() -> None:
    w, clock, _ = writer(bucket_s=60)
    w.add("acme", "churn", "3", requests=1, rows=2)
    clock.now += 60
    store_write = w.store.write
    refusals = []

    def refuse(rows: list, name: str) -> str:
        refusals.append(name)
        raise OSError("the store is away")

    w.store.write = refuse  # type: ignore[method-assign]
    with pytest.raises(OSError):
        w.flush()
    w.store.write = store_write  # type: ignore[method-assign]
    w.add("acme", "churn", "3", requests=1, rows=2)
    clock.now += 60
    assert len(w.flush()) == 2 and len(refusals) == 1
    assert sum(r["requests"] for r in usage(w.store)) == 2


def test_a_report_month_is_checked_and_the_first_of_january_reports_december() -> None:
    from datetime import datetime, timezone

    from shardline.errors import InvalidSetting
    from shardline.storage.ledger import check_month, previous_month

    assert check_month("2026-11") == "2026-11"
    for wrong in ("2026-13", "2026-1", "26-11", "2026-00", "november"):
        with pytest.raises(InvalidSetting, match="is not a month; give it as YYYY-MM"):
            check_month(wrong)
    assert previous_month(datetime(2027, 1, 1, 6, tzinfo=timezone.utc)) == "2026-12"
    assert previous_month(datetime(2026, 12, 1, 6, tzinfo=timezone.utc)) == "2026-11"


def test_the_per_request_shortcuts_add_what_add_with_keywords_adds() -> None:
    fast, fast_clock, _ = writer()
    slow, slow_clock, _ = writer()
    fast.add_request("acme", "churn", "3")
    fast.add_rows("acme", "churn", "3", 4, 480, 64)
    fast.add_rows("acme", "churn", "3", 1, 120, 16)
    slow.add("acme", "churn", "3", requests=1, rows=5, bytes_read=600, bytes_written=80)
    fast_clock.now += 61
    slow_clock.now += 61
    fast.flush()
    slow.flush()
    (one,), (other,) = usage(fast.store), usage(slow.store)  # one row each: the tenant's use of the version
    assert one == other
    assert (one["requests"], one["rows"], one["bytes_read"], one["bytes_written"]) == (1, 5, 600, 80)
