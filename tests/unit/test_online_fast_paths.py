"""The fast paths of the online tier: inline scoring, matrix rows and the matrix path, per-worker quotas,
the infer path parser."""

from __future__ import annotations

import asyncio
import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pytest

from shardline.errors import InvalidInput, RateLimited
from shardline.online.admission import next_seconds_per_row, runs_inline, worker_share
from shardline.online.batcher import Batcher, BatchLimits
from shardline.online.dataplane import DataPlane
from shardline.online.logs import request_id_from
from shardline.online.metrics import Metrics, _Tally
from shardline.online.protocols import kserve_v2
from shardline.online.protocols.kserve_v2 import decode_infer_request, encode_infer_response, infer_path_params
from shardline.online.protocols.v2_fast import fast_binary_rows, fast_rows
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.rows import Rows, check_rows, float_rows
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


def test_one_slow_call_barely_moves_the_speed_a_lasting_change_is_followed() -> None:
    fast = 10e-6
    assert next_seconds_per_row(None, 2e-3) == 2e-3  # the first measurement sets it
    spiked = next_seconds_per_row(fast, 5e-3)  # one call preempted or collecting garbage for 5 ms
    assert spiked == pytest.approx(12e-6) and runs_inline(1, spiked, 0.0005)
    slower = fast
    for calls in range(1, 100):  # the model really takes 1 ms a row now
        slower = next_seconds_per_row(slower, 1e-3)
        if not runs_inline(1, slower, 0.0005):
            break
    assert 20 < calls < 40 and slower < 1e-3  # off the loop within a few dozen calls
    assert next_seconds_per_row(1e-3, 1e-6) == pytest.approx(0.8e-3 + 0.2e-6)  # a fall is followed at once


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
    name = str(arrow_type) if arrow_type != pa.float32() else "float32"
    signature = Signature(inputs=[ColumnSpec(name=f"f{j}", type=name) for j in range(7)],
                          outputs=[ColumnSpec(name="y", type="int64")])
    plan = signature.plan
    schema = plan.input_schema
    rng = np.random.default_rng(1)
    for rows in (1, 2, 3, 5, 64, 1, 3, 2048, 2049, 5000):  # again: from the remembered templates; then past them
        matrix = rng.normal(size=(rows, 7)).astype(arrow_type.to_pandas_dtype())
        table = float_rows(plan, (matrix,), "m:1").table()
        expected = pa.table({f"f{j}": pa.array(matrix[:, j]) for j in range(7)}, schema=schema)
        assert table.equals(expected), rows
    mixed = Signature(inputs=[ColumnSpec(name="a", type="float32"), ColumnSpec(name="b", type="int64")],
                      outputs=[ColumnSpec(name="y", type="int64")])
    assert mixed.plan.layout is None  # an integer column: Arrow rows, no float arrays


# -- the batcher with an inline model ------------------------------------------------------------
class TwoPathModel:
    """Doubles x on the event loop (``inline``) unless told not to, or in a coroutine (``predict``)."""

    def __init__(self, inline_ok: bool = True) -> None:
        self.inline_ok = inline_ok
        self.calls: list[tuple[str, list[float]]] = []

    def inline(self, rows: Rows) -> pa.RecordBatch | None:
        if not self.inline_ok:
            return None
        values = rows.table().column("x").to_pylist()
        self.calls.append(("inline", values))
        if -1 in values:
            raise InvalidInput("x = -1 cannot be scored")
        return pa.RecordBatch.from_pydict({"y": [2 * v for v in values]})

    async def predict(self, rows: Rows) -> pa.RecordBatch:
        values = rows.table().column("x").to_pylist()
        self.calls.append(("pool", values))
        await asyncio.sleep(0.01)
        return pa.RecordBatch.from_pydict({"y": [2 * v for v in values]})


ONE_FLOAT = Signature(inputs=[ColumnSpec(name="x", type="float64")], outputs=[ColumnSpec(name="y", type="float64")])


def rows(*values: float) -> Rows:
    return check_rows(pa.table({"x": pa.array(values, pa.float64())}), ONE_FLOAT, "m:1")


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


