"""The fast paths of the online tier: inline scoring, matrix rows and the matrix path, per-worker quotas,
the infer path parser."""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pytest

from shardline.errors import InvalidInput, RateLimited
from shardline.online.admission import runs_inline, worker_share
from shardline.online.batcher import Batcher, BatchLimits
from shardline.online.dataplane import DataPlane, input_schema
from shardline.online.matrix_rows import MatrixRows
from shardline.online.protocols.kserve_v2 import decode_infer_request, encode_infer_response, infer_path_params
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.runtimes import RuntimeOptions
from shardline.settings import OnlineSettings
from shardline.signature import ColumnSpec, Signature
from shardline.storage.model_cache import ModelCache
from shardline.storage.registry import ModelRegistry

from tests.conftest import BuiltModel


# -- pure decisions -------------------------------------------------------------------------------
def test_only_a_measured_model_whose_rows_fit_the_budget_runs_inline() -> None:
    assert runs_inline(10, 20e-6, 0.0005)  # 200 us of a 500 us budget
    assert not runs_inline(64, 20e-6, 0.0005)  # 1.28 ms: to a thread
    assert not runs_inline(1, None, 0.0005)  # never measured: to a thread, so a slow model never blocks the loop
    assert not runs_inline(1, 1e-9, 0.0)  # budget 0: everything to threads


def test_each_worker_holds_its_share_of_a_quota_rounded_up() -> None:
    assert worker_share(200, 1) == 200
    assert worker_share(200, 2) == 100
    assert worker_share(5, 2) == 3
    assert worker_share(1, 4) == 1  # never 0


def test_inference_paths_are_recognised_and_nothing_else() -> None:
    assert infer_path_params("/v2/models/churn/infer") == {"name": "churn"}
    assert infer_path_params("/v2/models/churn/versions/3/infer") == {"name": "churn", "version": "3"}
    for other in ("/v2/models/churn", "/v2/models//infer", "/v2/models/churn/ready", "/v1/models/churn/infer",
                  "/v2/models/churn/versions//infer", "/v2/models/a/b/infer"):
        assert infer_path_params(other) is None, other


# -- matrix rows ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arrow_type", [pa.float32(), pa.float64()])
def test_matrix_rows_are_the_table_built_column_by_column(arrow_type: pa.DataType) -> None:
    schema = pa.schema([pa.field(f"f{j}", arrow_type, nullable=False) for j in range(7)])
    builder = MatrixRows(schema)
    rng = np.random.default_rng(1)
    for rows in (1, 2, 3, 5, 64, 1, 3):  # again: from the remembered templates
        matrix = rng.normal(size=(rows, 7))
        table = builder.table(matrix)
        expected = pa.table({f"f{j}": pa.array(matrix[:, j].astype(arrow_type.to_pandas_dtype())) for j in range(7)},
                            schema=schema)
        assert table.equals(expected), rows
    with pytest.raises(ValueError, match="one float type"):
        MatrixRows(pa.schema([("a", pa.float32()), ("b", pa.int64())]))


# -- the batcher with an inline model ------------------------------------------------------------
class TwoPathModel:
    """Doubles x on the event loop (``inline``) unless told not to, or in a coroutine (``predict``)."""

    def __init__(self, inline_ok: bool = True) -> None:
        self.inline_ok = inline_ok
        self.calls: list[tuple[str, list[float]]] = []

    def inline(self, table: pa.Table) -> pa.RecordBatch | None:
        if not self.inline_ok:
            return None
        values = table.column("x").to_pylist()
        self.calls.append(("inline", values))
        if -1 in values:
            raise InvalidInput("x = -1 cannot be scored")
        return pa.RecordBatch.from_pydict({"y": [2 * v for v in values]})

    async def predict(self, table: pa.Table) -> pa.RecordBatch:
        values = table.column("x").to_pylist()
        self.calls.append(("pool", values))
        await asyncio.sleep(0.01)
        return pa.RecordBatch.from_pydict({"y": [2 * v for v in values]})


def rows(*values: float) -> pa.Table:
    return pa.table({"x": pa.array(values, pa.float64())})


