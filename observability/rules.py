"""Prometheus rules from an SLO file: recording rules of the error ratios, and burn-rate alerts.

The alerts are the Google SRE workbook's multi-window, multi-burn-rate alerts ("Alerting on SLOs",
its sixth iteration), for a 30-day SLO period:

- page when the budget burns 14.4 times as fast as it may over 1 h and over 5 min (2% of a 30-day
  budget spent in an hour), or 6 times over 6 h and over 30 min (5% in six hours);
- ticket when it burns at least as fast as it may (1x) over 3 d and over 6 h (10% in three days).

The long window keeps a short spike from paging; the short one stops the alert soon after the
burn stops. Each SLO gets them per model and, where its series carry a tenant, per tenant:

    model:shardline_slo_errors:ratio_rate<window>         {model, slo, slo_class, sli}
    model_tenant:shardline_slo_errors:ratio_rate<window>  {model, tenant, slo, slo_class, sli}
    shardline:slo_objective:ratio                        {slo, slo_class, sli}: the target

An error ratio is the bad events' rate over all events' in the window; with no event in it there is
no ratio (0/0) and no alert. With events and none bad it is 0, not absent (``or ... * 0``), so the
dashboards show a line at 0. Two more rules watch what the SLOs stand on: a recorded GPU busy share
(DCGM's engine activity, which MIG instances report, else its utilisation) and
``ShardlineScrapeTargetDown`` (a target of a Shardline scrape job down for 5 min: its SLOs go blind).

One alert predicts instead of counting: ``ShardlineBatchJobWillBeLate``, a running batch job whose SLA
projection (``shardline_batch_job_projected_finish_timestamp_seconds``, the tracker's, from the shards
settled lately) is past its deadline, or that still runs past it (a stalled job has no projection), for
10 min (a projection moves while the first shards settle). Its value is the seconds it will be (or is) late.

Pure: ``rule_groups`` returns the groups as data, ``rules_yaml`` the file's text.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

import yaml

from shardline.observability.slos import SLIS, Slo, SloConfig, promql_string

WINDOWS = ("5m", "30m", "1h", "6h", "3d")
# (burn rate, long window, short window): the workbook's page and ticket pairs.
PAGE = ((14.4, "1h", "5m"), (6.0, "6h", "30m"))
TICKET = ((1.0, "3d", "6h"),)
SCRAPE_ALERT = "ShardlineScrapeTargetDown"
LATE_ALERT = "ShardlineBatchJobWillBeLate"
LATE_FOR = "10m"
_JOB = "job_id, tenant, model, version"  # the batch metrics' labels of one run
OBJECTIVE = "shardline:slo_objective:ratio"
GPU_BUSY = "shardline:gpu_busy:percent"


def ratio_record(scope: str, window: str) -> str:
    """The recorded error ratio's name: ``scope`` is ``model`` or ``model_tenant``."""
    return f"{scope}:shardline_slo_errors:ratio_rate{window}"


def scopes(slo: Slo) -> list[tuple[str, str]]:
    """(scope, alert name) of an SLO: per model, and per tenant where its series have the label."""
    tenant_alert = slo.sli.tenant_alert
    return [("model", slo.sli.alert)] + ([("model_tenant", tenant_alert)] if tenant_alert else [])


def error_ratio(slo: Slo, scope: str, window: str) -> str:
    """PromQL of the SLO's error ratio over ``window``, by model (and tenant)."""
    by = "model, tenant" if scope == "model_tenant" else "model"
    sli, sel = slo.sli, slo.selector()
    if sli.histogram:
        threshold = repr(float(slo.objective.threshold_seconds or 0.0))  # as prometheus_client writes ``le``
        total = f"sum by ({by}) (rate({sli.metric}_count{{{sel}}}[{window}]))"
        good = f'sum by ({by}) (rate({sli.metric}_bucket{{{sel}, le="{threshold}"}}[{window}]))'
        return f"(\n  {total}\n  -\n  {good}\n)\n/\n{total}\n"
    total = f"sum by ({by}) (rate({sli.metric}{{{sel}}}[{window}]))"
    bad = f"sum by ({by}) (rate({sli.metric}{{{sel}, {sli.bad}}}[{window}]))"
    return f"(\n  {bad}\n  or\n  {total} * 0\n)\n/\n{total}\n"


def _labels(slo: Slo) -> dict[str, str]:
    return {"slo": slo.id, "slo_class": slo.cls.name, "sli": slo.sli.name}


def _burn(slo: Slo, scope: str, pairs: tuple[tuple[float, str, str], ...]) -> str:
    budget = f"{slo.budget:g}"
    clauses = []
    for factor, long, short in pairs:
        rate = f"({factor:g} * {budget})"
        clauses.append(f'(\n  {ratio_record(scope, long)}{{slo="{slo.id}"}} > {rate}\n  and\n'
                       f'  {ratio_record(scope, short)}{{slo="{slo.id}"}} > {rate}\n)')
    return "\nor\n".join(clauses) + "\n"


def _who(scope: str) -> str:
    return ("tenant {{ $labels.tenant }} on model {{ $labels.model }}" if scope == "model_tenant"
            else "model {{ $labels.model }}")


