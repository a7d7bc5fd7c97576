"""Dynamic batching for one loaded model.

Requests queue by priority class; a batch goes to the model when it holds
``max_batch_size`` rows or its oldest request has waited ``max_wait_s``, and only
while fewer than ``max_concurrent_batches`` of the model's batches run. With a wait
of 0 a request goes at once when the model is idle, and batches form by themselves
while it is busy (Triton's default): low latency at low load, large batches at high.

A request is never split across batches; one larger than the batch limit goes alone.
If the model fails a batch, its requests are retried one by one, so one bad request
does not fail its neighbours. Requests are checked against the signature before they
are submitted (``DataPlane``); the batcher only queues, groups, calls and splits.

A fast model need not leave the event loop: with an ``inline`` callable (it scores a
batch on the caller's thread, or answers None when it should not: the model is not
loaded, or its measured time for these rows is over the inline budget), ``try_now``
scores a request at once in the request's own task when nothing is queued or running
(no future, no task, no thread hand-off), and every batch that forms under load is
offered to ``inline`` before it goes to ``predict``. Batches still form under load as
before: while one batch runs, arrivals queue and go together as the next.

A request's rows are ``Rows`` checked against the model's signature (``shardline.rows``): an
Arrow table, or float arrays (the protocol adapters' fast path); the callables answer a record
batch or a dict of numpy columns. A batch that holds both kinds is scored in two calls, its
float arrays together and its tables together, so that a batch under load costs no more per
request than a request scored alone (arrays made into Arrow and back would cost more than the model).

The queue is bounded in requests (``queue_capacity``, by priority: ``admits``) and in
bytes of rows (``queue_bytes``, by the same shares: ``admits_bytes``), so a few large
requests cannot hold unbounded memory while they wait; a request refused either way is
``Overloaded`` (503, Retry-After).

The decisions (``batch_wait``, ``take_batch``, ``admits_bytes``) are pure and tested without a loop.
Everything else runs on the event loop thread; the model runs wherever ``predict``
sends it (a thread pool).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Mapping, TypeAlias

import numpy as np
import pyarrow as pa
from opentelemetry.trace import Link, Span

from shardline.errors import InferenceFailed, InvalidBundle, Overloaded, RuntimeUnavailable
from shardline.observability import tracing
from shardline.online.admission import SHED_SHARE, admits, drain_seconds, retry_after
from shardline.rows import Rows
from shardline.tenants import PRIORITIES, Priority

Inputs: TypeAlias = Rows  # a request's (or a batch's) rows
Output: TypeAlias = "pa.RecordBatch | dict[str, np.ndarray]"  # a model's answer: rows, or numpy columns (from arrays)
Answer: TypeAlias = "pa.Table | dict[str, np.ndarray]"  # a request's part of it
Predict = Callable[[Inputs], Awaitable[Output]]
InlinePredict = Callable[[Inputs], "Output | None"]  # None: not now, send it to ``predict``
BatchObserver = Callable[[int, int, float], None]  # rows, requests, seconds
# Failures of the model as a whole (it cannot load): retrying rows one by one cannot help.
_MODEL_WIDE = (RuntimeUnavailable, InvalidBundle)
_RATE_SMOOTHING = 0.2


def _rows_of(output: Any, rows: int) -> int:
    """Rows of a scoring result: ``num_rows``, or the length of a dict's arrays (one that differs wins)."""
    if isinstance(output, dict):
        for values in output.values():
            if len(values) != rows:
                return len(values)
        return rows
    return int(getattr(output, "num_rows", rows))


@dataclass(frozen=True)
class BatchLimits:
    """How one model batches and how much it queues."""

    max_batch_size: int
    max_wait_s: float
    queue_capacity: int
    max_concurrent_batches: int = 1
    queue_bytes: int = 256 * 1024 * 1024  # bytes of rows queued at most (OnlineSettings.queue_bytes)

    def __post_init__(self) -> None:
        if (self.max_batch_size < 1 or self.queue_capacity < 1 or self.max_concurrent_batches < 1
                or self.queue_bytes < 1):
            raise ValueError(f"batch limits must be at least 1: {self}")
        if self.max_wait_s < 0:
            raise ValueError(f"max_wait_s must not be negative, got {self.max_wait_s}")


