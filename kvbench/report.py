"""One self-contained HTML page per sweep, built from results only (never from engines).

The page embeds plotly.js once in its head (works offline, no CDN) and holds: the sweep's
environment and configs, a summary table (one row per run, failed runs with their error,
NaN cells explain why on hover), and the plots that the data supports -- a plot whose
metric no run measured is left out rather than drawn empty.

Runs are labelled by what the user chose: the presets that differ and the overrides
typed for the sweep (``results.run_labels``), never by the parameters a preset derives;
every varying parameter is in the parameters table. The summary (``summary_view``: the
same columns, statistics and formats as the terminal summary) puts the experiment's
headline metrics first, units in the headers, about ten columns on the first screen and
every other metric in a full table below; repeats of a configuration are pooled into one
row and one bar with a 95 % bootstrap confidence interval of the mean (error bars). The
experiment's headline plot (``headline.plot``, a key of ``PLOTS``) comes first. Legends
sit outside the plotting area; latency CDFs become small multiples (one row of panels
per value of the first label part) beyond ``SMALL_MULTIPLES_AT`` configurations.

Runs against a live server (``server_metrics.parquet``) add the server's scraped KV usage
and queue over time above each request's latencies, and each request's latency against
the prompt tokens the server reported cached for it.

Every string from the results (metric names, labels, config values, errors, paths) goes
through ``html_page.escape``, plot labels included, and the page is written by
``html_page.write_page``: named after the results directory given, and never over a file
kvbench did not write.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from kvbench import metrics
from kvbench.html_page import GENERATOR_META, PageOutputError, escape, write_page
from kvbench.results import (
    REPEAT_COLUMN,
    Results,
    ResultsError,
    label_columns,
    label_names,
    load,
    plain_value,
    varying_config_columns,
)
from kvbench.summary_view import (
    CI_CONFIDENCE,
    SummaryColumn,
    SummaryView,
    cell_note,
    format_cell,
    format_value,
    pooled_runs,
    summary_view,
)
from kvbench.summary_view import column as summary_column

MAX_POINTS_PER_LINE = 2000  # time series are thinned so a long run does not bloat the page
PLOT_CONFIG = {"displaylogo": False, "responsive": True}
# Beyond this many configurations one CDF panel per latency would hold too many lines.
SMALL_MULTIPLES_AT = 6
# Every legend sits to the right of the plotting area (plotly shrinks the plot to make room).
LEGEND_OUTSIDE = {"x": 1.02, "xanchor": "left", "y": 1.0, "yanchor": "top"}

STYLE = """
.banner { background: #fff4d6; border: 1px solid #e0b84c; padding: 8px 12px; }
body { font-family: system-ui, sans-serif; margin: 1.5rem auto; max-width: 1300px; color: #222; }
h1 { margin-bottom: 0.2rem; } .sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; font-size: 0.85rem; margin: 0.5rem 0 1rem; }
th, td { border: 1px solid #ddd; padding: 0.25rem 0.5rem; text-align: right; }
th { background: #f4f4f4; position: sticky; top: 0; } td.text { text-align: left; }
tr.failed td { background: #fdecea; } td.nan { color: #999; }
.scroll { overflow-x: auto; max-height: 36rem; max-width: 100%; border: 1px solid #eee; }
th { font-weight: 600; } td.label { text-align: left; white-space: nowrap; }
p.note { color: #666; font-size: 0.85rem; margin: 0.2rem 0; } ul.errors { font-size: 0.85rem; }
pre { background: #f7f7f7; padding: 0.6rem; overflow-x: auto; font-size: 0.8rem; }
.plot { margin: 1rem 0 2rem; } details { margin: 0.4rem 0; }
"""


# --------------------------------------------------------------------------- public API
def build_report(results_dir: str | os.PathLike[str], out_path: str | os.PathLike[str] | None = None) -> Path:
    """Write the HTML report for the results under ``results_dir`` and return its path.

    Default ``out_path``: ``reports/<name of results_dir>.html`` relative to the working
    directory (parents are created) -- named after the directory given, never after the
    sweep name stored in run.json, so a copied run directory gets its own report. Reads
    results only; raises ResultsError when there are none and PageOutputError (naming the
    path) when the output exists but is not a kvbench page.
    """
    res = load(results_dir)
    name = report_name(results_dir)
    out = Path(out_path) if out_path is not None else Path("reports") / f"{name}.html"
    return write_page(out, render_report(res, title=name, source=str(results_dir)))


def report_name(results_dir: str | os.PathLike[str]) -> str:
    """The report's name: the last component of ``results_dir`` once resolved ("." -> the cwd's name)."""
    return Path(results_dir).resolve().name or "root"


def _mode_banner(runs: pd.DataFrame) -> str:
    """Say loudly when times are modeled, not measured (simulation mode)."""
    if "mode" not in runs or not (runs["mode"] == "sim").any():
        return ""
    which = "All runs are" if (runs["mode"] == "sim").all() else "Runs with mode=sim are"
    return (
        '<p class="banner"><b>Simulated.</b> ' + which + " simulation-mode runs: step times, latencies, "
        "throughput and roofline fractions come from the cost model of the hardware profile "
        "(kvbench/sim/cost_model.py), not from a clock. KV memory figures are exact block accounting.</p>"
    )


def render_report(res: Results, title: str, source: str = "") -> str:
    """The full HTML page for ``res`` as a string. Pure: writes nothing."""
    runs = res.runs
    view = summary_view(runs)
    # One row per configuration with an ok run (repeats pooled). ``label`` is plot text
    # only (trace names, category ticks, hover): escaped once here, so plotly shows a label
    # such as "<b>x</b>" literally, its parts on separate lines.
    ok = pooled_runs(runs, sep="\n")
    if not ok.empty:
        ok = ok.assign(label=ok["label"].map(lambda text: escape(text).replace("\n", "<br>")))
    builders = sorted(PLOTS, key=lambda plot: plot[0] != view.headline.plot)  # the headline plot first
    figures = [(name, fig) for _, name, build in builders for fig in [build(res, ok)] if fig is not None]
    for _, fig in figures:
        fig.update_layout(legend=LEGEND_OUTSIDE)
    plot_html = "\n".join(
        f'<div class="plot"><h3>{escape(name)}</h3>'
        + pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=f"fig-{i}", config=PLOT_CONFIG)
        + "</div>"
        for i, (name, fig) in enumerate(figures)
    )
    num_failed = int((runs.get("status", pd.Series(dtype=str)) == "failed").sum())
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    chosen = label_columns(runs)
    names = label_names(chosen)
    labelled_by = ", ".join(names[c] for c in chosen) or "nothing (one configuration)"
    num_varying = len([c for c in varying_config_columns(runs) if c != REPEAT_COLUMN])
    pooled = (
        f" in {len(view.rows)} configurations (repeats pooled: mean and {CI_CONFIDENCE:.0%} bootstrap "
        "confidence interval of the mean, shown as \u00b1 half its width and as error bars)"
        if view.has_repeats
        else ""
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
{GENERATOR_META}
<title>kvbench report: {escape(title)}</title>
<style>{STYLE}</style>
<script type="text/javascript">{get_plotlyjs()}</script>
</head><body>
<h1>kvbench report: {escape(title)}</h1>
{_mode_banner(runs)}
<p class="sub">{len(runs)} runs ({num_failed} failed){escape(pooled)} from {escape(source)}, generated {stamp}.
Runs are labelled by what was chosen: {escape(labelled_by)}; all {num_varying} parameters that vary are
under <a href="#parameters">Parameters</a>.</p>
<h2 id="summary">Summary</h2>
{_summary_table(view)}
<h2>Plots</h2>
{plot_html or "<p>No completed run to plot.</p>"}
<h2 id="parameters">Parameters</h2>
{_parameters_table(runs, view)}
<h2>Environment</h2>
{_environment_table(runs)}
<h2>Configuration</h2>
{_configs(runs, res.configs)}
<h2>Metric definitions</h2>
<details><summary>Units and definitions of every metric</summary>{_metric_docs()}</details>
</body></html>
"""


def report_main(argv: Sequence[str] | None = None) -> int:
    """``kvbench report RESULTS_DIR [--out FILE]``: write the report, print its path.

    Returns 0 on success, 2 when RESULTS_DIR holds no readable results or the output path
    holds something kvbench did not write.
    """
    parser = argparse.ArgumentParser(
        prog="kvbench report",
        description="Write the HTML report of a results directory. An existing output file is "
        "replaced only if kvbench wrote it (a user's file of the same name is refused).",
    )
    parser.add_argument("results_dir", help="a sweep directory (results/<sweep>) or one run directory")
    parser.add_argument(
        "--out", default=None, help="output HTML file (default: reports/<name of RESULTS_DIR>.html)"
    )
    args = parser.parse_args(argv)
    try:
        out = build_report(args.results_dir, args.out)
    except (ResultsError, PageOutputError) as exc:
        print(f"kvbench report: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


# --------------------------------------------------------------------------- helpers
def _is_nan(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _has(ok: pd.DataFrame, column: str) -> bool:
    return column in ok and bool(np.isfinite(ok[column].to_numpy(dtype=float)).any())


# --------------------------------------------------------------------------- plots
def _error_bars(ok: pd.DataFrame, column: str) -> dict[str, object] | None:
    """Plotly error bars from the pooled repeats' confidence interval of ``column``; None
    when no configuration has one (single runs, or deterministic metrics)."""
    low, high = ok.get(f"{column}.ci_low"), ok.get(f"{column}.ci_high")
    if low is None or high is None or not np.isfinite(low.to_numpy(dtype=float)).any():
        return None
    return {
        "type": "data",
        "symmetric": False,
        "array": (high - ok[column]).fillna(0).to_numpy(),
        "arrayminus": (ok[column] - low).fillna(0).to_numpy(),
    }


def _bar(ok: pd.DataFrame, column: str, name: str, **style: object) -> go.Bar:
    """One bar per configuration: the mean over its repeats, with their CI as error bars."""
    return go.Bar(x=ok["label"], y=ok[column], name=name, error_y=_error_bars(ok, column), **style)


def _bars(ok: pd.DataFrame, columns: Sequence[str], names: Sequence[str], **layout: object) -> go.Figure:
    fig = go.Figure([_bar(ok, c, n) for c, n in zip(columns, names) if c in ok])
    fig.update_layout(barmode="group", height=420, margin={"t": 30}, **layout)
    return fig


def _throughput_latency(res: Results, ok: pd.DataFrame) -> go.Figure | None:
    if not _has(ok, "output_tokens_per_s"):
        return None
    fig = make_subplots(rows=1, cols=2, subplot_titles=("output tokens/s", "TPOT (ms)"))
    fig.add_trace(_bar(ok, "output_tokens_per_s", "output tokens/s"), row=1, col=1)
    for stat in ("median", "p99"):
        column = f"tpot_ms_{stat}"
        if column in ok:
            fig.add_trace(_bar(ok, column, f"TPOT {stat}"), row=1, col=2)
    fig.update_layout(barmode="group", height=440, margin={"t": 40})
    return fig


LATENCY_CDFS: tuple[tuple[str, str], ...] = (
    ("ttft_ms", "TTFT (ms)"),
    ("tpot_ms", "TPOT (ms)"),
    ("e2el_ms", "E2E latency (ms)"),
)
CDF_ROW_HEIGHT_PX = 230


def _latency_cdfs(res: Results, ok: pd.DataFrame) -> go.Figure | None:
    """CDFs of each configuration's requests (repeats pooled). Up to SMALL_MULTIPLES_AT
    configurations share one panel per latency; beyond, small multiples: one row of
    panels per value of the first label part (e.g. workload=chat), one line per value of
    the rest (e.g. prefix_cache=radix), colours and legend shared by the rows."""
    if res.requests.empty or ok.empty:
        return None
    parts = ok["label"].str.split("<br>", n=1)
    if len(ok) > SMALL_MULTIPLES_AT:
        facets = parts.str[0]
        lines = parts.map(lambda p: p[1] if len(p) > 1 else p[0])
    else:
        facets = pd.Series("", index=ok.index)
        lines = ok["label"]
    facet_names = list(dict.fromkeys(facets))
    line_names = list(dict.fromkeys(lines))
    num_rows = len(facet_names)
    titles = [f"{kind}: {facet}" if facet else kind for facet in facet_names for _, kind in LATENCY_CDFS]
    height = CDF_ROW_HEIGHT_PX * num_rows + 80
    fig = make_subplots(
        rows=num_rows,
        cols=len(LATENCY_CDFS),
        subplot_titles=[t.replace("<br>", " ") for t in titles],
        vertical_spacing=min(0.3, 90 / height) if num_rows > 1 else 0.0,
        horizontal_spacing=0.06,
    )
    drawn = False
    shown: set[str] = set()
    for (_, run), facet, line in zip(ok.iterrows(), facets, lines):
        requests = res.requests[res.requests["run_id"].isin(run["run_ids"])]
        if requests.empty:
            continue
        latencies = metrics.per_request(requests)
        row = facet_names.index(facet) + 1
        color = _color(line_names.index(line))
        for col, (kind, _) in enumerate(LATENCY_CDFS, start=1):
            values = np.sort(latencies[kind].dropna().to_numpy())
            if values.size == 0:
                continue
            drawn = True
            fig.add_trace(
                go.Scatter(
                    x=values,
                    y=np.arange(1, values.size + 1) / values.size,
                    mode="lines",
                    line_shape="hv",
                    name=line,
                    legendgroup=line,
                    showlegend=line not in shown,
                    line={"color": color},
                ),
                row=row,
                col=col,
            )
            shown.add(line)
    for row in range(2, num_rows + 1):  # one latency scale per column, comparable down it
        for col in range(1, len(LATENCY_CDFS) + 1):
            fig.update_xaxes(matches=f"x{col if col > 1 else ''}", row=row, col=col)
    fig.update_yaxes(range=[0, 1.02])
    fig.update_yaxes(title_text="fraction of requests", col=1)
    fig.update_annotations(font_size=12)
    fig.update_layout(height=height, margin={"t": 40})
    return fig if drawn else None


def _kv_over_time(res: Results, ok: pd.DataFrame) -> go.Figure | None:
    if res.steps.empty or "kv_allocated_bytes" not in res.steps:
        return None
    fig = go.Figure()
    for i, (_, run) in enumerate(ok.iterrows()):
        steps = res.steps[res.steps["run_id"] == run["run_id"]]
        if steps.empty:
            continue
        stride = max(1, math.ceil(len(steps) / MAX_POINTS_PER_LINE))
        steps = steps.iloc[::stride]
        style = {"color": _color(i)}
        fig.add_trace(
            go.Scatter(
                x=steps["end_s"], y=steps["kv_allocated_bytes"], name=f"{run['label']} allocated", line=style
            )
        )
        fig.add_trace(
            go.Scatter(
                x=steps["end_s"],
                y=steps["kv_token_bytes"],
                name=f"{run['label']} token state",
                line={**style, "dash": "dot"},
                visible="legendonly",  # halves the clutter; one click shows it
            )
        )
    if not fig.data:
        return None
    fig.update_layout(
        height=440, margin={"t": 30}, xaxis_title="time since start (s)", yaxis_title="KV bytes"
    )
    return fig


def _waste(res: Results, ok: pd.DataFrame) -> go.Figure | None:
    parts = (
        ("kv_mean_token_bytes", "token state"),
        ("kv_reserved_unused_bytes_mean", "reserved, unused"),
        ("kv_internal_frag_bytes_mean", "internal fragmentation"),
        ("kv_external_frag_bytes_mean", "external fragmentation"),
    )
    if not _has(ok, "kv_mean_token_bytes"):
        return None
    fig = _bars(ok, [c for c, _ in parts], [n for _, n in parts], yaxis_title="mean KV bytes over the run")
    fig.update_layout(barmode="stack")
    return fig


def _concurrency(res: Results, ok: pd.DataFrame) -> go.Figure | None:
    if not _has(ok, "peak_num_running"):
        return None
    return _bars(
        ok,
        ["peak_num_running", "mean_num_running"],
        ["peak running sequences", "mean running sequences"],
        yaxis_title="sequences",
    )


# Prefix hit rates drawn side by side: (column, legend name).
PREFIX_RATES: tuple[tuple[str, str], ...] = (
    ("prefix_hit_rate", "all admissions (re-admissions re-hit)"),
    ("prefix_hit_rate_first_admission", "first admission"),
    ("prefix_reuse_upper_bound", "reuse upper bound (unbounded cache)"),
)


def _prefix(res: Results, ok: pd.DataFrame) -> go.Figure | None:
    rates = [(c, n) for c, n in PREFIX_RATES if _has(ok, c)]
    if not rates:
        return None
    fig = make_subplots(rows=1, cols=2, subplot_titles=("prefix hit rate (tokens)", "TTFT median (ms)"))
    for i, (column, name) in enumerate(rates):
        fig.add_trace(_bar(ok, column, name, marker={"color": _color(i)}), row=1, col=1)
    if "ttft_ms_median" in ok:
        fig.add_trace(_bar(ok, "ttft_ms_median", "TTFT median", showlegend=False), row=1, col=2)
    fig.update_yaxes(range=[0, 1], row=1, col=1)
    fig.update_layout(barmode="group", height=420, margin={"t": 40}, showlegend=len(rates) > 1)
    return fig


def _sharing(res: Results, ok: pd.DataFrame) -> go.Figure | None:
    column = "kv_sharing_saved_fraction"
    if not _has(ok, column) or not (ok[column].fillna(0) > 0).any():
        return None
    return _bars(ok, [column], ["KV saved by sharing"], yaxis_title="fraction of unshared KV slots")


def _roofline(res: Results, ok: pd.DataFrame) -> go.Figure | None:
    if not _has(ok, "decode_roofline_fraction_mean"):
        return None
    return _bars(
        ok,
        ["decode_roofline_fraction_mean"],
        ["achieved fraction of the decode roofline"],
        yaxis_title="roofline time / step time",
    )


def _quality_vs_memory(res: Results, ok: pd.DataFrame) -> go.Figure | None:
    quality = [c for c in ok.columns if c.startswith("quality_") and _has(ok, c)]
    if not quality or not _has(ok, "kv_peak_allocated_bytes"):
        return None
    fig = make_subplots(rows=1, cols=len(quality), subplot_titles=[escape(q) for q in quality])
    # One line per engine (plot text, escaped like ``label``), else one per run.
    groups = ok["engine"].astype(str).map(escape) if "engine" in ok else ok["label"]
    for col, metric in enumerate(quality, start=1):
        for i, (group, runs) in enumerate(ok.groupby(groups, sort=True)):
            runs = runs.sort_values("kv_peak_allocated_bytes")
            fig.add_trace(
                go.Scatter(
                    x=runs["kv_peak_allocated_bytes"],
                    y=runs[metric],
                    mode="lines+markers",
                    text=runs["label"],
                    name=group,
                    legendgroup=group,
                    showlegend=col == 1,
                    line={"color": _color(i)},
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="peak KV bytes", row=1, col=col)
    fig.update_layout(height=420, margin={"t": 40})
    return fig


def _process_memory(res: Results, ok: pd.DataFrame) -> go.Figure | None:
    if res.memory.empty:
        return None
    fig = go.Figure()
    for i, (_, run) in enumerate(ok.iterrows()):
        memory = res.memory[res.memory["run_id"] == run["run_id"]]
        for dash, column in zip(
            ("solid", "dash", "dot"), ("rss_bytes", "nvml_used_bytes", "torch_allocated_bytes")
        ):
            if column in memory and np.isfinite(memory[column].to_numpy(dtype=float)).any():
                fig.add_trace(
                    go.Scatter(
                        x=memory["t_s"],
                        y=memory[column],
                        name=f"{run['label']} {column}",
                        line={"color": _color(i), "dash": dash},
                    )
                )
    if not fig.data:
        return None
    fig.update_layout(height=400, margin={"t": 30}, xaxis_title="time since start (s)", yaxis_title="bytes")
    return fig


def _server_timeline(res: Results, ok: pd.DataFrame) -> go.Figure | None:
    """Live servers: scraped KV usage and queue over time above each request's latencies,
    on one time axis (the runner's clock: both start at the run's start)."""
    server = res.server_metrics
    if server.empty:
        return None
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.06,
        subplot_titles=(
            "server KV usage (fraction of its pool)",
            "server requests: running (solid), waiting (dashed)",
            "requests at their arrival: TTFT (circles), E2E latency (crosses), ms",
        ),
    )
    for i, (_, run) in enumerate(ok.iterrows()):
        scrapes = server[server["run_id"] == run["run_id"]]
        if scrapes.empty:
            continue
        stride = max(1, math.ceil(len(scrapes) / MAX_POINTS_PER_LINE))
        scrapes = scrapes.iloc[::stride]
        color, label = _color(i), run["label"]
        group = {"legendgroup": label, "line": {"color": color}}
        fig.add_trace(
            go.Scatter(x=scrapes["t_s"], y=scrapes["kv_usage_fraction"], name=label, **group), row=1, col=1
        )
        for column, dash in (("num_running", "solid"), ("num_waiting", "dash")):
            fig.add_trace(
                go.Scatter(
                    x=scrapes["t_s"],
                    y=scrapes[column],
                    name=f"{label} {column}",
                    showlegend=False,
                    line_shape="hv",
                    legendgroup=label,
                    line={"color": color, "dash": dash},
                ),
                row=2,
                col=1,
            )
        requests = res.requests[res.requests["run_id"] == run["run_id"]]
        if requests.empty:
            continue
        latencies = metrics.per_request(requests)
        hover = _request_hover(requests)
        for column, symbol in (("ttft_ms", "circle"), ("e2el_ms", "x")):
            fig.add_trace(
                go.Scatter(
                    x=requests["arrival_s"],
                    y=latencies[column],
                    mode="markers",
                    marker={"color": color, "symbol": symbol, "size": 6},
                    text=hover,
                    name=f"{label} {column}",
                    showlegend=False,
                    legendgroup=label,
                ),
                row=3,
                col=1,
            )
    if not fig.data:
        return None
    fig.update_yaxes(range=[0, 1], row=1, col=1)
    fig.update_xaxes(title_text="time since start (s)", row=3, col=1)
    fig.update_layout(height=720, margin={"t": 40})
    return fig


def _cached_tokens_latency(res: Results, ok: pd.DataFrame) -> go.Figure | None:
    """Live-server sweeps: each request's TTFT and E2E latency against the prompt tokens the
    server reported cached for it (``num_cached_tokens``)."""
    if res.server_metrics.empty or "num_cached_tokens" not in res.requests:
        return None
    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT (ms)", "E2E latency (ms)"))
    for i, (_, run) in enumerate(ok.iterrows()):
        requests = res.requests[res.requests["run_id"] == run["run_id"]]
        cached = requests["num_cached_tokens"].to_numpy(dtype=float)
        if not np.isfinite(cached).any():
            continue
        latencies = metrics.per_request(requests)
        hover = _request_hover(requests)
        for col, column in enumerate(("ttft_ms", "e2el_ms"), start=1):
            fig.add_trace(
                go.Scatter(
                    x=cached,
                    y=latencies[column],
                    mode="markers",
                    marker={"color": _color(i), "size": 6},
                    text=hover,
                    name=run["label"],
                    legendgroup=run["label"],
                    showlegend=col == 1,
                ),
                row=1,
                col=col,
            )
    if not fig.data:
        return None
    fig.update_xaxes(title_text="cached prompt tokens")
    fig.update_layout(height=420, margin={"t": 40})
    return fig


def _request_hover(requests: pd.DataFrame) -> list[str]:
    """Per request: its id, prompt tokens and cached tokens as plot hover text (escaped)."""
    if "num_cached_tokens" in requests:
        cached = requests["num_cached_tokens"]
    else:
        cached = pd.Series(math.nan, index=requests.index)
    tokens = summary_column("num_cached_prompt_tokens")
    return [
        escape(f"request {rid}: {format_value(tokens, n)} prompt tokens, {format_value(tokens, hit)} cached")
        for rid, n, hit in zip(requests["request_id"], requests["num_prompt_tokens"], cached)
    ]


PlotBuilder = Callable[[Results, pd.DataFrame], "go.Figure | None"]
# (key, title, builder); an experiment's ``headline.plot`` names a key and that plot comes first.
PLOTS: tuple[tuple[str, str, PlotBuilder], ...] = (
    ("throughput", "Throughput and time per output token", _throughput_latency),
    ("latency_cdf", "Latency distributions (CDF over completed requests)", _latency_cdfs),
    (
        "server_timeline",
        "Live server: KV usage and queue over time, beside the request latencies",
        _server_timeline,
    ),
    (
        "server_cached_tokens",
        "Live server: request latency against cached prompt tokens",
        _cached_tokens_latency,
    ),
    ("kv_over_time", "KV memory over time (dotted: token state, click the legend)", _kv_over_time),
    ("kv_waste", "Where the KV memory goes (PagedAttention Fig. 2 split)", _waste),
    ("concurrency", "Concurrency reached under the KV budget", _concurrency),
    ("prefix_cache", "Prefix cache", _prefix),
    ("sharing", "Memory saved by sharing (parallel sampling, beams)", _sharing),
    ("roofline", "Decode efficiency against the memory-bandwidth roofline", _roofline),
    ("quality_memory", "Quality against memory", _quality_vs_memory),
    ("process_memory", "Process memory samples", _process_memory),
)
PLOT_KEYS: tuple[str, ...] = tuple(key for key, _, _ in PLOTS)


def _color(i: int) -> str:
    palette = pio.templates["plotly"].layout.colorway
    return palette[i % len(palette)]


# --------------------------------------------------------------------------- tables
def _summary_table(view: SummaryView) -> str:
    """The first-screen table (label, status, the headline-first columns), the failed runs'
    errors, then every summary metric in a scrolling table under a collapsed heading."""
    lead = _metric_table(view, view.first)
    notes = []
    if view.unknown_headline:
        notes.append("Headline metric(s) no run recorded: " + ", ".join(view.unknown_headline) + ".")
    if view.rest:
        notes.append(f"{len(view.rest)} more metrics in the full table below.")
    errors = [
        f"<li><b>{escape(row.label)}</b>: {escape('; '.join(row.errors))}</li>"
        for row in view.rows
        if row.errors
    ]
    full = _metric_table(view, (*view.first, *view.rest), raw_names=True)
    return (
        lead
        + "".join(f'<p class="note">{escape(note)}</p>' for note in notes)
        + (f'<ul class="errors">{"".join(errors)}</ul>' if errors else "")
        + f"<details><summary>All summary metrics ({len(view.first) + len(view.rest)} columns, "
        "catalogue names)</summary>" + full + "</details>"
    )


def _metric_table(view: SummaryView, columns: Sequence[SummaryColumn], raw_names: bool = False) -> str:
    """One row per configuration; a header names the metric (short, or its catalogue name)
    with its unit and carries its definition on hover; a NaN cell says why on hover."""
    repeats = view.has_repeats
    head = ["<th>run</th>", "<th>status</th>", *(["<th>runs</th>"] if repeats else [])]
    for c in columns:
        text = f"{c.metric} ({c.unit})" if raw_names and c.unit else c.metric if raw_names else c.header
        head.append(f'<th title="{escape(c.definition)}">{escape(text)}</th>')
    body = []
    for row in view.rows:
        cells = [f'<td class="label">{escape(row.label)}</td>', f'<td class="text">{escape(row.status)}</td>']
        if repeats:
            cells.append(f'<td class="num">{len(row.run_ids)}</td>')
        for c in columns:
            cell = row.cells[c.metric]
            note = cell_note(c, cell)
            title = f' title="{escape(note)}"' if note else ""
            kind = "nan" if cell.num_values == 0 else "num"
            cells.append(f'<td class="{kind}"{title}>{escape(format_cell(c, cell))}</td>')
        status = "failed" if row.num_ok == 0 else "ok"
        body.append(f'<tr class="{status}">{"".join(cells)}</tr>')
    return f'<div class="scroll"><table><tr>{"".join(head)}</tr>{"".join(body)}</table></div>'


def _parameters_table(runs: pd.DataFrame, view: SummaryView) -> str:
    """Every config column that varies (derived workload parameters included), one row per
    configuration, in a collapsed, scrolling table."""
    columns = [c for c in varying_config_columns(runs) if c != REPEAT_COLUMN]
    if not columns:
        return "<p>Every run has the same configuration (see Configuration).</p>"
    first = runs.drop_duplicates("run_id").set_index(runs["run_id"].astype(str))
    head = "".join(f"<th>{escape(c)}</th>" for c in ["run", *columns])
    body = "".join(
        f'<tr><td class="label">{escape(row.label)}</td>'
        + "".join(
            f'<td class="text">{escape(plain_value(first.at[row.run_ids[0], c]))}</td>' for c in columns
        )
        + "</tr>"
        for row in view.rows
    )
    return (
        f"<details><summary>{len(columns)} parameters vary between runs</summary>"
        f'<div class="scroll"><table><tr>{head}</tr>{body}</table></div></details>'
    )


def _environment_table(runs: pd.DataFrame) -> str:
    columns = sorted(c for c in runs.columns if c.startswith("env."))
    if not columns:
        return "<p>No environment recorded.</p>"
    rows = []
    for c in columns:
        values = sorted({str(v) for v in runs[c] if not _is_nan(v)})
        rows.append(
            f'<tr><td class="text">{escape(c[4:])}</td><td class="text">{escape(" | ".join(values))}</td></tr>'
        )
    return f"<table><tr><th>field</th><th>value(s) across runs</th></tr>{''.join(rows)}</table>"


def _configs(runs: pd.DataFrame, configs: dict[str, str]) -> str:
    parts = []
    for i, run_id in enumerate(runs["run_id"].astype(str)):
        text = configs.get(run_id, "")
        opened = " open" if i == 0 else ""
        parts.append(
            f"<details{opened}><summary>{escape(run_id)}</summary><pre>{escape(text or '(no config.yaml)')}</pre></details>"
        )
    return "\n".join(parts)


def _metric_docs() -> str:
    rows = "".join(
        f'<tr><td class="text"><code>{escape(d.name)}</code></td><td class="text">{escape(d.unit)}</td>'
        f'<td class="text">{escape(d.better or "-")}</td><td class="text">{escape(d.definition)}</td></tr>'
        for d in metrics.METRICS
    )
    return f"<table><tr><th>metric</th><th>unit</th><th>better</th><th>definition</th></tr>{rows}</table>"
