"""The one definition of a sweep's summary, shared by the terminal (``kvbench.sweep``) and
the HTML report (``kvbench.report``) so both show the same statistics.

It fixes which metrics a summary shows and in which order (the experiment's headline
metrics first, ``headline.metrics`` in its YAML, else ``DEFAULT_HEADLINE``), each
column's header with its unit (from the metric catalogue, ``kvbench.metrics.METRICS``,
and ``RUN_FACTS`` for figures recorded in run.json meta), how a value is written, and
how the repeats of one configuration (``run.repeats=N``) are pooled: one row per
configuration holding the mean over its ok repeats and, with two or more, a 95 %
percentile-bootstrap confidence interval of that mean (``CI_NUM_RESAMPLES`` seeded
resamples of the repeats). A deterministic metric has equal repeats and so no interval.

``FIRST_SCREEN_METRICS`` columns are shown first (with the label and status, about ten
columns fit 1400 px); every other summary metric follows in the full table.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvbench.metrics import LATENCY_KINDS, METRICS_BY_NAME, MetricDoc
from kvbench.results import configuration_keys, run_labels


@dataclass(frozen=True)
class RunFact:
    """A figure of a run's configuration recorded in run.json meta (not measured, so not
    in the metric catalogue) that a summary may show."""

    name: str
    unit: str
    definition: str


# E.g. gqa_vs_mha's headline KV bytes per token.
RUN_FACTS: tuple[RunFact, ...] = (
    RunFact(
        "kv_bytes_per_token",
        "bytes",
        "KV cache bytes one token occupies in this run's model and KV dtype (run.json meta)",
    ),
    RunFact("kv_pool_bytes", "bytes", "the KV pool the engine was given (run.json meta)"),
)
_FACTS_BY_NAME: dict[str, RunFact] = {fact.name: fact for fact in RUN_FACTS}

# Shown first when an experiment names no headline: throughput, latency, KV memory.
DEFAULT_HEADLINE: tuple[str, ...] = (
    "output_tokens_per_s",
    "ttft_ms_median",
    "ttft_ms_p99",
    "tpot_ms_median",
    "tpot_ms_p99",
    "kv_peak_allocated_bytes",
    "peak_num_running",
    "kv_token_fraction_mean",
)
# Every metric a summary may show, in table order after the headline ones.
SUMMARY_METRICS: tuple[str, ...] = (
    "num_completed",
    "num_rejected",
    "requests_per_s",
    "output_tokens_per_s",
    "goodput_requests_per_s",
    "ttft_ms_median",
    "ttft_ms_p99",
    "tpot_ms_median",
    "tpot_ms_p99",
    "itl_ms_p99",
    "e2el_ms_p99",
    "peak_num_running",
    "kv_bytes_per_token",
    "kv_peak_allocated_bytes",
    "kv_token_fraction_mean",
    "prefix_hit_rate",
    # Side by side: what the cache hit at each request's first admission, and what an
    # unbounded cache could have hit on the same requests (same definition).
    "prefix_hit_rate_first_admission",
    "prefix_reuse_upper_bound",
    "kv_sharing_saved_fraction",
    "num_preemptions",
    "decode_roofline_fraction_mean",
    # Live-server runs: what the server itself reported (kvbench.server_metrics).
    "server_prefix_hit_rate",
    "server_num_preemptions",
    "server_kv_usage_peak",
    "server_num_waiting_peak",
)
# Metric columns shown first; with the label and status columns about ten fit 1400 px.
FIRST_SCREEN_METRICS = 8
# The per-run line printed when a run finishes (kvbench.sweep): the default headline's
# throughput, median latencies and KV peak, in the summary's headers and formats.
RUN_LINE_METRICS: tuple[str, ...] = (
    "output_tokens_per_s",
    "ttft_ms_median",
    "tpot_ms_median",
    "kv_peak_allocated_bytes",
)
CI_CONFIDENCE = 0.95
CI_NUM_RESAMPLES = 2000
CI_SEED = 0

SHORT_NAMES: dict[str, str] = {
    "num_completed": "completed",
    "num_rejected": "rejected",
    "requests_per_s": "requests",
    "output_tokens_per_s": "output",
    "goodput_requests_per_s": "goodput",
    "peak_num_running": "peak running seqs",
    "kv_bytes_per_token": "KV per token",
    "kv_peak_allocated_bytes": "peak KV",
    "kv_token_fraction_mean": "KV token share",
    "prefix_hit_rate": "prefix hit rate",
    "prefix_hit_rate_first_admission": "hit rate, 1st admission",
    "prefix_reuse_upper_bound": "reuse upper bound",
    "kv_sharing_saved_fraction": "KV saved by sharing",
    "num_preemptions": "preemptions",
    "decode_roofline_fraction_mean": "decode roofline share",
    "server_prefix_hit_rate": "server prefix hit rate",
    "server_num_preemptions": "server preemptions",
    "server_kv_usage_peak": "server KV usage peak",
    "server_num_waiting_peak": "server waiting peak",
}
# Catalogue units as a header writes them; counts are plain numbers.
UNIT_TEXT: dict[str, str] = {
    "bytes": "B",
    "count": "",
    "fraction": "0-1",
    "tokens/s": "tok/s",
    "1/s": "req/s",
}


@dataclass(frozen=True)
class Headline:
    """An experiment's headline (config ``headline``): metrics shown first, plot drawn first."""

    metrics: tuple[str, ...] = ()
    plot: str | None = None


