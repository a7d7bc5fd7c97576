"""A custom-code model whose every call waits while a gate file exists: a batch job that lasts as long as a test
needs, and costs no CPU while it waits.

Tests of a job stopped, killed or raced midway used to make the job slow with one-row batches over many rows: a
worker's core busy for a minute, which slowed the suite's other process and left the timing to the machine's load.
With this model the test holds the gate while it acts and removes it to let the job (or its resume) run at full
speed. It is a real custom-code bundle (``package_python``), scored by the platform as any user's code is.
"""

from __future__ import annotations

from pathlib import Path

from shardline.build.code_bundles import package_python
from shardline.build.examples import breast_cancer, shard_table
from shardline.storage.registry import ModelRegistry

CODE = '''
"""Scores the mean radius; each call waits {pause_s} s first while the test's gate file exists."""
import time
from pathlib import Path

GATE = Path({gate!r})


class Model:
    def predict(self, rows):
        if GATE.exists():
            time.sleep({pause_s})
        return {{"score": rows.column("mean radius").to_numpy()}}
'''


def package_gated(folder: Path, gate: Path, pause_s: float, name: str = "gated") -> Path:
    """Package the model into ``folder / 'bundle'`` (its inputs: `write_shards`' columns less ``id``, which a
    job passes through); returns the bundle's folder. The gate is read at each call, so the test opens and
    closes it at will."""
    folder.mkdir(parents=True, exist_ok=True)
    code = folder / "gated.py"
    code.write_text(CODE.format(gate=str(gate), pause_s=pause_s))
    package_python(code, folder / "bundle", name=name, sample=shard_table(breast_cancer(), 8, 0, 0),
                   exclude=["id"])
    return folder / "bundle"


def push_gated(registry: ModelRegistry, folder: Path, gate: Path, pause_s: float, name: str = "gated") -> int:
    """Package the model (:func:`package_gated`), push it and point the alias ``prod`` at it; its version."""
    version = registry.push(package_gated(folder, gate, pause_s, name)).version or 1
    registry.set_alias(name, "prod", version)
    return version


def check_scores(out: Path, inputs: Path) -> None:
    """Every part in ``out`` is the gated model's for its shard in ``inputs``: its ids, each scored its mean
    radius."""
    import numpy as np
    import pyarrow.parquet as pq

    parts = sorted(out.glob("*.parquet"))
    assert parts and [p.name for p in parts] == sorted(p.name for p in inputs.glob("*.parquet"))
    for part in parts:
        shard = pq.read_table(inputs / part.name, columns=["id", "mean radius"])
        scored = pq.read_table(part, columns=["id", "score"])
        assert scored.column("id").equals(shard.column("id")), part.name
        np.testing.assert_array_equal(scored.column("score").to_numpy(), shard.column("mean radius").to_numpy(),
                                      err_msg=part.name)
