"""Reference data profiles: a compact summary of a table, for drift checks and gates.

Per column: its type, null rate and, for numbers, min/max/mean/std and quantiles;
for strings, the most frequent values. Computed with pyarrow.compute in one pass
per column; the profile of a table is small JSON whatever the table's size.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from shardline.signature import type_name

QUANTILES = [0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0]
TOP_VALUES = 20


def _numeric(column: pa.ChunkedArray) -> dict[str, Any]:
    valid = pc.drop_null(column)
    if len(valid) == 0:
        return {}
    as_float = pc.cast(valid, pa.float64())
    return {
        "min": pc.min(as_float).as_py(),
        "max": pc.max(as_float).as_py(),
        "mean": pc.mean(as_float).as_py(),
        "std": pc.stddev(as_float).as_py(),
        "quantiles": dict(zip([str(q) for q in QUANTILES], pc.quantile(as_float, q=QUANTILES).to_pylist())),
    }


def _categorical(column: pa.ChunkedArray) -> dict[str, Any]:
    counts = pc.value_counts(pc.drop_null(column))
    pairs = sorted(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()), key=lambda p: -p[1])
    total = sum(c for _, c in pairs) or 1
    return {"distinct": len(pairs), "top": {str(v): c / total for v, c in pairs[:TOP_VALUES]}}


def profile_table(table: pa.Table, columns: list[str] | None = None) -> dict[str, Any]:
    """Summarize the named columns (all by default) of a table."""
    summary: dict[str, Any] = {"rows": table.num_rows, "columns": {}}
    for name in columns or table.column_names:
        column = table.column(name)
        entry: dict[str, Any] = {
            "type": type_name(column.type),
            "null_rate": column.null_count / table.num_rows if table.num_rows else 0.0,
        }
        if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
            entry.update(_numeric(column))
        elif pa.types.is_string(column.type) or pa.types.is_large_string(column.type) or pa.types.is_boolean(column.type):
            entry.update(_categorical(column))
        summary["columns"][name] = entry
    return summary