def alert_rule(slo: Slo, scope: str, alert: str, severity: str, runbook_url: str) -> dict[str, Any]:
    """One alert: ``severity`` page (14.4x and 6x) or ticket (1x)."""
    pairs = PAGE if severity == "page" else TICKET
    target = f"{slo.objective.target * 100:g}%"
    speed = "fast" if severity == "page" else "steadily"
    windows = " or ".join(f"{f:g}x over {long} and {short}" for f, long, short in pairs)
    threshold = slo.objective.threshold_seconds
    within = f" within {threshold:g} s" if threshold is not None else ""
    return {
        "alert": alert,
        "expr": _burn(slo, scope, pairs),
        "labels": {"severity": severity, **_labels(slo)},
        "annotations": {
            "summary": f"{_who(scope)}: the {slo.sli.title} budget of {slo.id} is burning {speed}",
            "description": (f"{{{{ $value | humanizePercentage }}}} of events bad over the long window; the "
                            f"objective is {target} good{within} (class {slo.cls.name}), burn threshold {windows}."),
            "runbook_url": f"{runbook_url}#{alert.lower()}",
        },
    }


def rule_groups(config: SloConfig) -> list[tuple[dict[str, Any], str | None]]:
    """The rule groups, each with a comment to write above it (or None)."""
    groups: list[tuple[dict[str, Any], str | None]] = []
    objectives = [{"record": OBJECTIVE, "expr": f"vector({slo.objective.target:g})", "labels": _labels(slo)}
                  for slo in config.slos]
    groups.append(({"name": "shardline-slo-objectives", "rules": objectives}, None))
    for slo in config.slos:  # records, then the alerts that read them: a group runs its rules in order, so the
        # alerts see this evaluation's ratios (separate groups run in no set order, a step behind or not)
        records = [{"record": ratio_record(scope, window), "expr": error_ratio(slo, scope, window),
                    "labels": _labels(slo)}
                   for scope, _ in scopes(slo) for window in WINDOWS]
        alerts = [alert_rule(slo, scope, alert, severity, config.runbook_url)
                  for scope, alert in scopes(slo) for severity in ("page", "ticket")]
        groups.append(({"name": f"shardline-slo-{slo.id}", "rules": records + alerts}, None))
    groups.append(({"name": "shardline-batch-projection", "rules": [late_alert(config.runbook_url)]},
                   "A running batch job projected to finish past its deadline (docs/metrics.md)."))
    groups.append(({"name": "shardline-platform", "rules": [
        {"record": GPU_BUSY,
         "expr": "100 * DCGM_FI_PROF_GR_ENGINE_ACTIVE\nor on (Hostname, gpu)\nDCGM_FI_DEV_GPU_UTIL\n"},
        {"alert": SCRAPE_ALERT, "expr": f'up{{job=~"{promql_string(config.scrape_jobs)}"}} == 0\n', "for": "5m",
         "labels": {"severity": "ticket"},
         "annotations": {
             "summary": "{{ $labels.job }} target {{ $labels.instance }} is down",
             "description": "Prometheus has not scraped {{ $labels.instance }} for 5 minutes: the SLOs that read "
                            "it see no events, so their alerts cannot fire.",
             "runbook_url": f"{config.runbook_url}#{SCRAPE_ALERT.lower()}"}},
    ]}, "What the SLOs stand on: GPU busy share (DCGM exporter's names) and the scrape targets."))
    return groups


def late_alert(runbook_url: str) -> dict[str, Any]:
    """The predictive batch alert (see the module docstring)."""
    running = f"and on ({_JOB})\n  (shardline_batch_job_running == 1)"
    return {
        "alert": LATE_ALERT,
        "expr": ("(\n  shardline_batch_job_projected_finish_timestamp_seconds\n  -\n"
                 f"  shardline_batch_job_deadline_timestamp_seconds > 0\n  {running}\n)\nor on ({_JOB})\n"
                 f"(\n  time() - shardline_batch_job_deadline_timestamp_seconds > 0\n  {running}\n)\n"),
        "for": LATE_FOR,
        "labels": {"severity": "ticket"},
        "annotations": {
            "summary": "batch job {{ $labels.job_id }} of tenant {{ $labels.tenant }} (model {{ $labels.model }}) "
                       "will miss its deadline",
            "description": "Projected (or already) {{ $value | humanizeDuration }} past its deadline at the rate its "
                           "shards settle now; it has been so for " + LATE_FOR + ".",
            "runbook_url": f"{runbook_url}#{LATE_ALERT.lower()}",
        },
    }


def alert_names(config: SloConfig) -> list[str]:
    """Every alert the rules raise, in file order, each once."""
    names = [alert for slo in config.slos for _, alert in scopes(slo)] + [LATE_ALERT, SCRAPE_ALERT]
    return list(dict.fromkeys(names))


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the expressions) as literal blocks."""


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def rules_yaml(config: SloConfig, source: str | PurePath) -> str:
    """The rules file's text: generated from the SLO file ``source``, one commented block per group.

    The header names ``source`` by its file name only, so the text does not depend on the working folder or
    on how the path was spelled (`slo render --check` compares it with the committed file)."""
    lines = [f"# Generated by `shardline slo rules` (or `slo render`) from {PurePath(source).name}: edit that file, "
             "not this one.",
             "# Recording rules and multi-window, multi-burn-rate alerts (docs/slo.md, docs/runbooks.md).",
             "groups:"]
    for group, comment in rule_groups(config):
        if comment:
            lines.append(f"  # {comment}")
        body = yaml.dump([group], Dumper=_Dumper, sort_keys=False, width=120, default_flow_style=False)
        lines.extend("  " + line if line else line for line in body.rstrip("\n").split("\n"))
    return "\n".join(lines) + "\n"


__all__ = ["LATE_ALERT", "SLIS", "WINDOWS", "PAGE", "TICKET", "alert_names", "late_alert", "error_ratio", "ratio_record", "rule_groups",
           "rules_yaml", "scopes"]