def test_a_matrix_is_scored_from_the_matrix_on_every_path_exactly_like_its_rows(
    local_registry: ModelRegistry, breast_cancer_model: BuiltModel, tmp_path: Path
) -> None:
    calls: list[str] = []

    async def scenario(plane: DataPlane) -> tuple[Any, pa.Table, Any, list[Any]]:
        await plane.start()
        try:
            tenant = plane.authenticate("Bearer k")
            served = await plane.model(tenant, "breast-cancer")
            original = plane._score

            def spy(served: Any, runtime: Any, inputs: Any) -> Any:
                thread = "loop" if threading.current_thread() is threading.main_thread() else "pool"
                calls.append(f"{thread} {'Matrix' if inputs.arrays is not None else 'Table'} {inputs.num_rows}")
                return original(served, runtime, inputs)

            plane._score = spy  # type: ignore[method-assign]
            plan = served.signature.plan
            matrix = float_rows(plan, (signature_matrix(breast_cancer_model, slice(0, 3)),), served.pinned)
            loaded = await plane.infer(tenant, served, matrix)  # not loaded, not measured: loaded on the pool
            table = await plane.infer(tenant, served, features(breast_cancer_model, slice(0, 3)))
            fast = await plane.infer(tenant, served, matrix)  # measured, fast, idle: on the loop (if allowed)
            parts = [float_rows(plan, (signature_matrix(breast_cancer_model, slice(i, i + 2)),), served.pinned)
                     for i in range(0, 8, 2)]
            together = await asyncio.gather(*(plane.infer(tenant, served, part) for part in parts))
            return loaded, table, fast, together
        finally:
            await plane.stop()

    expected, _ = breast_cancer_model.expected(features(breast_cancer_model, slice(0, 8)))
    for inline_max_ms, path in ((50, "loop"), (0, "pool")):
        calls.clear()
        loaded, table, fast, together = asyncio.run(
            scenario(make_plane(local_registry, tmp_path / str(inline_max_ms), inline_max_ms=inline_max_ms,
                                max_concurrent_batches=1)))  # one batch at a time: the queued ones go together
        assert calls[:3] == ["pool Matrix 3", f"{path} Table 3", f"{path} Matrix 3"]
        if path == "loop":  # each of the four concurrent requests is scored at once, before the next is read
            assert calls[3:] == ["loop Matrix 2"] * 4
        else:  # the first goes alone; the three that queued behind it go together, as one matrix
            assert calls[3:] == ["pool Matrix 2", "pool Matrix 6"]
        for answer in (loaded, fast):
            assert isinstance(answer, dict)
            np.testing.assert_array_equal(answer["label"], table.column("label").to_numpy())
            np.testing.assert_array_equal(answer["probabilities"].ravel(),
                                          table.column("probabilities").combine_chunks().flatten().to_numpy())
        assert [len(a["label"]) for a in together] == [2, 2, 2, 2]
        np.testing.assert_array_equal(np.concatenate([a["label"] for a in together]), expected)


