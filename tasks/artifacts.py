"""What a batch run shows in the Prefect UI: artifact keys stable per job, and the markdown summary.

Prefect keeps every artifact published under one key as that key's history (its
versions), so the keys here name the *job*, not the run: ``batch-<job name>-<kind>``,
where the job name is the deployment's when the run comes from one (``nightly``) and
otherwise the model's name with the output folder's (``breast-cancer-scored-1a2b3c4d``:
the last folder name, and 8 hex digits of the whole output URL so that two folders
named alike stay apart). Kinds: ``summary`` (markdown, what a person reads first),
``totals`` (the summary as a table), ``sla`` (planned vs actual), ``progress``.
Keys hold lowercase letters, digits and dashes only, as Prefect requires.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from shardline.bundle import ModelRef
from shardline.figures import moment, rate, rows_quarantined, shard_counts, span
from shardline.storage.job_identity import JobSummary
from shardline.storage.scoring import shadowed_note

MAX_NAME = 60  # characters of the job name in a key; the rest of a long name is cut
MAX_QUARANTINED_LISTED = 20  # quarantined shards listed by name in the summary; the manifest has all


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def batch_job_name(deployment: str | None, model: str, output: str) -> str:
    """The job's name in artifact keys: the deployment's, else the model name + output folder + a hash."""
    if deployment and _slug(deployment):
        return _slug(deployment)[:MAX_NAME].strip("-")
    name = _slug(ModelRef.split(model)[0]) or "model"
    folder = _slug(output.rstrip("/").rsplit("/", 1)[-1])
    digest = hashlib.sha256(output.rstrip("/").encode()).hexdigest()[:8]
    return "-".join(p for p in (name[:30].strip("-"), folder[:20].strip("-"), digest) if p)


def current_deployment() -> str | None:
    """The name of the deployment this flow run came from; None when it came from none.

    A run from no deployment (`batch run`) costs no API read: the run's own context says so.
    (``prefect.runtime.deployment.name`` reads the flow run from the API each time to learn
    that, tens of milliseconds a call on a local server.)
    """
    from prefect.context import FlowRunContext
    from prefect.runtime import deployment

    context = FlowRunContext.get()
    if context is not None and context.flow_run is not None and context.flow_run.deployment_id is None:
        return None
    name = deployment.name
    return str(name) if name else None


def batch_artifact_key(kind: str, model: str, output: str, deployment: str | None) -> str:
    """``batch-<job name>-<kind>`` (see the module docstring); ``deployment`` is None for a run not from one."""
    return f"batch-{batch_job_name(deployment, model, output)}-{kind}"


def _throughput(summary: JobSummary, planned: dict[str, Any] | None) -> str:
    if not summary.rows_scored:
        return "nothing scored in this run (every shard was settled before, or quarantined)"
    line = (f"{rate(summary.rows_scored, summary.steady_seconds, 'rows')} scoring ({summary.rows_scored:,} rows "
            f"in {span(summary.steady_seconds)})")
    if planned and planned.get("actual_seconds"):
        line += f"; {rate(planned['shards'], planned['actual_seconds'], 'shards')} over the whole run"
    return line


def _sla_line(planned: dict[str, Any] | None) -> str:
    if not planned:
        return "not tracked"
    verdict = "**met**" if planned["status"] == "met" else "**breached**"
    return (f"{verdict}: finished {moment(planned['finished'])} for a deadline of {moment(planned['deadline'])} "
            f"({span(planned['actual_seconds'])} of the {span(planned['budget_seconds'])} allowed)")


def summary_markdown(summary: JobSummary, planned: dict[str, Any] | None = None) -> str:
    """The run in a few lines: rows, quarantined shards and why, throughput, SLA, where the output is."""
    if summary.shards_quarantined == 0:
        outcome = f"{summary.rows_out:,} rows scored"
    elif summary.rows_out == 0:
        outcome = "every shard was quarantined"
    else:
        outcome = f"{summary.shards_quarantined:,} of {summary.shards:,} shards quarantined"
    shards = shard_counts(summary.shards, summary.shards_committed, summary.shards_quarantined, summary.shards_skipped)
    lines = [
        f"## Batch job `{summary.job_id[:12]}`: {outcome}",
        "",
        f"Model `{summary.model}` for tenant `{summary.tenant}`.",
        "",
        "| measure | count |",
        "|---|---:|",
        f"| rows in | {summary.rows_in:,} |",
        f"| rows out | {summary.rows_out:,} |",
        f"| rows quarantined | {rows_quarantined(summary.rows_quarantined, summary.shards_unreadable)} |",
        f"| shards | {shards} |",
        "",
        f"**Throughput:** {_throughput(summary, planned)}.",
        "",
        f"**SLA:** {_sla_line(planned)}.",
        "",
        f"**Output:** `{summary.output}`" + (f" (manifest `{summary.manifest}`)" if summary.manifest else ""),
    ]
    if summary.quarantined:
        lines += ["", "**Quarantined shards:**", ""]
        shown = sorted(summary.quarantined.items())[:MAX_QUARANTINED_LISTED]
        lines += [f"- `{shard}`: {reason or 'no reason recorded'}" for shard, reason in shown]
        more = len(summary.quarantined) - len(shown)
        if more > 0:
            lines.append(f"- and {more} more: every one is in the manifest")
    if summary.shadowed_columns:
        lines += ["", f"**Note:** {shadowed_note(summary.shadowed_columns)}."]
    return "\n".join(lines) + "\n"


def totals_table(summary: JobSummary) -> list[dict[str, str]]:
    """The ``totals`` table artifact: every figure of the summary, named and written for a person to read."""
    figures = [
        ("job", summary.job_id), ("model", summary.model), ("tenant", summary.tenant),
        ("shards", f"{summary.shards:,}"), ("shards committed", f"{summary.shards_committed:,}"),
        ("shards quarantined", f"{summary.shards_quarantined:,}"),
        ("shards unreadable (rows unknown)", f"{summary.shards_unreadable:,}"),
        ("shards settled by an earlier run", f"{summary.shards_skipped:,}"),
        ("rows in", f"{summary.rows_in:,}"), ("rows out", f"{summary.rows_out:,}"),
        ("rows quarantined", rows_quarantined(summary.rows_quarantined, summary.shards_unreadable)),
        ("rows scored in this run", f"{summary.rows_scored:,}"),
        ("scoring time", span(summary.steady_seconds) if summary.rows_scored else "-"),
        ("scoring throughput",
         rate(summary.rows_scored, summary.steady_seconds, "rows") if summary.rows_scored else "-"),
        ("output", summary.output), ("manifest", summary.manifest or "-"),
    ]
    rows = [{"measure": measure, "value": value} for measure, value in figures]
    rows += [{"measure": f"quarantined {shard}", "value": reason or "no reason recorded"}
             for shard, reason in sorted(summary.quarantined.items())]
    return rows