@dataclass(frozen=True)
class SummaryColumn:
    """One metric column: ``header`` is the short name with its unit, e.g. "TTFT p99 (ms)".

    A column of bytes is written in one unit, ``byte_unit`` (B, KiB, MiB or GiB, chosen by
    its largest value), named in the header: "peak KV (MiB)".
    """

    metric: str
    header: str
    unit: str
    definition: str
    byte_unit: str = ""


@dataclass(frozen=True)
class Cell:
    """A configuration's value of one metric: the mean over its ok runs and, over two or
    more runs that differ, the bootstrap CI of that mean (NaN bounds otherwise)."""

    value: float
    ci_low_value: float = math.nan
    ci_high_value: float = math.nan
    num_values: int = 1
    missing_reason: str = ""

    @property
    def has_ci(self) -> bool:
        return math.isfinite(self.ci_low_value) and self.ci_high_value > self.ci_low_value


@dataclass(frozen=True)
class SummaryRow:
    """One configuration: its label, its runs (repeats pooled), status and cells by metric."""

    label: str
    run_ids: tuple[str, ...]
    num_ok: int
    status: str  # "ok", "failed", or "2/3 ok" when some repeats failed
    cells: Mapping[str, Cell]
    errors: tuple[str, ...]


@dataclass(frozen=True)
class SummaryView:
    """What a summary shows: ``first`` columns on the first screen, ``rest`` after them."""

    headline: Headline
    first: tuple[SummaryColumn, ...]
    rest: tuple[SummaryColumn, ...]
    rows: tuple[SummaryRow, ...]
    unknown_headline: tuple[str, ...]  # headline metrics no run recorded

    @property
    def has_repeats(self) -> bool:
        return any(len(row.run_ids) > 1 for row in self.rows)


# --------------------------------------------------------------------------- columns
def metric_doc(metric: str) -> MetricDoc | RunFact | None:
    """The catalogue entry of ``metric`` (or its RUN_FACTS entry); None when unknown
    (quality_* metrics are documented by their harness)."""
    return METRICS_BY_NAME.get(metric) or _FACTS_BY_NAME.get(metric)


BYTE_UNITS: tuple[tuple[str, int], ...] = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024), ("B", 1))