def test_a_runtime_without_the_float_path_scores_float_rows_as_their_table(
    local_registry: ModelRegistry, breast_cancer_model: BuiltModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardline.runtimes.onnx import OnnxModel, _ArrayPlan

    tables: list[int] = []
    predict_arrow = OnnxModel._predict_arrow

    def counted(self: OnnxModel, batch: Any) -> pa.RecordBatch:
        tables.append(batch.num_rows)
        return predict_arrow(self, batch)

    monkeypatch.setattr(_ArrayPlan, "of", classmethod(lambda cls, *args: None))  # as a runtime without one
    monkeypatch.setattr(OnnxModel, "_predict_arrow", counted)

    async def scenario(plane: DataPlane) -> list[Any]:
        await plane.start()
        try:
            tenant = plane.authenticate("Bearer k")
            served = await plane.model(tenant, "breast-cancer")
            matrix = float_rows(served.signature.plan, (signature_matrix(breast_cancer_model, slice(0, 3)),), served.pinned)
            return [await plane.infer(tenant, served, matrix) for _ in range(2)]  # on the pool, then at once
        finally:
            await plane.stop()

    answers = asyncio.run(scenario(make_plane(local_registry, tmp_path, inline_max_ms=50)))
    expected, _ = breast_cancer_model.expected(features(breast_cancer_model, slice(0, 3)))
    assert tables == [3, 3]
    for answer in answers:
        assert isinstance(answer, pa.Table)
        np.testing.assert_array_equal(answer.column("label").to_numpy(), expected)


def test_a_batch_of_matrices_and_tables_scores_each_kind_in_one_call() -> None:
    async def scenario() -> tuple[list[Any], list[tuple[str, int]]]:
        calls: list[tuple[str, int]] = []

        async def predict(inputs: Any) -> Any:
            await asyncio.sleep(0.005)
            if inputs.arrays is not None:
                calls.append(("matrix", inputs.num_rows))
                return {"y": 2 * inputs.arrays[0][:, 0]}
            calls.append(("table", inputs.num_rows))
            return pa.RecordBatch.from_pydict({"y": [2 * v for v in inputs.table().column("x").to_pylist()]})

        plan = ONE_FLOAT.plan
        batcher = Batcher("m:1", BatchLimits(64, 0.0, 100), predict)
        first = batcher.submit(rows(0.5), "normal")  # runs alone; the next four queue behind it
        await asyncio.sleep(0)
        mixed = [batcher.submit(float_rows(plan, (np.array([[1.0], [2.0]]),), "m:1"), "normal"),
                 batcher.submit(rows(3.0), "high"),
                 batcher.submit(float_rows(plan, (np.array([[4.0]]),), "m:1"), "low"),
                 batcher.submit(rows(5.0, 6.0), "normal")]
        return await asyncio.gather(first, *mixed), calls

    answers, calls = asyncio.run(scenario())
    assert calls == [("table", 1), ("matrix", 3), ("table", 3)]
    assert [list(a["y"]) if isinstance(a, dict) else a.column("y").to_pylist() for a in answers] == \
        [[1.0], [2.0, 4.0], [6.0], [8.0], [10.0, 12.0]]


def fast_body(values: list[list[Any]], **tensor: Any) -> bytes:
    inputs = [{"name": f"f{j}", "datatype": "FP32", "shape": [len(column)], "data": column, **tensor}
              for j, column in enumerate(values)]
    return orjson.dumps({"inputs": inputs, "id": "r-9"})


FLOATS = Signature(inputs=[ColumnSpec(name=f"f{j}", type="float32") for j in range(3)],
                   outputs=[ColumnSpec(name="label", type="int64"),
                            ColumnSpec(name="probabilities", type="fixed_size_list<float32>[2]")])


def test_json_floats_decode_to_a_matrix_whose_table_is_the_general_paths() -> None:
    body = orjson.dumps({"inputs": [  # out of order: still the fast path
        {"name": "f2", "datatype": "FP32", "shape": [2], "data": [0.1, 0.2]},
        {"name": "f0", "datatype": "FP32", "shape": [2], "data": [1.5, -2.0]},
        {"name": "f1", "datatype": "FP32", "shape": [2], "data": [3.0, 1e30]}]})
    decoded = decode_infer_request(body, None, FLOATS, "m:1")
    assert decoded.rows.arrays is not None and decoded.rows.arrays[0].dtype == np.float32
    matrix = decoded.rows.arrays[0]
    np.testing.assert_array_equal(matrix, np.array([[1.5, 3.0, 0.1], [-2.0, 1e30, 0.2]], np.float32))
    assert decoded.table.equals(pa.table({f"f{j}": matrix[:, j] for j in range(3)}, schema=FLOATS.plan.input_schema))


def test_a_one_row_request_decodes_to_the_same_float32_values_as_a_float64_cast() -> None:
    values = {"f1": 16777217.0, "f2": 0.1, "f0": 1e-40}  # past float32's integers, inexact, subnormal
    body = orjson.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [1], "data": [v]} for n, v in values.items()]})
    decoded = decode_infer_request(body, None, FLOATS, "m:1")
    matrix = decoded.rows.arrays[0] if decoded.rows.arrays is not None else None
    assert matrix is not None and matrix.shape == (1, 3) and matrix.flags.c_contiguous
    want = np.array([[values["f0"], values["f1"], values["f2"]]], np.float64).astype(np.float32)
    assert matrix.tobytes() == want.tobytes()


