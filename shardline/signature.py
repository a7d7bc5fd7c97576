"""Model signatures: input and output columns as Arrow types, and the schema check.

A type is written as a string: a primitive alias Arrow knows (``float32``,
``int64``, ``string``, ``bool``, ...), ``list<T>``, or ``fixed_size_list<T>[N]``.
"""

from __future__ import annotations

import functools
import math
import re
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from shardline.arrays import numpy_values
from shardline.errors import InvalidBundle

if TYPE_CHECKING:
    from shardline.rows import SignaturePlan

_FIXED = re.compile(r"^fixed_size_list<(.+)>\[(\d+)\]$")
_LIST = re.compile(r"^list<(.+)>$")
_NAMES = {
    pa.float16(): "float16",
    pa.float32(): "float32",
    pa.float64(): "float64",
    pa.string(): "string",
    pa.large_string(): "large_string",
    pa.bool_(): "bool",
}


@functools.lru_cache(maxsize=1024)
def parse_type(text: str) -> pa.DataType:
    """Turn a signature type string into an Arrow type (cached: it is on every online request's path).

    Raises:
        InvalidBundle: the string names no Arrow type.
    """
    text = text.strip()
    if match := _FIXED.match(text):
        return pa.list_(parse_type(match.group(1)), int(match.group(2)))
    if match := _LIST.match(text):
        return pa.list_(parse_type(match.group(1)))
    try:
        return pa.type_for_alias(text)
    except ValueError as e:
        raise InvalidBundle(
            f"signature type {text!r} is not an Arrow type; use a name such as "
            "'float32', 'int64', 'string', 'list<float32>' or 'fixed_size_list<float32>[4]'"
        ) from e


def type_name(dtype: pa.DataType) -> str:
    """Write an Arrow type as a signature type string (the inverse of parse_type)."""
    if pa.types.is_fixed_size_list(dtype):
        return f"fixed_size_list<{type_name(dtype.value_type)}>[{dtype.list_size}]"
    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
        return f"list<{type_name(dtype.value_type)}>"
    return _NAMES.get(dtype, str(dtype))


def leaf_type(dtype: pa.DataType) -> pa.DataType:
    """The type of a column's single values: ``float32`` for ``fixed_size_list<fixed_size_list<float32>[4]>[3]``."""
    while pa.types.is_fixed_size_list(dtype) or pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
        dtype = dtype.value_type
    return dtype


def row_shape(dtype: pa.DataType) -> list[int]:
    """The tensor shape of one row of a column, -1 where it varies: ``[]`` for a primitive column,
    ``[k]`` for ``fixed_size_list<T>[k]``, ``[a, b]`` for ``fixed_size_list<fixed_size_list<T>[b]>[a]``,
    ``[-1]`` for ``list<T>``. A model's tensor for the column has shape ``[N, *row_shape]``."""
    dims = []
    while True:
        if pa.types.is_fixed_size_list(dtype):
            dims.append(dtype.list_size)
        elif pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
            dims.append(-1)
        else:
            return dims
        dtype = dtype.value_type


def tensor_type_name(value_type: str, dims: list[int]) -> str:
    """The signature type of a column whose rows are tensors of shape ``dims`` (-1: varies) of ``value_type``
    (the inverse of ``row_shape``): ``tensor_type_name("float32", [30])`` is ``fixed_size_list<float32>[30]``."""
    name = value_type
    for dim in reversed(dims):
        name = f"list<{name}>" if dim < 0 else f"fixed_size_list<{name}>[{dim}]"
    return name


