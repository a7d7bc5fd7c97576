"""The spot simulation's report: the lines `shardline cost simulate` prints, and the same as an HTML page with
plots (matplotlib, inline SVG: the page needs nothing else)."""

from __future__ import annotations

import html
import math
from typing import Sequence

from pydantic import BaseModel

from shardline.capacity.spot import JobWork, RunResult, Setup, Summary, Sweep
from shardline.figures import amount, span

_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:70em;color:#222}
table{border-collapse:collapse;font-size:.9em}th,td{padding:.3em .6em;border-bottom:1px solid #ddd;text-align:right}
th:first-child,td:first-child{text-align:left}.muted{color:#666}figure{margin:1em 0}
figure svg{display:block;max-width:100%;height:auto}"""


class SpotReport(BaseModel):
    """Everything the report shows: the job, the setting simulated, on demand, spot, and the sweep."""

    job: JobWork
    setup: Setup
    trace: str | None = None
    on_demand: RunResult
    spot: Summary
    runs: list[RunResult]
    sweep: Sweep


def money(value: float) -> str:
    """An amount of money: two decimals, or two significant digits under 0.01 (a seconds-long job's cost)."""
    return f"{value:.2f}" if value >= 0.01 or value == 0 else f"{value:.2g}"


def _rate(rate: float | None) -> str:
    return "unknown" if rate is None else f"{amount(rate)}/worker-h"


def _until(rate: float | None, report: SpotReport) -> str:
    if rate is None:
        return f"beyond every rate swept (up to {_rate(report.sweep.break_even.swept_up_to)})"
    if rate == 0.0:
        return "not even without preemptions"
    return f"up to about {_rate(rate)}"


def summary_lines(report: SpotReport) -> list[str]:
    """What the command prints."""
    job, setup, od, spot, even = report.job, report.setup, report.on_demand, report.spot, report.sweep.break_even
    preemptions = setup.preemptions
    how = (f"the trace {report.trace} ({len(preemptions.trace_s or ())} notices)" if report.trace
           else f"{amount(preemptions.rate_per_hour)} notices per spot worker-hour (Poisson)")
    rows = sum(s.rows for s in job.shards)
    finish = span(spot.mean_finish_s) if math.isfinite(spot.mean_finish_s) else "never"
    added = "on-demand" if setup.response.capacity == "on-demand" else "same-pool"
    return [
        f"job {job.job_id}: {len(job.shards)} shards, {rows:,} rows, {span(job.busy_seconds)} of scoring on "
        f"{job.workers} worker{'s' if job.workers != 1 else ''} ({job.hardware_class}: "
        f"{money(setup.prices.on_demand)}/h on demand, {money(setup.prices.spot)}/h spot); deadline "
        f"{span(job.deadline_s)} after the start",
        f"on demand: finishes in {span(od.finish_s)}, costs {money(od.cost)}"
        + (f" ({od.scale_ups} SLA scale-up{'s' if od.scale_ups != 1 else ''})" if od.scale_ups else ""),
        f"spot under {how}, notice {preemptions.notice_s:g} s, replacement after {preemptions.replace_s:g} s, "
        f"{spot.runs} seeded runs:",
        f"  mean cost {money(spot.mean_cost)} ({spot.cost_ratio:.2f}x on demand), p95 {money(spot.p95_cost)}; deadline "
        f"met in {spot.attainment:.0%} of runs; mean finish {finish}",
        f"  {amount(spot.mean_preemptions)} preemptions a run; {span(spot.mean_lost_s)} of scoring redone, "
        f"{span(spot.mean_saved_s)} kept by range checkpoints; {amount(spot.mean_scale_ups)} SLA scale-ups "
        f"({setup.response.step} {added} workers each)",
        f"spot stays at or under half the on-demand cost, meeting the deadline in {even.attainment_target:.0%} of "
        f"runs, {_until(even.half_cost_until, report)}",
        f"spot pays off (cheaper than on demand, deadline met in {even.attainment_target:.0%}) "
        f"{_until(even.pays_until, report)}",
    ]


def _sweep_plot(report: SpotReport) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from shardline.figures import inline_svg

    points = [p for p in report.sweep.points if p.rate_per_hour]
    figure, (cost, met) = plt.subplots(1, 2, figsize=(10, 3.4))
    rates = [p.rate_per_hour or 0.0 for p in points]
    cost.plot(rates, [p.cost_ratio for p in points], marker="o", color="#4C72B0", label="spot, mean")
    cost.axhline(1.0, color="#C44E52", linestyle="--", label="on demand")
    cost.axhline(0.5, color="#999", linestyle=":", label="half of on demand")
    cost.set_xscale("log")
    cost.set_xlabel("preemption notices per spot worker-hour", fontsize=8)
    cost.set_ylabel("cost / on-demand cost", fontsize=8)
    cost.legend(fontsize=7)
    met.plot(rates, [p.attainment for p in points], marker="o", color="#55A868")
    met.axhline(report.sweep.break_even.attainment_target, color="#999", linestyle=":")
    met.set_xscale("log")
    met.set_ylim(-0.02, 1.02)
    met.set_xlabel("preemption notices per spot worker-hour", fontsize=8)
    met.set_ylabel("share of runs meeting the deadline", fontsize=8)
    for axes in (cost, met):
        axes.tick_params(labelsize=7)
    return inline_svg(figure)


def _finish_plot(report: SpotReport) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from shardline.figures import inline_svg

    figure, axes = plt.subplots(figsize=(6, 3))
    finished = [r.finish_s / 3600 for r in report.runs if math.isfinite(r.finish_s)]
    axes.hist(finished, bins=20, color="#4C72B0", label="spot runs")
    axes.axvline(report.job.deadline_s / 3600, color="#C44E52", linestyle="--", label="deadline")
    axes.axvline(report.on_demand.finish_s / 3600, color="#55A868", linestyle=":", label="on demand")
    axes.set_xlabel("hours from the start to the last shard", fontsize=8)
    axes.set_ylabel("runs", fontsize=8)
    axes.legend(fontsize=7)
    axes.tick_params(labelsize=7)
    return inline_svg(figure)


def _table(points: Sequence[Summary]) -> str:
    rows = "".join(
        f"<tr><td>{amount(p.rate_per_hour or 0.0)}</td><td>{p.cost_ratio:.3f}</td><td>{p.attainment:.0%}</td>"
        f"<td>{amount(p.mean_preemptions)}</td><td>{span(p.mean_lost_s)}</td><td>{span(p.mean_saved_s)}</td>"
        f"<td>{amount(p.mean_scale_ups)}</td></tr>" for p in points)
    return ("<table><tr><th>notices/worker-h</th><th>cost / on demand</th><th>deadline met</th><th>preemptions</th>"
            f"<th>redone</th><th>kept by checkpoints</th><th>scale-ups</th></tr>{rows}</table>")


def render_html(report: SpotReport) -> str:
    """A self-contained HTML page: the summary, the sweep's plots and table, and the runs' finish times."""
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"
    lines = "".join(f"<li>{html.escape(line.strip())}</li>" for line in summary_lines(report))
    return "".join([
        f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>Spot: {html.escape(report.job.job_id)}</title>"
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>Spot against on demand: job {html.escape(report.job.job_id)}</h1><ul>{lines}</ul>",
        "<h2>Where spot stops paying off</h2>", f"<figure>{_sweep_plot(report)}</figure>",
        _table(report.sweep.points),
        "<h2>Finish times at the simulated setting</h2>", f"<figure>{_finish_plot(report)}</figure>",
        "<p class=muted>A discrete-event replay of the job's measured shard seconds (docs/cost.md, 'Spot "
        "economics': what it assumes).</p></body></html>",
    ])