@pytest.mark.parametrize("body, outcome", [
    (fast_body([[1.0], [2.0], [True]]), "holds bool values"),
    (fast_body([[1.0], [2.0], ["3"]]), "holds string values"),
    (fast_body([[1.0], [2.0], [None]]), "null or mixed"),
    (fast_body([[1.0], [2.0], [3.0]], shape=[True]), "'shape' is [True]"),
    (fast_body([[1.0], [2.0], [3.0]], parameters={"binary_data_size": 4}), "runs past the end"),
    (fast_body([[1.0], [2.0], [3.0, 4.0]]), "inputs disagree on the number of rows"),
], ids=["bool", "string", "null", "bool-shape", "parameters", "ragged"])
def test_what_the_fast_path_does_not_take_goes_the_general_way_with_its_errors(body: bytes, outcome: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(outcome)):
        decode_infer_request(body, None, FLOATS, "m:1")


def general_path(monkeypatch: pytest.MonkeyPatch, body: bytes, header: str | None = None,
                 signature: Signature = FLOATS) -> Any:
    """What the general path makes of a body, JSON or binary tensors (both fast paths turned off): the decoded
    request, or the error it raises."""
    with monkeypatch.context() as patched:
        patched.setattr(kserve_v2, "fast_rows", lambda *args: None)
        patched.setattr(kserve_v2, "fast_binary_rows", lambda *args: None)
        try:
            return decode_infer_request(body, header, signature, "m:1")
        except InvalidInput as e:
            return e


def test_parameters_that_change_nothing_keep_the_fast_path_and_others_get_the_general_paths_message(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    mlserver = fast_body([[1.5], [2.0], [3.25]], parameters={"content_type": "np"})  # MLServer's codecs send it
    assert fast_rows(mlserver, FLOATS, "m:1") is not None
    general = general_path(monkeypatch, mlserver)
    assert general.rows.arrays is not None
    assert decode_infer_request(mlserver, None, FLOATS, "m:1").rows.arrays[0].tobytes() == general.rows.arrays[0].tobytes()

    not_an_object = fast_body([[1.5], [2.0], [3.25]], parameters=["np"])
    assert fast_rows(not_an_object, FLOATS, "m:1") is None
    with pytest.raises(InvalidInput, match="input 'f0': 'parameters' is not an object"):
        decode_infer_request(not_an_object, None, FLOATS, "m:1")


FLOATS64 = Signature(inputs=[ColumnSpec(name=f"f{j}", type="float64") for j in range(3)],
                     outputs=[ColumnSpec(name="label", type="int64")])


@pytest.mark.parametrize("values, signature", [
    ([[3], [2.5], [-7]], FLOATS),  # JavaScript's and Go's 3.0 is 3
    ([[0, 1.5, 2**24], [-(2**24), 2, 0.1], [1, 1, 1]], FLOATS),  # several rows, ints mixed with floats in one input
    ([[2**53], [-(2**53)], [12345678901]], FLOATS64),
], ids=["one-row", "rows", "float64"])
def test_json_ints_a_float_column_holds_exactly_take_the_fast_path_to_the_general_paths_rows(
    monkeypatch: pytest.MonkeyPatch, values: list[list[Any]], signature: Signature
) -> None:
    body = fast_body(values, datatype="FP32" if signature is FLOATS else "FP64")
    assert fast_rows(body, signature, "m:1") is not None  # taken
    decoded, general = decode_infer_request(body, None, signature, "m:1"), general_path(monkeypatch, body, None, signature)
    assert decoded.rows.arrays is not None and general.rows.arrays is not None
    assert decoded.rows.arrays[0].tobytes() == general.rows.arrays[0].tobytes()
    dtype = signature.plan.layout.dtypes[0]  # type: ignore[union-attr]
    assert decoded.rows.arrays[0].tobytes() == np.array([list(map(float, row)) for row in zip(*values)], dtype).tobytes()


@pytest.mark.parametrize("values, signature", [
    ([[1.5], [2.0], [2**24 + 1]], FLOATS),  # past float32's exact whole numbers: rounded, as the general path does
    ([[1.5], [2.0], [-(2**53) - 1]], FLOATS64),
], ids=["float32", "float64"])
def test_json_ints_past_a_float_columns_whole_numbers_go_the_general_way(
    monkeypatch: pytest.MonkeyPatch, values: list[list[Any]], signature: Signature
) -> None:
    body = fast_body(values, datatype="FP32" if signature is FLOATS else "FP64")
    assert fast_rows(body, signature, "m:1") is None
    decoded = decode_infer_request(body, None, signature, "m:1")
    assert decoded.rows.arrays is not None
    assert decoded.rows.arrays[0][0, 2] == np.array(values[2], signature.plan.layout.dtypes[0])[0]  # type: ignore[union-attr]


LISTS = Signature(inputs=[ColumnSpec(name="x", type="fixed_size_list<float32>[3]"), ColumnSpec(name="w", type="float32")],
                  outputs=[ColumnSpec(name="label", type="int64")])


def lists_body(x: Any, shape: list[int], w: Any = (0.5, -1.0)) -> bytes:
    return orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "data": x},
                                    {"name": "w", "datatype": "FP32", "shape": [len(w)], "data": list(w)}]})


