"""The runtime contract as tests: one abstract class each runtime's tests mix in (fsspec's ``tests/abstract``).

``shardline.runtimes.base.Runtime`` states the contract that both tiers rely on; ``RuntimeConformance``
checks it for one bundle. A runtime's test module subclasses it (``class TestMyRuntime(RuntimeConformance)``)
and overrides two fixtures:

- ``bundle``: ``(bundle_dir, manifest)`` of a packaged model the runtime loads;
- ``rows``: a table of at least 8 rows of the signature's input columns, in the signature's types.

and, where they differ from the defaults, the class attributes ``rtol``/``atol`` (how closely a row
scored alone must match the same row scored in a batch) and ``required_packages`` (the packages
whose absence must be answered with the registry's install hint). This class is not collected by
itself: its name does not start with ``Test``.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from shardline.bundle import Manifest
from shardline.errors import InvalidBundle, InvalidInput, RuntimeUnavailable, ShardlineError
from shardline.rows import float_rows
from shardline.runtimes import KNOWN_RUNTIMES, Runtime, RuntimeOptions, create_runtime

OPTIONS = RuntimeOptions(device="cpu", intra_op_threads=1)


def column_values(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A column as one numpy array: (rows,) for scalars, (rows, k, ...) for fixed-size lists."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    shape = [len(array)]
    while pa.types.is_fixed_size_list(array.type):
        shape.append(array.type.list_size)
        array = array.flatten()
    return array.to_numpy(zero_copy_only=False).reshape(shape)


class RuntimeConformance:
    """What every runtime must do, checked on the bundle and rows its subclass provides."""

    rtol: float = 1e-5
    atol: float = 1e-6
    required_packages: tuple[str, ...] = ()
    options: RuntimeOptions = OPTIONS

    @pytest.fixture
    def bundle(self) -> tuple[Path, Manifest]:
        raise NotImplementedError("a runtime's conformance tests provide the bundle fixture")

    @pytest.fixture
    def rows(self) -> pa.Table:
        raise NotImplementedError("a runtime's conformance tests provide the rows fixture")

    @pytest.fixture
    def runtime(self, bundle: tuple[Path, Manifest]) -> Iterator[Runtime]:
        runtime = create_runtime(bundle[0], bundle[1], self.options)
        runtime.load()
        yield runtime
        runtime.close()

    def assert_same_rows(self, got: pa.RecordBatch | pa.Table, want: pa.RecordBatch | pa.Table) -> None:
        """The same columns, rows and values (floats within rtol/atol, everything else exactly)."""
        assert got.schema.names == want.schema.names and got.num_rows == want.num_rows
        for name in want.schema.names:
            a, b = column_values(got.column(name)), column_values(want.column(name))
            if np.issubdtype(b.dtype, np.floating):
                np.testing.assert_allclose(a, b, rtol=self.rtol, atol=self.atol, err_msg=name)
            else:
                np.testing.assert_array_equal(a, b, err_msg=name)

    # -- loading -------------------------------------------------------------------------------

    def test_the_registry_finds_the_runtime_by_the_manifests_name(self, bundle: tuple[Path, Manifest]) -> None:
        entry = KNOWN_RUNTIMES[bundle[1].runtime]
        runtime = create_runtime(bundle[0], bundle[1], self.options)
        assert (type(runtime).__module__, type(runtime).__name__) == (entry.module, entry.class_name)

    def test_init_only_stores_its_arguments_and_load_does_the_work(self, bundle: tuple[Path, Manifest],
                                                                  tmp_path: Path) -> None:
        missing = tmp_path / "not-fetched-yet"
        runtime = create_runtime(missing, bundle[1], self.options)  # nothing is read here
        assert (runtime.bundle_dir, runtime.manifest, runtime.options) == (missing, bundle[1], self.options)
        with pytest.raises(ShardlineError) as caught:  # the project's error, not a library's
            runtime.load()
        assert isinstance(caught.value, (InvalidBundle, RuntimeUnavailable))

    def test_a_corrupt_model_file_is_an_invalid_bundle_at_load(self, bundle: tuple[Path, Manifest],
                                                              tmp_path: Path) -> None:
        copy = tmp_path / "bundle"
        shutil.copytree(bundle[0], copy)
        model = next(a for a in bundle[1].artifacts if a.role == "model")
        (copy / model.path).write_bytes(b"this is not a model")
        runtime = create_runtime(copy, bundle[1], self.options)
        with pytest.raises(InvalidBundle, match=model.path):
            runtime.load()

    def test_predict_before_load_is_refused(self, bundle: tuple[Path, Manifest], rows: pa.Table) -> None:
        with pytest.raises(RuntimeError, match="load"):
            create_runtime(bundle[0], bundle[1], self.options).predict(rows)

    def test_a_loaded_model_says_the_device_it_runs_on(self, runtime: Runtime) -> None:
        assert runtime.device in ("cpu", "cuda")

    def test_close_releases_it_and_it_is_then_unusable(self, runtime: Runtime, rows: pa.Table) -> None:
        runtime.close()
        runtime.close()  # twice is harmless
        with pytest.raises(RuntimeError):
            runtime.predict(rows)

    def test_a_missing_package_names_the_extra_to_install(self, bundle: tuple[Path, Manifest],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
        entry = KNOWN_RUNTIMES[bundle[1].runtime]
        assert self.required_packages, "a runtime names the packages it needs"
        for package in self.required_packages:
            monkeypatch.setitem(sys.modules, package, None)  # `import package` now fails as if not installed
        monkeypatch.delitem(sys.modules, entry.module, raising=False)  # so a module-level import fails too
        with pytest.raises(RuntimeUnavailable) as caught:
            create_runtime(bundle[0], bundle[1], self.options).load()
        assert entry.extra in str(caught.value)

    def test_an_unknown_runtime_is_an_invalid_bundle_naming_the_known_ones(self, bundle: tuple[Path, Manifest]) -> None:
        manifest = bundle[1].model_copy(update={"runtime": "no-such-runtime"})
        with pytest.raises(InvalidBundle, match="no-such-runtime") as caught:
            create_runtime(bundle[0], manifest, self.options)
        assert all(name in str(caught.value) for name in KNOWN_RUNTIMES)

    # -- predicting ----------------------------------------------------------------------------

    def test_outputs_are_the_signatures_columns_one_row_per_input_row(self, runtime: Runtime, rows: pa.Table) -> None:
        out = runtime.predict(rows)
        outputs = runtime.manifest.signature.outputs
        assert isinstance(out, pa.RecordBatch)
        assert [(f.name, f.type) for f in out.schema] == [(c.name, c.arrow_type) for c in outputs]
        assert out.num_rows == rows.num_rows

    def test_a_record_batch_and_a_table_of_several_chunks_give_the_same_rows(self, runtime: Runtime,
                                                                            rows: pa.Table) -> None:
        whole = runtime.predict(rows)
        chunked = pa.Table.from_batches(rows.slice(0, 3).to_batches() + rows.slice(3).to_batches())
        self.assert_same_rows(runtime.predict(chunked), whole)
        self.assert_same_rows(runtime.predict(rows.combine_chunks().to_batches()[0]), whole)

    def test_rows_keep_their_order(self, runtime: Runtime, rows: pa.Table) -> None:
        backwards = pa.array(range(rows.num_rows - 1, -1, -1))
        self.assert_same_rows(runtime.predict(rows.take(backwards)), pa.table(runtime.predict(rows)).take(backwards))

    def test_an_empty_batch_answers_no_rows_with_the_output_columns(self, runtime: Runtime, rows: pa.Table) -> None:
        out = runtime.predict(rows.slice(0, 0))
        assert out.num_rows == 0
        assert [(f.name, f.type) for f in out.schema] == [(c.name, c.arrow_type) for c in runtime.manifest.signature.outputs]

    def test_one_row_at_a_time_and_all_at_once_give_the_same_answers(self, runtime: Runtime, rows: pa.Table) -> None:
        whole = runtime.predict(rows)
        alone = pa.Table.from_batches([runtime.predict(rows.slice(i, 1)) for i in range(rows.num_rows)])
        self.assert_same_rows(alone, whole)

    def test_columns_beyond_the_signatures_are_ignored(self, runtime: Runtime, rows: pa.Table) -> None:
        extra = rows.append_column("not_an_input", pa.array(["x"] * rows.num_rows))
        self.assert_same_rows(runtime.predict(extra.select(["not_an_input", *rows.schema.names])), runtime.predict(rows))

    def test_a_missing_input_column_is_invalid_input_naming_it(self, runtime: Runtime, rows: pa.Table) -> None:
        dropped = runtime.manifest.signature.inputs[0].name
        with pytest.raises(InvalidInput, match=dropped):
            runtime.predict(rows.drop_columns([dropped]))

    def test_an_input_column_of_another_type_is_invalid_input(self, runtime: Runtime, rows: pa.Table) -> None:
        name = runtime.manifest.signature.inputs[0].name
        at = rows.schema.get_field_index(name)
        wrong = pa.array([{"a": 1}] * rows.num_rows)  # a struct: no input type takes it
        with pytest.raises(InvalidInput):
            runtime.predict(rows.set_column(at, name, wrong))

    def test_calls_from_several_threads_at_once_give_the_same_answers(self, runtime: Runtime, rows: pa.Table) -> None:
        whole = runtime.predict(rows)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: runtime.predict(rows), range(8)))
        for answer in answers:
            self.assert_same_rows(answer, whole)

    def test_float_rows_score_like_their_arrow_rows(self, runtime: Runtime, rows: pa.Table) -> None:
        plan = runtime.manifest.signature.plan
        layout = plan.layout
        if layout is None:
            pytest.skip("float rows are for signatures of float columns and float list columns")
        if layout.stacked:
            arrays = (np.ascontiguousarray(np.column_stack([column_values(rows.column(n)) for n in plan.input_names]),
                                           dtype=layout.dtypes[0]),)
        else:
            arrays = tuple(np.ascontiguousarray(column_values(rows.column(n)), dtype=d)
                           for n, d in zip(plan.input_names, layout.dtypes))
        answer = runtime.predict(float_rows(plan, arrays, runtime.manifest.reference))
        want = runtime.predict(rows)
        for name in want.schema.names:
            b = column_values(want.column(name))
            a = column_values(answer.column(name)) if isinstance(answer, pa.RecordBatch) else answer[name]
            assert (a.dtype, a.shape) == (b.dtype, b.shape), name
            if np.issubdtype(b.dtype, np.floating):
                np.testing.assert_allclose(a, b, rtol=self.rtol, atol=self.atol, err_msg=name)
            else:  # labels, names: exactly
                np.testing.assert_array_equal(a, b, err_msg=name)
