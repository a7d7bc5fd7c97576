"""Signatures: type strings, compatibility, and the messages a user reads."""

from __future__ import annotations

from decimal import Decimal

import numpy as np
import pyarrow as pa
import pytest

from shardline.errors import InvalidBundle, InvalidInput
from shardline.signature import (
    ColumnSpec,
    Signature,
    feeds,
    is_compatible,
    non_finite_counts,
    parse_type,
    schema_problems,
    type_name,
)


@pytest.mark.parametrize(
    "text, dtype",
    [
        ("float32", pa.float32()),
        ("int64", pa.int64()),
        ("string", pa.string()),
        ("bool", pa.bool_()),
        ("list<float32>", pa.list_(pa.float32())),
        ("fixed_size_list<float32>[2]", pa.list_(pa.float32(), 2)),
        ("fixed_size_list<list<int64>>[3]", pa.list_(pa.list_(pa.int64()), 3)),
    ],
)
def test_type_strings_round_trip(text: str, dtype: pa.DataType) -> None:
    assert parse_type(text) == dtype
    assert type_name(dtype) == text


def test_unknown_type_names_the_accepted_forms() -> None:
    with pytest.raises(InvalidBundle, match="'floot32' is not an Arrow type.*fixed_size_list"):
        parse_type("floot32")


@pytest.mark.parametrize(
    "got, expected, fits",
    [
        (pa.float64(), pa.float32(), True),
        (pa.int32(), pa.float32(), True),
        (pa.int64(), pa.int32(), True),
        (pa.float32(), pa.int64(), False),
        (pa.string(), pa.float32(), False),
        (pa.large_string(), pa.string(), True),
        (pa.string_view(), pa.string(), True),
        (pa.binary_view(), pa.binary(), True),
        (pa.binary(), pa.string(), False),
        (pa.dictionary(pa.int16(), pa.string()), pa.string(), True),  # a pandas category
        (pa.dictionary(pa.int8(), pa.int64()), pa.float32(), True),
        (pa.dictionary(pa.int8(), pa.string()), pa.float32(), False),
        (pa.list_(pa.float64(), 4), pa.list_(pa.float32(), 4), True),
        (pa.list_(pa.float32(), 3), pa.list_(pa.float32(), 4), False),
        (pa.list_(pa.float32()), pa.list_(pa.float32(), 4), False),
        (pa.list_(pa.float32(), 4), pa.list_(pa.float32()), True),
    ],
)
def test_compatibility_table(got: pa.DataType, expected: pa.DataType, fits: bool) -> None:
    assert is_compatible(got, expected) is fits


@pytest.mark.parametrize("got", [pa.list_(pa.float64()), pa.large_list(pa.float32()), pa.list_(pa.int64())])
def test_a_list_column_feeds_a_fixed_size_list_input_but_is_no_compatible_signature(got: pa.DataType) -> None:
    vector = pa.list_(pa.float32(), 30)
    # what pandas, Polars and Spark write for a column of arrays: scored, each row's length checked when read ...
    assert feeds(got, vector) and schema_problems(pa.schema([("v", got)]), [ColumnSpec(name="v", type="fixed_size_list<float32>[30]")], "m:1") == []
    # ... but a model version that takes [30] where the last took any length is a breaking change (the gate's)
    assert not is_compatible(got, vector)
    assert not feeds(pa.list_(pa.string()), vector) and not feeds(pa.float32(), vector)


def test_a_list_column_whose_rows_do_not_fit_says_which_rows_or_which_values() -> None:
    from shardline.rows import check_rows

    signature = Signature(inputs=[ColumnSpec(name="v", type="fixed_size_list<int8>[2]")],
                          outputs=[ColumnSpec(name="label", type="int64")])
    with pytest.raises(InvalidInput, match=r"column 'v' holds 2 of 3 rows whose lists are not 2 values long \(1, 3\); "
                                           r"the model 'm:1' takes 2 a row"):
        check_rows(pa.table({"v": pa.array([[1, 2], [3], [4, 5, 6]], pa.list_(pa.int64()))}), signature, "m:1")
    with pytest.raises(InvalidInput, match=r"column 'v' cannot be read as fixed_size_list<int8>\[2\] .*not in range"):
        check_rows(pa.table({"v": pa.array([[1, 2], [300, 4]], pa.list_(pa.int64()))}), signature, "m:1")