def column(metric: str, values: Sequence[float] = ()) -> SummaryColumn:
    """The summary column of ``metric``: short name, unit and definition; a bytes column
    takes the largest unit that its largest finite value in ``values`` reaches."""
    doc = metric_doc(metric)
    unit = doc.unit if doc else ""
    short = SHORT_NAMES.get(metric) or _latency_name(metric) or metric.replace("_", " ")
    byte_unit = ""
    if unit == "bytes":
        finite = [abs(v) for v in values if math.isfinite(v)]
        largest = max(finite, default=0.0)
        byte_unit = next((name for name, scale in BYTE_UNITS if largest >= scale), "B")
    unit_text = byte_unit or UNIT_TEXT.get(unit, unit)
    header = f"{short} ({unit_text})" if unit_text else short
    return SummaryColumn(metric, header, unit, doc.definition if doc else metric, byte_unit)


def _latency_name(metric: str) -> str:
    """ "TTFT p99" for ttft_ms_p99 (its unit, ms, goes into the header's parentheses)."""
    kind, _, stat = metric.partition("_ms_")
    return f"{kind.upper()} {stat}" if kind in LATENCY_KINDS and stat else ""


def headline(runs: pd.DataFrame) -> Headline:
    """The experiment's headline recorded with the runs (meta ``headline``: a dict, or its
    JSON text after a round trip through the runs frame); the first run that names one."""
    for value in runs.get("headline", ()):
        record = json.loads(value) if isinstance(value, str) and value else value
        if isinstance(record, Mapping) and (record.get("metrics") or record.get("plot")):
            return Headline(tuple(str(m) for m in record.get("metrics") or ()), record.get("plot"))
    return Headline()


def _measured(runs: pd.DataFrame, metric: str) -> bool:
    return metric in runs and bool(np.isfinite(pd.to_numeric(runs[metric], errors="coerce")).any())


# --------------------------------------------------------------------------- pooling
def bootstrap_mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """The CI_CONFIDENCE percentile-bootstrap interval of the mean of ``values`` (seeded:
    the same values give the same interval); NaN bounds for fewer than two values."""
    array = np.asarray(values, dtype=float)
    if array.size < 2:
        return math.nan, math.nan
    rng = np.random.default_rng(CI_SEED)
    means = array[rng.integers(0, array.size, (CI_NUM_RESAMPLES, array.size))].mean(axis=1)
    tail = (1.0 - CI_CONFIDENCE) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


def _cell(runs: pd.DataFrame, metric: str) -> Cell:
    values = pd.to_numeric(runs[metric], errors="coerce").to_numpy(dtype=float) if metric in runs else []
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        reasons = runs.get(f"missing.{metric}", pd.Series(dtype=object)).dropna()
        reason = str(reasons.iloc[0]) if len(reasons) else "not measured"
        return Cell(math.nan, num_values=0, missing_reason=reason)
    low, high = bootstrap_mean_ci(finite)
    return Cell(float(np.mean(finite)), low, high, len(finite))


