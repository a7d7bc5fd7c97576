"""Grafana dashboards (JSON models) of the platform: online, LLM, tenants, batch and GPUs.

Each is built here from the series the code exports (``online/metrics.py``, ``online/router/metrics.py``, the
batch metrics of ``tasks/batch_telemetry.py``), the rules' recorded SLO series (``rules.py``) and the DCGM
exporter's GPU series. Panels take a Prometheus
data source chosen on the dashboard (``$datasource``) and filter on ``$model`` / ``$tenant`` where the series
carry them. Import them in Grafana (Dashboards > Import) or provision them from ``deploy/observability/
dashboards/``. Pure: ``dashboards`` returns them as dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardline.observability.rules import GPU_BUSY, OBJECTIVE, ratio_record

RATE = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass
class Panel:
    """A time series panel: queries (expression, legend), a unit, a width in grid columns (of 24)."""

    title: str
    queries: list[tuple[str, str]]
    unit: str = "short"
    width: int = 12
    description: str = ""


@dataclass
class Dashboard:
    """A dashboard's rows of panels and its template variables (label -> the series to list them from)."""

    uid: str
    title: str
    description: str
    rows: list[tuple[str, list[Panel]]]
    variables: dict[str, str] = field(default_factory=dict)

    def model(self) -> dict[str, Any]:
        """The Grafana JSON model."""
        panels: list[dict[str, Any]] = []
        y = 0
        for title, row in self.rows:
            panels.append({"id": len(panels) + 1, "type": "row", "title": title, "collapsed": False,
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
            y += 1
            x = 0
            for panel in row:
                if x + panel.width > 24:
                    x, y = 0, y + 8
                panels.append(_panel(panel, len(panels) + 1, x, y))
                x += panel.width
            y += 8
        return {
            "uid": self.uid, "title": self.title, "description": self.description, "tags": ["shardline"],
            "editable": True, "schemaVersion": 39, "version": 1, "refresh": "30s", "timezone": "utc",
            "time": {"from": "now-6h", "to": "now"}, "annotations": {"list": []},
            "templating": {"list": _variables(self.variables)}, "panels": panels,
        }


def _panel(panel: Panel, id: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": id, "type": "timeseries", "title": panel.title, "description": panel.description,
        "datasource": DATASOURCE, "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(panel.queries)],
    }


def _variables(variables: dict[str, str]) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                                     "query": "prometheus", "current": {}, "hide": 0}]
    for label, series in variables.items():
        listed.append({"name": label, "label": label, "type": "query", "datasource": DATASOURCE,
                       "query": {"query": f"label_values({series}, {label})", "refId": label},
                       "definition": f"label_values({series}, {label})", "refresh": 2, "includeAll": True,
                       "multi": True, "allValue": ".*", "current": {}, "hide": 0, "sort": 1})
    return listed


def _quantiles(metric: str, by: str, where: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{where}}}[{RATE}])))",
             f"p{int(q * 100)} " + " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(",")))
            for q in (0.5, 0.99)]


def _burn(slis: str, scope: str = "model", where: str = 'model=~"$model"') -> Panel:
    """The SLOs' burn rate over 1 h (1 = spending the budget exactly over 30 days)."""
    legend = "{{model}} {{tenant}} {{sli}}" if scope == "model_tenant" else "{{model}} {{sli}}"
    expr = (f'{ratio_record(scope, "1h")}{{sli=~"{slis}", {where}}}\n/ on (slo) group_left ()\n'
            f"(1 - {OBJECTIVE})")
    return Panel("Error budget burn rate, 1 h", [(expr, legend)], "short", 12,
                 "The SLO's error ratio over the last hour over its budget: 1 spends it in exactly 30 days; "
                 "the page alerts fire from 14.4 (1 h with 5 min) and 6 (6 h with 30 min).")


def _ratio(slis: str, window: str = "5m") -> Panel:
    return Panel(f"SLO error ratio, {window}",
                 [(f'{ratio_record("model", window)}{{sli=~"{slis}", model=~"$model"}}', "{{model}} {{sli}}")],
                 "percentunit")


