"""The rows a model reads, one contract for both tiers: a signature's plan, the row check, and ``Rows``.

``SignaturePlan`` is everything that reading rows for one signature needs, worked out once
(``Signature.plan``, a cached property of the immutable signature): the input and output Arrow
schemas, one ``ColumnPlan`` per input (its type, value type, row shape, whether it takes NaN),
for a signature whose inputs are all floats, its ``FloatLayout``: how those rows are held as numpy
arrays, without Arrow, and for one with ``input_tensor``, its ``tensor_view``: the signature with the
columns as the one ``[N, k]`` input tensor protocols take (whose rows are the columns' stacked matrix).

``check_rows`` is the one row check: the batch tier calls it on each batch of a shard (a refusal
quarantines the shard with its message) and the online tier on each request's rows (a refusal is a
400 with the same message). It refuses missing or mistyped columns (``SchemaMismatch``), values
that cannot be cast (``InvalidInput``), nulls (``NullValues``) and NaN or infinity where the column
does not declare them (``NonFiniteValues``), and casts to the signature's types.

``Rows`` are rows checked against one signature: they carry the plan they were checked with, so
nothing checks them again for that signature. They hold an Arrow table, or float arrays in the
plan's layout (a protocol adapter's fast path decodes requests straight into those), and make the
Arrow table from the arrays only when it is asked for (a runtime without a float path, capture).
``float_rows`` makes them from arrays, with the same finite check and message as ``check_rows``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardline.arrays import MatrixScratch, arrow_array, numpy_values, stack_columns
from shardline.errors import InvalidInput, NonFiniteValues, NullValues, SchemaMismatch
from shardline.signature import feeds, leaf_type, non_finite_counts, row_shape, schema_problems, type_name

if TYPE_CHECKING:
    from shardline.signature import ColumnSpec, Signature

_FLOATS = (pa.float32(), pa.float64())
_MAX_TEMPLATES = 256  # row counts remembered per signature (a bound: requests choose the row count)
# Past this many rows a table is built column by column, with no template: the template's one IPC read stops paying
# (30 float32 columns: 58 against 65 us at 2,048 rows, 186 against 104 at 5,000) and making one costs milliseconds
# (2.7 ms at 5,000 rows, 41 at 50,000), for a row count a large request or a capture file seldom repeats
# (figures: bench/README.md, "Figures behind the code").
_TEMPLATE_MAX_ROWS = 2048


@dataclass(frozen=True)
class ColumnPlan:
    """One input column as reading it needs it."""

    name: str
    spec: ColumnSpec
    arrow_type: pa.DataType
    value_type: pa.DataType  # the type of its single values (float32 for fixed_size_list<float32>[4])
    value_name: str  # that type as a signature writes it ("float32")
    shape: tuple[int, ...]  # one row's tensor shape: () primitive, (k,) fixed_size_list[k], -1 where it varies
    finite_only: bool  # a float column whose signature does not declare NaN and infinity


@dataclass(frozen=True)
class FloatLayout:
    """How rows of a float signature are held as numpy arrays (``Rows.arrays``).

    ``stacked``: every input a primitive column of one float type; one C-ordered ``(N, columns)``
    matrix, its columns the signature's. Otherwise every input a float column or a
    ``fixed_size_list<float>[k]`` column: one array per input, in the signature's order, ``(N,)`` or
    ``(N, k)`` of the column's own value type.
    """

    stacked: bool
    dtypes: tuple[np.dtype, ...]  # per array
    widths: tuple[int, ...]  # per array: the matrix's columns (stacked), else k (0 for a primitive column)
    finite: tuple[int, ...]  # the finite-only columns (stacked: matrix columns; else array positions)
    names: tuple[str, ...]  # the signature's inputs, in order


class SignaturePlan:
    """What reading rows for one signature needs, worked out once (see the module docstring)."""

    def __init__(self, signature: Signature) -> None:
        inputs, outputs = signature.inputs, signature.outputs
        self.input_names: tuple[str, ...] = tuple(c.name for c in inputs)
        self.output_names: list[str] = [c.name for c in outputs]
        self.input_schema = pa.schema([pa.field(c.name, c.arrow_type, c.nullable) for c in inputs])
        self.output_schema = pa.schema([pa.field(c.name, c.arrow_type, c.nullable) for c in outputs])
        self.columns: tuple[ColumnPlan, ...] = tuple(_column_plan(c) for c in inputs)
        self.by_name: dict[str, ColumnPlan] = {c.name: c for c in self.columns}
        self.positions: dict[str, int] = {n: i for i, n in enumerate(self.input_names)}
        self.finite_columns: tuple[str, ...] = tuple(c.name for c in self.columns if c.finite_only)
        self.not_nullable: tuple[int, ...] = tuple(i for i, c in enumerate(inputs) if not c.nullable)
        self.every_output: dict[bool, dict[str, bool]] = {  # all outputs, each binary or not (V2's default)
            flag: {n: flag for n in self.output_names} for flag in (False, True)}
        self.layout = _float_layout(self.columns)
        self.tensor_view: Signature | None = _tensor_view(signature)  # what tensor protocols show (input_tensor)
        self.embedding: tuple[str, str, int] | None = _embedding(signature)  # (text in, vector out, its size)
        self._stacked = _StackedTables(self.input_schema, self.layout.dtypes[0]) if self.layout and self.layout.stacked else None

    def table_of(self, arrays: Sequence[np.ndarray]) -> pa.Table:
        """Float arrays in this plan's layout as a table of the input schema."""
        if self._stacked is not None:
            return self._stacked.table(arrays[0])
        columns = []
        for array, column in zip(arrays, self.columns):
            if array.ndim == 1:
                columns.append(arrow_array(array).cast(column.arrow_type))
            else:
                flat = arrow_array(array.ravel()).cast(column.value_type)
                columns.append(pa.FixedSizeListArray.from_arrays(flat, type=column.arrow_type))
        return pa.Table.from_arrays(columns, schema=self.input_schema)

    def answer_table(self, answer: pa.Table | pa.RecordBatch | dict[str, np.ndarray]) -> pa.Table:
        """A runtime's answer (rows, or numpy columns from float rows) as a table of the output schema."""
        if isinstance(answer, pa.Table):
            return answer
        if isinstance(answer, pa.RecordBatch):
            return pa.Table.from_batches([answer])
        return pa.Table.from_batches([self.answer_batch(answer)])

    def answer_batch(self, answer: pa.RecordBatch | dict[str, np.ndarray]) -> pa.RecordBatch:
        """A runtime's answer to ``Rows`` as a record batch of the output schema (what a part is written from)."""
        if isinstance(answer, pa.RecordBatch):
            return answer
        arrays = []
        for field in self.output_schema:
            values = np.asarray(answer[field.name])
            if values.ndim == 2 and pa.types.is_fixed_size_list(field.type):
                flat = arrow_array(values.ravel()).cast(field.type.value_type)
                arrays.append(pa.FixedSizeListArray.from_arrays(flat, type=field.type))
            else:
                array = arrow_array(values)
                arrays.append(array if array.type == field.type else array.cast(field.type))
        return pa.RecordBatch.from_arrays(arrays, schema=self.output_schema)