def test_an_idle_fast_model_scores_at_once_and_a_busy_one_still_batches() -> None:
    async def scenario() -> tuple[Any, ...]:
        model = TwoPathModel()
        batcher = Batcher("m:1", BatchLimits(64, 0.0, 100), model.predict, inline=model.inline)
        now = batcher.try_now(rows(1.0))
        with pytest.raises(InvalidInput):
            batcher.try_now(rows(-1.0))  # its own error, raised to its own caller
        model.inline_ok = False
        declined = batcher.try_now(rows(2.0))  # declined (e.g. unloaded): the caller submits it
        blocker = batcher.submit(rows(3.0), "normal")  # goes to the pool
        await asyncio.sleep(0)  # its batch starts (and now runs in the pool for 10 ms)
        model.inline_ok = True
        busy = batcher.try_now(rows(4.0))  # a batch runs: no jumping the queue
        queued = [batcher.submit(rows(v), "normal") for v in (5.0, 6.0)]
        answers = await asyncio.gather(blocker, *queued)
        return now, declined, busy, answers, model.calls, batcher.busy

    now, declined, busy, answers, calls, still_busy = asyncio.run(scenario())
    assert now.column("y").to_pylist() == [2.0]
    assert declined is None and busy is None and not still_busy
    assert [a.column("y").to_pylist() for a in answers] == [[6.0], [10.0], [12.0]]
    # the queued pair formed one batch, and it was offered to the inline path first
    assert calls == [("inline", [1.0]), ("inline", [-1.0]), ("pool", [3.0]), ("inline", [5.0, 6.0])]


def test_a_model_that_waits_for_companions_is_not_scored_at_once() -> None:
    async def scenario() -> tuple[Any, list[float], Any]:
        model = TwoPathModel()
        batcher = Batcher("m:1", BatchLimits(64, 0.005, 100), model.predict, inline=model.inline)
        declined = batcher.try_now(rows(1.0))
        together = [batcher.submit(rows(v), "normal") for v in (1.0, 2.0)]
        answers = await asyncio.gather(*together)
        return declined, [v for a in answers for v in a.column("y").to_pylist()], model.calls

    declined, answers, calls = asyncio.run(scenario())
    assert declined is None and answers == [2.0, 4.0]
    assert calls == [("inline", [1.0, 2.0])]  # they waited for each other, then went together, inline


# -- the data plane: inline after the first (measured) call; quotas per worker -------------------
def features(model: BuiltModel, rows: slice) -> pa.Table:
    return pa.table({n: model.data.features[rows, j] for j, n in enumerate(model.data.names)})


def make_plane(registry: ModelRegistry, tmp_path: Path, **settings: Any) -> DataPlane:
    tenants = TenantDirectory.from_config({"tenants": [{
        "name": "acme", "api_keys_sha256": [hash_api_key("k")], "models": ["breast-cancer@prod"],
        "rate": {"requests_per_second": 1, "burst": 5}, "max_concurrent": 4,
    }]})
    return DataPlane(OnlineSettings(**settings), registry, ModelCache(tmp_path / "cache"), tenants,
                     RuntimeOptions("cpu", 1))


