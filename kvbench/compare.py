"""Compare two result sets (baseline vs candidate): matched runs, metric changes, gates.

Runs are matched by their configuration identity -- engine and its params, model,
hardware, workload and its params, run options, mode and seed (the runs-frame columns
``engine``, ``engine.*``, ``model.*``, ``hardware.*``, ``workload``, ``workload_params.*``,
``run.*``, ``mode``, ``seed``; never run id, sweep name, timestamps, environment or SLO).
The key is built from the same columns on both sides -- the union of what either side
recorded -- with a value a run does not have (a slab run has no ``prefix_cache``) read as
empty, so one run directory matches itself inside a sweep whatever else that sweep ran.
When one side has several runs of a configuration (repeats), their median is compared,
which is what a noisy nightly machine needs.

A gate ``METRIC:+10%`` fails when the candidate is more than 10 % above the baseline;
``METRIC:-5%`` when it is more than 5 % below; ``METRIC:+2`` is an absolute change in the
metric's unit. Verdicts that cannot be made fail too:

- a gated metric that is missing (NaN) in the baseline, the candidate or both cannot be
  judged, and fails its gate;
- a configuration that ran in the baseline but is absent from the candidate fails;
- a configuration that ran in the baseline but failed in the candidate fails.

``--allow-missing`` turns the first two into notes ("not judged") instead of failures, for
metrics that some configurations do not measure and for a candidate that deliberately ran
fewer configurations. A configuration that failed in the baseline is not judged (listed);
runs present only in the candidate are listed, not failed.

Only the summary metrics in each run's run.json are compared: per-request rows
(requests.parquet) and per-step rows are not read, so a regression visible only there --
say in a few requests' latencies that leave every summary percentile unchanged -- is not
seen. Gate on the summary metric that captures it.

Exit codes of ``kvbench compare``: 0 pass, 1 a failure above, 2 bad input (unreadable
results, a malformed gate, no configuration matched, an output path kvbench did not write).
"""

from __future__ import annotations

import argparse
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
from rich.markup import escape as escape_markup
from rich.table import Table
from rich.text import Text