def _online() -> Dashboard:
    m = 'model=~"$model"'
    routed = 'model=~"($model)(:.*)?"'  # the router's model label is name:version
    return Dashboard("shardline-online", "Shardline / Online", "Replicas (`shardline serve`) and the router.", [
        ("SLOs", [_burn("availability|latency"), _ratio("availability|latency")]),
        ("Replicas", [
            Panel("Requests by code", [(f"sum by (model, code) (rate(shardline_requests_total{{{m}}}[{RATE}]))",
                                        "{{model}} {{code}}")], "reqps"),
            Panel("Latency", _quantiles("shardline_request_seconds", "model", m), "s"),
            Panel("Queued", [(f"sum by (model, priority) (shardline_queue_depth{{{m}}})", "{{model}} {{priority}}")]),
            Panel("In batches now", [(f"sum by (model) (shardline_model_in_flight{{{m}}})", "{{model}}")]),
            Panel("Shed (503) and over quota (429)", [
                (f"sum by (model, priority) (rate(shardline_shed_total{{{m}}}[{RATE}]))", "shed {{model}} {{priority}}"),
                (f"sum by (quota) (rate(shardline_rate_limited_total[{RATE}]))", "over quota: {{quota}}")], "reqps"),
            Panel("Rows per batch (dynamic batcher)", _quantiles("shardline_batch_rows", "model", m)),
            Panel("Loaded versions, loads and unloads", [
                (f"sum by (model) (shardline_model_loaded{{{m}}})", "loaded {{model}}"),
                (f"sum by (model) (increase(shardline_model_loads_total{{{m}}}[1h]))", "loads/h {{model}}"),
                (f"sum by (model) (increase(shardline_model_unloads_total{{{m}}}[1h]))", "unloads/h {{model}}")]),
            Panel("Out-of-memory splits and capture", [
                (f"sum by (model) (rate(shardline_oom_splits_total{{{m}}}[{RATE}]))", "OOM splits {{model}}"),
                (f"sum by (model, outcome) (rate(shardline_capture_rows_total{{{m}}}[{RATE}]))",
                 "capture {{model}} {{outcome}}")], "ops"),
        ]),
        ("Router", [
            Panel("Answers by code (and nginx's fast lane)", [
                (f"sum by (code) (rate(shardline_router_requests_total{{{routed}}}[{RATE}]))", "router {{code}}"),
                (f"sum (rate(shardline_router_fast_lane_requests_total{{{routed}}}[{RATE}]))", "fast lane")],
                "reqps"),
            Panel("Router latency (retries included)", _quantiles("shardline_router_request_seconds", "model",
                                                                  routed), "s"),
            Panel("Retries, fallbacks, hedges", [
                (f"sum (rate(shardline_router_retries_total[{RATE}]))", "retries"),
                (f"sum (rate(shardline_router_fast_lane_retries_total[{RATE}]))", "fast lane retries"),
                (f"sum by (variant) (rate(shardline_router_fallbacks_total[{RATE}]))", "fallback {{variant}}"),
                (f"sum by (winner) (rate(shardline_router_hedges_total[{RATE}]))", "hedge won by {{winner}}")], "ops"),
            Panel("Replicas: available, wanted, running", [
                ("sum by (group) (shardline_router_replica_available)", "available {{group}}"),
                ("sum by (group) (shardline_router_replicas_wanted)", "wanted {{group}}"),
                ("sum by (group) (shardline_router_replicas)", "running {{group}}")]),
            Panel("Breakers open, ejections, hung replicas", [
                ("count by (group) (shardline_router_breaker_state == 2)", "open {{group}}"),
                ("sum by (group) (increase(shardline_router_ejections_total[1h]))", "ejected/h {{group}}"),
                ("sum by (group) (increase(shardline_router_hung_total[1h]))", "hung/h {{group}}")]),
            Panel("Demand and cold starts", [
                (f"sum by (model) (shardline_router_in_flight{{{routed}}})", "in flight {{model}}"),
                (f"sum by (model) (shardline_router_queued{{{routed}}})", "held for a start {{model}}"),
                (f"histogram_quantile(0.9, sum by (le) (rate(shardline_router_cold_start_seconds_bucket[1h])))",
                 "cold start p90 (s)")]),
        ]),
    ], {"model": "shardline_requests_total"})