@pytest.mark.parametrize("x", [
    [[1.5, 2, -3.25], [1e-40, 0.1, 7]],  # a list a row, as KServe's documents write an [N, k] input
    [[1.5, 2], [-3.25, 1e-40, 0.1, 7]],  # rows of other lengths, the total right: read flat, as the general path does
], ids=["nested", "uneven-rows"])
def test_json_data_nested_a_row_a_list_takes_the_fast_path_to_the_general_paths_arrays(
    monkeypatch: pytest.MonkeyPatch, x: list[list[float]]
) -> None:
    body = lists_body(x, [2, 3])
    assert fast_rows(body, LISTS, "m:1") is not None  # taken
    decoded, general = decode_infer_request(body, None, LISTS, "m:1"), general_path(monkeypatch, body, None, LISTS)
    assert decoded.rows.arrays is not None and general.rows.arrays is not None
    assert [a.tobytes() for a in decoded.rows.arrays] == [a.tobytes() for a in general.rows.arrays]
    flat = decode_infer_request(lists_body([v for row in x for v in row], [2, 3]), None, LISTS, "m:1")
    assert flat.rows.arrays is not None
    assert [a.tobytes() for a in decoded.rows.arrays] == [a.tobytes() for a in flat.rows.arrays]  # as sent flat


@pytest.mark.parametrize("body, message", [
    (lists_body([[[1.5, 2.0, 3.0]], [[4.0, 5.0, 6.0]]], [2, 3]), "'data' is nested deeper than its shape [2, 3]"),
    (lists_body([[1.5, 2.0, 3.0], 4.0, 5.0, 6.0], [2, 3]), "'data' mixes lists and single values"),
    (lists_body([[1.5, 2.0, 3.0], [4.0, 5.0]], [2, 3]), "input 'x' holds 5 values; its shape [2, 3] holds 6"),
    (lists_body([[1.5, 2.0, 3.0], [4.0, 5.0, True]], [2, 3]), "holds bool values"),
    (lists_body([1.5, 2.0, 3.0], [1, 3], w=[[0.5]]), "'data' is nested deeper than its shape [1] has dimensions"),
], ids=["deeper", "mixed", "short", "bool", "nested-1d"])
def test_nested_json_data_the_fast_path_does_not_take_gets_the_general_paths_message(
    monkeypatch: pytest.MonkeyPatch, body: bytes, message: str
) -> None:
    assert fast_rows(body, LISTS, "m:1") is None
    with pytest.raises(InvalidInput) as refused:
        decode_infer_request(body, None, LISTS, "m:1")
    assert message in str(refused.value)
    general = general_path(monkeypatch, body, None, LISTS)
    assert isinstance(general, InvalidInput) and str(general) == str(refused.value)


