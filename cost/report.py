"""The chargeback of a month: per tenant, model and tier, with unit costs, as text, HTML (with plots) and Prometheus.

``build_report`` prices a month of the metering ledger (``allocation.allocate``) and sums it per tenant, model and
tier: the cost, requests, rows, tokens and device-seconds, and from them the cost per 1,000 rows, per million
tokens and per request (each only where the line has that unit). Idle capacity is its own lines (per tier,
hardware class and capacity type). A distilled student (``shardline model distill``) is set beside its teacher:
each one's cost per 1,000 rows in the month (``students``; ``teachers_in`` reads who taught whom from the
registry's lineage). ``render_html`` draws with matplotlib (imported there; inline SVG, as the drift report): cost
per day by tenant, by tenant, and by hardware class.
"""

from __future__ import annotations

import html
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date
from typing import Any, Iterable, Mapping

from shardline.bundle import DISTILLATION_ROWS
from shardline.capacity.prices import PriceTable
from shardline.cost.allocation import IDLE, Allocation, Charge, Spend, allocate
from shardline.figures import amount, money
from shardline.cost.recommend import Recommendation, recommend
from shardline.storage.registry import ModelRegistry


def hardware_name(hardware_class: str, capacity_type: str) -> str:
    """A hardware class as the report's text names it: 'h100', or 'h100 (spot)' off on-demand capacity."""
    return hardware_class if capacity_type == "on-demand" else f"{hardware_class} ({capacity_type})"


@dataclass
class ReportLine:
    """What one tenant's use of one model in one tier cost in the month; ``by_hardware``: the same per hardware
    class and capacity type it ran on (their spends add up to ``spend``)."""

    tenant: str
    model: str
    tier: str
    spend: Spend = field(default_factory=Spend)
    by_hardware: dict[tuple[str, str], Spend] = field(default_factory=dict)

    @property
    def hardware(self) -> set[str]:
        """The hardware the line ran on, as the text names it ('cpu', 'cpu (spot)')."""
        return {hardware_name(hw, cap) for hw, cap in self.by_hardware}

    def per_hardware(self) -> list[tuple[str, str, "ReportLine"]]:
        """The line split by (hardware class, capacity type), each part a line of its own (its unit costs its
        own), in that order."""
        return [(hw, cap, ReportLine(self.tenant, self.model, self.tier, spend))
                for (hw, cap), spend in sorted(self.by_hardware.items())]

    @property
    def cost(self) -> float:
        """The line's cost."""
        return self.spend.cost

    @property
    def per_1k_rows(self) -> float | None:
        """Cost per 1,000 rows scored (None: no rows)."""
        return self.cost / self.spend.rows * 1_000 if self.spend.rows else None

    @property
    def per_1m_tokens(self) -> float | None:
        """Cost per million tokens, prompt and completion (None: no tokens)."""
        return self.cost / self.spend.tokens * 1_000_000 if self.spend.tokens else None

    @property
    def per_request(self) -> float | None:
        """Cost per request answered (None: no requests, as a batch job's)."""
        return self.cost / self.spend.requests if self.spend.requests else None


@dataclass(frozen=True)
class StudentCost:
    """A distilled student's cost per 1,000 rows in the month beside its teacher's (None: it scored none)."""

    student: str  # name:version
    teacher: str  # name:version
    per_1k_rows: float
    teacher_per_1k_rows: float | None

    def text(self, currency: str) -> str:
        """'mlp-student:1 0.0022 USD per 1k rows; its teacher mlp:1 0.0032 USD: 0.69x the teacher's'."""
        mine = f"{self.student} {money(self.per_1k_rows, currency)} per 1k rows"
        if self.teacher_per_1k_rows is None:
            return f"{mine}; its teacher {self.teacher} scored no rows this month"
        ratio = f": {self.per_1k_rows / self.teacher_per_1k_rows:.2f}x the teacher's" if self.teacher_per_1k_rows else ""
        return f"{mine}; its teacher {self.teacher} {money(self.teacher_per_1k_rows, currency)}{ratio}"


