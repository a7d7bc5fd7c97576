"""`shardline cost ...`: what the platform's use cost, from the metering ledger (`report`), and a finished batch
job replayed on spot capacity under preemptions, with the platform's checkpoints and SLA response, against on
demand (`simulate`: where spot stops paying off). docs/cost.md."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from shardline.cli.common import EXIT_OK, PRICES_HELP, check_output_file, fail
from shardline.errors import InvalidSetting, ShardlineError

cost_app = typer.Typer(help="Cost: chargeback per tenant from the metering ledger, and what spot saves.",
                       no_args_is_help=True)


@cost_app.command("report")
def report(
    month: str = typer.Option(..., "--month", help="The month to report, YYYY-MM (UTC), e.g. 2026-11."),
    tenant: Optional[str] = typer.Option(None, "--tenant", help="Only this tenant's charges."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Also write the report as HTML (with plots) "
                                          "to this file."),
    prices: Optional[Path] = typer.Option(None, "--prices", help=PRICES_HELP),
    prometheus: Optional[Path] = typer.Option(None, "--prometheus", help="Also write the costs as Prometheus "
                                              "gauges (text format, for node_exporter's textfile collector)."),
) -> None:
    """Chargeback for a month: cost per tenant, model and tier, per 1k rows, per million tokens, per request.

    Each replica or batch worker is priced at the larger of what it held and what it used (OpenCost's rule), split
    across tenants by their device-seconds; idle capacity is its own line, carried by the platform. Exit 2 on a
    bad month, a month the ledger does not hold, a class the price table does not price, or a file that cannot be
    written."""
    check_output_file(output, "-o")
    check_output_file(prometheus, "--prometheus")
    from shardline.capacity.prices import load_prices, prices_path
    from shardline.cost.report import build_report, render_html, render_prometheus, render_text, teachers_in
    from shardline.settings import StorageSettings
    from shardline.storage.ledger import LedgerStore, check_month
    from shardline.storage.registry import ModelRegistry

    try:
        check_month(month)
        storage = StorageSettings()
        store = LedgerStore(storage.home, storage.storage_options)
        table = store.read(month)
        if table.num_rows == 0:
            held = store.months()
            raise fail(f"the metering ledger ({store.location}) holds nothing for {month} "
                       f"({'its months: ' + ', '.join(held) if held else 'it is empty'}); meter some work first "
                       "(`shardline serve`, `shardline batch run`) or pick another --month")
        rows = table.to_pylist()
        if tenant is not None and not any(r["tenant"] == tenant for r in rows):
            known = sorted({r["tenant"] for r in rows if r["kind"] == "usage"})
            raise fail(f"tenant {tenant!r} used nothing in {month} (tenants with use: {', '.join(known)}); check "
                       "the name")
        result = build_report(rows, load_prices(prices_path(prices)), month, tenant,
                              teachers_in(ModelRegistry.from_settings(storage)))
    except ShardlineError as e:
        raise fail(e) from e
    typer.echo(render_text(result), nl=False)
    for path, text in ((output, render_html(result) if output else ""),
                       (prometheus, render_prometheus(result) if prometheus else "")):
        if path is not None:
            _write(path, text)
            typer.echo(f"wrote {path}", err=True)
    raise typer.Exit(EXIT_OK)


def _write(path: Path, text: str) -> None:
    """Write a report's file, or exit with the one line that says why it cannot be written."""
    try:
        path.write_text(text)
    except OSError as e:
        raise fail(f"cannot write {str(path)!r} ({e.strerror or e}); choose another path") from e


@cost_app.command("simulate")
def cost_simulate(
    job_id: str = typer.Argument(..., help="A finished batch job's id (`shardline batch status` lists them)."),
    rate_per_hour: Optional[float] = typer.Option(None, "--rate-per-hour", min=0.0, help="Preemption notices per "
                                                  "spot worker-hour (Poisson) \\[default: 1]."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="A trace instead: one notice time a line, seconds "
                                         "from the job's start; each takes one spot worker."),
    notice_s: float = typer.Option(120.0, "--notice-s", min=0.0, help="Seconds from a notice to the reclaim "
                                   "(AWS 120, GCP and Azure 30)."),
    replace_s: float = typer.Option(180.0, "--replace-s", min=0.0, help="Seconds until a reclaimed spot worker "
                                    "is replaced."),
    seed: int = typer.Option(0, "--seed", help="The first seed; runs use seed, seed+1, ..."),
    runs: int = typer.Option(100, "--runs", min=1, help="Seeded runs at the setting (the sweep uses a fifth)."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="Workers \\[default: as many as the job "
                                          "kept busy]."),
    slack: Optional[float] = typer.Option(None, "--slack", min=0.0, help="Deadline at the on-demand finish plus "
                                          "this fraction (0.4: 40%) \\[default: the job's own SLA]."),
    hardware_class: Optional[str] = typer.Option(None, "--hardware-class", help="Price workers as this class "
                                                 "(h100, h200, cpu-8c, ...) \\[default: by the device it used]."),
    response: str = typer.Option("same", "--response", help="Workers the SLA response adds: 'same' (the "
                                 "job's pool, as scaling its cluster does) or 'on-demand'."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write an HTML report with plots here."),
    prices: Optional[Path] = typer.Option(None, "--prices", help=PRICES_HELP),
) -> None:
    """Replay a finished batch job on spot capacity under preemptions, against on demand.

    Reports the cost and deadline attainment over seeded runs, and the preemption rate where spot stops paying
    off. Exit codes: 0 simulated, 2 the job or an option was wrong (one line says what).
    """
    check_output_file(output, "-o")
    from shardline.capacity.hardware import default_hardware
    from shardline.capacity.problem import class_price
    from shardline.capacity.replay import job_work, load_finished_job
    from shardline.capacity.spot import (
        Preemptions, Prices, Response, Setup, parse_trace, simulate, summarize, sweep, with_slack,
    )
    from shardline.capacity.spot_report import SpotReport, render_html, summary_lines
    from shardline.capacity.prices import load_prices, prices_path
    from shardline.settings import BatchSettings, DaskSettings, StorageSettings

    try:
        if rate_per_hour is not None and trace is not None:
            raise InvalidSetting("give --rate-per-hour or --trace, not both: a rate draws notices, a trace gives them")
        if response not in ("same", "on-demand"):
            raise InvalidSetting(f"--response is 'same' or 'on-demand', not {response!r}")
        times = None
        if trace is not None:
            try:
                times = parse_trace(trace.read_text(), str(trace))
            except OSError as e:
                raise InvalidSetting(
                    f"cannot read the trace {str(trace)!r} ({e.strerror}); give a readable file") from e
        storage, batch = StorageSettings(), BatchSettings()
        finished = load_finished_job(storage.home, job_id, storage.storage_options)
        work = job_work(finished, workers=workers, hardware_class=hardware_class).model_copy(
            update={"margin_fraction": batch.sla_margin})
        hardware = default_hardware(load_prices(prices_path(prices)))
        priced = Prices(on_demand=class_price(hardware, work.hardware_class, "on-demand"),
                        spot=class_price(hardware, work.hardware_class, "spot"))
        answer = Response(capacity=response, check_s=batch.sla_check_interval_s,  # type: ignore[arg-type]
                          window_s=batch.sla_window_s)
        setup = Setup(prices=priced, response=answer,
                      preemptions=Preemptions(rate_per_hour=1.0 if rate_per_hour is None else rate_per_hour,
                                              trace_s=times, notice_s=notice_s, replace_s=replace_s,
                                              drain_s=DaskSettings().preemption_drain_s))
        if slack is not None:
            work = with_slack(work, setup, slack)
        seeds = range(seed, seed + runs)
        swept = sweep(work, setup, range(seed, seed + max(1, runs // 5)))
        summary, results = summarize(work, setup, seeds, swept.on_demand_cost)
        report = SpotReport(job=work, setup=setup, trace=str(trace) if trace else None,
                            on_demand=simulate(work, setup.model_copy(update={"capacity": "on-demand"})),
                            spot=summary, runs=results, sweep=swept)
    except (ShardlineError, ValueError) as e:
        raise fail(e) from e
    for line in summary_lines(report):
        typer.echo(line)
    if output:
        _write(output, render_html(report))
        typer.echo(f"report written to {output}")
