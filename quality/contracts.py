"""Data contracts: a great-expectations suite made from a bundle's signature and reference profile.

Per input column of the signature: the column exists; its type is one the input
accepts (checked on the pandas view great-expectations validates: an integer
column with nulls shows as float64 there, strings as object); no nulls unless the
signature allows them; numbers within the reference min/max widened by
``range_tolerance`` of the reference range; strings and booleans only from the
reference's categories, when the reference listed all of them. With
``distribution=True`` the suite also holds great-expectations' own distribution
checks: KL divergence on the reference's decile bins and quantile ranges.

``ShardContract`` is what batch jobs call on a sample of each shard: picklable (it
holds the manifest and the profile, nothing of great-expectations). A sample is
first screened with vectorized Arrow and numpy checks of the same expectations (the same
code lists them, as plain parameters; every float column's range from one matrix of the
sample), under great-expectations' rules; only a sample
the screen cannot pass (or a suite with distribution expectations) is validated by
great-expectations, whose verdict and details the contract reports. So a job whose
shards all pass never imports it, and a passing sample costs a hundredth of a validation (figures: bench/README.md, "Figures behind the code"). great-expectations is imported on the
first sample it must judge, and its suite built once per process (cached by
content). Its import takes seconds: nothing on the online path or at CLI start
imports it. ``GX_ANALYTICS_ENABLED=false`` is set (if unset) before it is imported.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardline.arrays import numpy_values, stack_columns
from shardline.bundle import DriftPolicy, Manifest
from shardline.errors import RuntimeUnavailable
from shardline.signature import ColumnSpec

if TYPE_CHECKING:  # pragma: no cover
    from great_expectations.core import ExpectationSuite

_FLOATS = ["float16", "float32", "float64"]
_INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
_QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


@dataclass(frozen=True)
class ContractRules:
    """How strict a contract is."""

    range_tolerance: float = 0.5
    """Numbers may lie this share of the reference range beyond its min and max."""
    mostly: float = 0.99
    """Share of a sample's values that must pass a value check (range, categories)."""
    distribution: bool = False
    """Also check the distribution (GX KL divergence on the reference bins, quantiles)."""
    quantile_tolerance: float = 0.25
    """With ``distribution``: a quantile may move this share of the reference's 5-95% spread."""


def _gx() -> Any:
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    try:
        import great_expectations as gx
    except ImportError as e:
        raise RuntimeUnavailable(
            "data contracts need great-expectations, which is not installed; pip install 'shardline[quality]'"
        ) from e
    return gx


def _is_text(dtype: pa.DataType) -> bool:
    """A string column of any width or layout (pandas shows each as str values)."""
    return pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or pa.types.is_string_view(dtype)


def _type_list(spec: ColumnSpec) -> list[str] | None:
    dtype = spec.arrow_type
    if pa.types.is_floating(dtype):
        return _FLOATS + _INTS
    if pa.types.is_integer(dtype):
        return _INTS + ["float64"]  # pandas shows an integer column with nulls as float64
    if _is_text(dtype):
        return ["str", "object"]  # values of an object column are checked one by one: str
    if pa.types.is_boolean(dtype):
        return ["bool", "object"]
    return None


def _kl_partition(entry: dict[str, Any]) -> dict[str, Any] | None:
    bins = entry.get("bins", {})
    edges, fractions = bins.get("edges", []), bins.get("fractions", [])
    if len(edges) < 2 or len(fractions) != len(edges) + 1:
        return None
    return {"bins": edges, "weights": fractions[1:-1], "tail_weights": [fractions[0], fractions[-1]]}