@dataclass
class CostReport:
    """A month's chargeback (see the module docstring); ``tenant`` set: that tenant's lines only."""

    month: str
    currency: str
    lines: list[ReportLine]
    idle: dict[tuple[str, str, str], float]  # (tier, hardware class, capacity type) -> cost
    per_day: dict[tuple[date, str], float]  # (day, tenant or IDLE) -> cost
    per_hardware: dict[tuple[str, str], float]  # (hardware class, capacity type) -> cost, idle included
    priced_capacity: float
    tenant: str | None = None
    recommendations: list[Recommendation] = field(default_factory=list)  # the whole month's (none for one tenant)
    students: list[StudentCost] = field(default_factory=list)  # distilled students that scored rows, by name

    @property
    def charged(self) -> float:
        """The tenants' charges (the lines' sum)."""
        return sum(line.cost for line in self.lines)

    @property
    def idle_cost(self) -> float:
        """The idle lines' sum."""
        return sum(self.idle.values())


def build_report(rows: Iterable[dict[str, Any]], prices: PriceTable, month: str, tenant: str | None = None,
                 teachers: Mapping[str, str] | None = None) -> CostReport:
    """The chargeback of ``rows`` (a month of the ledger, as ``LedgerStore.read`` gives them); ``teachers``
    (student name:version -> teacher name:version, ``teachers_in``) sets each student that scored rows beside
    its teacher.

    Raises:
        InvalidSetting: a hardware class the price table does not price.
    """
    allocation = allocate(rows, prices)
    report = summarize(allocation, month, tenant)
    if tenant is None:
        report.recommendations = recommend(allocation, prices)
    report.students = students_beside_teachers(allocation, teachers or {}, tenant)
    return report


def teachers_in(registry: ModelRegistry) -> dict[str, str]:
    """Every distilled student's teacher in ``registry``: student name:version -> teacher name:version (its
    lineage's parent, as ``shardline model distill`` records it)."""
    return {f"{m.name}:{m.version}": str(m.lineage.parent) for name in registry.list_models()
            for m in registry.list_versions(name) if m.lineage.parent and DISTILLATION_ROWS in m.lineage.metrics}


def students_beside_teachers(allocation: Allocation, teachers: Mapping[str, str],
                             tenant: str | None = None) -> list[StudentCost]:
    """Each student's cost per 1,000 rows (all its charges in the month, or ``tenant``'s) beside its teacher's."""
    cost: dict[str, float] = defaultdict(float)
    rows: dict[str, int] = defaultdict(int)
    for charge in allocation.charges:
        if charge.tenant != IDLE and (tenant is None or charge.tenant == tenant):
            cost[f"{charge.model}:{charge.version}"] += charge.spend.cost
            rows[f"{charge.model}:{charge.version}"] += charge.spend.rows

    def per_1k(model: str) -> float | None:
        return cost[model] / rows[model] * 1_000 if rows.get(model) else None

    found = []
    for student, teacher in sorted(teachers.items()):
        mine = per_1k(student)
        if mine is not None:
            found.append(StudentCost(student, teacher, mine, per_1k(teacher)))
    return found


def summarize(allocation: Allocation, month: str, tenant: str | None = None) -> CostReport:
    """Sum an allocation's charges per tenant, model and tier (``build_report``)."""
    lines: dict[tuple[str, str, str], ReportLine] = {}
    idle: dict[tuple[str, str, str], float] = defaultdict(float)
    per_day: dict[tuple[date, str], float] = defaultdict(float)
    per_hardware: dict[tuple[str, str], float] = defaultdict(float)
    for charge in allocation.charges:
        if tenant is not None and charge.tenant != tenant:
            continue
        per_day[(charge.day, charge.tenant)] += charge.spend.cost
        per_hardware[(charge.hardware_class, charge.capacity_type)] += charge.spend.cost
        if charge.tenant == IDLE:
            idle[(charge.tier, charge.hardware_class, charge.capacity_type)] += charge.spend.cost
            continue
        _add(lines, charge)
    ordered = sorted(lines.values(), key=lambda line: (-line.cost, line.tenant, line.model, line.tier))
    return CostReport(month, allocation.currency, ordered, dict(idle), dict(per_day), dict(per_hardware),
                      allocation.priced_capacity, tenant)


def _add(lines: dict[tuple[str, str, str], ReportLine], charge: Charge) -> None:
    key = (charge.tenant, charge.model, charge.tier)
    line = lines.get(key)
    if line is None:
        line = lines[key] = ReportLine(*key)
    line.spend.add(charge.spend)
    line.by_hardware.setdefault((charge.hardware_class, charge.capacity_type), Spend()).add(charge.spend)