def test_decimal_and_boolean_columns_feed_float_inputs_as_scikit_learn_casts_them() -> None:
    from shardline.rows import check_rows

    signature = Signature(inputs=[ColumnSpec(name="price", type="float32"), ColumnSpec(name="flag", type="float64")],
                          outputs=[ColumnSpec(name="label", type="int64")])
    table = pa.table({"price": pa.array([Decimal("1.00"), Decimal("2.50")], pa.decimal128(10, 2)),
                      "flag": pa.array([True, False])})
    assert feeds(pa.decimal128(10, 2), pa.float32()) and feeds(pa.bool_(), pa.float64())
    assert not is_compatible(pa.decimal128(10, 2), pa.float32())  # data that fits, not a compatible signature
    assert not feeds(pa.decimal128(10, 2), pa.int64()) and not feeds(pa.bool_(), pa.string())
    rows = check_rows(table, signature, "m:1").table()
    assert rows.column("price").to_pylist() == [1.0, 2.5] and rows.column("flag").to_pylist() == [1.0, 0.0]


def test_dictionary_encoded_columns_are_read_as_their_values_by_the_row_check() -> None:
    from shardline.rows import check_rows

    # a pandas category (Parquet restores it for text) and an encoded number, as both tiers read them
    signature = Signature(inputs=[ColumnSpec(name="city", type="string"), ColumnSpec(name="age", type="float32")],
                          outputs=[ColumnSpec(name="label", type="int64")])
    city = pa.array(["oslo", "lima", "oslo"]).dictionary_encode().cast(pa.dictionary(pa.int16(), pa.string()))
    rows = check_rows(pa.table({"city": city, "age": pa.array([30, 41, 30]).dictionary_encode()}), signature, "m:1")

    table = rows.table()
    assert table.schema == signature.plan.input_schema
    assert table.column("city").to_pylist() == ["oslo", "lima", "oslo"]
    assert table.column("age").to_pylist() == [30.0, 41.0, 30.0]


def test_schema_problems_say_what_got_and_do() -> None:
    inputs = [ColumnSpec(name="age", type="float32"), ColumnSpec(name="city", type="string")]
    schema = pa.schema([("age", pa.string())])

    problems = schema_problems(schema, inputs, "churn:3")

    assert problems == [
        "column 'age' is string, the model 'churn:3' expects float32; cast it to float32 before scoring",
        "column 'city' is missing; the model 'churn:3' needs it (string); add it or pick the model this "
        "data was made for",
    ]
    assert schema_problems(pa.schema([("age", pa.float64()), ("city", pa.string())]), inputs, "m") == []
    # a column the data holds twice was said to be missing
    twice = pa.schema([("age", pa.float64()), ("city", pa.string()), ("age", pa.float64())])
    assert schema_problems(twice, inputs, "churn:3") == [
        "'age' is in the data more than once; keep one column of each name the model 'churn:3' reads"]


def test_many_missing_or_mistyped_columns_are_one_line_each_not_one_sentence_per_column() -> None:
    """A shard of the wrong data set: 30 columns missing read as one line (the batch quarantine reason, the CLI
    and the online tier's 400 all carry it), naming the first five and what the data has."""
    from shardline.build.examples import breast_cancer
    from shardline.errors import SchemaMismatch
    from shardline.rows import check_rows

    names = breast_cancer().names
    signature = Signature(inputs=[ColumnSpec(name=n, type="float32") for n in names],
                          outputs=[ColumnSpec(name="label", type="int64")])
    wrong = pa.table({"id": [1, 2], "foo": ["a", "b"]})

    problems = schema_problems(wrong.schema, signature.inputs, "breast-cancer:1")

    assert problems == [
        "30 of 30 columns the model 'breast-cancer:1' needs are missing: 'mean radius', 'mean texture', "
        "'mean perimeter', 'mean area', 'mean smoothness', ... (all float32); the data has 2 columns: 'id', 'foo'; "
        "add them or pick the model this data was made for"
    ]
    with pytest.raises(SchemaMismatch) as refused:  # the one row check both tiers call: the same one line
        check_rows(wrong, signature, "breast-cancer:1")
    assert str(refused.value) == problems[0] and refused.value.problems == problems

    strings = pa.table({n: pa.array(["1.0"]) for n in names[:7]} | {names[7]: pa.array([b"\x01"])}
                       | {n: pa.array([1.0]) for n in names[8:]})
    [mistyped] = schema_problems(strings.schema, signature.inputs, "breast-cancer:1")
    assert mistyped == (
        "8 columns have types the model 'breast-cancer:1' cannot read: 'mean radius', 'mean texture', "
        "'mean perimeter', 'mean area', 'mean smoothness', ... are string, expected float32; 'mean concave points' "
        "is binary, expected float32; cast them to the types expected before scoring"
    )