def test_a_fast_model_moves_onto_the_event_loop_once_measured_and_answers_the_same(
    local_registry: ModelRegistry, breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    threads: list[str] = []

    async def scenario(plane: DataPlane) -> list[pa.Table]:
        await plane.start()
        try:
            tenant = plane.authenticate("Bearer k")
            served = await plane.model(tenant, "breast-cancer")
            original = plane._score

            def spy(*args: Any) -> pa.RecordBatch:
                threads.append(threading.current_thread().name)
                return original(*args)

            plane._score = spy  # type: ignore[method-assign]
            answers = [await plane.infer(tenant, served, features(breast_cancer_model, slice(i, i + 2)))
                       for i in range(0, 8, 2)]
            return answers
        finally:
            await plane.stop()

    fast = asyncio.run(scenario(make_plane(local_registry, tmp_path, inline_max_ms=50)))
    loop_thread = threading.current_thread().name
    assert threads[0].startswith("shardline-infer")  # the first call loads and measures, on the pool
    assert set(threads[1:]) == {loop_thread}  # then on the loop: no hand-off
    threads.clear()
    pooled = asyncio.run(scenario(make_plane(local_registry, tmp_path / "b", inline_max_ms=0)))
    assert all(t.startswith("shardline-infer") for t in threads)
    expected, _ = breast_cancer_model.expected(features(breast_cancer_model, slice(0, 8)))
    for answers in (fast, pooled):
        np.testing.assert_array_equal(np.concatenate([a.column("label").to_numpy() for a in answers]), expected)


def test_with_two_workers_each_holds_half_of_a_tenants_quotas(local_registry: ModelRegistry, tmp_path: Path) -> None:
    def admitted(plane: DataPlane, hold: bool) -> int:
        tenant = plane.authenticate("Bearer k")
        held: list[Any] = []
        count = 0
        try:
            for _ in range(10):
                guard = plane.admit(tenant)
                try:
                    guard.__enter__()
                except RateLimited:
                    break
                count += 1
                if hold:
                    held.append(guard)
                else:
                    guard.__exit__(None, None, None)
        finally:
            for guard in held:
                guard.__exit__(None, None, None)
        return count

    clock = [0.0]
    for workers, concurrent, burst in ((1, 4, 5), (2, 2, 3)):
        plane = make_plane(local_registry, tmp_path, workers=workers)
        plane._clock = lambda: clock[0]
        assert admitted(plane, hold=True) == concurrent  # max_concurrent 4, split
        plane = make_plane(local_registry, tmp_path, workers=workers)
        plane._clock = lambda: clock[0]
        assert admitted(plane, hold=False) == burst  # burst 5, split and rounded up


# -- the matrix path: V2 JSON floats -> matrix -> runtime -> numpy columns -> V2 JSON, no Arrow ---
def signature_matrix(model: BuiltModel, rows: slice) -> np.ndarray:
    index = [model.data.names.index(n) for n in model.manifest.signature.input_names]
    return np.ascontiguousarray(model.data.features[rows][:, index], dtype=np.float32)


def test_a_measured_fast_model_scores_a_matrix_exactly_like_its_rows(
    local_registry: ModelRegistry, breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    async def scenario(plane: DataPlane) -> tuple[Any, pa.Table, Any]:
        await plane.start()
        try:
            tenant = plane.authenticate("Bearer k")
            served = await plane.model(tenant, "breast-cancer")
            matrix = signature_matrix(breast_cancer_model, slice(0, 3))
            unmeasured = plane.infer_matrix_now(served, matrix)  # not loaded, not measured: the table path loads it
            table = await plane.infer(tenant, served, features(breast_cancer_model, slice(0, 3)))
            assert plane.infer_matrix_now(served, matrix, captured=True) is None  # capture keeps Arrow rows
            return unmeasured, table, plane.infer_matrix_now(served, matrix)
        finally:
            await plane.stop()

    unmeasured, table, fast = asyncio.run(scenario(make_plane(local_registry, tmp_path, inline_max_ms=50)))
    assert unmeasured is None and isinstance(fast, dict)
    np.testing.assert_array_equal(fast["label"], table.column("label").to_numpy())
    np.testing.assert_array_equal(fast["probabilities"].ravel(), table.column("probabilities").combine_chunks().flatten().to_numpy())
    _, _, pooled = asyncio.run(scenario(make_plane(local_registry, tmp_path / "b", inline_max_ms=0)))
    assert pooled is None  # a model kept off the event loop is never scored there, matrix or not


def fast_body(values: list[list[Any]], **tensor: Any) -> bytes:
    inputs = [{"name": f"f{j}", "datatype": "FP32", "shape": [len(column)], "data": column, **tensor}
              for j, column in enumerate(values)]
    return orjson.dumps({"inputs": inputs, "id": "r-9"})


FLOATS = Signature(inputs=[ColumnSpec(name=f"f{j}", type="float32") for j in range(3)],
                   outputs=[ColumnSpec(name="label", type="int64"),
                            ColumnSpec(name="probabilities", type="fixed_size_list<float32>[2]")])


def test_json_floats_decode_to_a_matrix_whose_table_is_the_general_paths() -> None:
    body = orjson.dumps({"inputs": [  # out of order, one [N, 1] shape: still the fast path
        {"name": "f2", "datatype": "FP64", "shape": [2, 1], "data": [0.1, 0.2]},
        {"name": "f0", "datatype": "FP32", "shape": [2], "data": [1.5, -2.0]},
        {"name": "f1", "datatype": "FP32", "shape": [2], "data": [3.0, 1e30]}]})
    decoded = decode_infer_request(body, None, FLOATS, "m:1")
    assert decoded.matrix is not None and decoded.matrix.dtype == np.float32
    np.testing.assert_array_equal(decoded.matrix, np.array([[1.5, 3.0, 0.1], [-2.0, 1e30, 0.2]], np.float32))
    assert decoded.table.equals(pa.table({f"f{j}": decoded.matrix[:, j] for j in range(3)},
                                         schema=input_schema(FLOATS)))


@pytest.mark.parametrize("body, outcome", [
    (fast_body([[1.0], [2.0], [1]]), "ints: general path"),  # an int is a valid FP value, read the general way
    (fast_body([[1.0], [2.0], [True]]), "holds bool values"),
    (fast_body([[1.0], [2.0], ["3"]]), "holds string values"),
    (fast_body([[1.0], [2.0], [None]]), "null or mixed"),
    (fast_body([[1.0], [2.0], [3.0]], shape=[True]), "'shape' is [True]"),
    (fast_body([[1.0], [2.0], [3.0]], parameters={"binary_data_size": 4}), "runs past the end"),
    (fast_body([[1.0], [2.0], [3.0, 4.0]]), "inputs disagree on the number of rows"),
], ids=["int", "bool", "string", "null", "bool-shape", "parameters", "ragged"])
def test_what_the_fast_path_does_not_take_goes_the_general_way_with_its_errors(body: bytes, outcome: str) -> None:
    if outcome.endswith("general path"):
        decoded = decode_infer_request(body, None, FLOATS, "m:1")
        assert decoded.matrix is None and decoded.table.column("f2").to_pylist() == [1.0]
        return
    with pytest.raises(InvalidInput, match=re.escape(outcome)):
        decode_infer_request(body, None, FLOATS, "m:1")


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_numpy_columns_encode_exactly_like_the_same_rows_as_arrow(binary: bool) -> None:
    decoded = decode_infer_request(
        orjson.dumps({"inputs": [{"name": f"f{j}", "datatype": "FP32", "shape": [2], "data": [0.5, 1.5]}
                                 for j in range(3)], "id": "r-1", "parameters": {"binary_data_output": binary}}),
        None, FLOATS, "m:1")
    label = np.array([1, 0], np.int64)
    probabilities = np.array([[0.25, 0.75], [0.9, 0.1]], np.float32)
    rows = pa.table({"label": label, "probabilities": pa.FixedSizeListArray.from_arrays(probabilities.ravel(), 2)})
    as_numpy = encode_infer_response("m", 1, decoded, {"label": label, "probabilities": probabilities})
    assert as_numpy == encode_infer_response("m", 1, decoded, rows)
    assert as_numpy == encode_infer_response("m", 1, decoded, rows.slice(0).to_batches()[0])


def test_a_capture_rate_samples_that_share_of_requests_once_each() -> None:
    import random

    from shardline.online.capture import OnlineCapture

    random.seed(4)
    draws = [OnlineCapture("/nowhere", 0.25, None).draw() for _ in range(4_000)]  # type: ignore[arg-type]
    assert 850 < sum(draws) < 1_150
    assert not OnlineCapture("/nowhere", 0.0, None).draw()  # type: ignore[arg-type]
    assert not OnlineCapture(None, 1.0, None).draw()  # type: ignore[arg-type]  # no root: off
    assert all(OnlineCapture("/nowhere", 1.0, None).draw() for _ in range(10))  # type: ignore[arg-type]