class ColumnSpec(BaseModel):
    """One column of a signature (immutable: a signature's plan is worked out from its columns once)."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(min_length=1, description="Column name.")
    type: str = Field(description="Arrow type string, e.g. 'float32'.")
    nullable: bool = Field(default=False, description="Whether nulls are allowed.")
    non_finite: bool = Field(
        default=False,
        description="Whether NaN and +/-infinity are values the model takes in this (float) column, e.g. a tree "
        "model's missing value. Without it both tiers refuse them: the online tier with 400 naming the input, "
        "the batch tier by quarantining the shard. Packaging sets it for a float column whose sample holds them.",
    )

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        parse_type(value)
        return value

    @model_serializer(mode="wrap")
    def _without_default_flags(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # non_finite is written only when set, so every bundle made before it keeps its manifest and digests.
        data: dict[str, Any] = handler(self)
        if not self.non_finite:
            data.pop("non_finite", None)
        return data

    @property
    def arrow_type(self) -> pa.DataType:
        """The column's Arrow type."""
        return parse_type(self.type)


class Signature(BaseModel):
    """What a model reads and what it writes, column by column.

    Immutable (the columns are tuples of frozen specs), so what reading its rows needs is worked
    out once and kept on it: ``plan`` (``shardline.rows.SignaturePlan``). The plan is not part of
    the model's fields: it is not serialized, compared, copied or pickled.
    """

    model_config = ConfigDict(frozen=True)

    inputs: tuple[ColumnSpec, ...] = Field(min_length=1)
    outputs: tuple[ColumnSpec, ...] = Field(min_length=1)
    input_tensor: str | None = Field(
        default=None, min_length=1,
        description="Tensor protocols (Open Inference Protocol V2) take the inputs as one [N, k] tensor of this name, "
        "the k input columns stacked in order (the model's own input, as Triton shows it), instead of one [N] tensor "
        "per column. Only for inputs that are all float32 (or all float64) columns. The rows stay columns: batch "
        "shards, capture and profiles hold the k columns. None: one tensor per column.",
    )

    @field_validator("inputs", "outputs")
    @classmethod
    def _unique_names(cls, value: tuple[ColumnSpec, ...]) -> tuple[ColumnSpec, ...]:
        names = [c.name for c in value]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"column names repeat: {dupes}")
        return value

    @model_validator(mode="after")
    def _stackable(self) -> "Signature":
        if self.input_tensor is not None:
            types = sorted({c.type for c in self.inputs})
            if len(types) != 1 or parse_type(types[0]) not in (pa.float32(), pa.float64()):
                raise ValueError(f"input_tensor {self.input_tensor!r}: inputs are taken as one tensor only when they "
                                 f"are all float32 (or all float64) columns; they are {types}")
        return self

    @model_serializer(mode="wrap")
    def _without_input_tensor(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # input_tensor is written only when set, so every bundle made before it keeps its manifest and digests.
        data: dict[str, Any] = handler(self)
        if self.input_tensor is None:
            data.pop("input_tensor", None)
        return data

    @property
    def input_names(self) -> list[str]:
        """Names of the input columns, in order."""
        return [c.name for c in self.inputs]

    @property
    def output_names(self) -> list[str]:
        """Names of the output columns, in order."""
        return [c.name for c in self.outputs]

    def output_schema(self) -> pa.Schema:
        """The Arrow schema of what the model returns."""
        return self.plan.output_schema

    @functools.cached_property
    def plan(self) -> SignaturePlan:
        """What reading rows for this signature needs (schemas, column plans, float layout), made once."""
        from shardline.rows import SignaturePlan

        return SignaturePlan(self)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> "Signature":
        """This signature (it is immutable), or with ``update`` a new one, validated and with its own plan."""
        if update:
            return Signature.model_validate({**dict(self), **update})
        return self

    def __copy__(self) -> "Signature":
        return self

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> "Signature":
        return self

    def __getstate__(self) -> dict[Any, Any]:
        """Pickled without the plan (it holds locks; it is made again where it is needed)."""
        state = super().__getstate__()
        state["__dict__"] = {k: v for k, v in state["__dict__"].items() if k != "plan"}
        return state


def _is_numeric(dtype: pa.DataType) -> bool:
    return pa.types.is_integer(dtype) or pa.types.is_floating(dtype)


_TEXT_TYPES = ((pa.string(), pa.large_string(), pa.string_view()), (pa.binary(), pa.large_binary(), pa.binary_view()))


def feeds(got: pa.DataType, expected: pa.DataType) -> bool:
    """Whether data of type ``got`` can be scored by an input of type ``expected``: ``is_compatible``; a decimal or
    boolean column where the input is a float (scikit-learn casts both); or a list column where the input is a
    fixed-size list of values it fits (what pandas, Polars and Spark write for a column of arrays:
    ``list<double>``), each row's length checked as the rows are read (``rows.check_rows``). A signature
    is not compatible with another by this (``quality.gates`` asks ``is_compatible``): a client of a list input may
    send any length."""
    if is_compatible(got, expected):
        return True
    if pa.types.is_dictionary(got):
        return feeds(got.value_type, expected)
    if casts_to_float(got, expected):
        return True
    return (pa.types.is_fixed_size_list(expected) and (pa.types.is_list(got) or pa.types.is_large_list(got))
            and feeds(got.value_type, expected.value_type))


def casts_to_float(got: pa.DataType, expected: pa.DataType) -> bool:
    """A decimal column (a warehouse's DECIMAL export) or a boolean one (a flag) feeding a float input: cast to the
    float, as scikit-learn casts them (``feeds``; the batch tier's contract sample and capture get the cast too)."""
    return pa.types.is_floating(expected) and (pa.types.is_decimal(got) or pa.types.is_boolean(got))


def is_compatible(got: pa.DataType, expected: pa.DataType) -> bool:
    """Whether a column of type ``got`` can feed an input of type ``expected``.

    Equal types fit; any integer or float fits a float input (the cast every
    scikit-learn model already does); strings fit strings of any width or layout
    (``string_view``), binaries binaries; lists fit when their values do and fixed
    sizes agree. A dictionary-encoded column (a pandas ``category``) fits where its values do.
    """
    if got == expected:
        return True
    if pa.types.is_dictionary(got):
        return is_compatible(got.value_type, expected)
    if pa.types.is_floating(expected) and _is_numeric(got):
        return True
    if pa.types.is_integer(expected) and pa.types.is_integer(got):
        return True
    for kinds in _TEXT_TYPES:
        if expected in kinds and got in kinds:
            return True
    if pa.types.is_fixed_size_list(expected):
        return (
            pa.types.is_fixed_size_list(got)
            and got.list_size == expected.list_size
            and is_compatible(got.value_type, expected.value_type)
        )
    if pa.types.is_list(expected) or pa.types.is_large_list(expected):
        return (
            pa.types.is_list(got) or pa.types.is_large_list(got) or pa.types.is_fixed_size_list(got)
        ) and is_compatible(got.value_type, expected.value_type)
    return False


NAMED_COLUMNS = 5  # columns a schema problem names before '...': a message stays one readable line


def named_columns(names: Sequence[str], most: int = NAMED_COLUMNS) -> str:
    """``'a', 'b', 'c', ...``: the first ``most`` names quoted, then '...' when there are more."""
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (", ..." if len(names) > most else "")


def schema_problems(schema: pa.Schema, inputs: Iterable[ColumnSpec], model: str) -> list[str]:
    """Every way ``schema`` fails to feed the inputs, one line per kind (missing, mistyped); empty when it fits.

    One missing (or mistyped) column gets its own sentence; several are collapsed into one
    line that counts them and names the first few (``NAMED_COLUMNS``), so a shard of the
    wrong data set reads "30 of 30 columns ... are missing: 'a', 'b', ...; the data has 2
    columns: 'id', 'foo'" instead of 30 sentences. The batch quarantine reasons, the CLI and
    the online tier's 400 all carry this one message.
    """
    specs = list(inputs)
    missing: list[ColumnSpec] = []
    mistyped: list[tuple[ColumnSpec, pa.DataType]] = []
    repeated: list[str] = []
    for spec in specs:
        index = schema.get_field_index(spec.name)  # -1 for a name the schema holds twice, too
        if index < 0 and len(schema.get_all_field_indices(spec.name)) > 1:
            repeated.append(spec.name)
        elif index < 0:
            missing.append(spec)
        elif not feeds(schema.field(index).type, spec.arrow_type):
            mistyped.append((spec, schema.field(index).type))
    problems = []
    if repeated:
        problems.append(f"{named_columns(repeated)} {'is' if len(repeated) == 1 else 'are'} in the data more than "
                        f"once; keep one column of each name the model {model!r} reads")
    if len(mistyped) == 1:
        spec, got = mistyped[0]
        problems.append(
            f"column {spec.name!r} is {type_name(got)}, the model {model!r} expects "
            f"{spec.type}; cast it to {spec.type} before scoring"
        )
    elif mistyped:
        groups: dict[tuple[str, str], list[str]] = {}  # (type got, type expected) -> the columns
        for spec, got in mistyped:
            groups.setdefault((type_name(got), spec.type), []).append(spec.name)
        shown = [f"{named_columns(names)} {'is' if len(names) == 1 else 'are'} {got}, expected {expected}"
                 for (got, expected), names in groups.items()]
        problems.append(
            f"{len(mistyped)} columns have types the model {model!r} cannot read: "
            f"{'; '.join(shown[:NAMED_COLUMNS])}{'; ...' if len(shown) > NAMED_COLUMNS else ''}; cast them to "
            "the types expected before scoring"
        )
    if len(missing) == 1:
        problems.append(
            f"column {missing[0].name!r} is missing; the model {model!r} needs it "
            f"({missing[0].type}); add it or pick the model this data was made for"
        )
    elif missing:
        types = sorted({spec.type for spec in missing})
        kinds = f" (all {types[0]})" if len(types) == 1 else ""
        problems.append(
            f"{len(missing)} of {len(specs)} columns the model {model!r} needs are missing: "
            f"{named_columns([spec.name for spec in missing])}{kinds}; the data has {len(schema.names)} "
            f"column{'s' if len(schema.names) != 1 else ''}"
            f"{': ' + named_columns(schema.names) if schema.names else ''}; add them or pick the model this "
            "data was made for"
        )
    return problems


def with_missing_values(sample: pa.Table, inputs: Sequence[ColumnSpec]) -> list[ColumnSpec]:
    """``inputs`` declaring what ``sample`` shows the model takes: a float column whose sample holds NaN or
    infinity declares ``non_finite``, and a primitive float column whose sample holds nulls or NaN declares both
    ``non_finite`` and ``nullable`` (a missing value, as a tree model reads NaN: pandas writes NaN to Parquet as
    null, and both tiers feed a null to the model as NaN). Other columns are left as they are."""
    takes_nan = non_finite_counts(sample, inputs)
    declared = []
    for spec in inputs:
        update: dict[str, bool] = {}
        if spec.name in takes_nan:
            update["non_finite"] = True
        if pa.types.is_floating(spec.arrow_type) and (spec.name in takes_nan or sample.column(spec.name).null_count):
            update.update(non_finite=True, nullable=True)
        declared.append(spec.model_copy(update=update) if update else spec)
    return declared


def non_finite_counts(batch: pa.RecordBatch | pa.Table, inputs: Iterable[ColumnSpec]) -> dict[str, int]:
    """Input column -> how many NaN or infinite values it holds, for float columns (and lists of floats)
    whose spec does not declare ``non_finite``; columns without any are left out. Nulls do not count.

    One pass per column in the common case: the float64 sum of finite values is finite.
    """
    found = {}
    for spec in inputs:
        if spec.non_finite:
            continue
        column = batch.column(spec.name)
        values = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        while pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type) or pa.types.is_large_list(
                values.type):
            values = values.flatten()
        if not pa.types.is_floating(values.type) or len(values) == 0:
            continue
        if values.null_count == 0:
            array = numpy_values(values)
            with np.errstate(over="ignore", invalid="ignore"):
                if math.isfinite(array.sum(dtype=np.float64)):
                    continue
            bad = int(np.count_nonzero(~np.isfinite(array)))
        else:
            bad = int(pc.sum(pc.invert(pc.is_finite(values))).as_py() or 0)
        if bad:
            found[spec.name] = bad
    return found