HEADER = ("tenant", "model", "tier", "hardware", "cost", "requests", "rows", "tokens", "device-h", "per 1k rows",
          "per 1M tokens", "per request")


def _cells(line: ReportLine, currency: str) -> tuple[str, ...]:
    use = line.spend
    return (line.tenant, line.model, line.tier, ", ".join(sorted(line.hardware)), money(use.cost, currency),
            f"{use.requests:,}", f"{use.rows:,}", f"{use.tokens:,}", amount(use.device_seconds / 3600),
            money(line.per_1k_rows, currency), money(line.per_1m_tokens, currency),
            money(line.per_request, currency))


def _summary(report: CostReport) -> list[str]:
    c = report.currency
    if report.tenant is not None:
        return [f"charged to {report.tenant}: {money(report.charged, c)}"]
    return [f"priced capacity: {money(report.priced_capacity, c)}",
            f"charged to tenants: {money(report.charged, c)}",
            f"idle (carried by the platform): {money(report.idle_cost, c)}"]


def _advice(report: CostReport) -> list[str]:
    if not report.recommendations:
        return []
    return ["recommendations (largest saving first):", *(f"- {r.text}" for r in report.recommendations)]


STUDENTS_TITLE = "distilled students beside their teachers"


def _students(report: CostReport) -> list[str]:
    return [s.text(report.currency) for s in report.students]


def render_text(report: CostReport) -> str:
    """The report as aligned text for a terminal."""
    rows = [HEADER, *(_cells(line, report.currency) for line in report.lines)]
    rows += [("(idle)", "", tier, hardware_name(hw, cap), money(cost, report.currency),
              *[""] * 7) for (tier, hw, cap), cost in sorted(report.idle.items())]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    text = [f"cost report {report.month}" + (f", tenant {report.tenant}" if report.tenant else "")]
    text += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    students = [f"{STUDENTS_TITLE}:", *(f"- {s}" for s in _students(report))] if report.students else []
    return "\n".join([*text, *_summary(report), *students, *_advice(report)]) + "\n"