def test_signature_refuses_repeated_columns() -> None:
    with pytest.raises(ValueError, match="column names repeat: \\['a'\\]"):
        Signature(inputs=[ColumnSpec(name="a", type="float32")] * 2, outputs=[ColumnSpec(name="y", type="int64")])


def test_output_schema_carries_types_and_nullability() -> None:
    signature = Signature(
        inputs=[ColumnSpec(name="x", type="float32")],
        outputs=[ColumnSpec(name="y", type="fixed_size_list<float32>[2]"), ColumnSpec(name="z", type="int64", nullable=True)],
    )
    schema = signature.output_schema()
    assert schema.field("y").type == pa.list_(pa.float32(), 2) and not schema.field("y").nullable
    assert schema.field("z").nullable


def test_non_finite_values_are_counted_per_float_column_unless_declared() -> None:
    nan, inf = float("nan"), float("inf")
    batch = pa.table({
        "a": pa.array([1.0, nan, 3.0], pa.float32()),
        "b": pa.array([1.0, None, -inf], pa.float64()),  # a null is not a NaN
        "v": pa.array([[1.0, inf], [nan, nan], [0.0, 0.0]], pa.list_(pa.float32(), 2)),
        "ok": pa.array([1e308, 1e308, 1e308]),  # finite values whose sum overflows are looked at one by one
        "n": pa.array([1, 2, 3]),
        "t": pa.array([nan, nan, nan], pa.float32()),
    })
    specs = [ColumnSpec(name="a", type="float32"), ColumnSpec(name="b", type="float64", nullable=True),
             ColumnSpec(name="v", type="fixed_size_list<float32>[2]"), ColumnSpec(name="ok", type="float64"),
             ColumnSpec(name="n", type="int64"), ColumnSpec(name="t", type="float32", non_finite=True)]
    assert non_finite_counts(batch, specs) == {"a": 1, "b": 1, "v": 3}
    assert ColumnSpec(name="t", type="float32", non_finite=True).model_dump()["non_finite"] is True
    assert "non_finite" not in ColumnSpec(name="a", type="float32").model_dump()  # old manifests keep their digest


@pytest.mark.parametrize("where", [0, 2_183, 2_184, 65_535])
def test_a_nan_in_any_block_of_a_large_batch_is_refused_with_its_column_and_count(where: int) -> None:
    """Batches past 1,024 rows are stacked into the model's matrix a block of rows at a time; a NaN in the first,
    a middle or the last block (or on a block's edge) is refused as a small batch's is, naming its column."""
    from shardline.build.examples import breast_cancer
    from shardline.errors import NonFiniteValues
    from shardline.rows import check_rows

    names = breast_cancer().names
    signature = Signature(inputs=[ColumnSpec(name=n, type="float32") for n in names],
                          outputs=[ColumnSpec(name="label", type="int64")])
    columns = {n: np.full(65_536, float(i)) for i, n in enumerate(names)}
    matrix = check_rows(pa.table(columns), signature, "breast-cancer:1").arrays[0]
    assert matrix.shape == (65_536, 30) and (matrix[where] == np.arange(30, dtype=np.float32)).all()

    columns[names[29]][where] = np.nan
    columns[names[4]][where] = np.inf
    with pytest.raises(NonFiniteValues) as refused:
        check_rows(pa.table(columns), signature, "breast-cancer:1")
    assert f"{{'{names[4]}': 1, '{names[29]}': 1}}" in str(refused.value)


@pytest.mark.parametrize("rows", [3, 2_000], ids=["small", "stacked"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_non_finite_message_speaks_of_float32s_range_only_for_a_float32_column(dtype: str, rows: int) -> None:
    """A number past float32's range is infinite once cast: said for a float32 column, not for a float64 one,
    on the table path, the stacked path and the online decoders' (``float_rows``)."""
    from shardline.errors import NonFiniteValues
    from shardline.rows import check_rows, float_rows

    signature = Signature(inputs=[ColumnSpec(name=n, type=dtype) for n in ("x", "y")],
                          outputs=[ColumnSpec(name="label", type="int64")])
    columns = {"x": np.ones(rows), "y": np.ones(rows)}
    columns["y"][1] = np.nan
    matrix = np.stack([columns["x"], columns["y"]], axis=1).astype(dtype)
    for refuse in (lambda: check_rows(pa.table(columns), signature, "m:1"),
                   lambda: float_rows(signature.plan, (matrix,), "m:1")):
        with pytest.raises(NonFiniteValues, match=r"columns \['y'\] hold NaN or infinite values") as refused:
            refuse()
        assert ("past float32's range" in str(refused.value)) is (dtype == "float32")
