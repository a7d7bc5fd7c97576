"""Real data for the drift feedback tests: a bundle with a full reference profile, captured shards, shifts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from shardline.bundle import Manifest
from shardline.build.examples import breast_cancer, golden_table, shard_table, split
from shardline.runtimes import RuntimeOptions, create_runtime
from shardline.storage.capture import write_capture

SHIFTED_COLUMN = "mean radius"


def profiled_bundle(source: Path, dest: Path) -> Manifest:
    """A copy of a packaged bundle whose reference profile covers the training rows and the model's outputs."""
    from shardline.quality.profile import attach_reference_profile

    shutil.copytree(source, dest)
    train, _ = split(breast_cancer())
    return attach_reference_profile(dest, golden_table(train))


def fresh_rows(rows: int, seed: int) -> pa.Table:
    """Rows drawn from the training distribution (a fresh sample: no drift)."""
    return shard_table(breast_cancer(), rows, 0, seed)


def scaled(table: pa.Table, column: str = SHIFTED_COLUMN, factor: float = 2.0) -> pa.Table:
    """The table with one feature multiplied on purpose (a unit change upstream)."""
    index = table.schema.get_field_index(column)
    return table.set_column(index, column, pc.multiply(table.column(column), factor))


def capture(root: str, bundle: Path, manifest: Manifest, version: int, table: pa.Table, tier: str, source: str) -> str:
    """Score ``table`` with the bundle's model and write inputs and outputs as one capture file."""
    runtime = create_runtime(bundle, manifest, RuntimeOptions(device="cpu"))
    runtime.load()
    try:
        inputs = table.select(manifest.signature.input_names)
        outputs = runtime.predict(inputs)
    finally:
        runtime.close()
    url = write_capture(root, manifest.name, version, tier, inputs, outputs, tenant="acme", source=source)
    assert url is not None
    return url