def _llm() -> Dashboard:
    m = 'model=~"$model"'
    return Dashboard("shardline-llm", "Shardline / LLM", "Text generation: time to first token, time between "
                     "tokens, tokens and the engines' slots.", [
        ("SLOs", [_burn("availability|ttft|tpot"), _ratio("ttft|tpot")]),
        ("Latency", [
            Panel("Time to first token", _quantiles("shardline_llm_time_to_first_token_seconds", "model", m), "s"),
            Panel("Time between tokens", _quantiles("shardline_llm_inter_token_seconds", "model", m), "s"),
        ]),
        ("Throughput and engines", [
            Panel("Tokens/s", [(f"sum by (model, kind) (rate(shardline_llm_tokens_total{{{m}}}[{RATE}]))",
                                "{{model}} {{kind}}")], "short"),
            Panel("Streams in flight", [(f"sum by (model) (shardline_llm_streams{{{m}}})", "{{model}}")]),
            Panel("Engine: waiting for a slot, slots busy", [
                (f"sum by (model) (shardline_llm_queued{{{m}}})", "waiting {{model}}"),
                (f"sum by (model) (shardline_llm_slots_busy{{{m}}})", "busy {{model}}")]),
            Panel("Decode steps/s", [(f"sum by (model) (rate(shardline_llm_decode_steps{{{m}}}[{RATE}]))",
                                      "{{model}}")], "ops"),
        ]),
    ], {"model": "shardline_llm_tokens_total"})


def _tenants() -> Dashboard:
    t = 'tenant=~"$tenant"'
    return Dashboard("shardline-tenants", "Shardline / Tenants", "Per tenant: traffic, errors, latency, quotas, "
                     "tokens and batch jobs.", [
        ("SLOs", [_burn("availability|latency|ttft", "model_tenant", t),
                  Panel("Availability error ratio, 1 h", [
                      (f'{ratio_record("model_tenant", "1h")}{{sli="availability", {t}}}', "{{tenant}} {{model}}")],
                      "percentunit")]),
        ("Traffic", [
            Panel("Requests by code", [(f"sum by (tenant, code) (rate(shardline_requests_total{{{t}}}[{RATE}]))",
                                        "{{tenant}} {{code}}")], "reqps"),
            Panel("Latency", _quantiles("shardline_request_seconds", "tenant", t), "s"),
            Panel("Over quota (429)", [(f"sum by (tenant, quota) (rate(shardline_rate_limited_total{{{t}}}[{RATE}]))",
                                        "{{tenant}} {{quota}}")], "reqps"),
            Panel("In flight", [(f"sum by (tenant) (shardline_tenant_in_flight{{{t}}})", "{{tenant}}")]),
            Panel("Shed (503)", [(f"sum by (tenant, priority) (rate(shardline_shed_total{{{t}}}[{RATE}]))",
                                  "{{tenant}} {{priority}}")], "reqps"),
            Panel("LLM tokens/s and time to first token", [
                (f"sum by (tenant, kind) (rate(shardline_llm_tokens_total{{{t}}}[{RATE}]))", "{{tenant}} {{kind}}"),
                *_quantiles("shardline_llm_time_to_first_token_seconds", "tenant", t)[1:]]),
        ]),
        ("Batch (the batch metrics listener, docs/metrics.md)", [
            Panel("Runs decided by their deadline (1 d)", [
                (f"sum by (tenant, outcome) (increase(shardline_batch_job_deadlines_total{{{t}}}[1d]))",
                 "{{tenant}} {{outcome}}")]),
            Panel("Rows/s", [(f"sum by (tenant) (shardline_batch_job_rows_per_second{{{t}}}\n"
                              f"and on (job_id) (shardline_batch_job_running == 1))", "{{tenant}}")], "short"),
        ]),
    ], {"tenant": "shardline_requests_total"})


