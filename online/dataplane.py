"""The data plane: tenant, model reference and Arrow rows in, Arrow rows out; no protocol.

Every wire protocol is a thin adapter over it (``online/protocols``). It answers with
rows or raises domain errors (``shardline.errors``); only the HTTP edge turns those into
status codes. Per request: authenticate the tenant (``authenticate``), hold its rate and
concurrency quota (``admit``), find the version it may call (``model``), check the rows
against the signature, queue them by the tenant's priority in the version's batcher,
and score them through the same model cache as the batch tier. Idle versions are
unloaded (scale to zero) and load again on their next request.

A request with a deadline (``X-Shardline-Timeout-Ms``, as the router sends what is left of
its own) is not scored once it has passed: one that arrives late is refused at once, and one
still queued or in a batch when it passes is answered 504 then (``DeadlineExceeded``) and
dropped from the queue, so a replica under a backlog spends no time on callers that have
given up.

Everything here runs on the event loop thread except what is sent to the thread
pools: inference and loading (``shardline-infer``), registry reads
(``shardline-registry``), and the protocol adapters' work on large bodies (``off_loop``:
decompressing, decoding, encoding; ``shardline-codec``). A loaded model whose measured time for a batch fits
``inline_max_ms`` is scored on the event loop instead (a thread hand-off costs more
than such a model); loading, and any slower model, always goes to the pool.

Capture (``capture_rate`` > 0 and a ``capture_root``, see ``online/capture.py``): a sampled
request's checked rows and its answer are appended to the version's capture buffer, whose
own thread writes Parquet; the buffers are flushed and closed when the plane stops.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import numpy as np
import pyarrow as pa

from shardline.bundle import ModelRef
from shardline.errors import (
    BudgetExceeded,
    DeadlineExceeded,
    InferenceFailed,
    InvalidInput,
    Overloaded,
)
from shardline.online.admission import TenantGate, next_seconds_per_row, runs_inline
from shardline.online.batcher import Batcher
from shardline.online.budgets import BudgetBoard
from shardline.online.capture import OnlineCapture
from shardline.online.generation import Generations
from shardline.online.headers import TIMEOUT_HEADER
from shardline.online.logs import CURRENT, deadline_left
from shardline.online.metrics import Metrics, ModelState, Snapshot
from shardline.online.models import ModelDirectory, ModelStatus, ServedModel
from shardline.online.served import ServedModels
from shardline.online.tenants import Tenant, TenantDirectory
from shardline.rows import Rows, check_rows
from shardline.runtimes import RuntimeOptions, generates
from shardline.runtimes.base import out_of_memory, split_out_of_memory
from shardline.settings import OnlineSettings
from shardline.storage.model_cache import ModelCache
from shardline.storage.registry import ModelRegistry, ResolvedModel

log = logging.getLogger("shardline.online")
T = TypeVar("T")
_CODEC_THREADS = 2  # decoding holds the GIL (orjson, numpy): more threads would not decode faster


class DataPlane:
    """Serves the tenants' models; see the module docstring."""

    def __init__(
        self,
        settings: OnlineSettings,
        registry: ModelRegistry,
        cache: ModelCache,
        tenants: TenantDirectory,
        runtime: RuntimeOptions = RuntimeOptions(),
        *,
        storage_options: dict[str, Any] | None = None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        capture_root: str | None = None,
        budgets: BudgetBoard | None = None,
    ) -> None:
        self.settings = settings
        self.budgets = budgets or BudgetBoard(None, 60.0)  # none: no tenant is ever past a threshold
        self.cache = cache
        self.tenants = tenants
        self.runtime = runtime
        self.storage_options = storage_options
        self.metrics = metrics or Metrics()
        self._clock = clock
        self._infer_pool: ThreadPoolExecutor | None = None
        self._io_pool: ThreadPoolExecutor | None = None
        self._codec_pool: ThreadPoolExecutor | None = None
        self.directory = ModelDirectory(registry, self._blocking_io, settings.alias_refresh_s, clock)
        self._gates: dict[str, TenantGate] = {}
        self._tokenizers: dict[str, Any] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._workers = settings.resolved_workers()  # each of N server processes holds 1/N of every quota
        self.capture = OnlineCapture(capture_root, settings.capture_rate, self.metrics, storage_options)
        self.models = ServedModels(settings, self.directory, cache, runtime, self.capture, clock, self._blocking_io)
        self.models.batcher_for = self._batcher_for
        self.started = False
        self.stopping = False
        self.metrics.watch(self.snapshot)
        self.llm = Generations(self)  # text generation (the LLM endpoints)

    # -- life cycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Start the thread pools and the idle reaper; warn about references that do not resolve."""
        self._infer_pool = ThreadPoolExecutor(self.settings.resolved_threads(), thread_name_prefix="shardline-infer")
        self._io_pool = ThreadPoolExecutor(2, thread_name_prefix="shardline-registry")
        self._codec_pool = ThreadPoolExecutor(_CODEC_THREADS, thread_name_prefix="shardline-codec")
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())
        self.metrics.start()
        self.budgets.start()
        self.started = True
        for tenant in self.tenants.tenants.values():
            for ref in tenant.models.values():
                try:
                    await self.directory.resolve(ref)
                except Exception as e:  # noqa: BLE001 - pushed or reachable later: its requests will say so
                    log.warning("a tenant's model does not resolve yet", extra={"fields": {
                        "tenant": tenant.name, "reference": str(ref), "error": f"{type(e).__name__}: {e}"}})

    async def stop(self) -> None:
        """Fail what is still queued, write what capture holds, stop the reaper and the pools."""
        self.stopping = True
        if self._reaper is not None:
            self._reaper.cancel()
        await self.directory.close()
        for served in self.models.values():
            await served.batcher.close(Overloaded("the server is shutting down; retry on another replica", 1))
        await self.capture.close(self._blocking_io)  # writes what is pending
        for pool in (self._infer_pool, self._io_pool, self._codec_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self.budgets.stop()
        self.metrics.close()

    @property
    def clock(self) -> Callable[[], float]:
        """The plane's monotonic clock (quotas, idle times)."""
        return self._clock

    @property
    def ready(self) -> bool:
        """Whether the server takes requests (started, not stopping); models may be scaled to zero."""
        return self.started and not self.stopping

    async def off_loop(self, call: Callable[[], T]) -> T:
        """Run a protocol adapter's CPU-heavy work on a large body (decompress, decode, encode) on the
        codec threads, so the event loop answers other requests meanwhile (with the request's context)."""
        if self._codec_pool is None:
            raise RuntimeError("DataPlane.start() was not awaited")
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._codec_pool, context.run, call)

    async def _blocking_io(self, call: Callable[[], T]) -> T:
        if self._io_pool is None:
            raise RuntimeError("DataPlane.start() was not awaited")
        return await asyncio.get_running_loop().run_in_executor(self._io_pool, call)

    # -- tenants ------------------------------------------------------------------------
    def authenticate(self, authorization: str | None, on_behalf_of: str | None = None) -> Tenant:
        """The tenant an ``Authorization`` header names; behind a router, the one its ``X-Shardline-Tenant``
        header names (see ``TenantDirectory.authenticate``)."""
        return self.tenants.authenticate(authorization, on_behalf_of)

    def admit(self, tenant: Tenant) -> TenantGate:
        """The tenant's gate, to enter around a request (``with plane.admit(tenant):``): it holds
        one of the tenant's concurrent requests and takes a token of its rate, or refuses.

        With ``workers`` server processes, each holds its share of the quotas (``worker_share``).
        The tenant's budget is asked first (``online/budgets.py``): past a threshold the answer is marked.

        Raises:
            BudgetExceeded: the tenant is at its monthly budget's hard limit (429, Retry-After to the month's end).

        Raises (on entering):
            RateLimited: over ``max_concurrent`` or the token bucket is empty.
        """
        self._check_budget(tenant.name)
        gate = self._gates.get(tenant.name)
        if gate is None or gate.tenant is not tenant:
            gate = self._gates[tenant.name] = TenantGate(tenant, self._workers, self._clock, self._count_refusal)
        return gate

    def _check_budget(self, tenant: str) -> None:
        try:
            state = self.budgets.check(tenant)
        except BudgetExceeded:
            self.metrics.budget_requests.labels(tenant, "hard").inc()
            self._count_refusal(tenant, "budget")
            raise
        if state is not None:
            self.metrics.budget_requests.labels(tenant, state.state).inc()
            info = CURRENT.get()
            if info is not None:
                info.budget = state.state

    def _count_refusal(self, tenant: str, quota: str) -> None:
        self.metrics.rate_limited.labels(tenant, quota).inc()

    # -- models (``online/served.py``) --------------------------------------------------
    async def model(
        self, tenant: Tenant, name: str, version: str | int | None = None, alias: str | None = None,
        variant: str | None = None,
    ) -> ServedModel:
        """The version of a model that a request means (``ServedModels.model``), as the variant the request names
        (``variant``, else its ``X-Shardline-Variant``: a router's fallback) when it names one; else, for a tenant
        past its budget's soft limit (``admit`` marked the request), its cheaper precision variant when it has
        one, the answer marked ``X-Shardline-Fallback: name:version#variant``. Every protocol asks here (V2 and
        ``/v1`` alike, ``model_for_reference``)."""
        info = CURRENT.get()
        if variant is None and info is not None and info.variant:
            variant = info.variant
        soft = variant is None and info is not None and info.budget == "soft"
        served = await self.models.model(tenant, name, version, alias, variant, cheaper=soft)
        if soft and info is not None and served.resolved.variant_name:
            info.fallback = f"{served.resolved.pinned}#{served.resolved.variant_name}"
        return served

    async def model_for_reference(self, tenant: Tenant, reference: str) -> ServedModel:
        """Like ``model`` for a reference string: ``name``, ``name@alias`` or ``name:version`` (``/v1``'s
        ``model``), with the same variant and budget choice."""
        name, alias, version = ModelRef.split(reference)
        return await self.model(tenant, name, version=version, alias=alias)

    async def versions(self, tenant: Tenant, name: str) -> list[int]:
        """The registry versions of a model the tenant may call."""
        return await self.models.versions(tenant, name)

    def is_loaded(self, served: ServedModel) -> bool:
        """Whether the version is loaded now (not scaled to zero)."""
        return self.models.is_loaded(served)

    async def model_status(self, tenant: Tenant, name: str, version: str | int | None = None) -> ModelStatus:
        """Whether a request for the model would be served now, and whether it is loaded; loads nothing.

        Ready means a request would be served: the server takes requests, the tenant may call
        the model, its version resolves, and (unless it is loaded) its runtime is installed and
        its bundle is at hand (``missing_for_serving``, remembered once found: versions never change).

        Raises:
            ModelNotFound, InvalidInput: as ``model``.
        """
        return await self.models.status(await self.model(tenant, name, version), self.ready)

    def _batcher_for(self, resolved: ResolvedModel, key: tuple[str, int, str], limits: Any) -> Batcher:
        """A served version's batcher: its batches scored by this plane (inline when fast, else on the pool)."""
        version = resolved.version_label

        def observe(rows: int, requests: int, seconds: float) -> None:
            self.metrics.observe_batch(resolved.name, version, rows, requests, seconds)

        async def predict(table: pa.Table) -> pa.RecordBatch:
            return await self._predict(key, table)

        def inline(table: pa.Table) -> pa.RecordBatch | None:
            return self._predict_inline(key, table)

        return Batcher(resolved.pinned, limits, predict, clock=self._clock, observe=observe, inline=inline)

    # -- inference ----------------------------------------------------------------------
    async def infer(
        self, tenant: Tenant, model: ServedModel | str, rows: pa.Table | Rows, *, captured: bool | None = None,
    ) -> pa.Table | dict[str, np.ndarray]:
        """Score rows with a model the tenant may call; the answer has one row per input row.

        Args:
            tenant: who asks (its priority orders the queue).
            model: a version from ``model()``, or a reference string.
            rows: an Arrow table holding at least the signature's input columns (checked here with the
                kernel's one row check, ``check_rows``), or ``Rows`` a protocol adapter made for this
                version's signature (checked when they were made: they carry its plan). Float ``Rows``
                are scored from their arrays, without Arrow, alone or batched with others.
            captured: whether the request is captured (``capture.draw()``); None: drawn here.

        Returns:
            The output rows as a table, or, for float ``Rows`` a runtime scored from their arrays,
            each output column as a numpy array.

        Raises:
            ModelNotFound, InvalidInput (and its subclasses; a model that generates text, whose tenants' token
            quotas and metering only ``/v1``'s generation endpoints hold), Overloaded, InferenceFailed,
            RuntimeUnavailable.
        """
        served = model if isinstance(model, ServedModel) else await self.model_for_reference(tenant, model)
        runtime = served.resolved.manifest.runtime
        if generates(runtime):
            raise InvalidInput(f"{served.pinned} generates text (runtime {runtime!r}): send its prompts to "
                               "/v1/chat/completions or /v1/completions, where the tenant's token quotas and "
                               "metering hold")
        plan = served.signature.plan
        checked = rows if isinstance(rows, Rows) and rows.plan is plan else check_rows(
            rows.table() if isinstance(rows, Rows) else rows, served.signature, served.pinned)
        if checked.num_rows == 0:
            return plan.output_schema.empty_table()
        answer = await self._score_rows(tenant, served, checked)
        if captured is None:
            captured = self.capture.draw()
        if captured:
            self.capture.sample(served.name, served.version, tenant.name, checked, answer, True)
        return answer  # type: ignore[no-any-return]

    async def _score_rows(self, tenant: Tenant, served: ServedModel, rows: Rows) -> Any:
        """At once when the model is fast and idle (``Batcher.try_now``), else through its queue; never past
        the request's deadline (``RequestInfo.deadline``).

        Raises:
            DeadlineExceeded: the deadline passed before the rows were scored (the batcher drops them).
        """
        served.last_used = self._clock()
        left = deadline_left()
        if left is not None and left <= 0:
            raise DeadlineExceeded(f"the request's deadline ({TIMEOUT_HEADER}) had passed when it reached model "
                                   f"{served.name!r}; send a longer {TIMEOUT_HEADER}")
        answer = served.batcher.try_now(rows)  # a fast, loaded, idle model: scored here, at once
        if answer is None:
            try:
                future = served.batcher.submit(rows, tenant.priority)
            except Overloaded:
                self.metrics.shed.labels(served.name, str(served.version), tenant.name, tenant.priority).inc()
                raise
            timer = None if left is None else asyncio.get_running_loop().call_later(left, _expire, future, served.name)
            try:
                answer = await future
            finally:
                served.last_used = self._clock()
                if timer is not None:
                    timer.cancel()
        served.last_used = self._clock()
        if self.metrics.ledger is not None:
            self.metrics.observe_rows(served.name, served.version_label, tenant.name, rows.num_rows,
                                      rows.nbytes, _answer_nbytes(answer))
        return answer

    async def _predict(self, key: tuple[str, int, str], inputs: Rows) -> Any:
        served = self.models[key]
        while served.unloading is not None:  # an unload in progress ends before the model is used again
            await asyncio.shield(served.unloading)
        if self._infer_pool is None:
            raise RuntimeError("DataPlane.start() was not awaited")
        context = contextvars.copy_context()  # log lines on the pool thread keep the request id
        return await asyncio.get_running_loop().run_in_executor(
            self._infer_pool, context.run, self._predict_blocking, served, inputs
        )

    def _predict_inline(self, key: tuple[str, int, str], inputs: Rows) -> Any:
        """Score on the event loop when the model is loaded and fast enough (see ``runs_inline``), else None."""
        served = self.models[key]
        if served.unloading is not None or not runs_inline(
                inputs.num_rows, served.seconds_per_row, self.settings.inline_max_ms / 1000.0):
            return None
        runtime = self.cache.held(served.content_digest, self.runtime)
        if runtime is None:  # scaled to zero or evicted: loading is for the pool
            return None
        return self._score(served, runtime, inputs)

    async def runtime_for(self, served: ServedModel) -> Any:
        """The version's loaded runtime (loaded through the model cache on a pool thread if it is not held):
        for a runtime used beside ``infer``, such as an LLM's generation engine."""
        runtime = self.cache.held(served.content_digest, self.runtime)
        if runtime is not None:
            return runtime
        if self._infer_pool is None:
            raise RuntimeError("DataPlane.start() was not awaited")
        return await asyncio.get_running_loop().run_in_executor(self._infer_pool, self._load_blocking, served)

    def _predict_blocking(self, served: ServedModel, inputs: Rows) -> Any:
        """Score on a pool thread through the model cache (which loads the model if it is not held)."""
        return self._score(served, self._load_blocking(served), inputs)

    def _load_blocking(self, served: ServedModel) -> Any:
        """The version's runtime from the model cache, loaded (and counted, logged) if it is not held."""
        resolved = served.resolved
        runtime = self.cache.held(served.content_digest, self.runtime)
        if runtime is None:
            started = time.perf_counter()
            runtime, loaded = self.cache.get_or_load(resolved, self.runtime, self.storage_options)
            if loaded:  # (batches that waited for this load on other pool threads do not count it again)
                self.metrics.loads.labels(resolved.name, str(resolved.version)).inc()
                if getattr(runtime, "fell_back_to_cpu", False):
                    self.metrics.device_fallbacks.labels(resolved.name, str(resolved.version)).inc()
                log.info("model loaded", extra={"fields": {
                    "model": resolved.pinned, "device": runtime.device, "seconds": round(time.perf_counter() - started, 3)}})
        return runtime

    def _score(self, served: ServedModel, runtime: Any, inputs: Rows) -> Any:
        """``runtime.predict`` (which picks its own fast path for the rows), timed (its smoothed
        time per row decides what runs inline).

        A batch the device has no memory for (``out_of_memory``) is split in two and each half scored
        the same way, down to one row; the model's batch limit is lowered to the half that fit, so the
        next batches are cut smaller before they are tried. Counted in ``shardline_oom_splits`` and
        logged. Only a single row that does not fit fails (InferenceFailed)."""
        if inputs.num_rows <= 1:  # nothing to split (most online requests): no closures made per call
            return self._timed(served, runtime, inputs)
        resolved = served.resolved

        def split(rows: int, half: int) -> None:
            limits = served.batcher.limits
            if limits.max_batch_size > half:
                served.batcher.limits = dataclasses.replace(limits, max_batch_size=max(1, half))
            self.metrics.oom_splits.labels(resolved.name, served.version_label).inc()
            log.warning("out of memory on a batch: split in two, the batch limit lowered", extra={"fields": {
                "model": resolved.pinned, "rows": rows, "max_batch_size": served.batcher.limits.max_batch_size}})

        return split_out_of_memory(
            lambda rows: self._timed(served, runtime, rows), inputs, split,
            lambda e: isinstance(e, InferenceFailed) and out_of_memory(e.__cause__))

    def _timed(self, served: ServedModel, runtime: Any, inputs: Rows) -> Any:
        """``runtime.predict(inputs)``, timed into ``served.seconds_per_row``; a failure not the request's is
        InferenceFailed.

        On a CPU runtime the time is the calling thread's CPU time: what the call would hold the
        event loop for, without the time the thread waited for the GIL or for a core (a pool
        thread under load waits for both, and would make a fast model look slow and keep it off
        the loop exactly when the loop is busiest). On a GPU the call's wall time counts (the
        thread sleeps while the device works, but the loop would wait all the same).
        """
        clock = served.clock
        if clock is None:
            clock = served.clock = time.thread_time if getattr(runtime, "device", "cpu") == "cpu" else time.perf_counter
        started = clock()
        try:
            output = runtime.predict(inputs)
        except InvalidInput:
            raise
        except Exception as e:  # an eviction meanwhile cannot cause it: the cache drops models, never closes them
            raise InferenceFailed(
                f"model {served.resolved.pinned} failed on {inputs.num_rows} rows that passed its signature check "
                f"({type(e).__name__}: {e}); this is a fault of the model or the server, not of the request"
            ) from e
        served.seconds_per_row = next_seconds_per_row(served.seconds_per_row,
                                                      (clock() - started) / max(1, inputs.num_rows))
        return output

    async def count_tokens(self, served: ServedModel, texts: list[str]) -> int:
        """Tokens the model read for ``texts`` (its own tokenizer and cut); 0 for a model without one."""
        if self._infer_pool is None:
            raise RuntimeError("DataPlane.start() was not awaited")
        return await asyncio.get_running_loop().run_in_executor(
            self._infer_pool, self._count_tokens_blocking, served, texts
        )

    def _count_tokens_blocking(self, served: ServedModel, texts: list[str]) -> int:
        resolved = served.resolved
        config = resolved.manifest.runtime_config.get("text_inputs")
        if not isinstance(config, dict):
            return 0
        digest = served.content_digest
        tokenizer = self._tokenizers.get(digest)
        if tokenizer is None:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(self.cache.local_dir(resolved) / config["tokenizer"]))
            tokenizer.enable_truncation(max_length=int(config["max_length"]))
            tokenizer.no_padding()
            self._tokenizers[digest] = tokenizer
        return sum(len(e.ids) for e in tokenizer.encode_batch(texts))

    # -- scale to zero ------------------------------------------------------------------
    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reap_interval_s)
            try:
                await self.reap_idle()
                self.metrics.refresh()  # with several workers, the gauges the others read
            except Exception:  # noqa: BLE001 - the reaper must outlive one bad pass
                log.exception("the idle reaper failed a pass")

    async def reap_idle(self) -> list[str]:
        """Unload every version idle past its time-out; returns the ones unloaded (``name:version``)."""
        return await self.models.reap_idle(
            lambda served: self.metrics.unloads.labels(served.name, str(served.version)).inc())

    # -- what the metrics read ----------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The gauges' values now."""
        loaded = set(self.cache.loaded())
        now = self._clock()
        models = [
            ModelState(s.name, str(s.version), s.content_digest in loaded, dict(s.batcher.depths()), s.batcher.in_flight,
                       max(0.0, now - s.last_used))
            for s in self.models.values()
        ]
        return Snapshot(models, {name: gate.in_flight for name, gate in self._gates.items()}, self._engine_stats())

    def _engine_stats(self) -> dict[tuple[str, str], dict[str, int]]:
        """(model, version) -> its generation engine's stats (waiting, slots busy, decode steps), for loaded LLMs."""
        stats = {}
        for served in self.models.values():
            if not generates(served.resolved.manifest.runtime):
                continue
            runtime = self.cache.held(served.content_digest, self.runtime)
            if runtime is not None:
                stats[(served.name, str(served.version))] = runtime.engine.stats()
        return stats


def _expire(future: asyncio.Future[Any], model: str) -> None:
    """Answer a queued request whose deadline passed (the batcher drops a request whose future is done)."""
    if not future.done():
        future.set_exception(DeadlineExceeded(
            f"the request's deadline ({TIMEOUT_HEADER}) passed while it waited in the queue of model {model!r}; "
            f"retry, or send a longer {TIMEOUT_HEADER}"))


def _answer_nbytes(answer: Any) -> int:
    """Bytes of an answer: an Arrow table or batch, or a dict of numpy arrays."""
    if isinstance(answer, dict):
        return sum(int(getattr(a, "nbytes", 0)) for a in answer.values())
    return int(getattr(answer, "nbytes", 0))