def _tensor_view(signature: Signature) -> Signature | None:
    """With ``input_tensor``: the signature as tensor protocols show it, its inputs one ``fixed_size_list<T>[k]``
    column of that name; its rows (one ``(N, k)`` array) are the stacked matrix of the columns' own layout. NaN and
    infinity pass the view: the columns' own check (``float_rows``) refuses them, naming the columns."""
    if signature.input_tensor is None:
        return None
    from shardline.signature import ColumnSpec, Signature

    k = len(signature.inputs)
    tensor = ColumnSpec(name=signature.input_tensor, type=f"fixed_size_list<{signature.inputs[0].type}>[{k}]",
                        non_finite=True)
    return Signature(inputs=(tensor,), outputs=signature.outputs)


def _embedding(signature: Signature) -> tuple[str, str, int] | None:
    """(text input, embedding output, its size) when the signature is an embedding model's (one string column
    in, one ``fixed_size_list<float>`` out); None otherwise."""
    ins, outs = signature.inputs, signature.outputs
    if (len(ins) == 1 and pa.types.is_string(ins[0].arrow_type) and len(outs) == 1
            and pa.types.is_fixed_size_list(outs[0].arrow_type)
            and pa.types.is_floating(outs[0].arrow_type.value_type)):
        return ins[0].name, outs[0].name, outs[0].arrow_type.list_size
    return None