from kvbench import metrics
from kvbench.html_page import GENERATOR_META, PageOutputError, escape, write_page
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
    ``verdict`` ("better", "worse", "same", "cannot judge" for a gated metric that is NaN on
    a side, "" when the metric has no preferred direction or an ungated side is NaN),
    ``gate`` (the gate text or "") and ``regressed`` (bool: the row fails a gate).
    ``failures``: one message per gate violation, gated metric that cannot be judged, run
    missing from the candidate, or run that failed only in the candidate.
    ``not_judged``: the same "cannot judge" and missing-run messages when ``allow_missing``
    made them notes instead of failures. ``failed_in_baseline``: labels of configurations
    whose baseline run failed, so nothing in them was judged.
    """

    table: pd.DataFrame
    failures: tuple[str, ...]
    unmatched_baseline: tuple[str, ...]
    unmatched_candidate: tuple[str, ...]
    num_matched: int
    not_judged: tuple[str, ...] = ()
    failed_in_baseline: tuple[str, ...] = ()

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
    allow_missing: bool = False,
) -> CompareResult:
    """Match runs of two result directories by configuration identity and compare their metrics.

    Reads only. Raises ResultsError when a side has no results and CompareError when a
    gate is malformed or names an unknown metric, or when no configuration matches.
    ``allow_missing``: gated metrics that are NaN on a side, and configurations missing
    from the candidate, become ``not_judged`` notes instead of failures.
    """
    base = load(baseline_path).runs
    cand = load(candidate_path).runs
    known = _metric_columns(base, cand)
    gates = [parse_gate(text, known) for text in fail_on]
    columns = identity_columns(base, cand)
    base = base.assign(_key=identity_keys(base, columns))
    cand = cand.assign(_key=identity_keys(cand, columns))
    # One label per configuration, from what varies across both sides.
    configs = pd.concat([base, cand], ignore_index=True).drop_duplicates("_key", ignore_index=True)
    labels = dict(zip(configs["_key"], run_labels(configs)))
    cand_keys, base_keys = set(cand["_key"]), set(base["_key"])
    matched = [key for key in dict.fromkeys(base["_key"]) if key in cand_keys]
    if not matched:
        raise CompareError(
            f"no run of {candidate_path} matches a run of {baseline_path} by configuration "
            f"(matched on {', '.join(columns)})"
        )
    rows, failures, not_judged, failed_in_baseline = [], [], [], []
    unjudged = not_judged if allow_missing else failures
    for key in matched:
        base_ok, cand_ok = _ok(base, key), _ok(cand, key)
        label = labels[key]
        if base_ok.empty:
            failed_in_baseline.append(label)
            continue
        if cand_ok.empty:
            errors = "; ".join(str(e) for e in cand[cand["_key"] == key].get("error", []) if e)
            failures.append(f"{label}: failed in the candidate ({errors or 'no error recorded'})")
            continue
        for metric in known:
            b = _median(base_ok, metric)
            c = _median(cand_ok, metric)
            metric_gates = [g for g in gates if g.metric == metric]
            if math.isnan(b) and math.isnan(c) and not metric_gates:
                continue
            verdict = _verdict(metric, b, c)
            regressed = False
            if metric_gates and (math.isnan(b) or math.isnan(c)):
                verdict = "cannot judge"
                regressed = not allow_missing
                unjudged.append(
                    f"{label}: {metric} cannot be judged by {' '.join(g.text for g in metric_gates)}: "
                    + _missing_sides(b, c, _why_missing(base_ok, metric), _why_missing(cand_ok, metric))
                )
            else:
                for gate in metric_gates:  # every gate on the metric applies
                    if gate.regressed(b, c):
                        regressed = True
                        failures.append(
                            f"{label}: {metric} {b:.4g} -> {c:.4g} ({_pct(b, c)}) breaks {gate.text}"
                        )
            rows.append(
                {
                    "run": label,
                    "metric": metric,
                    "baseline": b,
                    "candidate": c,
                    "change": c - b,
                    "change_pct": (c - b) / abs(b) * 100 if b != 0 and not math.isnan(b) else math.nan,
                    "verdict": verdict,
                    "gate": " ".join(g.text for g in metric_gates),
                    "regressed": regressed,
                }
            )
    unmatched_baseline = tuple(sorted(labels[k] for k in base_keys - cand_keys))
    unjudged.extend(
        f"{label}: ran in the baseline but is missing from the candidate" for label in unmatched_baseline
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
    return CompareResult(
        table=table,
        failures=tuple(failures),
        unmatched_baseline=unmatched_baseline,
        unmatched_candidate=tuple(sorted(labels[k] for k in cand_keys - base_keys)),
        num_matched=len(matched),
        not_judged=tuple(not_judged),
        failed_in_baseline=tuple(failed_in_baseline),
    )


def _metric_columns(*frames: pd.DataFrame) -> list[str]:
    names = [doc.name for doc in metrics.METRICS]
    extra = sorted({c for f in frames for c in f.columns if c.startswith("quality_")})
    return [n for n in [*names, *extra] if any(n in f for f in frames)]


def identity_columns(*frames: pd.DataFrame) -> list[str]:
    """The columns that identify a configuration: config columns of any frame, SLOs excluded."""
    columns = dict.fromkeys(c for f in frames for c in config_columns(f))
    return [c for c in columns if not c.startswith(IGNORED_CONFIG_PREFIXES)]


def identity_keys(runs: pd.DataFrame, columns: Sequence[str]) -> list[str]:
    """One configuration key per run over exactly ``columns``.

    A column the frame lacks reads as empty, like a null or NaN value: a run loaded alone
    has only its own config columns, the same run inside a sweep has NaN in the columns
    other runs brought, and both must give the same key.
    """
    return [
        "|".join(f"{c}={plain_value(row[c]) if c in runs else ''}" for c in columns)
        for _, row in runs.iterrows()
    ]


def _missing_sides(baseline: float, candidate: float, why_baseline: str, why_candidate: str) -> str:
    """Which side of a gated metric is NaN, with the reasons the runs recorded."""
    if math.isnan(baseline) and math.isnan(candidate):
        return f"missing on both sides (baseline: {why_baseline}; candidate: {why_candidate})"
    if math.isnan(baseline):
        return f"missing in the baseline ({why_baseline}), candidate {candidate:.4g}"
    return f"measured in the baseline ({baseline:.4g}) but missing in the candidate ({why_candidate})"


def _why_missing(runs: pd.DataFrame, metric: str) -> str:
    """The first ``missing.<metric>`` reason recorded by ``runs`` (run.json "missing")."""
    column = f"missing.{metric}"
    reasons = [r for r in runs.get(column, pd.Series(dtype=object)) if isinstance(r, str) and r]
    return reasons[0] if reasons else "no reason recorded"


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
    """Print the change table (headline and gated metrics unless ``show_all``) and failures.

    Labels and metric names come from result files: they are printed as plain text, never
    read as rich markup.
    """
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
    styles = {"better": "green", "worse": "red", "cannot judge": "yellow"}
    for row in shown.itertuples():
        style = "bold red" if row.regressed else styles.get(row.verdict, "")
        table.add_row(
            Text(row.run),
            Text(row.metric),
            f"{row.baseline:.4g}",
            f"{row.candidate:.4g}",
            _pct(row.baseline, row.candidate),
            _verdict_text(row.verdict, row.regressed),
            Text(row.gate),
            style=style,
        )
    console.print(table)
    for name, items in (
        ("only in baseline", result.unmatched_baseline),
        ("only in candidate", result.unmatched_candidate),
        ("failed in the baseline (not judged)", result.failed_in_baseline),
    ):
        if items:
            console.print(f"{name}: {', '.join(items)}", markup=False, highlight=False)
    for note in result.not_judged:
        console.print(f"[yellow]NOT JUDGED[/] {escape_markup(note)} (--allow-missing)", highlight=False)
    for failure in result.failures:
        console.print(f"[bold red]FAIL[/] {escape_markup(failure)}", highlight=False)
    console.print("[green]PASS[/]" if result.passed else f"[bold red]{len(result.failures)} failure(s)[/]")


def _verdict_text(verdict: str, regressed: bool) -> str:
    if not regressed:
        return verdict
    return "CANNOT JUDGE" if verdict == "cannot judge" else f"{verdict} REGRESSION"


def write_html(result: CompareResult, path: str | os.PathLike[str], baseline: str, candidate: str) -> Path:
    """Write a self-contained HTML diff report (no scripts) and return its path.

    Every string from the results goes through ``html_page.escape``. Raises PageOutputError
    (naming the path) when ``path`` holds something kvbench did not write.
    """
    colors = {"better": "#e6f4ea", "worse": "#fdecea", "cannot judge": "#fff4d6"}
    rows = []
    for row in result.table.itertuples():
        color = "#f8c9c4" if row.regressed else colors.get(row.verdict, "")
        style = f' style="background:{color}"' if color else ""
        cells = (
            escape(row.run),
            f"<code>{escape(row.metric)}</code>",
            f"{row.baseline:.4g}",
            f"{row.candidate:.4g}",
            _pct(row.baseline, row.candidate),
            escape(_verdict_text(row.verdict, row.regressed)),
            escape(row.gate),
        )
        rows.append(f"<tr{style}>{''.join(f'<td>{cell}</td>' for cell in cells)}</tr>")
    failures = "".join(f"<li>{escape(f)}</li>" for f in result.failures)
    notes = "".join(f"<li>not judged (--allow-missing): {escape(n)}</li>" for n in result.not_judged)
    unmatched = "".join(
        f"<p>{name}: {escape(', '.join(items))}</p>"
        for name, items in (
            ("Only in baseline", result.unmatched_baseline),
            ("Only in candidate", result.unmatched_candidate),
            ("Failed in the baseline (not judged)", result.failed_in_baseline),
        )
        if items
    )
    verdict = "PASS" if result.passed else f"FAIL ({len(result.failures)})"
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
{GENERATOR_META}
<title>kvbench compare: {verdict}</title>
<style>body {{ font-family: system-ui, sans-serif; margin: 1.5rem auto; max-width: 1200px; }}
table {{ border-collapse: collapse; font-size: 0.85rem; }} td, th {{ border: 1px solid #ddd; padding: 0.2rem 0.5rem; }}
</style></head><body>
<h1>kvbench compare: {verdict}</h1>
<p>baseline <code>{escape(baseline)}</code>, candidate <code>{escape(candidate)}</code>,
{result.num_matched} matched configuration(s). Green: better, red: worse; darker red: a gate failed;
yellow: a gated metric missing on a side (cannot judge). Only run.json summary metrics are compared.</p>
<ul>{failures}{notes}</ul>{unmatched}
<table><tr><th>run</th><th>metric</th><th>baseline</th><th>candidate</th><th>change</th><th>verdict</th><th>gate</th></tr>
{"".join(rows)}</table></body></html>
"""
    return write_page(path, page)


