"""Prices per hardware class (MIG slices by their fraction) and allocation as OpenCost does, split by use."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from shardline.capacity.hardware import H100_MIG
from shardline.cost.allocation import IDLE, allocate
from shardline.capacity.prices import PriceTable, load_prices
from shardline.errors import InvalidSetting

PRICES = PriceTable.model_validate({"currency": "USD", "classes": {
    "cpu": {"unit": "core", "on-demand": 0.05, "spot": 0.02},
    "h100": {"unit": "gpu", "on-demand": 7.0, "spot": 2.8},
}})
BUCKET = datetime(2026, 11, 3, 10, tzinfo=timezone.utc)


def row(kind: str, writer: str, hw: str = "h100", cap: str = "on-demand", tenant: str = "", model: str = "",
        **values: Any) -> dict[str, Any]:
    base = {"bucket_start": BUCKET, "writer": writer, "kind": kind, "tenant": tenant, "model": model, "version": "1",
            "tier": "online", "hardware_class": hw, "capacity_type": cap, "requests": 0, "rows": 0,
            "prompt_tokens": 0, "completion_tokens": 0, "device_seconds": 0.0, "units": 0.0, "reserved_seconds": 0.0}
    return {**base, **values}


def test_the_example_table_loads_and_a_mig_slice_costs_its_fraction_of_the_gpu() -> None:
    example = load_prices()
    assert example.per_unit_hour("h100", "on-demand") == 6.88
    three = next(p for p in H100_MIG if p.name == "3g.40gb")
    assert example.per_unit_hour("h100-mig-3g.40gb", "spot") == pytest.approx(2.75 * 3 / 7) == 2.75 * three.fraction
    assert example.per_unit_hour("h200-mig-1g.18gb", "on-demand") == pytest.approx(7.91 / 7)


def test_prices_it_cannot_give_say_which_class_and_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(InvalidSetting, match=r"hardware class 'a100', which the price table does not price \(it "
                                             r"prices \['cpu', 'h100'\]\); add it"):
        PRICES.per_unit_hour("a100", "on-demand")
    with pytest.raises(InvalidSetting, match="'h100' has no MIG profile '9g.99gb'"):
        PRICES.per_unit_hour("h100-mig-9g.99gb", "on-demand")
    bad = tmp_path / "prices.yaml"
    bad.write_text("classes:\n  cpu: {on-demand: -1}\n")
    with pytest.raises(InvalidSetting, match=r"prices.yaml' is wrong at classes.cpu.on-demand"):
        load_prices(bad)
    with pytest.raises(InvalidSetting, match="cannot read the price table"):
        load_prices(tmp_path / "missing.yaml")


def test_a_replica_is_priced_whole_and_split_by_device_seconds_with_idle_its_own_line() -> None:
    rows = [
        row("capacity", "gpu-1", units=1.0, reserved_seconds=3600.0),  # an H100 held for the hour
        row("usage", "gpu-1", tenant="acme", model="churn", device_seconds=900.0, requests=30, rows=300),
        row("usage", "gpu-1", tenant="globex", model="churn", device_seconds=300.0, requests=10, rows=100),
        row("capacity", "cpu-1", hw="cpu", cap="spot", units=4.0, reserved_seconds=1800.0),  # 4 spot cores, 30 min
        row("usage", "cpu-1", hw="cpu", cap="spot", tenant="acme", model="llm", device_seconds=5400.0,
            prompt_tokens=10, completion_tokens=20),  # concurrent streams: more device time than wall time
    ]
    allocation = allocate(rows, PRICES)
    cost = {(c.tenant, c.hardware_class): c.spend.cost for c in allocation.charges}
    assert cost[("acme", "h100")] == pytest.approx(7.0 * 900 / 3600)
    assert cost[("globex", "h100")] == pytest.approx(7.0 * 300 / 3600)
    assert cost[(IDLE, "h100")] == pytest.approx(7.0 * 2400 / 3600)  # the unused 40 minutes
    assert cost[("acme", "cpu")] == pytest.approx(4 * 0.02 / 2)  # capped at what it held: no idle, no more
    assert (IDLE, "cpu") not in cost
    assert allocation.priced_capacity == pytest.approx(7.0 + 0.04)
    assert sum(c.spend.cost for c in allocation.charges) == pytest.approx(allocation.priced_capacity)
    assert allocation.idle == pytest.approx(7.0 * 2400 / 3600)


def test_a_job_on_a_shared_cluster_pays_what_it_used() -> None:
    rows = [row("capacity", "batch-j1", hw="cpu", units=1.0, reserved_seconds=0.0),
            row("usage", "batch-j1", hw="cpu", tenant="acme", model="churn", device_seconds=7200.0, rows=10)]
    allocation = allocate(rows, PRICES)
    assert [(c.tenant, round(c.spend.cost, 6)) for c in allocation.charges] == [("acme", 0.1)]
    assert allocation.priced_capacity == pytest.approx(0.1)


def test_the_report_gives_unit_costs_per_tenant_model_and_tier_and_the_idle_apart() -> None:
    from shardline.cost.report import build_report, render_prometheus, render_text

    rows = [
        row("capacity", "gpu-1", units=1.0, reserved_seconds=3600.0),
        row("usage", "gpu-1", tenant="acme", model="churn", device_seconds=900.0, requests=30, rows=3000),
        row("usage", "gpu-1", tenant="globex", model="tiny", device_seconds=300.0, requests=10,
            prompt_tokens=40_000, completion_tokens=10_000),
    ]
    report = build_report(rows, PRICES, "2026-11")
    lines = {line.tenant: line for line in report.lines}
    assert lines["acme"].per_1k_rows == pytest.approx(1.75 / 3) and lines["acme"].per_1m_tokens is None
    assert lines["acme"].per_request == pytest.approx(1.75 / 30)
    assert lines["globex"].per_1m_tokens == pytest.approx(7.0 / 12 / 50_000 * 1e6)
    assert report.charged + report.idle_cost == pytest.approx(report.priced_capacity) == pytest.approx(7.0)
    text = render_text(report)
    assert "priced capacity: 7.00 USD" in text and "idle (carried by the platform): 4.67 USD" in text
    exposition = render_prometheus(report)
    assert 'shardline_cost{capacity_type="on-demand",currency="USD",hardware_class="h100",model="churn",' \
           'month="2026-11",tenant="acme",tier="online"} 1.75' in exposition
    only = build_report(rows, PRICES, "2026-11", tenant="globex")
    assert [line.tenant for line in only.lines] == ["globex"] and only.idle == {}
    brief = build_report([row("capacity", "gpu-1", units=1.0, reserved_seconds=3600.0),
                          row("usage", "gpu-1", tenant="acme", model="churn", device_seconds=11.0, rows=30)],
                         PRICES, "2026-11")
    (line,) = [t.split() for t in render_text(brief).splitlines() if t.startswith("acme")]
    assert "0.0031" in line  # 11 device-seconds, as the recommendations say them: the table showed 0.000


def test_a_line_on_two_hardware_classes_is_one_gauge_series_each_and_the_totals_hold() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from shardline.cost.report import build_report, render_prometheus, render_text

    rows = [  # acme's churn on an on-demand CPU replica and a spot one, and on an H100
        row("capacity", "cpu-1", hw="cpu", units=1.0, reserved_seconds=3600.0),
        row("usage", "cpu-1", hw="cpu", tenant="acme", model="churn", device_seconds=3600.0, rows=1_000),
        row("capacity", "cpu-2", hw="cpu", cap="spot", units=1.0, reserved_seconds=3600.0),
        row("usage", "cpu-2", hw="cpu", cap="spot", tenant="acme", model="churn", device_seconds=3600.0, rows=4_000),
        row("capacity", "gpu-1", units=1.0, reserved_seconds=360.0),
        row("usage", "gpu-1", tenant="acme", model="churn", device_seconds=360.0, rows=10_000),
    ]
    report = build_report(rows, PRICES, "2026-11")
    gauges = {family.name: {(s.labels["hardware_class"], s.labels["capacity_type"]): s.value for s in family.samples
                            if s.labels["tenant"] == "acme"}
              for family in text_string_to_metric_families(render_prometheus(report))}
    assert gauges["shardline_cost"] == {("cpu", "on-demand"): pytest.approx(0.05), ("cpu", "spot"): pytest.approx(0.02),
                                        ("h100", "on-demand"): pytest.approx(0.7)}
    assert sum(gauges["shardline_cost"].values()) == pytest.approx(report.charged) == pytest.approx(
        report.priced_capacity)
    assert gauges["shardline_cost_per_1k_rows"] == {  # each series' own rows
        ("cpu", "on-demand"): pytest.approx(0.05), ("cpu", "spot"): pytest.approx(0.005),
        ("h100", "on-demand"): pytest.approx(0.07)}
    # the text keeps one line per tenant, model and tier, naming the hardware it ran on
    (line,) = [t for t in render_text(report).splitlines() if t.startswith("acme")]
    assert "cpu, cpu (spot), h100" in line and "15,000" in line


def test_recommendations_name_idle_hardware_the_cheaper_class_and_spot_with_their_savings() -> None:
    from shardline.cost.recommend import recommend
    from shardline.cost.report import build_report, render_markdown, render_text

    rows = [
        # an H100 held for the hour and used 12 minutes by churn: 48 minutes idle
        row("capacity", "gpu-1", units=1.0, reserved_seconds=3600.0),
        row("usage", "gpu-1", tenant="acme", model="churn", device_seconds=720.0, requests=10, rows=1_000),
        # churn on 2 CPU cores as well, used all the hour: 1,000 rows for 0.1 USD against 1.4 on the GPU
        row("capacity", "cpu-1", hw="cpu", units=2.0, reserved_seconds=3600.0),
        row("usage", "cpu-1", hw="cpu", tenant="acme", model="churn", device_seconds=3600.0, requests=10, rows=1_000),
        # a batch job on an on-demand H100 that the table also prices on spot
        {**row("capacity", "batch-j1", units=1.0, reserved_seconds=1800.0), "tier": "batch"},
        {**row("usage", "batch-j1", tenant="globex", model="big", device_seconds=1800.0, rows=50), "tier": "batch"},
    ]
    allocation = allocate(rows, PRICES)
    found = {r.kind: r for r in recommend(allocation, PRICES)}
    assert set(found) == {"idle", "hardware", "spot"}
    assert found["idle"].saving == pytest.approx(7.0 * 2880 / 3600)
    assert "online h100 (on-demand) was idle for 80% of its 7.00 USD" in found["idle"].text
    assert found["hardware"].saving == pytest.approx(7.0 * 720 / 3600 - 0.1)  # 1.4 USD -> 0.1 USD for its rows
    assert "churn (online): 1,000 rows cost 1.40 USD on h100 and 0.1 USD on cpu" in found["hardware"].text
    assert found["spot"].saving == pytest.approx(3.5 - 1.4)  # half an hour at 7.0 against 2.8
    assert "its 0.5 device-hours on spot would cost 1.40 USD" in found["spot"].text
    brief = [{**row("capacity", "batch-j2", units=1.0, reserved_seconds=11.0), "tier": "batch"},
             {**row("usage", "batch-j2", tenant="globex", model="big", device_seconds=11.0, rows=5), "tier": "batch"}]
    (spot,) = recommend(allocate(brief, PRICES), PRICES)  # 11 s: said as it is, not "0.0 device-hours"
    assert "its 0.0031 device-hours on spot would cost 0.008556 USD" in spot.text
    assert [r.kind for r in recommend(allocation, PRICES)] == ["idle", "spot", "hardware"]  # largest saving first

    report = build_report(rows, PRICES, "2026-11")
    assert "recommendations (largest saving first):" in render_text(report)
    assert "## Recommendations" in render_markdown(report)
    assert build_report(rows, PRICES, "2026-11", tenant="acme").recommendations == []  # the platform's, not a tenant's
    quiet = [row("capacity", "gpu-1", units=1.0, reserved_seconds=3600.0),
             row("usage", "gpu-1", tenant="acme", model="churn", device_seconds=3500.0, rows=10)]
    assert recommend(allocate(quiet, PRICES), PRICES) == []  # busy, one class, online: nothing to say


def test_a_distilled_student_is_set_beside_its_teacher_per_1k_rows() -> None:
    from shardline.cost.report import build_report, render_html, render_markdown, render_text

    rows = [
        row("capacity", "cpu-1", hw="cpu", units=2.0, reserved_seconds=3600.0),  # 2 cores for the hour: 0.10
        row("usage", "cpu-1", hw="cpu", tenant="acme", model="mlp", device_seconds=4800.0, rows=40_000),
        row("usage", "cpu-1", hw="cpu", tenant="globex", model="mlp-lite", device_seconds=1800.0, rows=30_000),
        row("usage", "cpu-1", hw="cpu", tenant="acme", model="gbt-lite", device_seconds=600.0, rows=1_000),
    ]
    teachers = {"mlp-lite:1": "mlp:1", "gbt-lite:1": "gbt:3", "unused-lite:1": "mlp:1"}
    report = build_report(rows, PRICES, "2026-11", teachers=teachers)

    # the cores' 7,200 core-seconds are all used: mlp 4,800 of them for 40,000 rows, mlp-lite 1,800 for 30,000
    [gbt, mlp] = report.students  # by student name; a student with no rows is left out
    assert (mlp.student, mlp.teacher) == ("mlp-lite:1", "mlp:1")
    lines = {line.model: line for line in report.lines}
    assert mlp.per_1k_rows == pytest.approx(lines["mlp-lite"].per_1k_rows) == pytest.approx(0.10 * 1800 / 7200 / 30)
    assert mlp.teacher_per_1k_rows == pytest.approx(lines["mlp"].per_1k_rows) == pytest.approx(0.10 * 4800 / 7200 / 40)
    assert mlp.text("USD").endswith(": 0.50x the teacher's")
    assert gbt.teacher_per_1k_rows is None and gbt.text("USD").endswith("its teacher gbt:3 scored no rows this month")
    for rendered in (render_text(report), render_markdown(report), render_html(report)):
        assert "istilled students beside their teachers" in rendered and "mlp-lite:1" in rendered
    # one tenant's report: its own rows only (globex ran the student, acme the teacher)
    assert [s.teacher_per_1k_rows for s in build_report(rows, PRICES, "2026-11", "globex", teachers).students] == [None]
    assert "distilled" not in render_text(build_report(rows, PRICES, "2026-11"))