def binary_body(columns: dict[str, Any], datatype: str = "FP32", tail: bytes = b"", **request: Any) -> tuple[bytes, str]:
    """A body of binary tensors as tritonclient sends it (its default): the JSON header, then each input's bytes."""
    inputs = [{"name": n, "datatype": datatype, "shape": list(np.shape(v)), "parameters": {"binary_data_size": v.nbytes}}
              for n, v in columns.items()]
    header = orjson.dumps({"inputs": inputs, **request})
    return header + b"".join(np.ascontiguousarray(v).tobytes() for v in columns.values()) + tail, str(len(header))


COLUMNS = {f"f{j}": np.array([0.5 + j, -1e-40, 3.4e38], np.float32) for j in range(3)}


@pytest.mark.parametrize("columns, request_fields", [
    (COLUMNS, {}),
    ({n: v[:1] for n, v in COLUMNS.items()}, {"id": "r-2", "parameters": {"binary_data_output": True}}),
    (dict(reversed(COLUMNS.items())), {"outputs": [{"name": "label", "parameters": {"binary_data": True}}]}),
], ids=["three-rows", "one-row", "out-of-order"])
def test_binary_tensors_decode_on_the_fast_path_to_the_general_paths_rows(
    monkeypatch: pytest.MonkeyPatch, columns: dict[str, np.ndarray], request_fields: dict[str, Any]
) -> None:
    body, header = binary_body(columns, **request_fields)
    assert fast_binary_rows(body, int(header), FLOATS, "m:1") is not None  # taken

    decoded = decode_infer_request(body, header, FLOATS, "m:1")
    general = general_path(monkeypatch, body, header)
    matrix = decoded.rows.arrays[0] if decoded.rows.arrays is not None else None
    assert matrix is not None and matrix.flags.c_contiguous and matrix.flags.writeable and matrix.dtype == np.float32
    assert general.rows.arrays is not None and matrix.tobytes() == general.rows.arrays[0].tobytes()
    assert matrix.tobytes() == np.column_stack([COLUMNS[f"f{j}"][:len(matrix)] for j in range(3)]).tobytes()
    assert (decoded.request_id, decoded.outputs, decoded.binary) == (general.request_id, general.outputs, general.binary)
    assert decoded.binary == dict.fromkeys(decoded.outputs, bool(request_fields))  # as each request asked


_ONE = {n: v[:1] for n, v in COLUMNS.items()}


@pytest.mark.parametrize("body, message", [
    (binary_body(_ONE, datatype="FP64"), "input 'f0' is FP64, the model takes FP32: send datatype FP32"),
    (binary_body(_ONE, tail=b"\0\0\0\0"), "the body holds 4 bytes of binary data that no input claims"),
    (binary_body({**_ONE, "f2": np.zeros(2, np.float32)}), "inputs disagree on the number of rows"),
    (binary_body({"f0": _ONE["f0"], "f1": _ONE["f1"]}), "inputs missing: the model 'm:1' needs 'f2'"),
    (binary_body({**_ONE, "f9": _ONE["f2"]}), "input 'f9' is not an input of the model"),
    (binary_body({**_ONE, "f2": np.zeros((1, 2), np.float32)}), "input 'f2' has shape [1, 2]"),
    ((binary_body(_ONE)[0], "100000"), "says 100000 bytes of JSON, the body has only"),
    ((binary_body(_ONE)[0][:-2], binary_body(_ONE)[1]), "runs past the end of the body"),
    ((binary_body(_ONE)[0], " 12a"), "is ' 12a', not a number of bytes"),
], ids=["fp64", "bytes-left", "ragged", "missing", "unknown", "rank", "header-long", "cut-short", "header-not-digits"])
def test_binary_bodies_the_fast_path_does_not_take_get_the_general_paths_message(
    monkeypatch: pytest.MonkeyPatch, body: tuple[bytes, str], message: str
) -> None:
    raw, header = body
    size = int(header) if header.isdigit() else None
    assert size is None or fast_binary_rows(raw, size, FLOATS, "m:1") is None
    with pytest.raises(InvalidInput) as refused:
        decode_infer_request(raw, header, FLOATS, "m:1")
    assert message in str(refused.value)
    general = general_path(monkeypatch, raw, header)
    assert isinstance(general, InvalidInput) and str(general) == str(refused.value)