def pool(runs: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(label, its runs) per configuration, in first-run order; repeats share one entry."""
    if runs.empty:
        return []
    labels = run_labels(runs)
    keys = configuration_keys(runs)
    return [
        (str(labels[group.index[0]]), runs.loc[group.index]) for _, group in keys.groupby(keys, sort=False)
    ]


def summary_view(runs: pd.DataFrame) -> SummaryView:
    """The summary of ``runs``: headline-first columns and one row per configuration."""
    line = headline(runs)
    quality = sorted(c for c in runs.columns if c.startswith("quality_"))
    measured = [m for m in dict.fromkeys((*line.metrics, *SUMMARY_METRICS, *quality)) if _measured(runs, m)]
    lead = [m for m in dict.fromkeys((*line.metrics, *DEFAULT_HEADLINE)) if m in measured]
    first = lead[:FIRST_SCREEN_METRICS]
    rest = [m for m in measured if m not in first]
    rows = []
    for label, members in pool(runs):
        status = members["status"].astype(str) if "status" in members else pd.Series("ok", members.index)
        ok = members[status == "ok"]
        num_ok = len(ok)
        text = "ok" if num_ok == len(members) else "failed" if num_ok == 0 else f"{num_ok}/{len(members)} ok"
        errors = tuple(
            str(e) for e in members.get("error", pd.Series(dtype=object)) if isinstance(e, str) and e
        )
        if num_ok:
            cells = {m: _cell(ok, m) for m in (*first, *rest)}
        else:
            cells = {
                m: Cell(math.nan, num_values=0, missing_reason="the run failed") for m in (*first, *rest)
            }
        rows.append(SummaryRow(label, tuple(members["run_id"].astype(str)), num_ok, text, cells, errors))

    def columns(names: list[str]) -> tuple[SummaryColumn, ...]:
        return tuple(column(m, [row.cells[m].value for row in rows]) for m in names)

    return SummaryView(
        headline=line,
        first=columns(first),
        rest=columns(rest),
        rows=tuple(rows),
        unknown_headline=tuple(m for m in line.metrics if m not in measured),
    )


# --------------------------------------------------------------------------- formatting
def format_value(column: SummaryColumn, value: object) -> str:
    """One value as a summary writes it: "-" for NaN; bytes in the column's unit with three
    significant digits; fractions with three decimals; integers with thousands
    separators; else four significant digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return str(value)
    number = float(value)
    if column.byte_unit:
        scaled = number / dict(BYTE_UNITS)[column.byte_unit]
        return f"{scaled:,.0f}" if column.byte_unit == "B" or abs(scaled) >= 100 else f"{scaled:.3g}"
    if column.unit == "fraction":
        return f"{number:.3f}"
    if number.is_integer() and abs(number) < 1e15:
        return f"{int(number):,}"
    return f"{number:,.4g}" if abs(number) < 1e4 else f"{number:,.0f}"


def format_cell(column: SummaryColumn, cell: Cell) -> str:
    """The cell's text: its value, and "±h" (half the CI's width) when repeats differ."""
    text = format_value(column, cell.value)
    if cell.has_ci:
        text += " \u00b1" + format_value(column, (cell.ci_high_value - cell.ci_low_value) / 2.0)
    return text


def cell_note(column: SummaryColumn, cell: Cell) -> str:
    """Hover text of a cell: why it is empty, or how a pooled value was made."""
    if cell.num_values == 0:
        return cell.missing_reason
    if cell.num_values == 1:
        return ""
    interval = (
        f"; {CI_CONFIDENCE:.0%} bootstrap CI of the mean [{format_value(column, cell.ci_low_value)}, "
        f"{format_value(column, cell.ci_high_value)}]"
        if cell.has_ci
        else "; all equal"
    )
    return f"mean of {cell.num_values} repeats{interval}"


def pooled_runs(runs: pd.DataFrame, sep: str = " ") -> pd.DataFrame:
    """One row per configuration with at least one ok run, for plots: ``label`` (parts
    joined by ``sep``), ``run_ids`` (its ok runs), the first ok run's other values, and
    for every numeric column the mean over the ok runs plus ``<column>.ci_low`` /
    ``<column>.ci_high`` (``bootstrap_mean_ci``; NaN with one run or equal values)."""
    if runs.empty:
        return runs.assign(label=pd.Series(dtype=str), run_ids=pd.Series(dtype=object))
    labels = run_labels(runs, sep=sep)
    status = runs["status"].astype(str) if "status" in runs else pd.Series("ok", index=runs.index)
    numeric = [c for c in runs.columns if pd.api.types.is_numeric_dtype(runs[c]) and c != "run.repeat"]
    rows = []
    keys = configuration_keys(runs)
    for _, group in keys.groupby(keys, sort=False):
        ok = runs.loc[[i for i in group.index if status[i] == "ok"]]
        if ok.empty:
            continue
        row = {**ok.iloc[0].to_dict(), "label": str(labels[group.index[0]])}
        row["run_ids"] = tuple(ok["run_id"].astype(str))
        for c in numeric:
            values = ok[c].to_numpy(dtype=float)
            finite = values[np.isfinite(values)]
            row[c] = float(finite.mean()) if finite.size else math.nan
            distinct = finite.size > 1 and finite.min() < finite.max()
            row[f"{c}.ci_low"], row[f"{c}.ci_high"] = (
                bootstrap_mean_ci(finite) if distinct else (math.nan, math.nan)
            )
        rows.append(row)
    return pd.DataFrame(rows)
