"""Compare two result sets (baseline vs candidate): matched runs, metric changes, gates.

Runs are matched by configuration -- engine and its params, model, hardware, workload,
mode and seed (the runs-frame columns ``engine``, ``engine.*``, ``model.*``,
``hardware.*``, ``workload``, ``mode``, ``seed``) -- never by run id, timestamps or
environment. When one side has several runs of a configuration (repeats), their median
is compared, which is what a noisy nightly machine needs.

A gate ``METRIC:+10%`` fails when the candidate is more than 10 % above the baseline;
``METRIC:-5%`` when it is more than 5 % below; ``METRIC:+2`` is an absolute change in the
metric's unit. A gated metric measured in the baseline but missing (NaN) in the
candidate fails too, and so does a configuration that ran in the baseline but failed in
the candidate. Runs present on one side only are listed, not failed.

Exit codes of ``kvbench compare``: 0 pass, 1 regression, 2 bad input or nothing matched.
"""

from __future__ import annotations

import argparse
import html
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from kvbench import metrics
from kvbench.results import ResultsError, config_columns, load, plain_value, run_labels

# Short names from the issue text and the docs, resolved to metric names.
ALIASES: dict[str, str] = {
    "throughput": "output_tokens_per_s",
    "request_throughput": "requests_per_s",
    "goodput": "goodput_requests_per_s",
    **{
        f"{kind}_{stat}": f"{kind}_ms_{stat}"
        for kind in metrics.LATENCY_KINDS
        for stat in metrics.LATENCY_STATS
    },
}
# Printed by default (all metrics go into the HTML report and CompareResult.table).
HEADLINE_METRICS: tuple[str, ...] = (
    "output_tokens_per_s",
    "requests_per_s",
    "ttft_ms_median",
    "ttft_ms_p99",
    "tpot_ms_median",
    "tpot_ms_p99",
    "itl_ms_p99",
    "e2el_ms_p99",
    "kv_peak_allocated_bytes",
    "kv_token_fraction_mean",
    "prefix_hit_rate",
    "prefix_hit_rate_first_admission",
    "peak_num_running",
    "num_preemptions",
)
# Config columns that do not define what was run (an SLO only changes goodput's verdict).
IGNORED_CONFIG_PREFIXES: tuple[str, ...] = ("slo.",)
_GATE = re.compile(r"^(?P<metric>[A-Za-z0-9_.]+):(?P<sign>[+-])(?P<value>\d+(\.\d+)?)(?P<pct>%?)$")


class CompareError(ValueError):
    """Unusable compare input (bad gate, unknown metric, nothing matched); message says which."""


@dataclass(frozen=True)
class Gate:
    """Fail when ``sign * (candidate - baseline)`` exceeds ``limit`` (times |baseline| if relative)."""

    metric: str
    sign: int  # +1: an increase is a regression; -1: a decrease is
    limit: float
    relative: bool
    text: str

    def regressed(self, baseline: float, candidate: float) -> bool:
        change = self.sign * (candidate - baseline)
        bound = self.limit * abs(baseline) if self.relative else self.limit
        return change > bound


@dataclass(frozen=True)
class CompareResult:
    """What ``compare`` found.

    ``table``: one row per (matched configuration, metric) with ``run`` (label), ``metric``,
    ``baseline``, ``candidate``, ``change``, ``change_pct`` (NaN when baseline is 0),
    ``verdict`` ("better", "worse", "same", "" when the metric has no preferred direction
    or a side is NaN), ``gate`` (the gate text or "") and ``regressed`` (bool).
    ``failures``: one message per gate violation or run that failed only in the candidate.
    """

    table: pd.DataFrame
    failures: tuple[str, ...]
    unmatched_baseline: tuple[str, ...]
    unmatched_candidate: tuple[str, ...]
    num_matched: int

    @property
    def passed(self) -> bool:
        return not self.failures


