"""`shardline cost ...`: what the platform's use cost, from the metering ledger (docs/cost.md)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import typer

from shardline.cli.common import EXIT_OK, fail
from shardline.errors import ShardlineError

cost_app = typer.Typer(help="Cost: chargeback per tenant from the metering ledger.", no_args_is_help=True)

MONTH = re.compile(r"^\d{4}-(0[1-9]|1[0-2])$")


def _prices_path(given: Path | None) -> Path | None:
    """The price table to read: --prices, else SHARDLINE_METERING_PRICES_FILE, else <home>/prices.yaml when there,
    else None (the example's list prices)."""
    from shardline.settings import MeteringSettings, StorageSettings

    if given is not None:
        return given
    configured = MeteringSettings().prices_file
    if configured:
        return Path(configured)
    in_home = Path(StorageSettings().home) / "prices.yaml"
    return in_home if in_home.is_file() else None


@cost_app.command("report")
def report(
    month: str = typer.Option(..., "--month", help="The month to report, YYYY-MM (UTC), e.g. 2026-11."),
    tenant: Optional[str] = typer.Option(None, "--tenant", help="Only this tenant's charges."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Also write the report as HTML (with plots) "
                                          "to this file."),
    prices: Optional[Path] = typer.Option(None, "--prices", help="The price table (YAML); default "
                                          "SHARDLINE_METERING_PRICES_FILE, else <home>/prices.yaml, else the "
                                          "example's cloud list prices."),
    prometheus: Optional[Path] = typer.Option(None, "--prometheus", help="Also write the costs as Prometheus "
                                              "gauges (text format, for node_exporter's textfile collector)."),
) -> None:
    """Chargeback for a month: cost per tenant, model and tier, per 1k rows, per million tokens, per request.

    Each replica or batch worker is priced at the larger of what it held and what it used (OpenCost's rule), split
    across tenants by their device-seconds; idle capacity is its own line, carried by the platform. Exit 2 on a
    bad month, a month the ledger does not hold, or a class the price table does not price."""
    from shardline.cost.prices import load_prices
    from shardline.cost.report import build_report, render_html, render_prometheus, render_text
    from shardline.settings import StorageSettings
    from shardline.storage.ledger import LedgerStore

    if not MONTH.match(month):
        raise fail(f"--month {month!r} is not a month; give it as YYYY-MM, e.g. 2026-11")
    try:
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
        result = build_report(rows, load_prices(_prices_path(prices)), month, tenant)
    except ShardlineError as e:
        raise fail(e) from e
    typer.echo(render_text(result), nl=False)
    for path, text in ((output, render_html(result) if output else ""),
                       (prometheus, render_prometheus(result) if prometheus else "")):
        if path is not None:
            try:
                path.write_text(text)
            except OSError as e:
                raise fail(f"cannot write {str(path)!r} ({e.strerror or e}); choose another path") from e
            typer.echo(f"wrote {path}", err=True)
    raise typer.Exit(EXIT_OK)
