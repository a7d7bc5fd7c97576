"""A data contract travels to real Dask worker processes, validates there and keeps its suite per process."""

from __future__ import annotations

from typing import Any

from shardline.build.examples import breast_cancer, golden_table, shard_table, shifted_table, split
from shardline.quality.contracts import ShardContract
from shardline.quality.profile import profile_table


def test_a_contract_validates_shards_on_worker_processes(dask_address: str, breast_cancer_model: Any) -> None:
    from distributed import Client

    train, _ = split(breast_cancer())
    contract = ShardContract(breast_cancer_model.manifest, profile_table(golden_table(train)))
    good = [shard_table(breast_cancer(), 500, i * 500, seed=i) for i in range(4)]
    bad = shifted_table(good[0], nulls={"mean radius": 0.5}, seed=1)
    with Client(dask_address) as client:
        client.run(lambda: __import__("shardline.quality.contracts").quality.contracts._VALIDATORS.clear())
        futures = [client.submit(contract, shard, pure=False) for shard in [*good, bad]]
        results = client.gather(futures)
        built = client.run(lambda: len(__import__("shardline.quality.contracts").quality.contracts._VALIDATORS))
    assert results[:4] == [[], [], [], []]
    assert len(results[4]) == 1 and "'mean radius' has" in results[4][0] and "expect_column_values_to_not_be_null" in results[4][0]
    assert all(count <= 1 for count in built.values())  # one suite per worker process, however many shards
    assert sum(built.values()) >= 1
