"""The HTML report: content checks, the CLI entry, and a headless-Chromium render check."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from plotly.offline import get_plotlyjs
from run_fixtures import synthetic_run, write_sweep, write_synthetic

from kvbench import metrics, report, results

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
)
# Prepended to a copy of the page: console.error/warn and uncaught errors become
# "KVBENCH-CONSOLE-<level>" lines on Chromium's stderr (it logs every console call as INFO).
CONSOLE_HOOK = """<script>
(function () {
  for (const level of ["error", "warn"]) {
    const original = console[level].bind(console);
    console[level] = (...args) => original("KVBENCH-CONSOLE-" + level.toUpperCase() + ": " + args.join(" "));
  }
  window.addEventListener("error", (e) => console.log("KVBENCH-CONSOLE-ERROR: " + e.message));
})();
</script>"""


@pytest.fixture(scope="module")
def sweep_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    sweep_dir = write_sweep(root, "block_size_demo")
    out = report.build_report(sweep_dir, root / "out" / "report.html")
    return sweep_dir, out, out.read_text()


def plot_ids(page: str) -> list[str]:
    return re.findall(r'<div id="(fig-\d+)" class="plotly-graph-div"', page)


def test_report_is_self_contained(sweep_report):
    _, _, page = sweep_report
    assert page.count(get_plotlyjs()) == 1  # plotly.js embedded exactly once
    assert "<script src=" not in page and "cdn.plot.ly/plotly" not in page.replace(get_plotlyjs(), "")


def test_report_content(sweep_report):
    _, _, page = sweep_report
    for title in (
        "Throughput and time per output token",
        "Latency distributions",
        "KV memory over time",
        "Where the KV memory goes",
        "Concurrency reached",
        "Prefix cache",
        "Memory saved by sharing",
        "Decode efficiency",
        "Quality against memory",
        "Process memory samples",
    ):
        assert title in page
    assert len(plot_ids(page)) == 10
    assert "out of KV blocks" in page and 'class="failed"' in page  # the failed run and its error
    assert "engine=paged block_size=8" in page  # labels name what varied
    assert 'class="nan" title="the run failed"' in page  # empty cells say why
    assert "git_revision" in page and "abc" in page  # environment
    assert "<summary>run0</summary>" in page  # per-run config
    assert "kv_token_fraction_mean" in page  # metric definitions


def test_plots_without_data_are_left_out(tmp_path):
    run_dir = write_synthetic(tmp_path / "r", "r", "paged", 16)
    page = report.build_report(run_dir, tmp_path / "one.html").read_text()
    assert "Prefix cache" in page  # lookups happened (0 % hits) so the plot is kept
    assert "Memory saved by sharing" not in page  # one sample per request: nothing shared
    assert "Quality against memory" not in page
    assert "nothing (one configuration)" in page


def test_report_main_default_path_and_errors(tmp_path, monkeypatch, capsys):
    sweep_dir = write_sweep(tmp_path / "results", "my_sweep", failed=False)
    monkeypatch.chdir(tmp_path)
    assert report.report_main([str(sweep_dir)]) == 0
    assert (tmp_path / "reports" / "my_sweep.html").is_file()
    assert report.report_main([str(sweep_dir), "--out", "x/y.html"]) == 0
    assert (tmp_path / "x" / "y.html").is_file()
    assert report.report_main([str(tmp_path / "nothing")]) == 2
    assert "no kvbench runs found" in capsys.readouterr().err


# --------------------------------------------------------------------------- Chromium
def find_chromium() -> str:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("CI is set but no Chromium binary was found (apt-get install -y chromium)")
    pytest.skip("no Chromium binary (apt-get install -y chromium) and CI is not set")


def run_chromium(binary: str, page: Path, tmp_path: Path, *mode: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    command = [
        binary,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        "--virtual-time-budget=20000",
        *mode,
        page.as_uri(),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)


def render(binary: str, page_path: Path, tmp_path: Path) -> tuple[str, list[str]]:
    """(DOM after scripts ran, console error lines) for a copy of the page with CONSOLE_HOOK."""
    hooked = tmp_path / f"hooked-{page_path.name}"
    hooked.write_text(page_path.read_text().replace("<head>", "<head>" + CONSOLE_HOOK, 1))
    done = run_chromium(binary, hooked, tmp_path, "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    errors = [
        line
        for line in done.stderr.splitlines()
        if "KVBENCH-CONSOLE-" in line or "Uncaught" in line or "ERROR:CONSOLE" in line
    ]
    return done.stdout, errors


def unrendered_plots(dom: str, ids: list[str]) -> list[str]:
    """Plot divs whose subtree has no plotly ``main-svg`` (each fig div is followed by the next)."""
    missing = []
    positions = [dom.find(f'id="{i}"') for i in ids] + [len(dom)]
    for i, (start, end) in enumerate(zip(positions[:-1], positions[1:])):
        if start < 0 or 'class="main-svg"' not in dom[start:end]:
            missing.append(ids[i])
    return missing


def test_render_check_catches_broken_pages(tmp_path):
    binary = find_chromium()
    broken = tmp_path / "broken.html"
    broken.write_text(
        '<!DOCTYPE html><html><head></head><body><div id="fig-0" class="plotly-graph-div"></div>'
        "<script>console.error('bad data'); notDefined();</script></body></html>"
    )
    dom, errors = render(binary, broken, tmp_path)
    assert unrendered_plots(dom, ["fig-0"]) == ["fig-0"]
    assert any("bad data" in line for line in errors)
    assert any("notDefined" in line for line in errors)


def test_report_renders_in_chromium(sweep_report, tmp_path):
    binary = find_chromium()
    _, page_path, page = sweep_report
    ids = plot_ids(page)
    dom, errors = render(binary, page_path, tmp_path)
    assert errors == []
    assert ids and unrendered_plots(dom, ids) == []
    screenshot = tmp_path / "report.png"
    shot = run_chromium(binary, page_path, tmp_path, f"--screenshot={screenshot}", "--window-size=1400,2400")
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert screenshot.stat().st_size > 20_000  # a blank page is a few KB


def test_first_admission_hit_rate_shown_next_to_the_reuse_bound(tmp_path):
    sweep_dir = tmp_path / "bound"
    for i, bound in enumerate((0.5, 0.75)):
        requests, steps, memory, meta = synthetic_run(f"b{i}", "paged", 16, seed=i, prefix_hit_fraction=0.25)
        summary = metrics.summarize_run(requests, steps, meta, memory)
        # What summarize_run gives when handed the replayed requests' prompts.
        values = {**summary.metrics, "prefix_reuse_upper_bound": bound}
        missing = {k: v for k, v in summary.missing.items() if k != "prefix_reuse_upper_bound"}
        results.write_run(sweep_dir / f"b{i}", requests, steps, memory, meta, "x: 1\n", values, missing)
    page = report.build_report(sweep_dir, tmp_path / "bound.html").read_text()
    header = re.search(r"<tr>(<th>.*?)</tr>", page).group(1)
    columns = re.findall(r"<th>([^<]+)</th>", header)
    first = columns.index("prefix_hit_rate_first_admission")
    assert columns[first - 1 : first + 2] == [
        "prefix_hit_rate",
        "prefix_hit_rate_first_admission",
        "prefix_reuse_upper_bound",
    ]
    assert '<td class="num">0.75</td>' in page
    for _column, legend in report.PREFIX_RATES:  # the three rates drawn side by side, named
        assert legend in page