@dataclass
class Pending:
    """One queued request: its rows, class, arrival time and the future its answer goes to."""

    inputs: Inputs
    priority: Priority
    enqueued: float
    future: asyncio.Future[Answer] = field(repr=False)
    nbytes: int = 0  # of the rows, as ``rows_nbytes`` counts them
    span: Span | None = field(default=None, repr=False)  # its time in the batcher, when tracing is on

    @property
    def rows(self) -> int:
        """Rows of the request."""
        return self.inputs.num_rows


def rows_nbytes(inputs: Inputs) -> int:
    """Bytes a request's rows hold (what its place in the queue costs in memory)."""
    return inputs.nbytes


def admits_bytes(queued_bytes: int, request_bytes: int, capacity_bytes: int, priority: Priority) -> bool:
    """Whether a model's queue, holding ``queued_bytes`` of rows, takes a request of ``request_bytes``.

    A class may fill its share of ``capacity_bytes`` (``SHED_SHARE``: low half, normal 80%, high all);
    an empty queue takes any request (the body limit bounds it; refusing it would refuse it forever).
    """
    return queued_bytes == 0 or queued_bytes + request_bytes <= capacity_bytes * SHED_SHARE[priority]


def batch_wait(queued_rows: int, oldest_enqueued: float | None, now: float, limits: BatchLimits) -> float | None:
    """Seconds until a batch should go: 0.0 now, None when nothing is queued."""
    if oldest_enqueued is None:
        return None
    if queued_rows >= limits.max_batch_size:
        return 0.0
    return max(0.0, oldest_enqueued + limits.max_wait_s - now)


def take_batch(queues: Mapping[Priority, deque[Pending]], max_rows: int) -> list[Pending]:
    """Pop the next batch: highest class first, oldest first within a class, up to ``max_rows``.

    The first request is always taken, even when it alone is over ``max_rows``.
    """
    batch: list[Pending] = []
    rows = 0
    for priority in PRIORITIES:
        queue = queues[priority]
        while queue:
            head = queue[0]
            if batch and rows + head.rows > max_rows:
                return batch
            batch.append(queue.popleft())
            rows += head.rows
            if rows >= max_rows:
                return batch
    return batch


