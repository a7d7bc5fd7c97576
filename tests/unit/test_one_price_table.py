"""One price table prices all three: `cost report` (the ledger's chargeback), `plan capacity` (the hardware the
packer buys) and `cost simulate` (spot and on-demand workers). Edit the file and all three change with it."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shardline.cli import app
from shardline.storage.job_records import JobParameters, JobRecord, JobRecords
from shardline.storage.ledger import Holding, LedgerStore
from shardline.storage.output import OutputLayout, PartRecord

DEMAND = ("models:\n  - {name: llm, demand: 3000, unit: tokens/s, memory_gb: 60,\n"
          "     profiles: {cuda-nvidia-h100-80gb-hbm3: {throughput: 1600}}}\n")


def table(gpu: float, spot: float) -> str:
    """A price table: an H100 GPU-hour at ``gpu`` on demand and ``spot`` on spot."""
    return yaml.safe_dump({"currency": "USD", "classes": {"cpu": {"unit": "core", "on-demand": 0.05},
                                                          "h100": {"unit": "gpu", "on-demand": gpu, "spot": spot}}})


def a_finished_gpu_job(home: Path, out: Path) -> str:
    """A nightly job that finished on one H100: six 10-minute shards in the output's ledger, its record under the
    home, and its hour of GPU use in the metering ledger (what `cost report` charges)."""
    started = datetime.now(timezone.utc).replace(day=1, hour=1, minute=0, second=0, microsecond=0)
    layout = OutputLayout(str(out), job_id="nightly")
    for i in range(6):
        layout.record(PartRecord(shard=f"in/part-{i}.parquet", relative=f"part-{i}.parquet", fingerprint=str(i),
                                 job_key="nightly", status="committed", rows_in=1000, rows_out=1000, seconds=600.0,
                                 ranges=4))
    JobRecords(str(home)).write(JobRecord(
        job_id="nightly", parameters=JobParameters(model="llm", input_uri="in", output_uri=str(out)),
        state="completed", started_at=started, finished_at=started + timedelta(hours=1),
        deadline=started + timedelta(hours=2)))
    LedgerStore(str(home)).record_batch(Holding("batch", "h100", "on-demand", 1.0), "acme", "llm", "1", "nightly",
                                        started, {"device_seconds": 3600.0, "rows": 6000}, 3600.0, 3600.0)
    return f"{started:%Y-%m}"


def priced(home: Path, month: str, demand: Path, how: list[str], env: dict[str, str]) -> tuple[str, float, str]:
    """What the three commands print or write, each given the price table ``how`` (``--prices FILE``, or nothing
    with ``env`` naming it)."""
    runner, env = CliRunner(), {"SHARDLINE_STORAGE_HOME": str(home), **env}
    report = runner.invoke(app, ["cost", "report", "--month", month, *how], env=env)
    assert report.exit_code == 0, report.output
    plan_file = home / "plan.yaml"
    plan = runner.invoke(app, ["plan", "capacity", "--demand", str(demand), "-o", str(plan_file), *how], env=env)
    assert plan.exit_code == 0, plan.output
    simulate = runner.invoke(app, ["cost", "simulate", "nightly", "--runs", "5", "--slack", "0.4", *how], env=env)
    assert simulate.exit_code == 0, simulate.output
    return report.output, yaml.safe_load(plan_file.read_text())["cost_per_hour"], simulate.output


def test_one_edited_price_file_changes_what_report_plan_and_simulate_price(tmp_path: Path) -> None:
    home = tmp_path / "home"
    month = a_finished_gpu_job(home, tmp_path / "out")
    demand = tmp_path / "demand.yaml"
    demand.write_text(DEMAND)
    prices = tmp_path / "prices.yaml"
    prices.write_text(table(gpu=4.0, spot=1.6))
    before = priced(home, month, demand, ["--prices", str(prices)], {})
    prices.write_text(table(gpu=8.0, spot=2.0))  # the same file edited; found by the default resolution this time
    after = priced(home, month, demand, [], {"SHARDLINE_METERING_PRICES_FILE": str(prices)})
    (report, plan, simulate), (report_after, plan_after, simulate_after) = before, after
    # the chargeback: the job's GPU-hour at the table's price (the example's list price would be 6.88)
    assert "priced capacity: 4.00 USD" in report and "priced capacity: 8.00 USD" in report_after
    assert "on spot would cost 1.60 USD" in report and "on spot would cost 2.00 USD" in report_after
    # the plan: two whole H100s for 3,000 tokens/s, at the table's GPU-hour
    assert (plan, plan_after) == (8.0, 16.0)
    # the simulation: workers at the table's on-demand and spot prices; the on-demand replay costs twice as much
    assert "(h100: 4.00/h on demand, 1.60/h spot)" in simulate
    assert "(h100: 8.00/h on demand, 2.00/h spot)" in simulate_after
    on_demand = [float(re.search(r"on demand: finishes in \S+, costs ([\d.]+)", out)[1])  # type: ignore[index]
                 for out in (simulate, simulate_after)]
    assert on_demand[1] == pytest.approx(2 * on_demand[0], abs=0.01)  # as printed, to the cent


@pytest.mark.parametrize(("args", "flag"), [
    (["cost", "report", "--month", "MONTH", "-o", "{nowhere}/x.html"], "-o"),
    (["cost", "report", "--month", "MONTH", "--prometheus", "{nowhere}/x.prom"], "--prometheus"),
    (["cost", "simulate", "nightly", "--runs", "2", "-o", "{nowhere}/s.html"], "-o"),
])
def test_a_file_that_cannot_be_written_is_refused_before_anything_is_printed(
    args: list[str], flag: str, tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    month = a_finished_gpu_job(home, tmp_path / "out")
    nowhere = tmp_path / "nodir"
    asked = [a.replace("MONTH", month).format(nowhere=nowhere) for a in args]
    result = CliRunner().invoke(app, asked, env={"SHARDLINE_STORAGE_HOME": str(home)})
    assert result.exit_code == 2 and result.stdout == "", result.output  # no report, then an error
    assert result.stderr.splitlines() == [
        f"error: cannot write '{asked[-1]}': the folder {nowhere} does not exist; make it or pass another path to "
        f"{flag}"]
    assert not nowhere.exists()
    folder = CliRunner().invoke(app, [*asked[:-1], str(tmp_path)], env={"SHARDLINE_STORAGE_HOME": str(home)})
    assert folder.exit_code == 2 and folder.stdout == ""
    assert folder.stderr.splitlines() == [f"error: cannot write '{tmp_path}': it is a folder; pass a file's path to "
                                          f"{flag}"]