def _batch() -> Dashboard:
    w = 'model=~"$model", tenant=~"$tenant"'
    return Dashboard("shardline-batch", "Shardline / Batch", "Batch jobs against their deadlines, from the batch "
                     "metrics listener of the process that dispatches them (SHARDLINE_BATCH_METRICS_PORT, "
                     "docs/metrics.md).", [
        ("SLO", [_burn("deadline"),
                 Panel("Runs decided by their deadline, by outcome (1 d)", [
                     (f"sum by (model, outcome) (increase(shardline_batch_job_deadlines_total{{{w}}}[1d]))",
                      "{{model}} {{outcome}}")])]),
        ("Jobs", [
            Panel("Running", [(f"sum by (tenant, model) (shardline_batch_job_running{{{w}}})", "{{tenant}} {{model}}")]),
            Panel("Rows/s per job", [(f"shardline_batch_job_rows_per_second{{{w}}}\n"
                                      f"and on (job_id) (shardline_batch_job_running == 1)", "{{job_id}} ({{tenant}})")],
                  "short"),
            Panel("Shards settled and quarantined per job", [
                (f'sum by (job_id, state) (shardline_batch_job_shards{{{w}, state=~"committed|resumed|quarantined|failed"}})',
                 "{{job_id}} {{state}}")]),
            Panel("Projected finish against the deadline (seconds of slack; below 0: late)", [
                (f"shardline_batch_job_deadline_timestamp_seconds{{{w}}}\n"
                 f"- on (job_id) group_left ()\nshardline_batch_job_projected_finish_timestamp_seconds{{{w}}}\n"
                 f"and on (job_id) (shardline_batch_job_running == 1)", "{{job_id}} ({{tenant}})")], "s"),
        ]),
    ], {"model": "shardline_batch_job_running", "tenant": "shardline_batch_job_running"})


def _gpus() -> Dashboard:
    h = 'Hostname=~"$Hostname"'
    gpu = "{{Hostname}} gpu {{gpu}} {{GPU_I_PROFILE}} {{GPU_I_ID}}"
    return Dashboard("shardline-gpus", "Shardline / GPUs", "GPUs and MIG instances from the DCGM exporter (its "
                     "Kubernetes pod mapping adds the pod). Busy: DCGM_FI_PROF_GR_ENGINE_ACTIVE (per MIG instance), "
                     "else DCGM_FI_DEV_GPU_UTIL where a GPU does not report it.", [
        ("Use", [
            Panel("Busy (graphics engine active; utilisation where not reported)", [
                (f"100 * DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{h}}}\nor on (Hostname, gpu)\nDCGM_FI_DEV_GPU_UTIL{{{h}}}",
                 gpu)], "percent"),
            Panel("Busy, recorded (all GPUs)", [(f"avg by (Hostname) ({GPU_BUSY}{{{h}}})", "{{Hostname}}")],
                  "percent"),
            Panel("Tensor cores active", [(f"100 * DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{{{h}}}", gpu)], "percent"),
            Panel("Memory used", [
                (f"DCGM_FI_DEV_FB_USED{{{h}}}\n/ (DCGM_FI_DEV_FB_USED{{{h}}} + DCGM_FI_DEV_FB_FREE{{{h}}})", gpu)],
                "percentunit"),
        ]),
        ("Health", [
            Panel("Power (W)", [(f"DCGM_FI_DEV_POWER_USAGE{{{h}}}", gpu)], "watt", 8),
            Panel("Temperature (C)", [(f"DCGM_FI_DEV_GPU_TEMP{{{h}}}", gpu)], "celsius", 8),
            Panel("Last XID error", [(f"DCGM_FI_DEV_XID_ERRORS{{{h}}}", gpu)], "short", 8),
            Panel("Models splitting batches after out-of-memory", [
                (f"sum by (model) (rate(shardline_oom_splits_total[{RATE}]))", "{{model}}")], "ops", 24),
        ]),
    ], {"Hostname": "DCGM_FI_DEV_FB_USED"})


def dashboards() -> dict[str, dict[str, Any]]:
    """Every dashboard's JSON model, by file name."""
    built = (_online(), _llm(), _tenants(), _batch(), _gpus())
    return {f"{d.uid}.json": d.model() for d in built}
