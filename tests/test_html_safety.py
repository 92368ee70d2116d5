"""Hostile text in results never runs as script in a kvbench page, and still shows as text.

Issue 17 item 2: ``compare.write_html`` wrote metric names unescaped, so a run.json summary
key ``quality_<img src=x onerror=alert(9)>`` ran script when the compare page opened. Here
every string that reaches a page -- metric names, run ids, config values (which become run
labels, legend names and category ticks in plotly), missing-value reasons, errors, the
environment, config.yaml and directory names -- carries a payload that would set
``document.title`` to "XSS", and both pages are opened in headless Chromium.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from chromium_render import find_chromium, render, unrendered_plots
from run_fixtures import synthetic_run

from kvbench import compare, metrics, report, results
from kvbench.html_page import (
    GENERATOR_META,
    MARKER_SEARCH_BYTES,
    PageOutputError,
    escape,
    is_kvbench_page,
    write_page,
)

# Each payload would set the title to "XSS" if it ran; the string "XSS" itself never
# appears in any payload, so finding it in the rendered page means script ran.
IMG = "<img src=x onerror=document.title='X'+'SS'>"
SCRIPT = "<script>document.title='X'+'SS'</script>"
SVG = "<svg onload=document.title='X'+'SS'>"
ATTRIBUTE = "\"'><img src=x onerror=document.title='X'+'SS'>"
LINK = '<a href="https://example.invalid/">click</a><b>bold</b>'
METRIC = f"quality_{IMG}"


class Elements(HTMLParser):
    """Every element's (tag, attributes) and the text of every script in a DOM dump."""

    def __init__(self, dom: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str | None]]] = []
        self.scripts: list[str] = []
        self._in_script = False
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts.append(data)


def write_hostile_sweep(sweep_dir: Path, tpot_s: float) -> Path:
    """Two ok runs whose engines differ (so labels carry the payloads) and one failed run."""
    for i, engine in enumerate((f"paged{SVG}", f"slab{LINK}")):
        requests, steps, memory, meta = synthetic_run(SCRIPT + str(i), engine, 16, seed=i, tpot_s=tpot_s)
        meta["workload"] = ATTRIBUTE
        meta["model"] = {**meta["model"], "name": IMG}
        meta["environment"] = {**meta["environment"], "git_revision": SCRIPT}
        summary = metrics.summarize_run(requests, steps, meta, memory)
        values = {**summary.metrics, METRIC: 0.5 + 0.1 * i, f"quality_{LINK}": 0.25}
        missing = {**summary.missing, "goodput_requests_per_s": ATTRIBUTE}
        results.write_run(sweep_dir / f"run{i}{IMG}", requests, steps, memory, meta, SCRIPT, values, missing)
    failed = synthetic_run(f"failed{SCRIPT}", f"h2o{SVG}", 16)[3]
    results.write_failed_run(sweep_dir / f"failed{IMG}", failed, f"RuntimeError: {SCRIPT}", SCRIPT)
    return sweep_dir


