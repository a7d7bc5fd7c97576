"""Data contracts: a great-expectations suite from the signature and reference profile, as batch jobs call it."""

from __future__ import annotations

import pickle
import subprocess
import sys
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from shardline.bundle import Manifest
from shardline.build.examples import breast_cancer, golden_table, shard_table, shifted_table, split, with_site
from shardline.quality import contracts
from shardline.quality.contracts import ContractRules, ShardContract, expectation_suite
from shardline.quality.profile import profile_table
from shardline.signature import ColumnSpec, Signature


@pytest.fixture(scope="module")
def site_model(breast_cancer_model: Any) -> tuple[Manifest, dict]:
    """The breast-cancer manifest with a categorical ``site`` input, and the profile of its training rows."""
    manifest = breast_cancer_model.manifest
    signature = Signature(inputs=[*manifest.signature.inputs, ColumnSpec(name="site", type="string")],
                          outputs=manifest.signature.outputs)
    train, _ = split(breast_cancer())
    return manifest.model_copy(update={"signature": signature}), profile_table(with_site(golden_table(train), seed=1))


def _sample(seed: int, rows: int = 1_000, **site: Any) -> pa.Table:
    return with_site(shard_table(breast_cancer(), rows, 0, seed), seed=seed, **site)


def test_a_sample_like_the_reference_passes(site_model: tuple[Manifest, dict]) -> None:
    contract = ShardContract(*site_model)
    assert contract(_sample(5)) == []
    assert contract(_sample(6).to_batches(max_chunksize=10_000)[0]) == []  # a record batch works too


def test_failures_name_the_column_and_the_expectation(site_model: tuple[Manifest, dict]) -> None:
    contract = ShardContract(*site_model)
    bad = _sample(7, sites=("north", "mars"), shares=(0.7, 0.3))
    bad = shifted_table(bad, scale={"mean radius": 3.0}, nulls={"worst area": 0.25}).drop_columns(["mean texture"])
    failures = contract(bad)
    assert len(failures) == 4, failures
    text = "\n".join(failures)
    assert "column 'mean texture' is missing (expect_column_to_exist)" in text
    assert "'worst area' has" in text and "nulls or NaN values (2" in text and "the model takes neither" in text
    assert "(expect_column_values_to_not_be_null)" in text
    assert "'mean radius':" in text and "(expect_column_values_to_be_between)" in text
    assert "'site':" in text and "'mars'" in text and "(expect_column_values_to_be_in_set)" in text


def test_a_wrong_type_is_a_failed_expectation(site_model: tuple[Manifest, dict]) -> None:
    sample = _sample(8)
    sample = sample.set_column(sample.schema.get_field_index("mean area"), "mean area",
                               pa.array(["big"] * sample.num_rows))
    failures = ShardContract(*site_model)(sample)
    assert any("'mean area' holds" in f and "expect_column_values_to_be_in_type_list" in f for f in failures), failures


def test_the_contract_pickles_and_its_suite_is_built_once_per_process(site_model: tuple[Manifest, dict]) -> None:
    first = ShardContract(*site_model)
    first(_sample(9, rows=100))
    built = len(contracts._VALIDATORS)
    copy = pickle.loads(pickle.dumps(first))
    assert copy.key == first.key and copy(_sample(10, rows=100)) == []
    assert len(contracts._VALIDATORS) == built  # the copy found the cached suite
    assert len(pickle.dumps(first)) < 200_000


def test_distribution_expectations_use_great_expectations_kl_divergence(site_model: tuple[Manifest, dict]) -> None:
    manifest, profile = site_model
    suite = expectation_suite(manifest, profile, ContractRules(distribution=True))
    kinds = {e.expectation_type for e in suite.expectations}
    assert {"expect_column_kl_divergence_to_be_less_than", "expect_column_quantile_values_to_be_between"} <= kinds
    contract = ShardContract(manifest, profile, ContractRules(distribution=True))
    assert contract(_sample(11)) == []
    failures = contract(shifted_table(_sample(12), scale={"mean radius": 1.4}))
    assert any("'mean radius': KL divergence" in f for f in failures), failures
    assert all("'mean radius'" in f for f in failures)


