"""Measure a report's layout in headless Chromium: bounding boxes of plot titles, legends
and plotting areas, the summary table's position, and the run labels.

A copy of the page gets ``MEASURE_SCRIPT``: once plotly has drawn (window load plus a
delay, which ``--virtual-time-budget`` lets run), it writes its measurements as JSON into
a ``<pre id="kvbench-layout">`` element, which ``--dump-dom`` hands back.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from pathlib import Path

from chromium_render import run_chromium

WINDOW_WIDTH_PX = 1400
WINDOW_HEIGHT_PX = 900  # the first screen of a laptop-sized window

MEASURE_SCRIPT = """<script>
window.addEventListener("load", () => setTimeout(() => {
  const box = (el) => { const r = el.getBoundingClientRect();
    return {left: r.left, top: r.top + window.scrollY, right: r.right, bottom: r.bottom + window.scrollY}; };
  const plots = [...document.querySelectorAll(".plotly-graph-div")].map((div) => ({
    id: div.id,
    titles: [...div.querySelectorAll(".annotation-text, .gtitle")]
      .filter((t) => t.textContent.trim()).map((t) => ({text: t.textContent, box: box(t)})),
    legends: [...div.querySelectorAll("g.legend")].map(box),
    legend_entries: div.querySelectorAll("g.legend g.traces").length,
    areas: [...div.querySelectorAll(".draglayer .nsewdrag")].map(box),
    ticks: [...div.querySelectorAll(".xtick text, .ytick text")].map(box),
  }));
  const summary = document.querySelector("#summary + div table");
  const out = document.createElement("pre");
  out.id = "kvbench-layout";
  out.textContent = JSON.stringify({
    plots: plots,
    summary_table: summary ? box(summary) : null,
    labels: [...(summary ? summary.querySelectorAll("td.label") : [])].map((td) => td.textContent),
    page_width: document.documentElement.scrollWidth,
  });
  document.body.appendChild(out);
}, 500));
</script>"""


@dataclass(frozen=True)
class Box:
    left: float
    top: float
    right: float
    bottom: float

    def overlaps(self, other: Box, margin_px: float = 0.5) -> bool:
        """True when the two boxes share an area (touching edges, within ``margin_px``, do not count)."""
        return (
            min(self.right, other.right) - max(self.left, other.left) > margin_px
            and min(self.bottom, other.bottom) - max(self.top, other.top) > margin_px
        )


@dataclass(frozen=True)
class PlotLayout:
    plot_id: str
    titles: tuple[tuple[str, Box], ...]
    legends: tuple[Box, ...]
    num_legend_entries: int
    areas: tuple[Box, ...]  # one plotting area per subplot


@dataclass(frozen=True)
class PageLayout:
    plots: tuple[PlotLayout, ...]
    summary_table: Box | None
    labels: tuple[str, ...]
    page_width_px: float


def measure(binary: str, page_path: Path, tmp_path: Path) -> PageLayout:
    """The layout of ``page_path`` at WINDOW_WIDTH_PX x WINDOW_HEIGHT_PX in Chromium."""
    hooked = tmp_path / f"measured-{page_path.name}"
    hooked.write_text(page_path.read_text().replace("</body>", MEASURE_SCRIPT + "</body>", 1))
    done = run_chromium(
        binary, hooked, tmp_path, "--dump-dom", f"--window-size={WINDOW_WIDTH_PX},{WINDOW_HEIGHT_PX}"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r'<pre id="kvbench-layout">(.*?)</pre>', done.stdout, re.S)
    assert found, "the measuring script did not run"
    data = json.loads(html.unescape(found.group(1)))
    plots = tuple(
        PlotLayout(
            plot["id"],
            tuple((t["text"], Box(**t["box"])) for t in plot["titles"]),
            tuple(Box(**b) for b in plot["legends"]),
            plot["legend_entries"],
            tuple(Box(**b) for b in plot["areas"]),
        )
        for plot in data["plots"]
    )
    table = Box(**data["summary_table"]) if data["summary_table"] else None
    return PageLayout(plots, table, tuple(data["labels"]), data["page_width"])


def screenshot(binary: str, page_path: Path, tmp_path: Path, out: Path, height_px: int) -> Path:
    """A PNG of the page at WINDOW_WIDTH_PX wide and ``height_px`` tall."""
    shot = run_chromium(
        binary, page_path, tmp_path, f"--screenshot={out}", f"--window-size={WINDOW_WIDTH_PX},{height_px}"
    )
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return out