HELP_EPILOG = """Runs are matched by configuration identity (engine, model, hardware, workload and their
parameters, run options, mode, seed), the same key on both sides, so one run directory
can be compared against a sweep that contains it. Repeats of a configuration compare by
median.

Failures (exit 1): a gate broken; a gated metric that is NaN on either side ("cannot
judge"); a configuration that ran in the baseline but is missing from the candidate; a
configuration that failed only in the candidate. --allow-missing makes the NaN and
missing-configuration cases notes instead of failures.

Only the summary metrics recorded in each run.json are compared; requests.parquet and
steps.parquet are not read, so a regression visible only in per-request rows is not seen.

Exit codes: 0 pass, 1 failure, 2 bad input (unreadable results, malformed gate, nothing
matched, an HTML output path holding a file kvbench did not write).
"""


def main(argv: Sequence[str] | None = None) -> int:
    """``kvbench compare BASELINE CANDIDATE [--fail-on M:+N% ...] [--allow-missing] [--html OUT] [--all]``.

    Prints the table, writes the HTML diff (default ``reports/compare-<candidate>.html``)
    and returns 0 (pass), 1 (a failure, see the module docstring) or 2 (bad input).
    """
    parser = argparse.ArgumentParser(
        prog="kvbench compare",
        description="Compare two result directories (baseline, candidate) and gate on metric changes.",
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    parser.add_argument(
        "--allow-missing",
        action="store_true",
        help="a gated metric that is NaN on either side, or a baseline configuration missing from "
        "the candidate, is reported as not judged instead of failing",
    )
    parser.add_argument(
        "--html",
        default=None,
        help="HTML diff report path (default reports/compare-<candidate>.html; "
        "an existing file is replaced only if kvbench wrote it)",
    )
    parser.add_argument("--all", action="store_true", help="print every metric, not only the headline ones")
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160)
    try:
        result = compare(args.baseline, args.candidate, args.fail_on, allow_missing=args.allow_missing)
    except (ResultsError, CompareError) as exc:
        console.print(f"kvbench compare: {exc}", highlight=False, markup=False)
        return 2
    print_table(result, console, show_all=args.all)
    out = args.html or Path("reports") / f"compare-{Path(args.candidate).resolve().name}.html"
    try:
        written = write_html(result, out, args.baseline, args.candidate)
    except PageOutputError as exc:
        console.print(f"kvbench compare: {exc}", highlight=False, markup=False)
        return 2
    console.print(f"HTML diff: {written}", highlight=False, markup=False)
    return 0 if result.passed else 1
