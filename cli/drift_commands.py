"""`shardline drift ...`: check a model's captured data against its reference profile, or write an HTML report.

Runs in this process, without Prefect: the drift-watch flow does the same on a
schedule and emits the events automations answer (see docs/drift.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from shardline.cli.common import EXIT_OK, EXIT_USAGE, check_output_file, fail
from shardline.errors import ShardlineError

if TYPE_CHECKING:
    from shardline.quality.drift_checks import DriftCheck

EXIT_DRIFT = 4
EXIT_NOT_JUDGED = EXIT_USAGE  # no verdict, as when nothing was captured: a gate must not read it as "no drift"

drift_app = typer.Typer(help="Drift: captured inputs and outputs against a model's reference profile.",
                        no_args_is_help=True)

MODEL_HELP = "Model reference: name@alias (its current version) or name:version."
WINDOW_HELP = "How far back to read captured rows: 90s, 30m, 24h, 7d, 2w."
TIER_HELP = "Only one tier's capture: online or batch (default: both)."


def _run_check(model: str, window: str, tier: str | None, save: bool) -> "DriftCheck":
    from shardline.quality.drift_checks import check_drift, parse_window, reports_root, save_report
    from shardline.settings import DriftSettings, StorageSettings

    storage = StorageSettings()
    check = check_drift(storage, model, parse_window(window), tier=tier)
    if save:
        url = save_report(reports_root(storage, DriftSettings()), check.report, storage.storage_options)
        typer.echo(f"saved {url}", err=True)
    return check


def _print_check(check: "DriftCheck") -> None:
    report = check.report
    tiers = ", ".join(f"{t} {n:,}" for t, n in sorted(check.rows_by_tier.items()))
    typer.echo(f"{check.reference} -> {report.model}: {report.rows_current:,} captured rows ({tiers}) from "
               f"{check.since:%Y-%m-%d %H:%M} to {check.until:%Y-%m-%d %H:%M} UTC, "
               f"against {report.rows_reference:,} reference rows")
    rows = [("column", "role", "metric", "score", "threshold", "verdict")]
    for c in sorted(report.columns, key=lambda c: (not c.drifted, c.role != "input", c.column)):
        verdict = "DRIFT" if c.drifted else "ok" if c.judged else "not judged"
        rows.append((c.column, c.role, c.metric, f"{c.score:.4g}" if c.judged else "-", f"{c.threshold:.4g}", verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        line = "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()
        typer.secho(line, fg="red" if row[-1] == "DRIFT" else None, bold=i == 0)
    for c in report.columns:
        if c.drifted:
            typer.echo(f"{c.column}: {c.reason}")
    if report.drifted:
        typer.secho(f"{report.verdict}: {', '.join(report.drifted_columns)}", fg="red", bold=True)
    elif not report.judged:
        typer.secho(f"{report.verdict}; widen --window or wait for more captured rows", fg="yellow", bold=True)
    else:
        typer.secho(report.verdict, fg="green")


def _exit_code(check: "DriftCheck") -> int:
    if not check.report.judged:
        return EXIT_NOT_JUDGED
    return EXIT_DRIFT if check.report.drifted else EXIT_OK


@drift_app.command("check")
def drift_check(
    model: str = typer.Argument(..., help=MODEL_HELP),
    window: str = typer.Option("24h", help=WINDOW_HELP),
    tier: Optional[str] = typer.Option(None, help=TIER_HELP),
    save: bool = typer.Option(False, "--save", help="Also keep the report in the history (as drift-watch does)."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
) -> None:
    """Compare the recent capture of both tiers with the model's reference profile, column by column.

    Exit codes: 0 no drift, 4 drift found, 2 no verdict: the request was wrong (unknown
    model, no reference profile, nothing captured in the window) or too few rows were
    captured for the policy to judge (fewer than its min_rows; the table says "not judged").
    """
    try:
        check = _run_check(model, window, tier, save)
    except ShardlineError as e:
        raise fail(e) from e
    if json_out:
        typer.echo(json.dumps({**json.loads(check.report.model_dump_json()), "reference": check.reference,
                               "rows_by_tier": check.rows_by_tier, "drifted": check.report.drifted,
                               "judged": check.report.judged,
                               "score": check.report.score if check.report.judged else None}))
    else:
        _print_check(check)
    raise typer.Exit(_exit_code(check))


@drift_app.command("report")
def drift_report_html(
    model: str = typer.Argument(..., help=MODEL_HELP),
    output: Path = typer.Option(Path("drift-report.html"), "-o", "--output", help="HTML file to write."),
    window: str = typer.Option("24h", help=WINDOW_HELP),
    tier: Optional[str] = typer.Option(None, help=TIER_HELP),
) -> None:
    """Write a self-contained HTML report: reference vs current distributions, drift score over time.

    The history is the reports drift-watch (or `drift check --save`) stored for the
    version. Exit codes: 0 written (whatever the verdict), 2 the request was wrong.
    """
    check_output_file(output, "-o")
    try:
        from shardline.quality.drift_checks import current_capture, report_history, reports_root
        from shardline.quality.report import render_html
        from shardline.settings import DriftSettings, StorageSettings

        storage = StorageSettings()
        check = _run_check(model, window, tier, save=False)
        pinned = check.target.model
        history = report_history(reports_root(storage, DriftSettings()), pinned.name, pinned.version,
                                 storage.storage_options)
        frame = current_capture(storage, check.target, check.since, check.until, check.tier)
        html = render_html(check.report, check.target.profile, frame, history=[*history, check.report])
    except ShardlineError as e:
        raise fail(e) from e
    try:
        output.write_text(html, encoding="utf-8")
    except OSError as e:
        raise fail(f"cannot write {output}: {e}; pick another path with -o") from e
    verdict = f"drift in {', '.join(check.report.drifted_columns)}" if check.report.drifted else check.report.verdict
    typer.echo(f"wrote {output} ({check.report.model}: {verdict}; {len(history)} earlier reports)")