def parse_gate(text: str, known_metrics: Sequence[str] = ()) -> Gate:
    """Parse ``METRIC:+10%`` / ``METRIC:-5%`` / ``METRIC:+2``; aliases (``tpot_p99``) resolve.

    Raises CompareError naming the text when malformed or (given ``known_metrics``) unknown.
    """
    match = _GATE.match(text.strip())
    if not match:
        raise CompareError(
            f"--fail-on {text!r}: expected METRIC:+N% or METRIC:-N% (or an absolute METRIC:+N)"
        )
    metric = ALIASES.get(match["metric"], match["metric"])
    if known_metrics and metric not in known_metrics:
        raise CompareError(
            f"--fail-on {text!r}: unknown metric {metric!r}; known: {', '.join(sorted(known_metrics))}"
        )
    relative = match["pct"] == "%"
    value = float(match["value"])
    return Gate(metric, 1 if match["sign"] == "+" else -1, value / 100 if relative else value, relative, text)


def better_direction(metric: str) -> str:
    """ "lower", "higher" or "" for a metric; ``quality_*`` metrics are higher-better unless
    their name says perplexity, loss, KL or error."""
    doc = metrics.METRICS_BY_NAME.get(metric)
    if doc is not None:
        return doc.better
    if metric.startswith("quality_"):
        lower = ("perplexity", "ppl", "loss", "kl", "error")
        return "lower" if any(word in metric for word in lower) else "higher"
    return ""


def compare(
    baseline_path: str | os.PathLike[str],
    candidate_path: str | os.PathLike[str],
    fail_on: Sequence[str] = (),
) -> CompareResult:
    """Match runs of two result directories by configuration and compare their metrics.

    Reads only. Raises ResultsError when a side has no results and CompareError when a
    gate is malformed or names an unknown metric, or when no configuration matches.
    """
    base = load(baseline_path).runs
    cand = load(candidate_path).runs
    known = _metric_columns(base, cand)
    gates = [parse_gate(text, known) for text in fail_on]
    keys = _match_columns(base, cand)
    base = base.assign(_key=_keys(base, keys))
    cand = cand.assign(_key=_keys(cand, keys))
    # One label per configuration, from what varies across both sides.
    configs = pd.concat([base, cand], ignore_index=True).drop_duplicates("_key", ignore_index=True)
    labels = dict(zip(configs["_key"], run_labels(configs)))
    matched = [key for key in dict.fromkeys(base["_key"]) if key in set(cand["_key"])]
    if not matched:
        raise CompareError(
            f"no run of {candidate_path} matches a run of {baseline_path} by configuration "
            f"(matched on {', '.join(keys)})"
        )
    rows, failures = [], []
    for key in matched:
        base_ok, cand_ok = _ok(base, key), _ok(cand, key)
        label = labels[key]
        if cand_ok.empty or base_ok.empty:
            if cand_ok.empty and not base_ok.empty:
                errors = "; ".join(str(e) for e in cand[cand["_key"] == key].get("error", []) if e)
                failures.append(f"{label}: failed in the candidate ({errors or 'no error recorded'})")
            continue
        for metric in known:
            b = _median(base_ok, metric)
            c = _median(cand_ok, metric)
            if math.isnan(b) and math.isnan(c):
                continue
            regressed = False
            metric_gates = [g for g in gates if g.metric == metric]
            for gate in metric_gates:  # every gate on the metric applies
                if math.isnan(b):
                    continue
                if math.isnan(c):
                    regressed = True
                    failures.append(
                        f"{label}: {metric} measured in the baseline ({b:.4g}) but missing in the candidate"
                    )
                    break
                if gate.regressed(b, c):
                    regressed = True
                    failures.append(f"{label}: {metric} {b:.4g} -> {c:.4g} ({_pct(b, c)}) breaks {gate.text}")
            rows.append(
                {
                    "run": label,
                    "metric": metric,
                    "baseline": b,
                    "candidate": c,
                    "change": c - b,
                    "change_pct": (c - b) / abs(b) * 100 if b != 0 and not math.isnan(b) else math.nan,
                    "verdict": _verdict(metric, b, c),
                    "gate": " ".join(g.text for g in metric_gates),
                    "regressed": regressed,
                }
            )
    table = pd.DataFrame(
        rows,
        columns=[
            "run",
            "metric",
            "baseline",
            "candidate",
            "change",
            "change_pct",
            "verdict",
            "gate",
            "regressed",
        ],
    )
    cand_keys, base_keys = set(cand["_key"]), set(base["_key"])
    return CompareResult(
        table=table,
        failures=tuple(failures),
        unmatched_baseline=tuple(sorted(labels[k] for k in base_keys - cand_keys)),
        unmatched_candidate=tuple(sorted(labels[k] for k in cand_keys - base_keys)),
        num_matched=len(matched),
    )