@pytest.fixture(scope="module")
def hostile_pages(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hostile")
    base = write_hostile_sweep(root / "results" / f"base{IMG}", tpot_s=0.02)
    cand = write_hostile_sweep(root / "results" / f"cand{SVG}", tpot_s=0.03)
    report_page = report.build_report(base, root / "reports" / f"{report.report_name(base)}.html")
    result = compare.compare(base, cand, ["tpot_ms_p99:+10%"])
    assert not result.passed  # failure messages carry the labels onto the page too
    compare_page = compare.write_html(
        result, root / "reports" / f"compare-{cand.name}.html", str(base), str(cand)
    )
    return report_page, compare_page


def test_escape_is_one_path_for_text_attributes_and_plot_labels():
    assert escape(IMG) == "&lt;img src=x onerror=document.title=&#39;X&#39;+&#39;SS&#39;&gt;"
    assert escape('a "b" & c') == "a &#34;b&#34; &amp; c"  # numeric quotes: plotly decodes those
    assert escape(16) == "16"


def test_hostile_text_never_appears_raw_in_the_pages(hostile_pages):
    for page_path in hostile_pages:
        page = page_path.read_text()
        for payload in (IMG, SCRIPT, SVG, ATTRIBUTE, LINK):
            assert payload not in page, (page_path.name, payload)
        # Inside the plotly JSON, "<" is \u003c-escaped by plotly, and the labels are escaped
        # text before that: plotly draws them literally instead of as markup.
        assert "\\u003cscript" not in page and "\\u003csvg" not in page


@pytest.mark.parametrize("which", ["report", "compare"])
def test_hostile_text_runs_no_script_and_shows_as_text_in_chromium(which, hostile_pages, tmp_path):
    binary = find_chromium()
    page_path = hostile_pages[0] if which == "report" else hostile_pages[1]
    dom, errors = render(binary, page_path, tmp_path)
    assert "XSS" not in dom, "a payload ran"
    title = re.search(r"<title>(.*?)</title>", dom).group(1)
    assert title.startswith(f"kvbench {which}: ")
    parsed = Elements(dom)
    # No payload became an element: no inline handler, no link to the payload's site, no script.
    assert [(t, a) for t, a in parsed.elements if any(name.startswith("on") for name in a)] == []
    links = [
        (t, a) for t, a in parsed.elements if "example.invalid" in str(a.get("href", a.get("xlink:href")))
    ]
    assert links == []
    assert not any(tag in ("img", "svg") and "src" in a for tag, a in parsed.elements)
    assert not any("document.title='X'" in text for text in parsed.scripts)
    assert errors == []
    # The hostile text is on the page as text (a DOM dump writes text "<" as "&lt;").
    assert "&lt;img src=x onerror=document.title='X'+'SS'&gt;" in dom
    if which == "report":
        ids = re.findall(r'<div id="(fig-\d+)" class="plotly-graph-div"', page_path.read_text())
        assert ids and unrendered_plots(dom, ids) == []
        # Plotly drew the labels literally: a legend entry and a subplot title carry the payloads.
        legend = re.findall(r'class="legendtext"[^>]*>([^<]*)</text>', dom)
        assert any("paged&lt;svg onload=document.title='X'+'SS'&gt;" in text for text in legend), legend
        assert any("slab&lt;a href=" in text and "&lt;b&gt;bold&lt;/b&gt;" in text for text in legend), legend
        assert "quality_&lt;img src=x onerror=document.title='X'+'SS'&gt;</text>" in dom.replace(
            "</tspan>", ""
        )
    else:
        assert "<code>quality_&lt;img src=x onerror=document.title='X'+'SS'&gt;</code>" in dom
        assert "REGRESSION" in dom


def test_only_a_marker_near_the_top_makes_a_file_kvbench_s(tmp_path):
    page = f"<!DOCTYPE html><html><head>{GENERATOR_META}</head><body>ours</body></html>"
    ours = write_page(tmp_path / "ours.html", page)
    assert is_kvbench_page(ours)
    quoting = tmp_path / "notes.html"  # a user's page that quotes the tag far down
    quoting.write_text("<html>" + "x" * MARKER_SEARCH_BYTES + GENERATOR_META + "</html>")
    assert not is_kvbench_page(quoting)
    with pytest.raises(PageOutputError, match="refusing to overwrite a file kvbench did not write"):
        write_page(quoting, page)
    assert quoting.read_text().startswith("<html>xxx")
    with pytest.raises(ValueError, match="generator tag"):
        write_page(tmp_path / "unmarked.html", "<html>no tag</html>")  # kvbench never writes one
    legacy = tmp_path / "compare-old.html"  # a compare page from before the tag existed
    legacy.write_text(
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>kvbench compare: PASS'
    )
    assert write_page(legacy, page).read_text() == page
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compare-old.html", "notes.html", "ours.html"]
