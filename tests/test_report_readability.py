"""Issue 15 item 4: reports that stay readable at 20+ runs, and a terminal summary that
shows the same statistics as the HTML.

Labels name what the user chose (presets and typed overrides), not derived workload
parameters; headline metrics come first with units; repeats pool into one row with a
bootstrap confidence interval and error bars; and the ``prefix_caching`` report, opened
in headless Chromium at 1400 px, has short labels, few legend entries, no overlapping
titles, no legend over a plot, and the headline table on the first screen.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest
from chromium_render import find_chromium, render, unrendered_plots
from report_layout import WINDOW_HEIGHT_PX, WINDOW_WIDTH_PX, measure, screenshot
from run_fixtures import run_kvbench, synthetic_run

from kvbench import metrics, report, results, summary_view
from kvbench.sweep import print_sweep_summary


def write_repeated_sweep(sweep_dir: Path, num_repeats: int = 3) -> Path:
    """paged and slab, ``num_repeats`` repeats each with different timings; the gqa_vs_mha
    headline (KV bytes/token, peak running sequences, TPOT) recorded with every run."""
    for engine, block_size in (("paged", 16), ("slab", None)):
        for repeat in range(num_repeats):
            run_id = f"engine={engine}-{repeat}"
            requests, steps, memory, meta = synthetic_run(
                run_id, engine, block_size, seed=0, tpot_s=0.02 * (1 + 0.1 * repeat)
            )
            meta["run"] = {"device": "cpu", "repeat": repeat}
            meta["headline"] = {
                "metrics": ["kv_bytes_per_token", "peak_num_running", "tpot_ms_median"],
                "plot": "concurrency",
            }
            summary = metrics.summarize_run(requests, steps, meta, memory)
            results.write_run(
                sweep_dir / run_id, requests, steps, memory, meta, "x: 1\n", summary.metrics, summary.missing
            )
    return sweep_dir


# --------------------------------------------------------------------------- labels
def test_labels_name_presets_and_typed_overrides_not_derived_parameters():
    # Two workload presets bring their own parameters (derived: not in labels); the
    # block size varies within one engine preset (a typed override: in labels).
    runs = pd.DataFrame(
        {
            "run_id": [f"r{i}" for i in range(6)],
            "engine": ["paged"] * 4 + ["slab"] * 2,
            "engine.block_size": [8.0, 16.0, 8.0, 16.0, math.nan, math.nan],
            "engine.reservation": [None] * 4 + ["max_len"] * 2,
            "workload": ["chat", "chat", "rag", "rag", "chat", "rag"],
            "workload_params.num_turns": [4.0, 4.0, math.nan, math.nan, 4.0, math.nan],
            "workload_params.num_passages": [math.nan, math.nan, 64.0, 64.0, math.nan, 64.0],
            "model.name": ["tiny-gqa"] * 6,
        }
    )
    assert results.label_columns(runs) == ["engine", "workload", "engine.block_size"]
    assert results.run_labels(runs).tolist() == [
        "engine=paged workload=chat block_size=8",
        "engine=paged workload=chat block_size=16",
        "engine=paged workload=rag block_size=8",
        "engine=paged workload=rag block_size=16",
        "engine=slab workload=chat",
        "engine=slab workload=rag",
    ]
    # Two columns with one short name are written as the override a user types.
    clash = runs.assign(**{"workload_params.block_size": [1, 2, 1, 2, 1, 2]})
    assert "workload.block_size=2" in results.run_labels(clash)[1]


def test_repeats_share_one_label_and_pool_but_reruns_do_not():
    runs = pd.DataFrame(
        {
            "run_id": ["a0", "a1", "b0", "b1", "c", "d"],
            "engine": ["paged", "paged", "slab", "slab", "dense", "dense"],
            "run.repeat": [0, 1, 0, 1, 0, 0],  # c and d: the same config and repeat index twice
        }
    )
    labels = results.run_labels(runs).tolist()
    assert labels[:4] == ["engine=paged", "engine=paged", "engine=slab", "engine=slab"]
    assert labels[4:] == ["engine=dense [c]", "engine=dense [d]"]
    assert [len(group) for _, group in summary_view.pool(runs)] == [2, 2, 1, 1]
    assert "run.repeat" not in results.label_columns(runs)


def test_run_repeat_is_a_column_of_the_runs_frame(tmp_path):
    sweep = write_repeated_sweep(tmp_path / "s", num_repeats=2)
    runs = results.load(sweep).runs
    assert sorted(runs["run.repeat"]) == [0, 0, 1, 1] and set(runs["run.device"]) == {"cpu"}


# --------------------------------------------------------------------------- summary
def test_headline_first_with_units_and_repeats_pooled_with_a_bootstrap_ci(tmp_path):
    runs = results.load(write_repeated_sweep(tmp_path / "gqa")).runs
    view = summary_view.summary_view(runs)
    assert view.headline == summary_view.Headline(
        ("kv_bytes_per_token", "peak_num_running", "tpot_ms_median"), "concurrency"
    )
    assert [c.header for c in view.first[:3]] == [
        "KV per token (KiB)",
        "peak running seqs",
        "TPOT median (ms)",
    ]
    assert len(view.first) == summary_view.FIRST_SCREEN_METRICS
    assert [(row.label, len(row.run_ids)) for row in view.rows] == [("engine=paged", 3), ("engine=slab", 3)]
    paged = view.rows[0]
    tpot = paged.cells["tpot_ms_median"]
    values = sorted(runs[runs["engine"] == "paged"]["tpot_ms_median"])
    assert tpot.value == pytest.approx(sum(values) / 3)
    assert values[0] <= tpot.ci_low_value < tpot.value < tpot.ci_high_value <= values[-1]
    assert summary_view.bootstrap_mean_ci(values) == (tpot.ci_low_value, tpot.ci_high_value)  # seeded
    assert not paged.cells["kv_bytes_per_token"].has_ci  # deterministic: equal repeats, no interval
    assert summary_view.format_cell(view.first[0], paged.cells["kv_bytes_per_token"]) == "1"
    assert " \u00b1" in summary_view.format_cell(view.first[2], tpot)


def test_report_shows_the_headline_first_pools_repeats_and_draws_error_bars(tmp_path):
    sweep = write_repeated_sweep(tmp_path / "gqa")
    page = report.build_report(sweep, tmp_path / "gqa.html").read_text()
    first_table = page[page.index('id="summary"') : page.index("All summary metrics")]
    headers = re.findall(r"<th[^>]*>([^<]+)</th>", first_table)
    assert headers[:6] == [
        "run",
        "status",
        "runs",
        "KV per token (KiB)",
        "peak running seqs",
        "TPOT median (ms)",
    ]
    assert len(headers) <= 11  # the first screen: about ten columns fit 1400 px
    assert first_table.count('<td class="label">') == 2  # one row per configuration
    assert "mean of 3 repeats; 95% bootstrap CI of the mean [" in first_table
    assert "repeats pooled" in page
    # The headline plot comes first, with error bars from the repeats.
    titles = re.findall(r'<div class="plot"><h3>([^<]+)</h3>', page)
    assert titles[0] == "Concurrency reached under the KV budget"
    figures = re.findall(r'Plotly.newPlot\(\s*"fig-\d+",\s*(\[.*?\]),\s*\{', page, re.S)
    assert '"error_y"' in figures[0] and '"arrayminus"' in figures[0]


def test_unknown_headline_metrics_are_named_on_the_page(tmp_path):
    sweep = write_repeated_sweep(tmp_path / "s", num_repeats=1)
    for run_dir in results.find_runs(sweep):
        record = json.loads((run_dir / "run.json").read_text())
        record["meta"]["headline"] = {"metrics": ["tpot_ms_median", "no_such_metric"], "plot": None}
        (run_dir / "run.json").write_text(json.dumps(record))
    page = report.build_report(sweep, tmp_path / "s.html").read_text()
    assert "Headline metric(s) no run recorded: no_such_metric." in page


def test_terminal_summary_shows_the_html_statistics(tmp_path, capsys):
    sweep = write_repeated_sweep(tmp_path / "gqa")
    print_sweep_summary(sweep)
    terminal = capsys.readouterr().out
    page = report.build_report(sweep, tmp_path / "gqa.html").read_text()
    first_table = page[page.index('id="summary"') : page.index("All summary metrics")]
    html_cells = re.findall(r'<td class="(?:num|nan)"[^>]*>([^<]+)</td>', first_table)
    view = summary_view.summary_view(results.load(sweep).runs)
    expected = [summary_view.format_cell(c, row.cells[c.metric]) for row in view.rows for c in view.first]
    runs_column = [str(len(row.run_ids)) for row in view.rows]
    assert [c for c in html_cells if c not in runs_column] == expected
    flat = " ".join(terminal.split())
    for text in expected:
        assert text.replace(" ", "") in flat.replace(" ", ""), text
    assert "TTFT mean" not in terminal and "TPOT median" in " ".join(terminal.split())


# --------------------------------------------------------------------------- Chromium at 1400 px
MAX_LABEL_CHARS = 48
MAX_LEGEND_ENTRIES_OF_A_CDF = 6


@pytest.fixture(scope="module")
def prefix_caching_report(tmp_path_factory) -> Path:
    """``kvbench sweep +experiment=prefix_caching`` (12 runs) in simulation mode without
    warm-up, so it takes ~10 s on a 2-core machine (real mode waits for real-time arrivals,
    ~70 s); the headline is given on the command line as the experiment's YAML would."""
    root = tmp_path_factory.mktemp("prefix_caching")
    out = run_kvbench(
        "sweep",
        "+experiment=prefix_caching",
        "run.mode=sim",
        "run.warmup=false",
        "headline.metrics=[prefix_hit_rate,prefix_hit_rate_first_admission,ttft_ms_median,ttft_ms_p99]",
        "headline.plot=prefix_cache",
        cwd=root,
    )
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    assert "prefix hit" in out.stdout and "(0-1)" in out.stdout  # the terminal's headline column (wrapped)
    return root / "reports" / "prefix_caching.html"