def _metric_columns(*frames: pd.DataFrame) -> list[str]:
    names = [doc.name for doc in metrics.METRICS]
    extra = sorted({c for f in frames for c in f.columns if c.startswith("quality_")})
    return [n for n in [*names, *extra] if any(n in f for f in frames)]


def _match_columns(*frames: pd.DataFrame) -> list[str]:
    columns = dict.fromkeys(c for f in frames for c in config_columns(f))
    return [c for c in columns if not c.startswith(IGNORED_CONFIG_PREFIXES)]


def _keys(runs: pd.DataFrame, columns: Sequence[str]) -> list[str]:
    present = [c for c in columns if c in runs]
    return ["|".join(f"{c}={plain_value(row[c])}" for c in present) for _, row in runs.iterrows()]


def _ok(runs: pd.DataFrame, key: str) -> pd.DataFrame:
    same = runs[runs["_key"] == key]
    return same[same["status"] == "ok"] if "status" in same else same


def _median(runs: pd.DataFrame, metric: str) -> float:
    if metric not in runs:
        return math.nan
    values = runs[metric].to_numpy(dtype=float)
    values = values[np.isfinite(values)]
    return float(np.median(values)) if values.size else math.nan


def _verdict(metric: str, baseline: float, candidate: float) -> str:
    direction = better_direction(metric)
    if not direction or math.isnan(baseline) or math.isnan(candidate):
        return ""
    if candidate == baseline:
        return "same"
    up = candidate > baseline
    return "better" if up == (direction == "higher") else "worse"


def _pct(baseline: float, candidate: float) -> str:
    if baseline == 0 or math.isnan(baseline) or math.isnan(candidate):
        return "n/a"
    return f"{(candidate - baseline) / abs(baseline) * 100:+.1f}%"


# --------------------------------------------------------------------------- output
def print_table(result: CompareResult, console: Console, show_all: bool = False) -> None:
    """Print the change table (headline and gated metrics unless ``show_all``) and failures."""
    shown = result.table
    if not show_all:
        shown = shown[shown["metric"].isin(HEADLINE_METRICS) | (shown["gate"] != "")]
    table = Table(title=f"kvbench compare: {result.num_matched} matched configuration(s)")
    for name, justify in (
        ("run", "left"),
        ("metric", "left"),
        ("baseline", "right"),
        ("candidate", "right"),
        ("change", "right"),
        ("verdict", "left"),
        ("gate", "left"),
    ):
        table.add_column(name, justify=justify)
    styles = {"better": "green", "worse": "red"}
    for row in shown.itertuples():
        verdict = row.verdict + (" REGRESSION" if row.regressed else "")
        style = "bold red" if row.regressed else styles.get(row.verdict, "")
        table.add_row(
            row.run,
            row.metric,
            f"{row.baseline:.4g}",
            f"{row.candidate:.4g}",
            _pct(row.baseline, row.candidate),
            verdict,
            row.gate,
            style=style,
        )
    console.print(table)
    for name, items in (
        ("only in baseline", result.unmatched_baseline),
        ("only in candidate", result.unmatched_candidate),
    ):
        if items:
            console.print(f"{name}: {', '.join(items)}")
    for failure in result.failures:
        console.print(f"[bold red]FAIL[/] {failure}", highlight=False)
    console.print("[green]PASS[/]" if result.passed else f"[bold red]{len(result.failures)} failure(s)[/]")