def test_importing_the_quality_modules_does_not_import_great_expectations() -> None:
    code = ("import sys; import shardline.quality.contracts, shardline.quality.drift, shardline.quality.report, "
            "shardline.quality.profile; assert 'great_expectations' not in sys.modules; "
            "assert 'matplotlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_numbers_may_go_a_tolerance_beyond_the_reference_range(site_model: tuple[Manifest, dict]) -> None:
    manifest, profile = site_model
    entry = profile["columns"]["mean radius"]
    span = entry["max"] - entry["min"]
    sample = _sample(13)
    inside = np.full(sample.num_rows, entry["max"] + 0.4 * span)
    outside = np.full(sample.num_rows, entry["max"] + 0.6 * span)
    index = sample.schema.get_field_index("mean radius")
    contract = ShardContract(manifest, profile)
    assert contract(sample.set_column(index, "mean radius", pa.array(inside))) == []
    assert len(contract(sample.set_column(index, "mean radius", pa.array(outside)))) == 1


def _outside(sample: pa.Table, column: str, share: float, value: float) -> pa.Table:
    values = sample.column(column).to_numpy().copy()
    values[: int(round(share * len(values)))] = value
    return sample.set_column(sample.schema.get_field_index(column), column, pa.array(values))


def test_the_fast_screen_and_great_expectations_give_the_same_verdicts(site_model: tuple[Manifest, dict]) -> None:
    manifest, profile = site_model
    screened, judged = ShardContract(manifest, profile), ShardContract(manifest, profile)
    judged.screen = False  # great-expectations validates every sample
    far = profile["columns"]["mean radius"]["max"] * 10
    between = {kwargs["column"]: kwargs for kind, kwargs in contracts._screen_checks(manifest, profile, ContractRules())
               if kind == "expect_column_values_to_be_between"}
    low, high = between["mean radius"]["min_value"], between["mean texture"]["max_value"]
    samples = {
        "like the reference": _sample(20),
        "another fresh sample": _sample(21, rows=300),
        "0.5% out of range (mostly 0.99 allows it)": _outside(_sample(22), "mean radius", 0.005, far),
        "2% out of range": _outside(_sample(23), "mean radius", 0.02, far),
        "0.5% new category": _sample(24, sites=("north", "mars"), shares=(0.995, 0.005)),
        "5% new category": _sample(25, sites=("north", "mars"), shares=(0.95, 0.05)),
        "one null": shifted_table(_sample(26), nulls={"worst area": 0.001}),
        "a missing column": _sample(27).drop_columns(["mean texture"]),
        "strings for numbers": _sample(28).set_column(2, _sample(28).schema.field(2).name, pa.array(["x"] * 1_000)),
        "one NaN": _outside(_sample(29), "mean radius", 0.001, float("nan")),
        "every value NaN": _outside(_sample(30), "mean radius", 1.0, float("nan")),
        "values on the reference's bounds": _outside(_outside(_sample(31), "mean radius", 0.01, low), "mean texture",
                                                      0.01, high),
        "0.5% just under the lower bound": _outside(_sample(32), "mean radius", 0.005, low - 1e-6),
        "one infinity": _outside(_sample(33), "mean radius", 0.001, float("inf")),
        "one minus infinity and one NaN": _outside(_outside(_sample(34), "mean radius", 0.001, float("-inf")),
                                                    "mean texture", 0.001, float("nan")),
        "in two chunks, 2% out of range in the second": pa.concat_tables(
            [_sample(35).slice(0, 500), _outside(_sample(35), "mean radius", 0.02, far).slice(0, 500)]),
        "float32 columns": _sample(36).cast(pa.schema(
            [pa.field(f.name, pa.float32()) if pa.types.is_floating(f.type) else f for f in _sample(36).schema])),
        "no rows": _sample(37).slice(0, 0),
        "site as string_view": _as_view(_sample(38), "site"),
        "5% new category, site as string_view": _as_view(_sample(39, sites=("north", "mars"), shares=(0.95, 0.05)),
                                                         "site"),
    }
    for what, sample in samples.items():
        assert screened(sample) == judged(sample), what
    assert screened(samples["like the reference"]) == [] and screened(samples["2% out of range"]) != []
    assert screened(samples["0.5% out of range (mostly 0.99 allows it)"]) == []
    # text is text in any Arrow layout (once: "column 'site' holds str, the model takes one of ['str', 'object']")
    assert screened(samples["site as string_view"]) == [] and judged(samples["site as string_view"]) == []


def _as_view(sample: pa.Table, column: str) -> pa.Table:
    index = sample.schema.get_field_index(column)
    return sample.set_column(index, column, sample.column(column).cast(pa.string_view()))


def test_a_passing_sample_does_not_import_great_expectations(
    site_model: tuple[Manifest, dict], tmp_path: Any
) -> None:
    import pyarrow.parquet as pq

    manifest, profile = site_model
    (tmp_path / "contract.pkl").write_bytes(pickle.dumps(ShardContract(manifest, profile)))
    pq.write_table(_sample(30), tmp_path / "good.parquet")
    pq.write_table(_sample(31).drop_columns(["mean texture"]), tmp_path / "bad.parquet")
    code = ("import pickle, sys; import pyarrow.parquet as pq; contract = pickle.load(open(sys.argv[1], 'rb')); "
            "assert contract(pq.ParquetFile(sys.argv[2]).read()) == []; "
            "assert 'great_expectations' not in sys.modules; "
            "assert contract(pq.ParquetFile(sys.argv[3]).read()) and 'great_expectations' in sys.modules")
    files = [str(tmp_path / f) for f in ("contract.pkl", "good.parquet", "bad.parquet")]
    subprocess.run([sys.executable, "-c", code, *files], check=True, timeout=120)