def test_prefix_caching_report_is_readable_at_1400px(prefix_caching_report, tmp_path):
    binary = find_chromium()
    page = prefix_caching_report.read_text()
    dom, errors = render(binary, prefix_caching_report, tmp_path)
    ids = re.findall(r'<div id="(fig-\d+)" class="plotly-graph-div"', page)
    assert errors == [] and ids and unrendered_plots(dom, ids) == []
    layout = measure(binary, prefix_caching_report, tmp_path)

    # Labels: what was chosen, short (the old labels listed ~30 workload parameters).
    assert len(layout.labels) == 12 and len(set(layout.labels)) == 12
    assert max(len(label) for label in layout.labels) <= MAX_LABEL_CHARS, layout.labels
    assert all(re.fullmatch(r"workload=\w+ prefix_cache=\w+", label) for label in layout.labels)

    # The first screen shows the headline table, whole, within the window's width.
    table = layout.summary_table
    assert table is not None and table.bottom <= WINDOW_HEIGHT_PX and table.right <= WINDOW_WIDTH_PX
    assert layout.page_width_px <= WINDOW_WIDTH_PX  # nothing forces a horizontal page scroll

    # The headline plot comes first; CDFs are small multiples with one short legend.
    titles = re.findall(r'<div class="plot"><h3>([^<]+)</h3>', page)
    assert titles[0] == "Prefix cache"
    cdf = layout.plots[titles.index("Latency distributions (CDF over completed requests)")]
    assert len(cdf.areas) == 12 and cdf.num_legend_entries <= MAX_LEGEND_ENTRIES_OF_A_CDF

    for plot in layout.plots:
        boxes = [box for _, box in plot.titles]
        overlapping = [
            (a, b)
            for (a, box_a), (b, box_b) in itertools.combinations(plot.titles, 2)
            if box_a.overlaps(box_b)
        ]
        assert overlapping == [], (plot.plot_id, overlapping)
        assert not [t for t, box in plot.titles for area in plot.areas if box.overlaps(area)], plot.plot_id
        assert not [area for legend in plot.legends for area in plot.areas if legend.overlaps(area)], (
            f"{plot.plot_id}: a legend covers a plot"
        )
        assert all(box.right <= WINDOW_WIDTH_PX for box in boxes)

    shot = screenshot(binary, prefix_caching_report, tmp_path, tmp_path / "prefix_caching_1400.png", 5200)
    assert shot.stat().st_size > 100_000  # a blank page is a few KB
    print(f"prefix_caching report screenshot: {shot}")