def blank_text(text: str) -> str | None:
    """What makes ``text`` nothing to embed ("an empty string", "only whitespace"), or None when it holds something.

    An embedding model's tokenizer drops whitespace (all-MiniLM's WordPiece does): a text of only whitespace
    gets the empty string's vector, the embedding of nothing. The online tier refuses both (``/v1/embeddings``
    and V2 alike)."""
    if not text:
        return "an empty string"
    return "only whitespace" if text.isspace() else None


def _column_plan(spec: ColumnSpec) -> ColumnPlan:
    arrow_type = spec.arrow_type
    value_type = leaf_type(arrow_type)
    return ColumnPlan(spec.name, spec, arrow_type, value_type, type_name(value_type), tuple(row_shape(arrow_type)),
                      pa.types.is_floating(value_type) and not spec.non_finite)


def _float_layout(columns: tuple[ColumnPlan, ...]) -> FloatLayout | None:
    """The float layout of a signature, or None when an input is not a float column or a flat list of floats."""
    names = tuple(c.name for c in columns)
    if all(c.shape == () for c in columns) and len({c.arrow_type for c in columns}) == 1 \
            and columns[0].arrow_type in _FLOATS:
        dtype = np.dtype(columns[0].arrow_type.to_pandas_dtype())
        finite = tuple(i for i, c in enumerate(columns) if c.finite_only)
        return FloatLayout(True, (dtype,), (len(columns),), finite, names)
    if all(c.value_type in _FLOATS and (c.shape == () or (len(c.shape) == 1 and c.shape[0] > 0)
                                        and pa.types.is_fixed_size_list(c.arrow_type)) for c in columns):
        dtypes = tuple(np.dtype(c.value_type.to_pandas_dtype()) for c in columns)
        widths = tuple(c.shape[0] if c.shape else 0 for c in columns)
        return FloatLayout(False, dtypes, widths, tuple(i for i, c in enumerate(columns) if c.finite_only), names)
    return None