def _column_expectations(gxe: Any, spec: ColumnSpec, entry: dict[str, Any] | None, rules: ContractRules,
                         policy: DriftPolicy) -> list[Any]:
    name = spec.name
    found = [gxe.ExpectColumnToExist(column=name)]
    types = _type_list(spec)
    if types:
        found.append(gxe.ExpectColumnValuesToBeInTypeList(column=name, type_list=types))
    if not spec.nullable and not spec.non_finite:  # (NaN counts as null here: a column that takes NaN may hold it)
        found.append(gxe.ExpectColumnValuesToNotBeNull(column=name))
    if not entry:
        return found
    low, high = entry.get("min"), entry.get("max")
    if entry.get("kind") == "numeric" and low is not None and high is not None:
        span = high - low if high > low else max(abs(high), 1.0)
        margin = rules.range_tolerance * span
        found.append(gxe.ExpectColumnValuesToBeBetween(
            column=name, min_value=low - margin, max_value=high + margin, mostly=rules.mostly))
    dtype = spec.arrow_type
    categorical = _is_text(dtype) or pa.types.is_boolean(dtype)
    if categorical and entry.get("top") and entry.get("other", 0.0) <= 0.0:
        values: list[Any] = list(entry["top"])
        if pa.types.is_boolean(dtype):
            values = [v.lower() == "true" for v in values]
        found.append(gxe.ExpectColumnValuesToBeInSet(column=name, value_set=values, mostly=rules.mostly))
    if rules.distribution and entry.get("kind") == "numeric":
        partition = _kl_partition(entry)
        limit = policy.for_column(name).psi
        if partition is not None and limit is not None:
            holdout = 0.01 if 0.0 in partition["weights"] else 0.0
            found.append(gxe.ExpectColumnKLDivergenceToBeLessThan(
                column=name, partition_object=partition, threshold=limit / 2, internal_weight_holdout=holdout))
        quantiles = entry.get("quantiles", {})
        spread = quantiles.get("0.95", 0.0) - quantiles.get("0.05", 0.0)
        if all(str(q) in quantiles for q in _QUANTILES) and spread > 0:
            slack = rules.quantile_tolerance * spread
            found.append(gxe.ExpectColumnQuantileValuesToBeBetween(column=name, quantile_ranges={
                "quantiles": list(_QUANTILES),
                "value_ranges": [[quantiles[str(q)] - slack, quantiles[str(q)] + slack] for q in _QUANTILES],
            }))
    return found


def expectation_suite(manifest: Manifest, reference_profile: dict[str, Any] | None,
                      rules: ContractRules | None = None) -> "ExpectationSuite":
    """The expectation suite for a model's input data (see the module docstring for what it checks)."""
    gx = _gx()
    _batch_definition(gx)  # a suite needs an active context: this process's ephemeral one
    rules = rules or ContractRules()
    policy = manifest.drift or DriftPolicy()
    profiled = (reference_profile or {}).get("columns", {})
    suite = gx.ExpectationSuite(name=f"{manifest.reference}-inputs")
    for spec in manifest.signature.inputs:
        for expectation in _column_expectations(gx.expectations, spec, profiled.get(spec.name), rules, policy):
            suite.add_expectation(expectation)
    return suite


def _short(values: list[Any], limit: int = 5) -> str:
    seen: list[Any] = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return ", ".join(repr(v) if isinstance(v, str) else f"{v:.6g}" if isinstance(v, float) else str(v)
                     for v in seen[:limit])


def describe_failure(expectation: str, kwargs: dict[str, Any], result: dict[str, Any]) -> str:
    """One readable sentence for a failed expectation: the column, what was found, the expectation's name."""
    column = kwargs.get("column")
    share = result.get("unexpected_percent")
    examples = _short(result.get("partial_unexpected_list") or [])
    if expectation == "expect_column_to_exist":
        text = f"column {column!r} is missing"
    elif expectation == "expect_column_values_to_be_in_type_list":
        text = f"column {column!r} holds {result.get('observed_value')}, the model takes one of {kwargs.get('type_list')}"
    elif expectation == "expect_column_values_to_not_be_null":
        text = (f"column {column!r} has {result.get('unexpected_count')} nulls or NaN values ({share:.1f}% of rows); "
                "the model takes neither")  # (the contract reads the rows as pandas does: NaN counts as null)
    elif expectation == "expect_column_values_to_be_between":
        text = (f"column {column!r}: {share:.1f}% of values lie outside {kwargs.get('min_value'):.6g}.."
                f"{kwargs.get('max_value'):.6g} (the reference range with its tolerance), e.g. {examples}")
    elif expectation == "expect_column_values_to_be_in_set":
        text = f"column {column!r}: {share:.1f}% of values are categories the reference never had: {examples}"
    elif expectation == "expect_column_kl_divergence_to_be_less_than":
        observed = result.get("observed_value")
        text = (f"column {column!r}: KL divergence from the reference is "
                f"{'infinite' if observed is None else f'{observed:.3g}'}, above {kwargs.get('threshold'):.3g}")
    elif expectation == "expect_column_quantile_values_to_be_between":
        observed = (result.get("observed_value") or {}).get("values", [])
        quantiles = kwargs["quantile_ranges"]["quantiles"]
        text = f"column {column!r}: quantiles {quantiles} are {_short(observed, 10)}, outside the reference's ranges"
    else:
        text = f"column {column!r}: {json.dumps(result, default=str)[:200]}"
    return f"{text} ({expectation})"


