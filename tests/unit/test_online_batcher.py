"""Dynamic batching: the pure decisions, and the batcher on a real event loop with a fake model."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import pyarrow as pa
import pytest

from shardline.errors import InvalidInput, Overloaded, RuntimeUnavailable
from shardline.online.batcher import Batcher, BatchLimits, Pending, batch_wait, take_batch
from shardline.rows import Rows, check_rows
from shardline.signature import ColumnSpec, Signature
from shardline.tenants import PRIORITIES, Priority


ONE_FLOAT = Signature(inputs=[ColumnSpec(name="x", type="float64")], outputs=[ColumnSpec(name="y", type="float64")])


def rows(*values: float) -> Rows:
    """Checked rows of one float64 column, as the data plane queues them."""
    return check_rows(pa.table({"x": pa.array(values, pa.float64())}), ONE_FLOAT, "m:1")


def pending(n: int, priority: Priority = "normal", at: float = 0.0) -> Pending:
    loop = asyncio.new_event_loop()
    try:
        return Pending(rows(*range(n)), priority, at, loop.create_future())
    finally:
        loop.close()


# -- pure decisions -------------------------------------------------------------------------------
def test_a_batch_goes_when_full_or_when_the_oldest_waited_its_maximum() -> None:
    limits = BatchLimits(max_batch_size=8, max_wait_s=0.005, queue_capacity=100)
    assert batch_wait(0, None, now=1.0, limits=limits) is None
    assert batch_wait(3, oldest_enqueued=1.0, now=1.002, limits=limits) == pytest.approx(0.003)
    assert batch_wait(3, oldest_enqueued=1.0, now=1.006, limits=limits) == 0.0
    assert batch_wait(8, oldest_enqueued=1.0, now=1.0, limits=limits) == 0.0
    assert batch_wait(1, 1.0, 1.0, BatchLimits(8, 0.0, 100)) == 0.0  # no wait: go at once


def test_batches_take_high_priority_first_and_never_split_a_request() -> None:
    queues: dict[Priority, deque[Pending]] = {p: deque() for p in PRIORITIES}
    queues["low"].extend([pending(2, "low", 0.0)])
    queues["normal"].extend([pending(3, "normal", 1.0), pending(4, "normal", 2.0)])
    queues["high"].extend([pending(1, "high", 3.0)])

    first = take_batch(queues, max_rows=6)
    assert [(p.priority, p.rows) for p in first] == [("high", 1), ("normal", 3)]  # the next 4 rows would not fit
    second = take_batch(queues, max_rows=6)
    assert [(p.priority, p.rows) for p in second] == [("normal", 4), ("low", 2)]
    queues["normal"].append(pending(50, "normal"))
    assert [p.rows for p in take_batch(queues, max_rows=6)] == [50]  # too big for a batch: it goes alone
    assert take_batch(queues, max_rows=6) == []


def test_limits_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        BatchLimits(0, 0.0, 10)
    with pytest.raises(ValueError, match="must not be negative"):
        BatchLimits(1, -1.0, 10)


# -- the batcher on a loop ------------------------------------------------------------------------
class FakeModel:
    """Doubles x; refuses a row holding -1 (a request the signature check could not catch)."""

    def __init__(self, delay: float = 0.01) -> None:
        self.delay = delay
        self.batches: list[list[float]] = []

    async def __call__(self, rows: Rows) -> pa.RecordBatch:
        values = rows.table().column("x").to_pylist()
        self.batches.append(values)
        await asyncio.sleep(self.delay)
        if -1 in values:
            raise InvalidInput("x = -1 cannot be scored")
        return pa.RecordBatch.from_pydict({"y": [2 * v for v in values]})


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_requests_that_arrive_while_the_model_is_busy_go_together() -> None:
    async def scenario() -> tuple[list[Any], FakeModel]:
        model = FakeModel()
        batcher = Batcher("m:1", BatchLimits(64, 0.0, 100), model)
        first = batcher.submit(rows(1), "normal")  # goes at once: the model is idle
        rest = [batcher.submit(rows(float(i)), "normal") for i in range(2, 6)]
        answers = await asyncio.gather(first, *rest)
        return [a.column("y").to_pylist() for a in answers], model

    answers, model = run(scenario())
    assert answers == [[2.0], [4.0], [6.0], [8.0], [10.0]]
    assert model.batches == [[1.0], [2.0, 3.0, 4.0, 5.0]]


def test_with_a_wait_an_idle_model_waits_for_companions_up_to_it() -> None:
    async def scenario() -> FakeModel:
        model = FakeModel(delay=0.0)
        batcher = Batcher("m:1", BatchLimits(3, 0.05, 100), model)
        futures = [batcher.submit(rows(1.0), "normal")]
        await asyncio.sleep(0.01)
        futures.append(batcher.submit(rows(2.0), "normal"))
        futures.append(batcher.submit(rows(3.0), "normal"))  # full: goes now, not at 50 ms
        futures.append(batcher.submit(rows(4.0), "normal"))  # alone: goes when it waited 50 ms
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.gather(*futures[:3])
        assert loop.time() - started < 0.04
        await futures[3]
        assert loop.time() - started >= 0.045
        return model

    assert run(scenario()).batches == [[1.0, 2.0, 3.0], [4.0]]


def test_a_bad_request_does_not_fail_its_neighbours() -> None:
    async def scenario() -> list[Any]:
        model = FakeModel()
        batcher = Batcher("m:1", BatchLimits(64, 0.0, 100), model)
        blocker = batcher.submit(rows(0.0), "normal")
        batch = [batcher.submit(rows(v), "normal") for v in (1.0, -1.0, 3.0)]
        await blocker
        return list(await asyncio.gather(*batch, return_exceptions=True))

    good, bad, other = run(scenario())
    assert good.column("y").to_pylist() == [2.0] and other.column("y").to_pylist() == [6.0]
    assert isinstance(bad, InvalidInput) and "-1" in str(bad)


def test_a_model_that_cannot_load_fails_the_batch_without_retrying_each_request() -> None:
    calls = []

    async def broken(table: pa.Table) -> pa.RecordBatch:
        calls.append(table.num_rows)
        await asyncio.sleep(0.01)
        raise RuntimeUnavailable("no onnxruntime here")

    async def scenario() -> list[Any]:
        batcher = Batcher("m:1", BatchLimits(64, 0.0, 100), broken)
        futures = [batcher.submit(rows(float(i)), "normal") for i in range(4)]
        return list(await asyncio.gather(*futures, return_exceptions=True))

    outcomes = run(scenario())
    assert all(isinstance(o, RuntimeUnavailable) for o in outcomes) and calls == [1, 3]


def test_a_full_queue_sheds_low_priority_first_with_a_retry_time() -> None:
    async def scenario() -> tuple[list[str], Batcher]:
        model = FakeModel(delay=0.05)
        batcher = Batcher("m:1", BatchLimits(1, 0.0, queue_capacity=4), model)
        outcome = []
        futures = []
        for priority in ["normal", "normal", "normal", "low", "normal", "high", "high"]:
            try:
                futures.append(batcher.submit(rows(1.0), priority))  # type: ignore[arg-type]
                outcome.append(f"{priority}:queued")
            except Overloaded as e:
                assert e.retry_after >= 1
                outcome.append(f"{priority}:shed")
        await asyncio.gather(*futures)
        return outcome, batcher

    outcome, batcher = run(scenario())
    # the first goes to the model at once; then 3 queued: low (limit 2) is shed, normal (limit 3) too, high fits
    assert outcome == ["normal:queued"] * 3 + ["low:shed", "normal:queued", "high:queued", "high:shed"]
    assert not batcher.busy and batcher.depths() == {"high": 0, "normal": 0, "low": 0}


def test_a_caller_that_went_away_is_not_scored() -> None:
    async def scenario() -> FakeModel:
        model = FakeModel()
        batcher = Batcher("m:1", BatchLimits(64, 0.0, 100), model)
        first = batcher.submit(rows(1.0), "normal")
        gone = batcher.submit(rows(2.0), "normal")
        kept = batcher.submit(rows(3.0), "normal")
        gone.cancel()
        await asyncio.gather(first, kept)
        return model

    assert run(scenario()).batches == [[1.0], [3.0]]


def test_close_fails_what_is_queued() -> None:
    async def scenario() -> Any:
        batcher = Batcher("m:1", BatchLimits(64, 0.0, 100), FakeModel())
        running = batcher.submit(rows(1.0), "normal")
        queued = batcher.submit(rows(2.0), "normal")
        await batcher.close(Overloaded("shutting down", 1))
        return await asyncio.gather(running, queued, return_exceptions=True)

    running, queued = run(scenario())
    assert running.column("y").to_pylist() == [2.0] and isinstance(queued, Overloaded)