class _StackedTables:
    """Builds tables of one schema (every column the same float type) from ``(N, columns)`` matrices.

    Building the table column by column costs a slice and a wrapper per column (figures: bench/README.md, "Figures behind the code");
    reading it as an Arrow IPC record batch costs one call. For each row count up to ``_TEMPLATE_MAX_ROWS`` (past it,
    column by column) a template is made once from a table built the slow way: the IPC message's metadata (which
    depends only on the schema and the row count) and its body layout, checked to be one buffer per column of
    ``rows * itemsize`` bytes padded to 8. Only the body is written per table.
    """

    def __init__(self, schema: pa.Schema, dtype: np.dtype) -> None:
        self.schema = schema
        self.dtype = dtype
        self._templates: dict[int, tuple[bytes, int] | None] = {}
        self._lock = threading.Lock()

    def table(self, matrix: np.ndarray) -> pa.Table:
        """The rows of ``matrix`` (shape ``(rows, len(schema))``) as a table of the schema."""
        matrix = matrix.astype(self.dtype, copy=False)
        rows = matrix.shape[0]
        if rows > _TEMPLATE_MAX_ROWS:
            return self._slow(matrix)
        template = self._templates.get(rows)
        if template is None and rows not in self._templates:
            template = self._template(rows)
        if template is None:
            return self._slow(matrix)
        metadata, padded = template
        body = np.zeros((len(self.schema), padded), dtype=self.dtype)
        body[:, :rows] = matrix.T
        batch = pa.ipc.read_record_batch(pa.py_buffer(metadata + body.tobytes()), self.schema)
        return pa.Table.from_batches([batch], schema=self.schema)

    def _slow(self, matrix: np.ndarray) -> pa.Table:
        values = arrow_array(np.ascontiguousarray(matrix.T, dtype=self.dtype).ravel())
        rows = matrix.shape[0]
        columns = [values.slice(j * rows, rows) for j in range(len(self.schema))]
        return pa.Table.from_arrays(columns, schema=self.schema)

    def _template(self, rows: int) -> tuple[bytes, int] | None:
        """The IPC metadata and padded column length (in values) for ``rows``, or None if the layout differs."""
        with self._lock:
            if len(self._templates) >= _MAX_TEMPLATES:
                self._templates.clear()
            itemsize = self.dtype.itemsize
            padded = -(-rows * itemsize // 8) * 8 // itemsize
            probe = np.arange(rows * len(self.schema), dtype=self.dtype).reshape(rows, len(self.schema))
            expected = self._slow(probe).to_batches()  # one chunk per column: one batch
            template: tuple[bytes, int] | None = None
            if len(expected) == 1 and rows > 0:
                message = expected[0].serialize().to_pybytes()
                body_size = pa.ipc.read_message(message).body.size
                if body_size == len(self.schema) * padded * itemsize:
                    candidate = (message[: len(message) - body_size], padded)
                    body = np.zeros((len(self.schema), padded), dtype=self.dtype)
                    body[:, :rows] = probe.T
                    built = pa.ipc.read_record_batch(pa.py_buffer(candidate[0] + body.tobytes()), self.schema)
                    if built.equals(expected[0]):
                        template = candidate
            self._templates[rows] = template
            return template


class Rows:
    """Rows checked against one signature (``plan``): an Arrow table, or float arrays in the plan's
    ``FloatLayout`` (``arrays``), the table made from them when it is first asked for.

    Made by ``check_rows`` (from any Arrow rows) or ``float_rows`` (from float arrays a decoder built);
    a runtime reads ``arrays`` where it has a float path, else ``table()``.
    """

    __slots__ = ("plan", "arrays", "_table")

    def __init__(self, plan: SignaturePlan, table: pa.Table | pa.RecordBatch | None = None,
                 arrays: tuple[np.ndarray, ...] | None = None) -> None:
        if table is None and arrays is None:
            raise ValueError("Rows hold a table or float arrays")
        self.plan = plan
        self.arrays = arrays
        self._table = table

    @property
    def num_rows(self) -> int:
        """How many rows."""
        if self.arrays is not None:
            return int(self.arrays[0].shape[0])
        return int(self._table.num_rows)  # type: ignore[union-attr]

    @property
    def nbytes(self) -> int:
        """Bytes the rows hold."""
        if self.arrays is not None:
            return sum(int(a.nbytes) for a in self.arrays)
        return int(self._table.nbytes)  # type: ignore[union-attr]

    def table(self) -> pa.Table | pa.RecordBatch:
        """The rows as Arrow, of the signature's input columns and types (made once from the arrays)."""
        if self._table is None:
            self._table = self.plan.table_of(self.arrays)  # type: ignore[arg-type]
        return self._table

    def slice(self, offset: int, length: int) -> Rows:
        """Rows ``offset`` to ``offset + length`` (views, not copies)."""
        if self.arrays is not None:
            return Rows(self.plan, arrays=tuple(a[offset: offset + length] for a in self.arrays))
        return Rows(self.plan, self.table().slice(offset, length))

    @staticmethod
    def concat(parts: Sequence[Rows]) -> Rows:
        """The rows of ``parts`` (checked with one plan) one after the other: arrays if all hold them."""
        if len(parts) == 1:
            return parts[0]
        plan = parts[0].plan
        if all(p.arrays is not None for p in parts):
            arrays = tuple(np.concatenate(column) for column in zip(*(p.arrays for p in parts)))  # type: ignore[misc]
            return Rows(plan, arrays=arrays)
        tables = [p.table() for p in parts]
        return Rows(plan, pa.concat_tables([t if isinstance(t, pa.Table) else pa.Table.from_batches([t])
                                            for t in tables]))


def non_finite_error(counts: dict[str, int], rows: int, model: str, float32: bool = True) -> NonFiniteValues:
    """The one message for NaN or infinity in columns that do not take them (both tiers). ``float32``: one of the
    columns is float32, where a number past its range is infinite once cast (said only then)."""
    cast = " (a number past float32's range is infinite too)" if float32 else ""
    return NonFiniteValues(
        f"columns {sorted(counts)} hold NaN or infinite values ({counts} in {rows} rows) where the model {model!r} "
        f"takes finite numbers only{cast}; fill or drop those rows (a model "
        "that reads NaN as a missing value declares non_finite: true on the column in its signature)",
        counts,
    )


def null_error(counts: dict[str, int], rows: int, model: str) -> NullValues:
    """The one message for nulls in columns the model needs values in (both tiers)."""
    return NullValues(
        f"columns {sorted(counts)} hold nulls ({counts} in {rows} rows) where the model {model!r} needs values; "
        "fill or drop those rows",
        counts,
    )


def schema_mismatch(schema: pa.Schema, signature: Signature, model: str) -> SchemaMismatch | None:
    """The one refusal of rows whose columns cannot feed the signature (missing, or of an incompatible type)."""
    problems = schema_problems(schema, signature.inputs, model)
    return SchemaMismatch("; ".join(problems), problems) if problems else None


def check_rows(rows: pa.Table | pa.RecordBatch, signature: Signature, model: str,
               scratch: MatrixScratch | None = None) -> Rows:
    """The one row check: the signature's input columns of ``rows``, cast to its types, as ``Rows``.

    Other columns are left out. Rows that already have the input schema are not copied. ``scratch``: where a batch
    stacked into one matrix is stacked (a batch loop's, ``MatrixScratch``); else a fresh array.

    Raises:
        SchemaMismatch: a column is missing or of a type that cannot feed the model.
        InvalidInput: a value cannot be cast (e.g. out of range).
        NullValues: a column that is not nullable holds nulls.
        NonFiniteValues: a float column that does not declare ``non_finite`` holds NaN or infinity.
    """
    plan = signature.plan
    schema = plan.input_schema
    given = rows.schema  # (a new object on every access: read it once)
    if plan.layout is not None and plan.layout.stacked and rows.num_rows > _STACK_ROWS:
        stacked = _stacked_rows(rows, given, plan, model, scratch)
        if stacked is not None:
            return stacked
    if given.equals(schema):  # the protocol adapters build rows this way
        table = rows
    else:
        table = _cast_columns(rows, given, signature, model)
    columns = table.columns
    nulls = {schema.field(i).name: columns[i].null_count for i in plan.not_nullable if columns[i].null_count}
    if nulls:
        raise null_error(nulls, table.num_rows, model)
    if plan.finite_columns:
        bad = non_finite_counts(table, [plan.by_name[n].spec for n in plan.finite_columns])
        if bad:
            float32 = any(pa.types.is_float32(table.schema.field(name).type) for name in bad)
            raise non_finite_error(bad, table.num_rows, model, float32)
    return Rows(plan, table)


# Past this many rows (a batch tier's batches), rows of a stacked float signature whose columns are floats are
# checked and held as the (N, columns) matrix the model is fed: one copy that casts while it copies and one
# finite check over the matrix, where the Arrow path casts each column, sums each, and the runtime then
# stacks them anyway (figures: bench/README.md, "Figures behind the code").
_STACK_ROWS = 1024


def _stacked_rows(rows: pa.Table | pa.RecordBatch, given: pa.Schema, plan: SignaturePlan, model: str,
                  scratch: MatrixScratch | None) -> Rows | None:
    """Float columns of a stacked float signature as ``Rows`` of the one matrix, checked as ``check_rows``
    checks them; None when a column is missing, repeated, not a float column, or holds nulls (the Arrow
    path below names what is wrong)."""
    layout = plan.layout
    assert layout is not None
    columns = []
    for column in plan.columns:
        index = given.get_field_index(column.name)  # -1 when missing or repeated
        if index < 0 or not pa.types.is_floating(given.field(index).type):
            return None
        values = rows.column(index)
        if values.null_count:
            return None
        columns.append(numpy_values(values))
    return float_rows(plan, (stack_columns(columns, rows.num_rows, layout.dtypes[0], scratch),), model)


def _cast_columns(rows: pa.Table | pa.RecordBatch, given: pa.Schema, signature: Signature, model: str) -> pa.Table:
    columns = []
    for field in signature.plan.input_schema:
        index = given.get_field_index(field.name)
        if index < 0 or not feeds(given.field(index).type, field.type):
            raise schema_mismatch(given, signature, model) or SchemaMismatch(
                f"column {field.name!r} appears more than once; send it once", [field.name])
        column = rows.column(index)
        if column.type != field.type:
            try:
                column = column.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                lengths = _list_lengths_error(field, column, model) if pa.types.is_fixed_size_list(field.type) \
                    and (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)) else None
                if lengths is not None:
                    raise lengths from e
                raise InvalidInput(
                    f"column {field.name!r} cannot be read as {type_name(field.type)} by the model {model!r} ({e}); "
                    f"cast it to {type_name(field.type)} yourself, or fix the values that do not fit"
                ) from e
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=signature.plan.input_schema)


