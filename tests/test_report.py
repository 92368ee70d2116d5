"""The HTML report: content checks, the CLI entry, and a headless-Chromium render check."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from chromium_render import find_chromium, render, run_chromium, unrendered_plots
from plotly.offline import get_plotlyjs
from run_fixtures import config_yaml, run_kvbench, synthetic_run, write_sweep, write_synthetic
from server_fixtures import scraped_run, write_scraped_run

from kvbench import metrics, report, results
from kvbench.html_page import GENERATOR_META, PageOutputError, is_kvbench_page


@pytest.fixture(scope="module")
def sweep_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    sweep_dir = write_sweep(root, "block_size_demo")
    out = report.build_report(sweep_dir, root / "out" / "report.html")
    return sweep_dir, out, out.read_text()


def plot_ids(page: str) -> list[str]:
    return re.findall(r'<div id="(fig-\d+)" class="plotly-graph-div"', page)


def full_table_columns(page: str) -> list[str]:
    """The catalogue names heading the full summary table (under "All summary metrics")."""
    table = page[page.index("All summary metrics") :]
    header = re.search(r"<tr>(<th.*?)</tr>", table).group(1)
    return [name.split(" (")[0] for name in re.findall(r"<th[^>]*>([^<]+)</th>", header)]


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
    columns = full_table_columns(page)
    first = columns.index("prefix_hit_rate_first_admission")
    assert columns[first - 1 : first + 2] == [
        "prefix_hit_rate",
        "prefix_hit_rate_first_admission",
        "prefix_reuse_upper_bound",
    ]
    assert '<td class="num">0.750</td>' in page  # fractions with three decimals
    for _column, legend in report.PREFIX_RATES:  # the three rates drawn side by side, named
        assert legend in page


# --------------------------------------------------------------------------- issue 17: output safety
def test_report_of_a_copied_run_directory_is_named_after_that_directory(tmp_path, monkeypatch):
    # Issue 17 item 8: the output used to be named after the sweep name stored in run.json,
    # so reporting a copy of one run overwrote the whole sweep's report.
    sweep_dir = write_sweep(tmp_path / "results", "gqa", failed=False)
    monkeypatch.chdir(tmp_path)
    assert report.report_main([str(sweep_dir)]) == 0
    sweep_page = tmp_path / "reports" / "gqa.html"
    before = sweep_page.read_bytes()
    copy = tmp_path / "results" / "mine"
    shutil.copytree(sweep_dir / "run1", copy)  # its run.json still says sweep_name "gqa"
    assert report.report_main([str(copy)]) == 0
    assert sweep_page.read_bytes() == before
    page = (tmp_path / "reports" / "mine.html").read_text()
    assert "<title>kvbench report: mine</title>" in page and "run1" in page
    assert report.report_main(["results/mine/."]) == 0  # the resolved name, not "."
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == ["gqa.html", "mine.html"]


@pytest.mark.parametrize("kind", ["file", "directory", "symlink"])
def test_report_never_overwrites_what_kvbench_did_not_write(kind, tmp_path, monkeypatch, capsys):
    sweep_dir = write_sweep(tmp_path / "results", "thesis", failed=False)
    monkeypatch.chdir(tmp_path)
    planted = tmp_path / "reports" / "thesis.html"
    planted.parent.mkdir()
    notes = tmp_path / "notes.html"
    notes.write_text("<html>my own notes</html>")
    if kind == "file":
        planted.write_text("<html>my own notes</html>")
    elif kind == "directory":
        planted.mkdir()
        (planted / "keep.txt").write_text("mine")
    else:
        planted.symlink_to(notes)
    assert report.report_main([str(sweep_dir)]) == 2
    err = capsys.readouterr().err
    assert str(Path("reports") / "thesis.html") in err and "refusing to overwrite" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert notes.read_text() == "<html>my own notes</html>"
    if kind == "file":
        assert planted.read_text() == "<html>my own notes</html>"
    elif kind == "directory":
        assert (planted / "keep.txt").read_text() == "mine"
    else:
        assert planted.is_symlink()
    assert sorted(p.name for p in planted.parent.iterdir()) == ["thesis.html"]  # no temp file left
    with pytest.raises(PageOutputError, match="refusing to overwrite"):
        report.build_report(sweep_dir)  # the sweep's end-of-run report takes this path


def test_report_replaces_its_own_page_and_legacy_pages(tmp_path, monkeypatch):
    sweep_dir = write_sweep(tmp_path / "results", "nightly", failed=False)
    monkeypatch.chdir(tmp_path)
    page = tmp_path / "reports" / "nightly.html"
    page.parent.mkdir()
    # A report written before the generator tag existed: its exact opening bytes.
    page.write_text('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n<title>kvbench report: x')
    assert report.report_main([str(sweep_dir)]) == 0
    assert is_kvbench_page(page) and GENERATOR_META in page.read_text()[:300]
    assert report.report_main([str(sweep_dir)]) == 0  # and again over its own page


def test_report_output_under_a_file_is_one_line(tmp_path, capsys):
    sweep_dir = write_sweep(tmp_path / "results", "s", failed=False)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    assert report.report_main([str(sweep_dir), "--out", str(blocker / "r.html")]) == 2
    err = capsys.readouterr().err
    assert str(blocker / "r.html") in err and "cannot write" in err and len(err.strip().splitlines()) == 1
    assert blocker.read_text() == "a file, not a directory"


def test_sweep_end_report_never_overwrites_a_user_file(tmp_path):
    planted = tmp_path / "reports" / "planted.html"
    planted.parent.mkdir()
    planted.write_text("<p>the user's page</p>")
    out = run_kvbench(
        "sweep",
        "model=tiny-mqa",
        "workload.num_requests=1",
        "workload.prompt_len=24",
        "workload.output_len=2",
        "run.warmup=false",
        "run.sweep_name=planted",
        cwd=tmp_path,
    )
    assert out.returncode != 0, out.stdout  # the report could not be written: the sweep says so
    assert f"{Path('reports') / 'planted.html'}: refusing to overwrite" in out.stderr
    assert planted.read_text() == "<p>the user's page</p>"
    assert list((tmp_path / "results" / "planted").glob("*/run.json"))  # the results are kept


# --------------------------------------------------------------------------- live server
SERVER_PLOTS = (
    "Live server: KV usage and queue over time, beside the request latencies",
    "Live server: request latency against cached prompt tokens",
)


@pytest.fixture(scope="module")
def live_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    sweep_dir = root / "live"
    write_scraped_run(sweep_dir / "a", "a", seed=0)
    # A request id with markup: it reaches the page only through the hover text.
    requests, steps, memory, server, meta = scraped_run("b", seed=1)
    requests = requests.assign(request_id=["<b>evil</b>", *requests["request_id"].iloc[1:]])
    summary = metrics.summarize_run(requests, steps, meta, memory, server_metrics=server)
    results.write_run(
        sweep_dir / "b",
        requests,
        steps,
        memory,
        meta,
        config_yaml(meta),
        summary.metrics,
        summary.missing,
        extra_frames={"server_metrics": server},
    )
    write_synthetic(sweep_dir / "c", "c", "paged", 32)  # a run of kvbench's own engine beside them
    out = report.build_report(sweep_dir, root / "live.html")
    return out, out.read_text()


def test_report_shows_the_server_timeline_and_cached_tokens(live_report):
    _, page = live_report
    for title in SERVER_PLOTS:
        assert title in page
    assert "server KV usage (fraction of its pool)" in page
    columns = full_table_columns(page)
    for column in ("server_prefix_hit_rate", "server_kv_usage_peak", "server_num_preemptions"):
        assert column in columns
    # The engine run has no server metrics: its cells say why.
    assert 'title="not a live server run (no server metrics were scraped)"' in page
    ours = page.replace(get_plotlyjs(), "")  # plotly.js itself holds every kind of string
    assert "<b>evil" not in ours and "request &lt;b&gt;evil&lt;" in ours


def test_report_without_server_metrics_has_no_server_plots(sweep_report):
    _, _, page = sweep_report
    for title in SERVER_PLOTS:
        assert title not in page
    assert "server_prefix_hit_rate" not in full_table_columns(page)


def test_live_report_renders_in_chromium(live_report, tmp_path):
    binary = find_chromium()
    page_path, page = live_report
    ids = plot_ids(page)
    dom, errors = render(binary, page_path, tmp_path)
    assert errors == []
    assert len(ids) >= 2 and unrendered_plots(dom, ids) == []
    assert "<b>evil</b>" not in dom  # plotly drew the escaped hover text, not markup