def render_markdown(report: CostReport) -> str:
    """The report as a Markdown table (a Prefect artifact)."""
    rows = [_cells(line, report.currency) for line in report.lines]
    rows += [("(idle)", "", tier, hardware_name(hw, cap), money(cost, report.currency),
              *[""] * 7) for (tier, hw, cap), cost in sorted(report.idle.items())]
    text = [f"# Cost report {report.month}" + (f", tenant {report.tenant}" if report.tenant else ""), "",
            "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    text += ["| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |" for r in rows]
    advice = ["", "## Recommendations", "", *(f"- {r.text}" for r in report.recommendations)] if report.recommendations \
        else []
    students = ["", f"## {STUDENTS_TITLE.capitalize()}", "", *(f"- {s}" for s in _students(report))] \
        if report.students else []
    return "\n".join([*text, "", *(f"- {line}" for line in _summary(report)), *students, *advice]) + "\n"


def render_prometheus(report: CostReport) -> str:
    """The month's costs as Prometheus gauges (text exposition, for node_exporter's textfile collector or a
    Pushgateway): ``shardline_cost`` per tenant, model, tier, hardware class and capacity type (one series each:
    a line that ran on two is two series; tenant "(idle)" for idle), and ``shardline_cost_per_1k_rows``,
    ``_per_1m_tokens``, ``_per_request`` of each series where it has that unit."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    labels = ["month", "tenant", "model", "tier", "hardware_class", "capacity_type", "currency"]
    cost = Gauge("shardline_cost", "What the month's use cost, per tenant, model and tier (idle: its own tenant).",
                 labels, registry=registry)
    units = {name: Gauge(f"shardline_cost_{name}", f"The month's cost {name.replace('_', ' ')}.", labels,
                         registry=registry) for name in ("per_1k_rows", "per_1m_tokens", "per_request")}
    for whole in report.lines:
        for hw, cap, line in whole.per_hardware():
            values = [report.month, line.tenant, line.model, line.tier, hw, cap, report.currency]
            cost.labels(*values).set(line.cost)
            for name, gauge in units.items():
                figure = getattr(line, name)
                if figure is not None:
                    gauge.labels(*values).set(figure)
    for (tier, hw, cap), value in report.idle.items():
        cost.labels(report.month, IDLE, "", tier, hw, cap, report.currency).set(value)
    return generate_latest(registry).decode()


_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1200px;color:#222}
h1{font-size:1.5em} h2{font-size:1.2em;margin-top:1.6em} .muted{color:#666}
table{border-collapse:collapse;width:100%;font-size:.85em}th,td{padding:.3em .5em;border-bottom:1px solid #ddd;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums} tr.idle td{background:#f4f4f4;color:#555}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(520px,100%),1fr));gap:1em}
figure{margin:0;min-width:0} figure svg{display:block;max-width:100%;height:auto}
"""


def _plots(report: CostReport) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from shardline.figures import inline_svg

    plots = []
    days = sorted({day for day, _ in report.per_day})
    who = sorted({tenant for _, tenant in report.per_day}, key=lambda t: (t == IDLE, t))
    figure, ax = plt.subplots(figsize=(8, 3))
    bottom = [0.0] * len(days)
    for tenant in who:
        values = [report.per_day.get((day, tenant), 0.0) for day in days]
        ax.bar([d.isoformat() for d in days], values, bottom=bottom, label=tenant,
               color="#bbbbbb" if tenant == IDLE else None)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel(report.currency, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.tick_params(axis="x", rotation=45)
    ax.legend(fontsize=7)
    plots.append(("Cost per day, by tenant", inline_svg(figure)))
    by_tenant: dict[str, float] = defaultdict(float)
    for line in report.lines:
        by_tenant[line.tenant] += line.cost
    if report.idle:
        by_tenant[IDLE] = report.idle_cost
    by_hardware = {hardware_name(hw, cap): v for (hw, cap), v in report.per_hardware.items()}
    for title, shares in (("Cost by tenant", dict(by_tenant)), ("Cost by hardware class (idle included)", by_hardware)):
        figure, ax = plt.subplots(figsize=(6, 2.8))
        names = sorted(shares, key=lambda n: -shares[n])
        ax.barh(names, [shares[n] for n in names], color=["#bbbbbb" if n == IDLE else "#4C72B0" for n in names])
        ax.invert_yaxis()
        ax.set_xlabel(report.currency, fontsize=8)
        ax.tick_params(labelsize=7)
        plots.append((title, inline_svg(figure)))
    return plots


def render_html(report: CostReport) -> str:
    """The report as one self-contained HTML page: the summary, the plots, the chargeback table."""
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in HEADER)
    body = []
    for line in report.lines:
        cells = _cells(line, report.currency)
        body.append("<tr>" + "".join(f"<td class='num'>{e(c)}</td>" if i >= 4 else f"<td>{e(c)}</td>"
                                     for i, c in enumerate(cells)) + "</tr>")
    for (tier, hw, cap), cost in sorted(report.idle.items()):
        body.append(f"<tr class='idle'><td>(idle)</td><td></td><td>{e(tier)}</td><td>{e(hardware_name(hw, cap))}</td>"
                    f"<td class='num'>{e(money(cost, report.currency))}</td>" + "<td></td>" * 7 + "</tr>")
    figures = "".join(f"<figure><figcaption>{e(title)}</figcaption>{svg}</figure>" for title, svg in _plots(report))
    title = f"Cost report {report.month}" + (f", tenant {report.tenant}" if report.tenant else "")
    summary = "".join(f"<li>{e(s)}</li>" for s in _summary(report))
    advice = ("<h2>Recommendations</h2><ul>" + "".join(f"<li>{e(r.text)}</li>" for r in report.recommendations)
              + "</ul>") if report.recommendations else ""
    advice = (f"<h2>{e(STUDENTS_TITLE.capitalize())}</h2><ul>" + "".join(f"<li>{e(s)}</li>" for s in _students(report))
              + "</ul>" if report.students else "") + advice
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>{_STYLE}</style>"
            f"</head><body><h1>{e(title)}</h1><ul>{summary}</ul>"
            "<p class='muted'>Each replica or worker is priced at the larger of what it held and what it used; the "
            "used part is split across tenants by their device-seconds, the rest is idle, carried by the "
            "platform.</p>"
            f"<div class='plots'>{figures}</div><h2>Chargeback</h2><table><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>{advice}</body></html>")