def _list_lengths_error(field: pa.Field, column: pa.Array | pa.ChunkedArray, model: str) -> InvalidInput | None:
    """A list column whose rows are not all the fixed size the model's input takes, said with the lengths found;
    None where every row has that size (the cast failed on the values: the caller's message says so)."""
    size = field.type.list_size
    lengths = pc.list_value_length(column)
    wrong = pc.filter(lengths, pc.not_equal(lengths, size))
    if not len(wrong):
        return None
    found = sorted(set(wrong.to_pylist()))
    shown = ", ".join(map(str, found[:5])) + (", ..." if len(found) > 5 else "")
    return InvalidInput(
        f"column {field.name!r} holds {len(wrong)} of {len(column)} rows whose lists are not {size} values long "
        f"({shown}); the model {model!r} takes {size} a row: fix those rows or pick the model this data was made for")


def float_rows(plan: SignaturePlan, arrays: tuple[np.ndarray, ...], model: str) -> Rows:
    """``Rows`` from float arrays in ``plan.layout`` (of its dtypes and widths: the decoder's promise),
    refused as ``check_rows`` refuses them when a finite-only column holds NaN or infinity.

    One pass in the common case (``np.isfinite(...).all()``: no float64 sum under ``np.errstate``,
    whose context alone costs more than the check).

    Raises:
        NonFiniteValues: with ``check_rows``'s message.
    """
    layout = plan.layout
    if layout is not None and layout.finite:
        finite = np.isfinite(arrays[0]).all() if len(arrays) == 1 else all(np.isfinite(a).all() for a in arrays)
        if not finite:
            _refuse_non_finite(plan, layout, arrays, model)
    return Rows(plan, arrays=arrays)


def _refuse_non_finite(plan: SignaturePlan, layout: FloatLayout, arrays: tuple[np.ndarray, ...], model: str) -> None:
    counts = {}
    float32 = False
    for i in layout.finite:
        values = arrays[0][:, i] if layout.stacked else arrays[i]
        bad = int(np.count_nonzero(~np.isfinite(values)))
        if bad:
            counts[layout.names[i]] = bad
            float32 = float32 or values.dtype == np.float32
    if counts:  # (none: the sum overflowed, or the NaN are in columns that take them)
        raise non_finite_error(counts, int(arrays[0].shape[0]), model, float32)