def _raised(info: Any) -> str | None:
    """The exception message great-expectations recorded for a result (flat or keyed by metric), if any."""
    if not isinstance(info, dict):
        return None
    if info.get("raised_exception"):
        return str(info.get("exception_message"))
    for value in info.values():
        if isinstance(value, dict) and value.get("raised_exception"):
            return str(value.get("exception_message"))
    return None


class _Validator:
    """A built suite and the batch definition that validates a pandas frame against it (one per process and suite)."""

    def __init__(self, suite: Any, batch_definition: Any) -> None:
        self.suite = suite
        self.batch_definition = batch_definition


class _Plain:
    """Stands in for ``great_expectations.expectations``: each expectation as (type, kwargs), no import."""

    def __getattr__(self, name: str) -> Any:
        kind = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()  # ExpectColumnToExist -> expect_column_to_exist
        return lambda **kwargs: (kind, kwargs)


def _screen_checks(manifest: Manifest, reference_profile: dict[str, Any] | None,
                   rules: ContractRules) -> list[tuple[str, dict[str, Any]]] | None:
    """The suite's expectations as plain (type, kwargs), or None when one has no screen."""
    policy = manifest.drift or DriftPolicy()
    profiled = (reference_profile or {}).get("columns", {})
    checks = [check for spec in manifest.signature.inputs
              for check in _column_expectations(_Plain(), spec, profiled.get(spec.name), rules, policy)]
    return checks if all(kind in _SCREENS for kind, _ in checks) else None


def _share_ok(unexpected: int, considered: int, mostly: float | None) -> bool:
    """great-expectations' rule for map expectations: pass when the expected share of non-null values is >= mostly."""
    if considered == 0:
        return True
    return (considered - unexpected) / considered >= (1.0 if mostly is None else mostly)