def test_binary_bodies_the_fast_path_leaves_are_still_answered_by_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    header = orjson.dumps({"inputs": [  # another parameter, and one input as JSON data among binary ones
        {"name": "f0", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4, "note": "x"}},
        {"name": "f1", "datatype": "FP32", "shape": [1], "data": [2.5]},
        {"name": "f2", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}}]})
    body = header + np.float32(1.5).tobytes() + np.float32(-3.0).tobytes()
    assert fast_binary_rows(body, len(header), FLOATS, "m:1") is None
    decoded = decode_infer_request(body, str(len(header)), FLOATS, "m:1")
    assert decoded.rows.arrays is not None and decoded.rows.arrays[0].tolist() == [[1.5, 2.5, -3.0]]


def test_nan_in_binary_tensors_is_refused_on_the_fast_path_with_the_general_paths_message(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    body, header = binary_body({**COLUMNS, "f1": np.array([1.0, np.nan, np.inf], np.float32)})
    with pytest.raises(InvalidInput) as fast:
        fast_binary_rows(body, int(header), FLOATS, "m:1")
    general = general_path(monkeypatch, body, header)
    assert isinstance(general, InvalidInput) and str(fast.value) == str(general)
    assert str(general).startswith("columns ['f1'] hold NaN or infinite values ({'f1': 2} in 3 rows)")


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


# -- metrics tallies and request ids --------------------------------------------------------------
def _series(text: bytes) -> dict[str, float]:
    """The exposition's samples, less the creation times (which differ between registries)."""
    lines = [line.rsplit(" ", 1) for line in text.decode().splitlines()
             if line and not line.startswith("#") and "_created" not in line]
    return {name: float(value) for name, value in lines}


def test_tallied_metrics_expose_exactly_what_observing_one_by_one_does() -> None:
    tallied, direct = Metrics(), Metrics()
    direct._tallies = None  # every series observed one value at a time, as in multiprocess mode
    latencies = [0.0001, 0.0005, 0.0007, 0.005, 0.0051, 0.3, 10.0, 12.5]  # on bounds, between, past the last
    for exposed in range(2):  # the second round adds to what the first flushed, nothing counted twice
        for metrics in (tallied, direct):
            for i, seconds in enumerate(latencies):
                metrics.observe_request("v2", "m", "1", "acme" if i % 2 else "beta", 200 if i % 3 else 429, seconds)
                metrics.observe_batch("m", "1", rows=2 ** i, requests=1 + i % 2, seconds=seconds)
        got, want = _series(tallied.exposition()[0]), _series(direct.exposition()[0])
        assert got == pytest.approx(want, rel=1e-12)  # the sums are added in another order
    acme = 'model="m",protocol="v2",tenant="acme",version="1"}'
    # acme's values: 0.0005 and 0.005 (on bounds: Prometheus buckets are "<="), 0.3, 12.5 (past the last), twice
    assert [want[f'shardline_request_seconds_bucket{{le="{le}",{acme}'] for le in ("0.0005", "0.001", "0.005", "10.0")] \
        == [2, 2, 4, 6]
    assert want['shardline_request_seconds_count{model="m",protocol="v2",tenant="acme",version="1"}'] == 8
    assert want['shardline_requests_total{code="429",model="m",protocol="v2",tenant="beta",version="1"}'] == 4
    assert want['shardline_batch_rows_bucket{le="+Inf",model="m",version="1"}'] == 16
    assert any(isinstance(t, _Tally) for t in tallied._tallies or ())  # the fast path was taken


def test_new_request_ids_are_unique_hex_and_a_forked_worker_makes_its_own() -> None:
    ids = [request_id_from(None) for _ in range(10_000)]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert request_id_from("trace-1") == "trace-1" and request_id_from(" padded") != " padded"
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the worker: its first ids, then gone
        os.write(write, " ".join(request_id_from(None) for _ in range(3)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    theirs = os.read(read, 4096).decode().split()
    os.close(read)
    mine = [request_id_from(None) for _ in range(3)]
    assert len(theirs) == 3 and not set(theirs) & set(mine) and theirs[0][:16] != mine[0][:16]