class Batcher:
    """Queues, groups and runs one model's requests; see the module docstring."""

    def __init__(
        self,
        model: str,
        limits: BatchLimits,
        predict: Predict,
        *,
        clock: Callable[[], float] = time.monotonic,
        observe: BatchObserver | None = None,
        inline: InlinePredict | None = None,
    ) -> None:
        self.model = model
        self.limits = limits
        self._predict = predict
        self._inline = inline
        self._clock = clock
        self._observe = observe
        self._queues: dict[Priority, deque[Pending]] = {p: deque() for p in PRIORITIES}
        self._queued_rows = 0
        self._queued_bytes = 0
        self._running_batches = 0
        self._running_requests = 0
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.rows_per_second: float | None = None

    # -- what the metrics and the reaper read -------------------------------------------
    def depths(self) -> dict[Priority, int]:
        """Requests queued per priority class."""
        return {p: len(q) for p, q in self._queues.items()}

    @property
    def queued(self) -> int:
        """Requests queued, all classes."""
        return sum(len(q) for q in self._queues.values())

    @property
    def in_flight(self) -> int:
        """Requests in batches that are running now."""
        return self._running_requests

    @property
    def busy(self) -> bool:
        """Whether anything is queued or running."""
        return self._running_batches > 0 or self.queued > 0

    # -- submitting -------------------------------------------------------------------
    def submit(self, inputs: Inputs, priority: Priority) -> asyncio.Future[Answer]:
        """Queue rows; the future gets the model's answer for them (output rows, or numpy columns
        for float arrays).

        Raises:
            Overloaded: the queue is past what this priority class may fill.
        """
        queued = self.queued
        if not admits(queued, self.limits.queue_capacity, priority):
            wait = drain_seconds(self._queued_rows, self.rows_per_second)
            raise Overloaded(
                f"model {self.model!r} has {queued} requests queued, the most a {priority}-priority "
                f"request may join; it is shed to keep latency bounded: retry after {retry_after(wait)} s "
                "or ask for a higher priority class",
                retry_after(wait),
            )
        nbytes = rows_nbytes(inputs)
        if not admits_bytes(self._queued_bytes, nbytes, self.limits.queue_bytes, priority):
            wait = drain_seconds(self._queued_rows, self.rows_per_second)
            raise Overloaded(
                f"model {self.model!r} has {self._queued_bytes} bytes of rows queued; this request's {nbytes} "
                f"would pass the {SHED_SHARE[priority]:.0%} of the queue's {self.limits.queue_bytes} bytes "
                f"(SHARDLINE_ONLINE_QUEUE_BYTES) that a {priority}-priority request may fill: retry after "
                f"{retry_after(wait)} s, send fewer rows per request or ask for a higher priority class",
                retry_after(wait),
            )
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        pending = Pending(inputs, priority, self._clock(), future, nbytes)
        if tracing.ENABLED and tracing.recording():
            pending.span = _queued_span(self.model, inputs.num_rows, priority, future)
        self._queues[priority].append(pending)
        self._queued_rows += inputs.num_rows
        self._queued_bytes += nbytes
        self._dispatch()
        return future

    def try_now(self, inputs: Inputs) -> Answer | None:
        """Score rows at once on the caller's thread when the model is idle and ``inline`` takes them.

        The rows count as a batch of one request. Returns their answer, or None (nothing was
        done: ``submit`` them) when something is queued or running, the model waits for
        companions (``max_wait_s`` > 0), there is no ``inline`` callable, or it declined.

        Raises:
            Whatever the model raised for these rows (they were a batch of their own).
        """
        inline = self._inline
        if inline is None or self._running_batches or self._queued_rows or self.limits.max_wait_s > 0:
            return None
        rows = inputs.num_rows
        started = self._clock()
        self._running_batches += 1
        self._running_requests += 1
        began = time.time_ns() if tracing.ENABLED and tracing.recording() else 0
        try:
            output = inline(inputs)
        except BaseException as e:
            if began:
                tracing.end(self._inline_span(rows, began), error=e)
            raise
        finally:
            self._running_batches -= 1
            self._running_requests -= 1
        if output is None:
            return None
        if began:
            self._inline_span(rows, began).end()
        got = _rows_of(output, rows)
        if got != rows:
            raise self._wrong_rows(got, rows)
        self._measured(rows, 1, self._clock() - started)
        return output if isinstance(output, dict) else pa.Table.from_batches([output])

    def _wrong_rows(self, got: int, rows: int) -> InferenceFailed:
        return InferenceFailed(
            f"model {self.model!r} returned {got} rows for {rows}; a runtime must return one row per input row"
        )

    async def _score(self, inputs: Inputs) -> Output:
        """On the event loop when ``inline`` takes the rows, else through ``predict``."""
        if self._inline is not None:
            output = self._inline(inputs)
            if output is not None:
                return output
        return await self._predict(inputs)

    def _oldest(self) -> float | None:
        heads = [q[0].enqueued for q in self._queues.values() if q]
        return min(heads) if heads else None

    def _dispatch(self) -> None:
        """Start every batch that is due and may run; otherwise set a timer for the next one."""
        while self._running_batches < self.limits.max_concurrent_batches:
            wait = batch_wait(self._queued_rows, self._oldest(), self._clock(), self.limits)
            if wait is None:
                return
            if wait > 0:
                self._arm(wait)
                return
            batch = take_batch(self._queues, self.limits.max_batch_size)
            self._queued_rows -= total_rows(batch)
            self._queued_bytes -= sum(p.nbytes for p in batch)
            live = [p for p in batch if not p.future.done()]  # a caller that went away is dropped
            if not live:
                continue
            self._running_batches += 1
            self._running_requests += len(live)
            task = asyncio.get_running_loop().create_task(self._run(live))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _arm(self, wait: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(wait, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._dispatch()

    async def _run(self, batch: list[Pending]) -> None:
        started = self._clock()
        try:
            arrays = [p for p in batch if p.inputs.arrays is not None]
            if arrays and len(arrays) < len(batch):  # both kinds: each scored in its own call
                await self._run_part(arrays)
                await self._run_part([p for p in batch if p.inputs.arrays is None])
            else:
                await self._run_part(batch)
            self._measured(total_rows(batch), len(batch), self._clock() - started)
        finally:
            self._running_batches -= 1
            self._running_requests -= len(batch)
            self._dispatch()

    async def _run_part(self, batch: list[Pending]) -> None:
        """Score requests of one kind (all tables or all float arrays) in one call and answer each."""
        rows = total_rows(batch)
        inputs = batch[0].inputs if len(batch) == 1 else Rows.concat([p.inputs for p in batch])
        span = self._predict_span(batch, rows) if tracing.ENABLED and any(p.span for p in batch) else None
        try:
            output = await self._score(inputs)
        except Exception as e:  # noqa: BLE001 - each request gets the outcome that is its own
            if span is not None:
                tracing.end(span, error=e)
            if len(batch) == 1 or isinstance(e, _MODEL_WIDE):
                for pending in batch:
                    _fail(pending, e)
            else:
                await self._one_by_one(batch)
            return
        if span is not None:
            span.end()
        got = _rows_of(output, rows)
        if got != rows:
            error = self._wrong_rows(got, rows)
            for pending in batch:
                _fail(pending, error)
            return
        offset = 0
        for pending in batch:
            _answer(pending, _part(output, offset, pending.rows))
            offset += pending.rows

    def _inline_span(self, rows: int, began_ns: int) -> Span:
        """The runtime's call for rows scored inline (made once it took them: a declined call leaves no span)."""
        return tracing.start("shardline.runtime.predict", start_time=began_ns, attributes={
            "shardline.model": self.model, "shardline.batch.rows": rows, "shardline.batch.requests": 1})

    def _predict_span(self, batch: list[Pending], rows: int) -> Span:
        """The runtime's call for a batch: a child of its first request's time in the batcher, linked to every
        request's (one batch serves several traces)."""
        first = next((p.span for p in batch if p.span is not None), None)
        parent = None if first is None else tracing.context_of(first)
        return tracing.start("shardline.runtime.predict", parent=parent, attributes={
            "shardline.model": self.model, "shardline.batch.rows": rows, "shardline.batch.requests": len(batch),
        }, links=[Link(p.span.get_span_context()) for p in batch if p.span is not None])

    async def _one_by_one(self, batch: list[Pending]) -> None:
        for pending in batch:
            try:
                output = await self._score(pending.inputs)
            except Exception as e:  # noqa: BLE001
                _fail(pending, e)
            else:
                _answer(pending, _part(output, 0, pending.rows))

    def _measured(self, rows: int, requests: int, seconds: float) -> None:
        if seconds > 0:
            rate = rows / seconds
            previous = self.rows_per_second
            self.rows_per_second = rate if previous is None else previous + _RATE_SMOOTHING * (rate - previous)
        if self._observe is not None:
            self._observe(rows, requests, seconds)

    async def close(self, error: BaseException) -> None:
        """Fail what is queued with ``error`` and wait for running batches to end."""
        if self._timer is not None:
            self._timer.cancel()
        for queue in self._queues.values():
            while queue:
                _fail(queue.popleft(), error)
        self._queued_rows = 0
        self._queued_bytes = 0
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _part(output: Output, offset: int, rows: int) -> Answer:
    """A request's rows of a batch's output: numpy columns (views) or a table."""
    if isinstance(output, dict):
        if offset == 0 and rows == _rows_of(output, rows):
            return output
        return {name: values[offset:offset + rows] for name, values in output.items()}
    if offset == 0 and rows == output.num_rows:
        return pa.Table.from_batches([output])
    return pa.Table.from_batches([output.slice(offset, rows)])


def _answer(pending: Pending, answer: Answer) -> None:
    if not pending.future.done():
        pending.future.set_result(answer)


def _fail(pending: Pending, error: BaseException) -> None:
    if not pending.future.done():
        pending.future.set_exception(error)


def _queued_span(model: str, rows: int, priority: Priority, future: asyncio.Future[Answer]) -> Span:
    """A request's time in the batcher, from its arrival to its answer (a child of the request's span)."""
    span = tracing.start("shardline.batcher", attributes={
        "shardline.model": model, "shardline.rows": rows, "shardline.priority": str(priority)})

    def done(future: asyncio.Future[Answer]) -> None:
        error = None if future.cancelled() else future.exception()
        tracing.end(span, error=error)

    future.add_done_callback(done)
    return span


def total_rows(batch: Iterable[Pending]) -> int:
    """Rows of a batch."""
    return sum(p.rows for p in batch)