def _values(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """The values a map expectation counts: pandas treats NaN as null, so both are left out."""
    valid = pc.drop_null(column)
    return valid.filter(pc.invert(pc.is_nan(valid))) if pa.types.is_floating(valid.type) else valid


_NUMPY_NAMES = {"halffloat": "float16", "float": "float32", "double": "float64"}


def _screen_types(column: pa.ChunkedArray, kwargs: dict[str, Any]) -> bool:
    """The type check on the dtype pandas would give the column (what great-expectations looks at)."""
    kind, types = column.type, kwargs["type_list"]
    if _is_text(kind):
        return "str" in types  # an object column of str values
    if pa.types.is_boolean(kind):
        return ("bool" if column.null_count == 0 else "object") in types
    if pa.types.is_integer(kind) and column.null_count:
        return "float64" in types  # pandas makes an integer column with nulls float64
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return _NUMPY_NAMES.get(str(kind), str(kind)) in types
    return False


_Ranges = dict[str, tuple[float, float]]


def _float_ranges(table: pa.Table) -> _Ranges:
    """Each float column's (smallest, largest) value over ``table``, where it has rows and no nulls, from one matrix
    of them all: two reductions for every column together, where Arrow took two or three calls a column. numpy's
    min and max carry a NaN through, so a pair of numbers also says that the column holds no NaN."""
    if not table.num_rows:
        return {}
    picked = [(field.name, i) for i, field in enumerate(table.schema)
              if pa.types.is_floating(field.type) and not table.column(i).null_count]
    if not picked:
        return {}
    matrix = stack_columns([numpy_values(table.column(i)) for _, i in picked], table.num_rows, np.float64)
    return {name: (float(low), float(high)) for (name, _), low, high in zip(picked, matrix.min(axis=0),
                                                                            matrix.max(axis=0))}


def _screen_not_null(column: pa.ChunkedArray, ranges: _Ranges, name: str) -> bool:
    known = ranges.get(name)
    if known is not None and not math.isnan(known[0]):
        return True  # a float column without nulls or NaN
    if column.null_count:
        return False
    return not (pa.types.is_floating(column.type) and pc.any(pc.is_nan(column)).as_py())


def _screen_between(column: pa.ChunkedArray, kwargs: dict[str, Any], ranges: _Ranges) -> bool:
    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        return False  # a type failure: great-expectations says what
    low, high = kwargs["min_value"], kwargs["max_value"]
    known = ranges.get(kwargs["column"])
    if known is not None and low is not None and high is not None and low <= known[0] and known[1] <= high:
        return True  # (False for a NaN: the column is looked at below, NaN left out)
    if low is not None and high is not None:
        # One pass for the common case, every value inside (nulls and NaN left out, as min_max leaves them): a
        # passing sample's columns cost one call each instead of six.
        bounds = pc.min_max(column)
        smallest, largest = bounds["min"].as_py(), bounds["max"].as_py()
        if smallest is not None and largest is not None and low <= smallest and largest <= high:
            return True
    values = _values(column)
    outside = pc.or_(pc.less(values, low), pc.greater(values, high))
    return _share_ok(pc.sum(outside).as_py() or 0, len(values), kwargs.get("mostly"))


def _screen_in_set(column: pa.ChunkedArray, kwargs: dict[str, Any]) -> bool:
    values = _values(column)
    known = pc.is_in(values, value_set=pa.array(kwargs["value_set"], type=values.type))
    return _share_ok(len(values) - (pc.sum(known).as_py() or 0), len(values), kwargs.get("mostly"))


# What a passing sample must satisfy, per expectation type, as vectorized Arrow and numpy checks
# with great-expectations' rules on the pandas view it validates (NaN counts as null;
# value checks leave nulls out; `mostly` is the share of the rest that must pass).
# They only decide that a sample passes: when any of them fails, or the suite has an
# expectation without a screen (the distribution ones), great-expectations validates
# and its verdict and details are what the contract reports.
# Each is called with the sample, the expectation's kwargs and the sample's ``_float_ranges``.
_SCREENS: dict[str, Any] = {
    "expect_column_to_exist": lambda table, kw, _: table.schema.get_field_index(kw["column"]) >= 0
    or kw["column"] in table.column_names,  # (-1 for a repeated name too; column_names makes a list a call)
    "expect_column_values_to_be_in_type_list": lambda table, kw, _: _screen_types(table.column(kw["column"]), kw),
    "expect_column_values_to_not_be_null":
        lambda table, kw, ranges: _screen_not_null(table.column(kw["column"]), ranges, kw["column"]),
    "expect_column_values_to_be_between":
        lambda table, kw, ranges: _screen_between(table.column(kw["column"]), kw, ranges),
    "expect_column_values_to_be_in_set": lambda table, kw, _: _screen_in_set(table.column(kw["column"]), kw),
}


def _passes_screen(checks: list[tuple[str, dict[str, Any]]] | None, table: pa.Table) -> bool:
    """True when the sample certainly passes the suite (so great-expectations need not run on it)."""
    if checks is None:
        return False
    try:
        ranges = _float_ranges(table)
        return all(_SCREENS[kind](table, kwargs, ranges) for kind, kwargs in checks)
    except (KeyError, TypeError, ValueError, pa.ArrowException):
        return False  # anything odd: let great-expectations judge


_LOCK = threading.Lock()
_CONTEXT: dict[str, Any] = {}
_VALIDATORS: dict[str, _Validator] = {}
_SCREENS_BUILT: dict[str, list[tuple[str, dict[str, Any]]] | None] = {}


def _batch_definition(gx: Any) -> Any:
    if "batch_definition" not in _CONTEXT:
        from great_expectations.data_context.types.base import ProgressBarsConfig

        context = gx.get_context(mode="ephemeral")
        context.variables.progress_bars = ProgressBarsConfig(globally=False)
        asset = context.data_sources.add_pandas("shardline").add_dataframe_asset("sample")
        _CONTEXT["context"] = context
        _CONTEXT["batch_definition"] = asset.add_batch_definition_whole_dataframe("whole")
    return _CONTEXT["batch_definition"]


class ShardContract:
    """A picklable callable built from a manifest and its reference profile: ``contract(sample)`` lists what failed.

    great-expectations is imported lazily on the first call and the suite is cached
    per process (keyed by the manifest's digest, the profile and the rules), so
    later calls in the same process (a Dask worker) only validate.
    """

    def __init__(self, manifest: Manifest, reference_profile: dict[str, Any] | None,
                 rules: ContractRules | None = None) -> None:
        self.manifest = manifest
        self.reference_profile = reference_profile
        self.rules = rules or ContractRules()
        # Screen passing samples with vectorized checks of the same expectations and run
        # great-expectations only on the others (a hundredth of the time a sample).
        self.screen = True
        content = json.dumps([manifest.outputs_digest, manifest.reference, (manifest.drift or DriftPolicy()).model_dump(mode="json"),
                              reference_profile, asdict(self.rules)], sort_keys=True, default=str)
        self.key = hashlib.sha256(content.encode()).hexdigest()

    def _validator(self) -> _Validator:
        validator = _VALIDATORS.get(self.key)
        if validator is None:
            gx = _gx()
            batch_definition = _batch_definition(gx)
            suite = expectation_suite(self.manifest, self.reference_profile, self.rules)
            validator = _VALIDATORS[self.key] = _Validator(suite, batch_definition)
        return validator

    def __call__(self, sample: pa.Table | pa.RecordBatch) -> list[str]:
        """Validate a sample of rows; returns one sentence per failed expectation, [] when it passes."""
        if isinstance(sample, pa.RecordBatch):
            sample = pa.Table.from_batches([sample])
        present = set(sample.column_names)
        wanted = [c for c in self.manifest.signature.input_names if c in present]
        if self.screen:
            if self.key not in _SCREENS_BUILT:
                _SCREENS_BUILT[self.key] = _screen_checks(self.manifest, self.reference_profile, self.rules)
            if _passes_screen(_SCREENS_BUILT[self.key], sample.select(wanted)):
                return []  # great-expectations not even imported
        frame = sample.select(wanted).to_pandas()
        for name in wanted:
            dtype = sample.schema.field(name).type
            if _is_text(dtype):
                frame[name] = frame[name].astype(object)
        with _LOCK:
            validator = self._validator()
            batch = validator.batch_definition.get_batch(batch_parameters={"dataframe": frame})
            # Pass/fail first (about half the cost of SUMMARY); the failed ones again, with details.
            outcome = batch.validate(validator.suite, result_format="BOOLEAN_ONLY")
            failed = [r.expectation_config for r in outcome.results if not r.success]
            if not failed:
                return []
            details = _gx().ExpectationSuite(name=f"{validator.suite.name}-failed")
            for config in failed:
                details.add_expectation(config.to_domain_obj())
            outcome = batch.validate(details, result_format="SUMMARY")
        missing = {c for c in self.manifest.signature.input_names if c not in present}
        failures = []
        for result in outcome.results:
            if result.success:
                continue
            config = result.expectation_config
            kwargs = dict(config.kwargs)
            if kwargs.get("column") in missing and config.type != "expect_column_to_exist":
                continue  # the missing column is reported once
            error = _raised(result.exception_info)
            if error is not None:
                failures.append(f"column {kwargs.get('column')!r} could not be checked: {error[:200]} ({config.type})")
                continue
            failures.append(describe_failure(config.type, kwargs, dict(result.result)))
        return failures

    def __repr__(self) -> str:
        return f"ShardContract({self.manifest.reference}, {len(self.manifest.signature.inputs)} inputs)"
