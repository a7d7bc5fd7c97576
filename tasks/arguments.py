"""How a flow hands a large value to a task.

Prefect walks every argument of a task call twice, element by element, looking for futures and states (to
resolve them, and to link the task to the runs whose results it takes): about 90 us for each ledger record a
batch job's plan holds, so a job of 2,000 shards spent 0.44 s of the warm runner's time outside its shards
walking its plan (validate, infer-shards, commit) and 10,000 would spend seconds. ``whole`` marks an argument
Prefect takes as it is.
"""

from __future__ import annotations

from typing import TypeVar, cast

from prefect.utilities.annotations import opaque

T = TypeVar("T")


def whole(value: T) -> T:
    """``value`` as a task's argument that Prefect takes as a whole (``opaque``): the task is still linked to the
    one whose result it is (the run graph), but nothing inside it is visited."""
    return cast(T, opaque(value))
