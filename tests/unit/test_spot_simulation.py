"""The spot simulation (shardline.capacity.spot): a nightly job on spot with checkpoints, against on demand."""

from __future__ import annotations

import math
import random

import pytest

from shardline.capacity.hardware import default_hardware
from shardline.capacity.prices import PriceTable
from shardline.capacity.problem import class_price
from shardline.capacity.spot import (
    JobWork,
    Preemptions,
    Prices,
    Response,
    Setup,
    ShardWork,
    parse_trace,
    simulate,
    summarize,
    sweep,
    with_slack,
)
from shardline.capacity.spot_report import SpotReport, render_html, summary_lines
from shardline.errors import InvalidSetting

HARDWARE = default_hardware(PriceTable.model_validate({"classes": {  # a GPU at 4.00/h, 1.60/h on spot
    "cpu": {"unit": "core", "on-demand": 0.025, "spot": 0.00875}, "h100": {"unit": "gpu", "on-demand": 4.0, "spot": 1.6},
    "h200": {"unit": "gpu", "on-demand": 4.0, "spot": 1.6}}}))
PRICES = Prices(on_demand=class_price(HARDWARE, "h100", "on-demand"), spot=class_price(HARDWARE, "h100", "spot"))


def nightly(ranges: int = 4, shards: int = 240) -> JobWork:
    """240 shards of 4 to 6 minutes each on 8 GPU workers (about 2 h on demand), each scored in 4 checkpointed
    ranges; the deadline is set with 40% slack by the caller."""
    rng = random.Random(7)
    work = [ShardWork(name=f"part-{i:04d}.parquet", seconds=rng.uniform(240, 360), rows=200_000, ranges=ranges)
            for i in range(shards)]
    return JobWork(job_id="nightly", shards=work, workers=8, deadline_s=1.0, hardware_class="h100")


def setup(rate: float = 0.5, notice_s: float = 30.0, **response: object) -> Setup:
    return Setup(prices=PRICES, preemptions=Preemptions(rate_per_hour=rate, notice_s=notice_s),
                 response=Response(**response))  # type: ignore[arg-type]


def test_spot_with_checkpoints_meets_the_deadline_at_half_the_on_demand_cost_or_less() -> None:
    job = with_slack(nightly(), setup(), 0.4)
    on_demand = simulate(job, setup().model_copy(update={"capacity": "on-demand"}))
    assert on_demand.met and on_demand.preemptions == 0
    summary, runs = summarize(job, setup(rate=0.5), range(40), on_demand.cost)
    assert summary.attainment == 1.0  # every seeded run meets the deadline
    assert summary.cost_ratio <= 0.5 and all(r.cost <= 0.5 * on_demand.cost for r in runs)
    assert summary.mean_preemptions > 3  # preemptions happened: a 30 s notice, 4-6 min shards
    assert summary.mean_lost_s > 0 and summary.mean_saved_s > summary.mean_lost_s  # checkpoints kept most of it


def test_a_run_is_its_seed_and_range_checkpoints_lose_less() -> None:
    job = with_slack(nightly(), setup(), 0.4)
    assert simulate(job, setup(rate=2.0), 11) == simulate(job, setup(rate=2.0), 11)
    assert simulate(job, setup(rate=2.0), 11) != simulate(job, setup(rate=2.0), 12)
    whole = with_slack(nightly(ranges=1), setup(), 0.4)
    ranged, single = (summarize(j, setup(rate=2.0), range(10), 1.0)[0] for j in (job, whole))
    assert single.mean_saved_s == 0.0  # a shard of one range keeps nothing when its worker is reclaimed
    assert ranged.mean_lost_s < single.mean_lost_s / 2


def test_a_trace_takes_one_worker_a_notice() -> None:
    trace = parse_trace("at_s\n# two notices early, one late\n600\n900.5,worker-3\n\n5400  # late\n")
    assert trace == (600.0, 900.5, 5400.0)
    job = with_slack(nightly(), setup(), 0.4)
    run = simulate(job, Setup(prices=PRICES, preemptions=Preemptions(trace_s=trace, notice_s=30.0)), seed=3)
    assert run.preemptions == 3 and run.met
    with pytest.raises(InvalidSetting, match="line 2: 'soon' is not a time"):
        parse_trace("600\nsoon\n")
    with pytest.raises(InvalidSetting, match="must be a finite time of 0 or more"):
        parse_trace("-5\n")


def test_the_sla_response_adds_workers_when_the_job_turns_late() -> None:
    job = with_slack(nightly(), setup(), 0.4)
    seeds = range(10)
    answered, _ = summarize(job, setup(rate=12.0, capacity="on-demand"), seeds, 1.0)
    ignored, _ = summarize(job, setup(rate=12.0, step=0), seeds, 1.0)
    assert answered.mean_scale_ups >= 1 and ignored.mean_scale_ups == 0
    assert answered.attainment > ignored.attainment


def test_the_sweep_names_the_rate_where_spot_stops_paying_off() -> None:
    job = with_slack(nightly(), setup(), 0.4)
    swept = sweep(job, setup(), range(8), refine=3)
    even = swept.break_even
    assert even.half_cost_until is not None and even.pays_until is not None
    assert 0 < even.half_cost_until <= even.pays_until < math.inf
    # below the edge the claim holds, at the first swept rate above it it does not
    holding = [p for p in swept.points if (p.rate_per_hour or 0) <= even.half_cost_until]
    assert all(p.cost_ratio <= 0.5 and p.attainment >= 0.95 for p in holding)
    last = swept.points[-1]
    assert last.cost_ratio >= 1.0 or last.attainment < 0.95  # the sweep stopped where spot no longer pays


def test_the_report_prints_the_figures_and_draws_them() -> None:
    job = with_slack(nightly(shards=80), setup(), 0.4)
    on_demand = simulate(job, setup().model_copy(update={"capacity": "on-demand"}))
    swept = sweep(job, setup(), range(4), refine=1)
    summary, runs = summarize(job, setup(), range(10), swept.on_demand_cost)
    report = SpotReport(job=job, setup=setup(), on_demand=on_demand, spot=summary, runs=runs, sweep=swept)
    lines = summary_lines(report)
    assert lines[0].startswith("job nightly: 80 shards, 16,000,000 rows")
    assert f"costs {on_demand.cost:.2f}" in lines[1] and f"({summary.cost_ratio:.2f}x on demand)" in lines[3]
    page = render_html(report)
    assert page.count("<svg") == 2 and "Where spot stops paying off" in page


@pytest.mark.parametrize(("args", "message"), [
    (["missing-job"], "no job 'missing-job' under the home"),
    (["j", "--rate-per-hour", "2", "--trace", "t.csv"], "give --rate-per-hour or --trace, not both"),
    (["j", "--response", "cheap"], "--response is 'same' or 'on-demand', not 'cheap'"),
])
def test_cost_simulate_refuses_in_one_line(args: list[str], message: str, tmp_path: object) -> None:
    from typer.testing import CliRunner

    from shardline.cli import app

    result = CliRunner().invoke(app, ["cost", "simulate", *args], env={"SHARDLINE_STORAGE_HOME": str(tmp_path)})
    assert result.exit_code == 2 and message in result.output
    assert len(result.output.strip().splitlines()) == 1
