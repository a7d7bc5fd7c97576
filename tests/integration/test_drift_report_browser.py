"""The drift report in a real browser: headless chromium lays the page out and every plot fits its cell.

Skipped where no chromium is installed (Debian: `apt-get install chromium`); the same facts,
read from the HTML and SVG without a browser, are tests/unit/test_drift_report_layout.py.
A copy of the report gets a small script that measures each plot against its figure and
writes the numbers into the page, which `--dump-dom` prints; the report itself holds no script.
A screenshot of the page is left beside it (`report.png` in the test's folder) to look at.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import pytest

from shardline.build.examples import breast_cancer, shard_table, shifted_table, with_site
from shardline.quality.drift import drift_report
from shardline.quality.profile import profile_table
from shardline.quality.report import render_html

BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no chromium on this machine (apt-get install chromium)")

MEASURE = """<script>
addEventListener('load', () => {
  const cells = [...document.querySelectorAll('figure')].map(f => {
    const s = f.querySelector('svg').getBoundingClientRect(), c = f.getBoundingClientRect();
    return {column: f.dataset.column || f.className, svg_left: s.left, svg_right: s.right,
            cell_left: c.left, cell_right: c.right, svg_height: s.height};
  });
  const out = document.createElement('pre'); out.id = 'layout';
  out.textContent = JSON.stringify({page_width: document.documentElement.scrollWidth,
                                    window_width: innerWidth, cells});
  document.body.appendChild(out);
});
</script>"""
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1280,2000"]


def _chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    assert BROWSER is not None
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([BROWSER, *FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout)


def test_every_plot_fits_its_cell_in_chromium(tmp_path: Path) -> None:
    reference = profile_table(with_site(shard_table(breast_cancer(), 2_000, 0, 1), seed=2))
    shifted = with_site(shard_table(breast_cancer(), 2_000, 0, 8), seed=9, sites=("north", "south", "mars"))
    until = datetime(2027, 3, 4, 5, 0, tzinfo=timezone.utc)
    report = drift_report(reference, shifted_table(shifted, scale={"mean radius": 1.5}, seed=3),
                          model="breast-cancer:1", until=until)
    page = render_html(report, reference, history=[report])
    (tmp_path / "report.html").write_text(page, encoding="utf-8")
    measured = tmp_path / "measured.html"
    measured.write_text(page.replace("</body>", MEASURE + "</body>"), encoding="utf-8")

    dumped = _chromium("--dump-dom", measured.as_uri())
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    match = re.search(r'<pre id="layout">(.*?)</pre>', dumped.stdout, re.S)
    assert match, dumped.stdout[-2000:]
    layout = json.loads(match.group(1).replace("&quot;", '"').replace("&amp;", "&"))

    assert layout["page_width"] <= layout["window_width"]  # nothing scrolls sideways
    cells = layout["cells"]
    assert len(cells) >= 4
    for cell in cells:  # each plot inside its own figure, with a height that followed its width
        assert cell["svg_left"] >= cell["cell_left"] - 0.5 and cell["svg_right"] <= cell["cell_right"] + 0.5, cell
        assert cell["svg_height"] > 50, cell
    # two columns of plots side by side, none overlapping the next
    lefts = sorted({round(c["cell_left"]) for c in cells if c["column"] != "trend"})
    assert len(lefts) == 2

    shot = _chromium(f"--screenshot={tmp_path / 'report.png'}", (tmp_path / "report.html").as_uri())
    assert shot.returncode == 0 and (tmp_path / "report.png").stat().st_size > 10_000, shot.stderr[-2000:]