def write_html(result: CompareResult, path: str | os.PathLike[str], baseline: str, candidate: str) -> Path:
    """Write a self-contained HTML diff report (no scripts) and return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    colors = {"better": "#e6f4ea", "worse": "#fdecea"}
    rows = []
    for row in result.table.itertuples():
        color = "#f8c9c4" if row.regressed else colors.get(row.verdict, "")
        style = f' style="background:{color}"' if color else ""
        rows.append(
            f"<tr{style}><td>{html.escape(row.run)}</td><td><code>{row.metric}</code></td>"
            f"<td>{row.baseline:.4g}</td><td>{row.candidate:.4g}</td><td>{_pct(row.baseline, row.candidate)}</td>"
            f"<td>{row.verdict}{' REGRESSION' if row.regressed else ''}</td><td>{html.escape(row.gate)}</td></tr>"
        )
    failures = "".join(f"<li>{html.escape(f)}</li>" for f in result.failures)
    unmatched = "".join(
        f"<p>{name}: {html.escape(', '.join(items))}</p>"
        for name, items in (
            ("Only in baseline", result.unmatched_baseline),
            ("Only in candidate", result.unmatched_candidate),
        )
        if items
    )
    verdict = "PASS" if result.passed else f"FAIL ({len(result.failures)})"
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>kvbench compare: {verdict}</title>
<style>body {{ font-family: system-ui, sans-serif; margin: 1.5rem auto; max-width: 1200px; }}
table {{ border-collapse: collapse; font-size: 0.85rem; }} td, th {{ border: 1px solid #ddd; padding: 0.2rem 0.5rem; }}
</style></head><body>
<h1>kvbench compare: {verdict}</h1>
<p>baseline <code>{html.escape(baseline)}</code>, candidate <code>{html.escape(candidate)}</code>,
{result.num_matched} matched configuration(s). Green: better, red: worse; darker red: a gate failed.</p>
<ul>{failures}</ul>{unmatched}
<table><tr><th>run</th><th>metric</th><th>baseline</th><th>candidate</th><th>change</th><th>verdict</th><th>gate</th></tr>
{"".join(rows)}</table></body></html>
"""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(page)
    os.replace(tmp, path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``kvbench compare BASELINE CANDIDATE [--fail-on M:+N% ...] [--html OUT] [--all]``.

    Prints the table, writes the HTML diff (default ``reports/compare-<candidate>.html``)
    and returns 0 (pass), 1 (a gate failed or a run failed only in the candidate) or 2.
    """
    parser = argparse.ArgumentParser(prog="kvbench compare", description="Compare two result directories.")
    parser.add_argument("baseline")
    parser.add_argument("candidate")
    parser.add_argument(
        "--fail-on",
        nargs="+",
        default=[],
        action="extend",
        metavar="METRIC:±N%",
        help="gates such as tpot_ms_p99:+10%% output_tokens_per_s:-5%%",
    )
    parser.add_argument("--html", default=None, help="HTML diff report path")
    parser.add_argument("--all", action="store_true", help="print every metric, not only the headline ones")
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160)
    try:
        result = compare(args.baseline, args.candidate, args.fail_on)
    except (ResultsError, CompareError) as exc:
        console.print(f"kvbench compare: {exc}", highlight=False, markup=False)
        return 2
    print_table(result, console, show_all=args.all)
    out = args.html or Path("reports") / f"compare-{Path(args.candidate).resolve().name}.html"
    console.print(f"HTML diff: {write_html(result, out, args.baseline, args.candidate)}", highlight=False)
    return 0 if result.passed else 1
