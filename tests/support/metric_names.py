"""Which metric names a PromQL expression reads, and which names the code exports: for the tests that hold every
rule, dashboard or autoscaler query to series that exist.

``promql_metric_names`` parses an expression: strings, label matchers, ranges and label lists (``by (...)``,
``on (...)``) are blanked out, then every identifier that is not a function call (a name followed by ``(``), a
keyword or an aggregation is a metric name (the name before ``{`` or ``[``, or a bare one). ``exported_names``
collects the names the code exports, by building each registry or collector and reading its metric families (a
counter ``x`` is exported as ``x_total``; a histogram as ``x_bucket``, ``x_count`` and ``x_sum``): the replicas'
(``online/metrics.py``), the router's (``online/router/metrics.py``), the NVML GPU collector's
(``online/gpu_metrics.py``) and the batch metrics' (``tasks/batch_telemetry.py``).
"""

from __future__ import annotations

import re
from typing import Iterable

KEYWORDS = frozenset({
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset", "atan2",
    "inf", "nan", "start", "end",
    # aggregation operators: followed by `by (...)` as often as by `(`
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile",
    "limitk", "limit_ratio",
})
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` reads (recorded series included)."""
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub("{}", text)
    text = _RANGES.sub("[]", text)
    text = _LABEL_LISTS.sub(r"\1()", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        word = match.group()
        if text[match.end():].lstrip().startswith("(") or word.lower() in KEYWORDS:
            continue
        names.add(word)
    return names


def _family_names(families: Iterable[object]) -> set[str]:
    names = set()
    for family in families:
        name, kind = getattr(family, "name"), getattr(family, "type")
        if kind == "counter":
            names.add(f"{name}_total")
        elif kind == "histogram":
            names.update(f"{name}{suffix}" for suffix in ("_bucket", "_count", "_sum"))
        else:
            names.add(name)
    return names


class _NoGpus:
    """NVML as the GPU collector calls it, with no device: enough to list the families it exports."""

    class NVMLError(Exception):
        pass

    @staticmethod
    def nvmlDeviceGetCount() -> int:
        return 0


def exported_names() -> set[str]:
    """Every series name the code exports (see the module docstring)."""
    from shardline.online.gpu_metrics import GpuCollector
    from shardline.online.metrics import Metrics, ModelState, Snapshot
    from shardline.online.router.config import RouterConfig
    from shardline.online.router.health import BreakerPolicy
    from shardline.online.router.metrics import RouterMetrics
    from shardline.online.router.replicas import ReplicaSet

    replica = Metrics()
    replica.watch(lambda: Snapshot([ModelState("m", "1", True, {"normal": 0}, 0, 0.0)], {"t": 0},
                                   {("m", "1"): {"waiting": 0, "slots_busy": 0, "decode_steps": 0}}))
    config = RouterConfig.model_validate({"groups": [{"name": "g", "replicas": ["http://127.0.0.1:1"]}]})
    router = RouterMetrics(ReplicaSet(config, BreakerPolicy(), 10.0, lambda: 0.0), lambda: 0.0)
    from shardline.tasks.batch_telemetry import REGISTRY as BATCH

    return (_family_names(replica.registry.collect()) | _family_names(router.registry.collect())
            | _family_names(GpuCollector(_NoGpus()).collect()) | _family_names(BATCH.collect()))
