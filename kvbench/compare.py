"""Compare two result sets (baseline vs candidate): matched runs, metric changes, gates.

Runs are matched by their configuration identity -- engine and its params, model,
hardware, workload and its params, run options, mode and seed (the runs-frame columns
``engine``, ``engine.*``, ``model.*``, ``hardware.*``, ``workload``, ``workload_params.*``,
``run.*``, ``mode``, ``seed``; never run id, sweep name, timestamps, environment, SLO or the
repeat index ``run.repeat``). The key is built from the same columns on both sides -- the
union of what either side recorded -- with a value a run does not have (a slab run has no
``prefix_cache``) read as empty, so one run directory matches itself inside a sweep
whatever else that sweep ran. The runs of one configuration on a side (its repeats,
``kvbench sweep run.repeats=N``) are pooled, and their medians are compared.

How a change is judged depends on whether the metric is *deterministic* or *timed* in the
runs compared (``kvbench.metrics``: each metric's ``source``, and ``metrics.is_timed`` with
the run's mode and arrivals):

- deterministic (KV bytes, token-state share, hit rates and preemptions under offline
  arrivals or in sim mode, every engine metric in sim mode): compared exactly, and a gate
  fails when the change exceeds its threshold;
- timed (latencies and throughputs in real mode; KV state under real-time arrivals; sampled
  memory; a live server's figures): each side needs at least ``stats.MIN_REPEATS`` runs.
  A seeded bootstrap (``kvbench.stats``: each side resampled on its own, percentile
  interval of the change of the medians, 95 % by default) decides: "regression" when the
  whole interval lies beyond the gate's threshold, "pass" when it lies within, otherwise
  "inconclusive". With fewer runs a timed gate is "inconclusive", never a regression: one
  run a side says nothing about the noise. Inconclusive gates are listed, not failed.

A gate ``METRIC:+10%`` is broken when the candidate is more than 10 % above the baseline;
``METRIC:-5%`` when it is more than 5 % below; ``METRIC:+2`` is an absolute change in the
metric's unit. Verdicts that cannot be made fail too:

- a gated metric that is missing (NaN) in the baseline, the candidate or both cannot be
  judged, and fails its gate;
- a configuration that ran in the baseline but is absent from the candidate fails;
- a configuration that failed in the candidate (every repeat) fails.

``--allow-missing`` turns the first two into notes ("not judged") instead of failures, for
metrics that some configurations do not measure and for a candidate that deliberately ran
fewer configurations. A configuration that failed in the baseline is not judged (listed);
runs present only in the candidate are listed, not failed.

Every run records a machine-speed probe (``kvbench.probe``, ``env.probe_*``), measured
right before it. ``compare`` prints the candidate machine's speed relative to the
baseline's (each probe's median over a side's runs; the factor is their geometric mean).
With ``normalize``, every run's timed metrics, on both sides, are scaled to the baseline's
median speed by that run's own probe (its speed: the geometric mean of the probes both
sides recorded): times (ms, s) by speed / reference, rates (1/s, tokens/s, GB/s) by its
inverse, other units not at all. A run's probe is a snapshot of the machine's load before
the run, so this corrects a different or busier runner roughly; it does not replace
repeats.

Only the summary metrics in each run's run.json are compared: per-request rows
(requests.parquet) and per-step rows are not read, so a regression visible only there --
say in a few requests' latencies that leave every summary percentile unchanged -- is not
seen. Gate on the summary metric that captures it.

Outputs: the terminal table, an HTML page, a Markdown summary (``--markdown FILE``, appended,
as ``$GITHUB_STEP_SUMMARY`` expects) and github-action-benchmark's custom JSON
(``--json FILE``: lower-is-better metrics, tool ``customSmallerIsBetter``;
``--json-bigger FILE``: higher-is-better ones, ``customBiggerIsBetter``).

Exit codes of ``kvbench compare``: 0 pass (inconclusive gates included), 1 a failure
above, 2 bad input (unreadable results, a malformed gate, no configuration matched,
``--normalize`` without probes on both sides, an output path kvbench did not write).
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console
from rich.markup import escape as escape_markup
from rich.table import Table
from rich.text import Text

from kvbench import metrics, stats
from kvbench.html_page import GENERATOR_META, PageOutputError, escape, write_page
from kvbench.probe import PROBE_KEYS
from kvbench.results import ResultsError, config_columns, load, plain_value, replace_file, run_labels

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
# A run's repeat index (and count): repeats of one configuration are pooled, never told apart.
REPEAT_COLUMNS: tuple[str, ...] = ("run.repeat", "run.repeats")
# Metrics outside the catalogue (``quality_*``) are judged like the KV state: deterministic
# unless the schedule follows the wall clock.
UNCATALOGUED_SOURCE = metrics.SCHEDULE
# How a metric's unit responds to machine speed under --normalize: times shrink on a faster
# machine (scaled by the speed factor), rates grow (scaled by its inverse).
_SPEED_EXPONENTS: dict[str, int] = {"ms": 1, "s": 1, "1/s": -1, "tokens/s": -1, "GB/s": -1}
_GATE = re.compile(r"^(?P<metric>[A-Za-z0-9_.]+):(?P<sign>[+-])(?P<value>\d+(\.\d+)?)(?P<pct>%?)$")
# Gate verdicts, worst first: a metric with several gates shows the worst.
GATE_VERDICTS: tuple[str, ...] = ("regression", "cannot judge", "inconclusive", "pass")
# Marks every entry of a --json file as written by kvbench (an existing file is replaced
# only when all its entries carry it).
JSON_MARKER = "kvbench compare"
TABLE_COLUMNS: tuple[str, ...] = (
    "run",
    "metric",
    "timed",
    "num_baseline",
    "num_candidate",
    "baseline",
    "candidate",
    "change",
    "change_pct",
    "ci_low_pct",
    "ci_high_pct",
    "candidate_ci_low",
    "candidate_ci_high",
    "verdict",
    "gate",
    "gate_verdict",
    "regressed",
)


class CompareError(ValueError):
    """Unusable compare input (bad gate, unknown metric, nothing matched); message says which."""


@dataclass(frozen=True)
class Gate:
    """Broken when ``sign * (candidate - baseline)`` exceeds ``limit`` (times |baseline| if relative)."""

    metric: str
    sign: int  # +1: an increase is a regression; -1: a decrease is
    limit: float
    relative: bool
    text: str

    def excess(self, baseline: Any, candidate: Any) -> Any:
        """How far the change goes beyond the threshold (> 0: broken); floats or arrays."""
        bound = self.limit * np.abs(baseline) if self.relative else self.limit
        return self.sign * (candidate - baseline) - bound

    def regressed(self, baseline: float, candidate: float) -> bool:
        return bool(self.excess(baseline, candidate) > 0)


@dataclass(frozen=True)
class SpeedComparison:
    """How fast the candidate's machine was relative to the baseline's (``kvbench.probe``).

    ``baseline`` / ``candidate``: probe key -> median over that side's runs (probes a side
    did not record are absent). ``ratios``: candidate / baseline for probes on both sides.
    ``factor``: their geometric mean (> 1: the candidate's machine was faster), NaN when no
    probe is on both sides.
    """

    baseline: dict[str, float]
    candidate: dict[str, float]
    ratios: dict[str, float]
    factor: float

    def run_speeds(self, runs: pd.DataFrame) -> np.ndarray:
        """Each run's speed: the geometric mean of its probes among ``ratios``' keys (NaN
        where a run lacks one). float64 [len(runs)]."""
        if not self.ratios:
            return np.full(len(runs), math.nan)
        columns = [f"env.{key}" for key in self.ratios]
        figures = np.column_stack(
            [runs[c].to_numpy(dtype=float) if c in runs else np.full(len(runs), math.nan) for c in columns]
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.exp(np.log(np.where(figures > 0, figures, math.nan)).mean(axis=1))


@dataclass(frozen=True)
class CompareResult:
    """What ``compare`` found.

    ``table``: one row per (matched configuration, metric) with ``run`` (label), ``metric``,
    ``timed`` (judged with repeats, see the module doc), ``num_baseline`` /
    ``num_candidate`` (runs pooled on each side), ``baseline`` / ``candidate`` (medians;
    the candidate's scaled when ``normalized``), ``change``, ``change_pct`` (NaN when
    baseline is 0), ``ci_low_pct`` / ``ci_high_pct`` (the bootstrap interval of the
    relative change, in %; NaN unless timed with enough runs), ``candidate_ci_low`` /
    ``candidate_ci_high`` (the interval of the candidate's median), ``verdict`` ("better",
    "worse", "same", "inconclusive" for a timed change the repeats cannot tell from noise,
    "cannot judge" for a gated metric that is NaN on a side, "" when the metric has no
    preferred direction or an ungated side is NaN), ``gate`` (the gate text or ""),
    ``gate_verdict`` (one of GATE_VERDICTS, "" without a gate) and ``regressed`` (bool).
    ``failures``: one message per broken gate, gated metric that cannot be judged, run
    missing from the candidate, or configuration that failed in the candidate.
    ``not_judged``: the same "cannot judge" and missing-run messages when ``allow_missing``
    made them notes instead of failures. ``inconclusive``: one message per inconclusive
    gate, saying why. ``notes``: oddities that fail nothing (a deterministic metric that
    differs between repeats, some repeats failed). ``failed_in_baseline``: labels of
    configurations whose baseline runs failed, so nothing in them was judged. ``speed``:
    the machine-speed comparison. ``normalized``: every run's timed values were scaled to
    the baseline's median machine speed by its own probe (see the module doc).
    """

    table: pd.DataFrame
    failures: tuple[str, ...]
    unmatched_baseline: tuple[str, ...]
    unmatched_candidate: tuple[str, ...]
    num_matched: int
    not_judged: tuple[str, ...] = ()
    failed_in_baseline: tuple[str, ...] = ()
    inconclusive: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    speed: SpeedComparison = field(default_factory=lambda: SpeedComparison({}, {}, {}, math.nan))
    normalized: bool = False
    confidence: float = stats.DEFAULT_CONFIDENCE

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


def metric_unit(metric: str) -> str:
    """The catalogue's unit of ``metric``; "" for metrics outside it."""
    doc = metrics.METRICS_BY_NAME.get(metric)
    return doc.unit if doc is not None else ""


def run_timing(runs: pd.DataFrame) -> tuple[bool, bool]:
    """``(simulated, wall_clock_schedule)`` of a configuration's runs, as ``metrics.is_timed``
    takes them: simulated when every run is ``mode: sim``; the schedule follows the wall
    clock unless every run's schedule is clock-free (run.json ``clock_free_schedule``:
    every request ready at t = 0 or a closed loop of one; for older runs, offline arrivals
    in ``workload_params.arrival`` or ``.arrival.kind``) on kvbench's own engines (a live server, ``engine_kind``
    "live", schedules on its own clock). Missing facts read as the wall clock: a metric is
    judged as timed rather than cry wolf."""
    simulated = "mode" in runs and len(runs) > 0 and bool((runs["mode"] == "sim").all())
    wall_clock = False
    for _, row in runs.iterrows():
        arrival = plain_value(row.get("workload_params.arrival.kind")) or plain_value(
            row.get("workload_params.arrival")
        )
        live = plain_value(row.get("engine_kind")) == "live"
        recorded = plain_value(row.get("clock_free_schedule"))
        # Runs recorded before clock_free_schedule existed: offline arrivals stand for it.
        clock_free = recorded == "True" if recorded in ("True", "False") else arrival == "offline"
        wall_clock = wall_clock or live or not clock_free
    return simulated, wall_clock


def machine_speed(base: pd.DataFrame, cand: pd.DataFrame) -> SpeedComparison:
    """Compare the probe figures (``env.probe_*``) of two sides' runs; see SpeedComparison."""
    sides = []
    for runs in (base, cand):
        medians = {}
        for key in PROBE_KEYS:
            column = f"env.{key}"
            values = runs[column].to_numpy(dtype=float) if column in runs else np.array([])
            values = values[np.isfinite(values) & (values > 0)]
            if values.size:
                medians[key] = float(np.median(values))
        sides.append(medians)
    ratios = {key: sides[1][key] / sides[0][key] for key in PROBE_KEYS if key in sides[0] and key in sides[1]}
    factor = float(np.exp(np.mean(np.log(list(ratios.values()))))) if ratios else math.nan
    return SpeedComparison(sides[0], sides[1], ratios, factor)


@dataclass(frozen=True)
class _Bootstrap:
    """Resampling settings of one compare call."""

    confidence: float
    num_resamples: int
    seed: int


def compare(
    baseline_path: str | os.PathLike[str],
    candidate_path: str | os.PathLike[str],
    fail_on: Sequence[str] = (),
    allow_missing: bool = False,
    normalize: bool = False,
    confidence: float = stats.DEFAULT_CONFIDENCE,
    num_resamples: int = stats.DEFAULT_NUM_RESAMPLES,
    seed: int = stats.DEFAULT_SEED,
) -> CompareResult:
    """Match runs of two result directories by configuration identity and compare their metrics.

    Reads only. Raises ResultsError when a side has no results and CompareError when a
    gate is malformed or names an unknown metric, when no configuration matches, when
    ``confidence`` is not in (0, 1), or when ``normalize`` is asked but no machine-speed
    probe is recorded on both sides. ``allow_missing``: gated metrics that are NaN on a
    side, and configurations missing from the candidate, become ``not_judged`` notes
    instead of failures. ``confidence``, ``num_resamples``, ``seed``: the bootstrap's.
    """
    if not 0 < confidence < 1:
        raise CompareError(f"--confidence: must be in (0, 1), got {confidence}")
    base = load(baseline_path).runs
    cand = load(candidate_path).runs
    known = _metric_columns(base, cand)
    gates = [parse_gate(text, known) for text in fail_on]
    speed = machine_speed(base, cand)
    if normalize and not speed.ratios:
        raise CompareError(
            "--normalize: needs the machine-speed probe (env.probe_*) on both sides; "
            f"the baseline has {sorted(speed.baseline) or 'none'}, the candidate {sorted(speed.candidate) or 'none'}"
        )
    columns = identity_columns(base, cand)
    base = base.assign(_key=identity_keys(base, columns), _speed=speed.run_speeds(base))
    cand = cand.assign(_key=identity_keys(cand, columns), _speed=speed.run_speeds(cand))
    reference_speed = _normalize_reference(base, cand) if normalize else math.nan
    # One label per configuration, from what varies across both sides (not the repeat index).
    configs = pd.concat([base, cand], ignore_index=True).drop_duplicates("_key", ignore_index=True)
    configs = configs.drop(columns=[c for c in REPEAT_COLUMNS if c in configs])
    labels = dict(zip(configs["_key"], run_labels(configs)))
    cand_keys, base_keys = set(cand["_key"]), set(base["_key"])
    matched = [key for key in dict.fromkeys(base["_key"]) if key in cand_keys]
    if not matched:
        raise CompareError(
            f"no run of {candidate_path} matches a run of {baseline_path} by configuration "
            f"(matched on {', '.join(columns)})"
        )
    judge = _Judge(
        gates=gates,
        allow_missing=allow_missing,
        reference_speed=reference_speed,
        bootstrap=_Bootstrap(confidence, num_resamples, seed),
    )
    failed_in_baseline = []
    for key in matched:
        base_ok, cand_ok = _ok(base, key), _ok(cand, key)
        label = labels[key]
        if base_ok.empty:
            failed_in_baseline.append(label)
            continue
        cand_all = cand[cand["_key"] == key]
        if cand_ok.empty:
            errors = "; ".join(dict.fromkeys(str(e) for e in cand_all.get("error", []) if e))
            judge.failures.append(f"{label}: failed in the candidate ({errors or 'no error recorded'})")
            continue
        if len(cand_ok) < len(cand_all):
            judge.notes.append(
                f"{label}: {len(cand_all) - len(cand_ok)} of {len(cand_all)} candidate runs failed; "
                "the others were compared"
            )
        simulated, wall_clock = run_timing(pd.concat([base_ok, cand_ok], ignore_index=True))
        for metric in known:
            source = _source(metric)
            timed = metrics.is_timed(source, simulated=simulated, wall_clock_schedule=wall_clock)
            judge.metric(label, metric, base_ok, cand_ok, timed)
    unmatched_baseline = tuple(sorted(labels[k] for k in base_keys - cand_keys))
    judge.unjudged.extend(
        f"{label}: ran in the baseline but is missing from the candidate" for label in unmatched_baseline
    )
    return CompareResult(
        table=pd.DataFrame(judge.rows, columns=list(TABLE_COLUMNS)),
        failures=tuple(judge.failures),
        unmatched_baseline=unmatched_baseline,
        unmatched_candidate=tuple(sorted(labels[k] for k in cand_keys - base_keys)),
        num_matched=len(matched),
        not_judged=tuple(judge.not_judged),
        failed_in_baseline=tuple(failed_in_baseline),
        inconclusive=tuple(judge.inconclusive),
        notes=tuple(judge.notes),
        speed=speed,
        normalized=normalize,
        confidence=confidence,
    )


@dataclass
class _Judge:
    """Judges one metric of one configuration at a time, collecting rows and messages."""

    gates: list[Gate]
    allow_missing: bool
    reference_speed: float  # timed values are scaled to this machine speed; NaN: not normalised
    bootstrap: _Bootstrap
    rows: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    not_judged: list[str] = field(default_factory=list)
    inconclusive: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def unjudged(self) -> list[str]:
        """Where "cannot judge" and missing-run messages go."""
        return self.not_judged if self.allow_missing else self.failures

    def metric(self, label: str, metric: str, base: pd.DataFrame, cand: pd.DataFrame, timed: bool) -> None:
        """Judge ``metric`` of configuration ``label`` from each side's ok runs."""
        exponent = _SPEED_EXPONENTS.get(metric_unit(metric), 0) if timed else 0
        b_vals = _values(base, metric, exponent, self.reference_speed)
        c_vals = _values(cand, metric, exponent, self.reference_speed)
        b, c = _median(b_vals), _median(c_vals)
        metric_gates = [g for g in self.gates if g.metric == metric]
        if math.isnan(b) and math.isnan(c) and not metric_gates:
            return
        resamples = None
        if timed and min(b_vals.size, c_vals.size) >= stats.MIN_REPEATS:
            resamples = stats.resample_medians(
                b_vals, c_vals, self.bootstrap.num_resamples, self.bootstrap.seed
            )
        ci = self._relative_interval(resamples)
        cand_ci = (
            stats.percentile_interval(resamples.candidate, self.bootstrap.confidence)
            if resamples is not None
            else (math.nan, math.nan)
        )
        if not timed and (_varies(b_vals) or _varies(c_vals)):
            self.notes.append(
                f"{label}: {metric} differs between repeats although it is deterministic in these runs "
                f"(baseline {_spread(b_vals)}, candidate {_spread(c_vals)}); compared by median"
            )
        verdict = _timed_verdict(metric, b_vals, c_vals, ci) if timed else _verdict(metric, b, c)
        gate_verdict, regressed = "", False
        if metric_gates and (math.isnan(b) or math.isnan(c)):
            verdict = gate_verdict = "cannot judge"
            regressed = not self.allow_missing
            self.unjudged.append(
                f"{label}: {metric} cannot be judged by {' '.join(g.text for g in metric_gates)}: "
                + _missing_sides(b, c, _why_missing(base, metric), _why_missing(cand, metric))
            )
        elif metric_gates:
            verdicts = [
                self._gate(label, metric, gate, b, c, b_vals, c_vals, timed, resamples, ci)
                for gate in metric_gates
            ]
            gate_verdict = min(verdicts, key=GATE_VERDICTS.index)
            regressed = gate_verdict == "regression"
        self.rows.append(
            {
                "run": label,
                "metric": metric,
                "timed": timed,
                "num_baseline": int(b_vals.size),
                "num_candidate": int(c_vals.size),
                "baseline": b,
                "candidate": c,
                "change": c - b,
                "change_pct": (c - b) / abs(b) * 100 if b != 0 and not math.isnan(b) else math.nan,
                "ci_low_pct": ci[0] * 100,
                "ci_high_pct": ci[1] * 100,
                "candidate_ci_low": cand_ci[0],
                "candidate_ci_high": cand_ci[1],
                "verdict": verdict,
                "gate": " ".join(g.text for g in metric_gates),
                "gate_verdict": gate_verdict,
                "regressed": regressed,
            }
        )

    def _relative_interval(self, resamples: stats.MedianResamples | None) -> tuple[float, float]:
        """The interval of (candidate - baseline) / |baseline| over the resampled medians."""
        if resamples is None:
            return (math.nan, math.nan)
        with np.errstate(divide="ignore", invalid="ignore"):
            change = (resamples.candidate - resamples.baseline) / np.abs(resamples.baseline)
        return stats.percentile_interval(change, self.bootstrap.confidence)

    def _gate(
        self,
        label: str,
        metric: str,
        gate: Gate,
        b: float,
        c: float,
        b_vals: np.ndarray,
        c_vals: np.ndarray,
        timed: bool,
        resamples: stats.MedianResamples | None,
        ci: tuple[float, float],
    ) -> str:
        """One gate's verdict on a metric measured on both sides; records its message."""
        head = f"{label}: {metric} {b:.4g} -> {c:.4g} ({_pct(b, c)})"
        runs = f"{b_vals.size}/{c_vals.size} runs"
        if not timed:
            if gate.regressed(b, c):
                self.failures.append(f"{head} breaks {gate.text}")
                return "regression"
            return "pass"
        if resamples is None:
            self.inconclusive.append(
                f"{head} vs {gate.text}: inconclusive: a timed metric needs >= {stats.MIN_REPEATS} runs "
                f"a side to tell a change from noise, got {runs} (sweep with run.repeats=N)"
            )
            return "inconclusive"
        low, high = stats.percentile_interval(
            gate.excess(resamples.baseline, resamples.candidate), self.bootstrap.confidence
        )
        interval = f"{self.bootstrap.confidence:.0%} CI of the change {_interval_text(ci)}, {runs}"
        if low > 0:
            self.failures.append(f"{head} breaks {gate.text} ({interval})")
            return "regression"
        if high <= 0:
            return "pass"
        self.inconclusive.append(
            f"{head} vs {gate.text}: inconclusive: the {interval} straddles the threshold"
        )
        return "inconclusive"


def _metric_columns(*frames: pd.DataFrame) -> list[str]:
    names = [doc.name for doc in metrics.METRICS]
    extra = sorted({c for f in frames for c in f.columns if c.startswith("quality_")})
    return [n for n in [*names, *extra] if any(n in f for f in frames)]


def _source(metric: str) -> str:
    doc = metrics.METRICS_BY_NAME.get(metric)
    return doc.source if doc is not None else UNCATALOGUED_SOURCE


def identity_columns(*frames: pd.DataFrame) -> list[str]:
    """The columns that identify a configuration: config columns of any frame, SLOs and the
    repeat index excluded."""
    columns = dict.fromkeys(c for f in frames for c in config_columns(f))
    return [c for c in columns if not c.startswith(IGNORED_CONFIG_PREFIXES) and c not in REPEAT_COLUMNS]


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


def _values(
    runs: pd.DataFrame, metric: str, exponent: int = 0, reference_speed: float = math.nan
) -> np.ndarray:
    """The finite values of ``metric`` over ``runs`` (one per run that measured it), each
    times (its run's ``_speed`` / ``reference_speed``) ** ``exponent`` when the reference
    is finite and the exponent non-zero (--normalize)."""
    if metric not in runs:
        return np.array([], dtype=float)
    values = runs[metric].to_numpy(dtype=float)
    if exponent and math.isfinite(reference_speed):
        values = values * (runs["_speed"].to_numpy(dtype=float) / reference_speed) ** exponent
    return values[np.isfinite(values)]


def _normalize_reference(base: pd.DataFrame, cand: pd.DataFrame) -> float:
    """The baseline's median run speed (--normalize), after checking that every ok run on
    both sides has one. Raises CompareError naming a run without."""
    for side, runs in (("baseline", base), ("candidate", cand)):
        ok = runs[runs["status"] == "ok"] if "status" in runs else runs
        lacking = ok.loc[~np.isfinite(ok["_speed"].to_numpy(dtype=float)), "run_id"].tolist()
        if lacking:
            raise CompareError(
                f"--normalize: {side} run {lacking[0]} has no machine-speed probe (env.probe_*; "
                f"{len(lacking)} run(s) lack one, e.g. runs recorded before kvbench had the probe)"
            )
    speeds = base["_speed"].to_numpy(dtype=float)
    return float(np.median(speeds[np.isfinite(speeds)]))


def _median(values: np.ndarray) -> float:
    return float(np.median(values)) if values.size else math.nan


def _varies(values: np.ndarray) -> bool:
    return values.size > 1 and bool(values.min() != values.max())


def _spread(values: np.ndarray) -> str:
    return f"{values.min():.6g}..{values.max():.6g}" if values.size else "none"


def _verdict(metric: str, baseline: float, candidate: float) -> str:
    direction = better_direction(metric)
    if not direction or math.isnan(baseline) or math.isnan(candidate):
        return ""
    if candidate == baseline:
        return "same"
    up = candidate > baseline
    return "better" if up == (direction == "higher") else "worse"


def _timed_verdict(metric: str, b_vals: np.ndarray, c_vals: np.ndarray, ci: tuple[float, float]) -> str:
    """A timed metric's direction verdict: "better"/"worse" only when the interval of the
    change excludes 0; "same" when every run on both sides read the same value."""
    direction = better_direction(metric)
    if not direction or not b_vals.size or not c_vals.size:
        return ""
    if not _varies(np.concatenate([b_vals, c_vals])):
        return "same"
    low, high = ci
    if not (low > 0 or high < 0):  # NaN (too few runs) or an interval containing 0
        return "inconclusive"
    return "better" if (low > 0) == (direction == "higher") else "worse"


def _pct(baseline: float, candidate: float) -> str:
    if baseline == 0 or math.isnan(baseline) or math.isnan(candidate):
        return "n/a"
    return f"{(candidate - baseline) / abs(baseline) * 100:+.1f}%"


def _interval_text(ci: tuple[float, float]) -> str:
    """A relative interval (fractions) as "+1.2%..+8.4%"."""
    return f"{ci[0] * 100:+.1f}%..{ci[1] * 100:+.1f}%"


def _ci_cell(row: Any) -> str:
    """The terminal/HTML/Markdown cell for a row's interval: "exact" for a deterministic
    metric, the interval for a timed one, "n/a" when too few runs gave none."""
    if not row.timed:
        return "exact"
    if math.isnan(row.ci_low_pct):
        return "n/a"
    return f"{row.ci_low_pct:+.1f}%..{row.ci_high_pct:+.1f}%"


def _verdict_text(verdict: str, gate_verdict: str) -> str:
    """A row's verdict as shown: the gate's verdict when gated, else the direction."""
    if gate_verdict == "regression":
        return f"{verdict} REGRESSION".strip()
    if gate_verdict == "cannot judge":
        return "CANNOT JUDGE"
    if gate_verdict == "inconclusive":
        return "inconclusive (gate)"
    if gate_verdict == "pass":
        return f"{verdict} (pass)".strip() if verdict else "pass"
    return verdict


def speed_text(result: CompareResult) -> str:
    """One line on the candidate machine's speed relative to the baseline's."""
    speed = result.speed
    if not speed.ratios:
        sides = [
            name
            for name, probes in (("baseline", speed.baseline), ("candidate", speed.candidate))
            if not probes
        ]
        return (
            f"machine speed: not compared (no machine-speed probe recorded in the {' or '.join(sides)} runs)"
        )
    ratios = ", ".join(f"{key.removeprefix('probe_')} x{ratio:.2f}" for key, ratio in speed.ratios.items())
    text = (
        f"machine speed, candidate / baseline: x{speed.factor:.2f} (geometric mean of {ratios}; >1: faster)"
    )
    if result.normalized:
        text += "; timed metrics normalised run by run to the baseline's median machine speed"
    return text


def _shown(result: CompareResult, show_all: bool) -> pd.DataFrame:
    """The rows printed by default: headline and gated metrics."""
    table = result.table
    return table if show_all else table[table["metric"].isin(HEADLINE_METRICS) | (table["gate"] != "")]


def _summary_line(result: CompareResult) -> str:
    """ "PASS", "PASS (2 inconclusive)", "FAIL (3)" or "FAIL (3; 2 inconclusive)"."""
    parts = [str(len(result.failures))] if result.failures else []
    if result.inconclusive:
        parts.append(f"{len(result.inconclusive)} inconclusive")
    verdict = "PASS" if result.passed else "FAIL"
    return f"{verdict} ({'; '.join(parts)})" if parts else verdict


# --------------------------------------------------------------------------- output
def print_table(result: CompareResult, console: Console, show_all: bool = False) -> None:
    """Print the change table (headline and gated metrics unless ``show_all``), the machine
    speed, failures and inconclusive gates.

    Labels and metric names come from result files: they are printed as plain text, never
    read as rich markup.
    """
    table = Table(title=f"kvbench compare: {result.num_matched} matched configuration(s)")
    for name, justify in (
        ("run", "left"),
        ("metric", "left"),
        ("baseline", "right"),
        ("candidate", "right"),
        ("change", "right"),
        (f"{result.confidence:.0%} CI", "right"),
        ("runs", "right"),
        ("verdict", "left"),
        ("gate", "left"),
    ):
        table.add_column(name, justify=justify)
    styles = {"better": "green", "worse": "red", "cannot judge": "yellow", "inconclusive": "yellow"}
    for row in _shown(result, show_all).itertuples():
        style = "bold red" if row.regressed else styles.get(row.gate_verdict or row.verdict, "")
        # Text(): labels, metric names and gates are data, never rich markup.
        table.add_row(*(Text(cell) for cell in _row_cells(row, row.metric)), style=style)
    console.print(table)
    console.print(speed_text(result), markup=False, highlight=False)
    for name, items in (
        ("only in baseline", result.unmatched_baseline),
        ("only in candidate", result.unmatched_candidate),
        ("failed in the baseline (not judged)", result.failed_in_baseline),
    ):
        if items:
            console.print(f"{name}: {', '.join(items)}", markup=False, highlight=False)
    for note in result.notes:
        console.print(f"[cyan]NOTE[/] {escape_markup(note)}", highlight=False)
    for note in result.not_judged:
        console.print(f"[yellow]NOT JUDGED[/] {escape_markup(note)} (--allow-missing)", highlight=False)
    for note in result.inconclusive:
        console.print(f"[yellow]INCONCLUSIVE[/] {escape_markup(note)}", highlight=False)
    for failure in result.failures:
        console.print(f"[bold red]FAIL[/] {escape_markup(failure)}", highlight=False)
    summary = _summary_line(result)
    console.print(f"[green]{summary}[/]" if result.passed else f"[bold red]{summary}[/]", highlight=False)


def write_html(result: CompareResult, path: str | os.PathLike[str], baseline: str, candidate: str) -> Path:
    """Write a self-contained HTML diff report (no scripts) and return its path.

    Every string from the results goes through ``html_page.escape``. Raises PageOutputError
    (naming the path) when ``path`` holds something kvbench did not write.
    """
    colors = {"better": "#e6f4ea", "worse": "#fdecea", "cannot judge": "#fff4d6", "inconclusive": "#fff4d6"}
    rows = []
    for row in result.table.itertuples():
        color = "#f8c9c4" if row.regressed else colors.get(row.gate_verdict or row.verdict, "")
        style = f' style="background:{color}"' if color else ""
        cells = (
            escape(row.run),
            f"<code>{escape(row.metric)}</code>",
            f"{row.baseline:.4g}",
            f"{row.candidate:.4g}",
            escape(_pct(row.baseline, row.candidate)),
            escape(_ci_cell(row)),
            f"{row.num_baseline}/{row.num_candidate}",
            escape(_verdict_text(row.verdict, row.gate_verdict)),
            escape(row.gate),
        )
        rows.append(f"<tr{style}>{''.join(f'<td>{cell}</td>' for cell in cells)}</tr>")
    failures = "".join(f"<li>{escape(f)}</li>" for f in result.failures)
    notes = "".join(f"<li>not judged (--allow-missing): {escape(n)}</li>" for n in result.not_judged)
    notes += "".join(f"<li>inconclusive: {escape(n)}</li>" for n in result.inconclusive)
    notes += "".join(f"<li>note: {escape(n)}</li>" for n in result.notes)
    unmatched = "".join(
        f"<p>{name}: {escape(', '.join(items))}</p>"
        for name, items in (
            ("Only in baseline", result.unmatched_baseline),
            ("Only in candidate", result.unmatched_candidate),
            ("Failed in the baseline (not judged)", result.failed_in_baseline),
        )
        if items
    )
    verdict = escape(_summary_line(result))
    ci_head = f"{result.confidence:.0%} CI"
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
yellow: inconclusive (a timed change the repeats cannot tell from noise) or a gated metric missing
on a side (cannot judge). CI: the bootstrap interval of the change of the medians over the repeats
("exact": a deterministic metric). Only run.json summary metrics are compared.</p>
<p>{escape(speed_text(result))}</p>
<ul>{failures}{notes}</ul>{unmatched}
<table><tr><th>run</th><th>metric</th><th>baseline</th><th>candidate</th><th>change</th><th>{ci_head}</th><th>runs</th><th>verdict</th><th>gate</th></tr>
{"".join(rows)}</table></body></html>
"""
    return write_page(path, page)


def markdown_text(value: object) -> str:
    """Text for Markdown prose: HTML-escaped (GitHub renders inline HTML), on one line."""
    return html.escape(str(value), quote=False).replace("\n", " ")


def markdown_cell(value: object) -> str:
    """Text for a Markdown table cell: ``markdown_text`` with pipes escaped."""
    return markdown_text(value).replace("|", "\\|")


def markdown_summary(result: CompareResult, baseline: str, candidate: str, show_all: bool = False) -> str:
    """A Markdown summary for CI job summaries: the verdict, machine speed, failures and
    inconclusive gates, and a table of the gated rows (all shown rows with ``show_all``)."""
    icon = "✅" if result.passed else "❌"
    lines = [
        f"## {icon} kvbench compare: {markdown_text(_summary_line(result))}",
        "",
        f"baseline `{markdown_text(baseline)}`, candidate `{markdown_text(candidate)}`: "
        f"{result.num_matched} matched configuration(s).",
        "",
        markdown_text(speed_text(result)),
        "",
    ]
    for title, items in (
        ("Failures", result.failures),
        ("Inconclusive gates (not failures)", result.inconclusive),
        ("Not judged (--allow-missing)", result.not_judged),
        ("Notes", result.notes),
    ):
        if items:
            lines += [f"**{title}**", "", *(f"- {markdown_text(item)}" for item in items), ""]
    rows = _shown(result, show_all) if show_all else result.table[result.table["gate"] != ""]
    if len(rows):
        ci_head = f"{result.confidence:.0%} CI"
        lines += [
            f"| run | metric | baseline | candidate | change | {ci_head} | runs | verdict | gate |",
            "|---|---|---:|---:|---:|---:|---:|---|---|",
        ]
        for row in rows.itertuples():
            cells = _row_cells(row, f"`{row.metric}`")
            lines.append("| " + " | ".join(markdown_cell(cell) for cell in cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _row_cells(row: Any, metric: str) -> tuple[str, ...]:
    """One compare table row as text, in the column order of the terminal and Markdown
    tables (``metric`` as each shows it)."""
    return (
        row.run,
        metric,
        f"{row.baseline:.4g}",
        f"{row.candidate:.4g}",
        _pct(row.baseline, row.candidate),
        _ci_cell(row),
        f"{row.num_baseline}/{row.num_candidate}",
        _verdict_text(row.verdict, row.gate_verdict),
        row.gate,
    )


def append_markdown(path: str | os.PathLike[str], text: str) -> Path:
    """Append ``text`` to ``path`` (created if absent): never replaces what is there, as
    ``$GITHUB_STEP_SUMMARY`` expects. Raises CompareError naming the path on an OS error."""
    path = Path(path)
    try:
        with path.open("a", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as exc:
        raise CompareError(f"--markdown {path}: cannot append: {exc.strerror or exc}") from exc
    return path


def benchmark_entries(result: CompareResult, direction: str, show_all: bool = False) -> list[dict[str, Any]]:
    """The candidate's values in github-action-benchmark's custom format (tool
    ``customSmallerIsBetter`` for ``direction`` "lower", ``customBiggerIsBetter`` for
    "higher"): one ``{name, unit, value, range?, extra}`` per shown row whose metric is
    better in ``direction`` and whose candidate value is finite. ``name`` is
    "<configuration label> / <metric>"; ``range`` is "± half the bootstrap interval of the
    candidate's median" when the repeats gave one; ``extra`` says what was compared."""
    if direction not in ("lower", "higher"):
        raise ValueError(f"direction: must be 'lower' or 'higher', got {direction!r}")
    entries = []
    for row in _shown(result, show_all).itertuples():
        if better_direction(row.metric) != direction or not math.isfinite(row.candidate):
            continue
        entry: dict[str, Any] = {
            "name": f"{row.run} / {row.metric}",
            "unit": metric_unit(row.metric),
            "value": row.candidate,
        }
        if math.isfinite(row.candidate_ci_low):
            entry["range"] = f"± {(row.candidate_ci_high - row.candidate_ci_low) / 2:.4g}"
        verdict = _verdict_text(row.verdict, row.gate_verdict) or "no direction"
        entry["extra"] = (
            f"{JSON_MARKER}: median of {row.num_candidate} run(s); baseline {row.baseline:.4g} "
            f"({row.num_baseline} run(s)); change {_pct(row.baseline, row.candidate)}; {verdict}"
            + ("; normalised to the baseline's machine speed" if result.normalized and row.timed else "")
        )
        entries.append(entry)
    return entries


def is_benchmark_json(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a --json file kvbench wrote: a JSON list whose every entry's
    ``extra`` starts with JSON_MARKER (an empty list counts). Reads only."""
    try:
        entries = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(entries, list) and all(
        isinstance(e, dict) and str(e.get("extra", "")).startswith(JSON_MARKER) for e in entries
    )


def write_benchmark_json(path: str | os.PathLike[str], entries: list[dict[str, Any]]) -> Path:
    """Write ``entries`` to ``path`` atomically; an existing file is replaced only if kvbench
    wrote it (``is_benchmark_json``). Raises CompareError naming the path otherwise or on a
    filesystem error."""
    path = Path(path)
    if path.exists() and not (path.is_file() and is_benchmark_json(path)):
        raise CompareError(
            f"{path}: refusing to overwrite a file kvbench did not write (choose another path)"
        )
    text = json.dumps(entries, indent=2) + "\n"
    try:
        return replace_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    except ResultsError as exc:
        raise CompareError(str(exc)) from exc


HELP_EPILOG = """Runs are matched by configuration identity (engine, model, hardware, workload and their
parameters, run options, mode, seed; not the repeat index), the same key on both sides,
so one run directory can be compared against a sweep that contains it. A configuration's
repeats (kvbench sweep ... run.repeats=5) are pooled and compared by median.

Deterministic metrics (KV bytes, hit rates and preemptions under offline arrivals or in
sim mode, every engine metric in sim mode) are compared exactly against the gate. Timed
metrics (latencies, throughputs in real mode; KV state under real-time arrivals) need at
least 3 runs a side: a gate is a REGRESSION only when the bootstrap confidence interval of
the change of the medians (--confidence, default 95 %, seeded) lies wholly beyond its
threshold, pass when it lies within, otherwise inconclusive (listed, exit code unchanged).
With fewer runs a timed gate is always inconclusive.

Failures (exit 1): a gate broken; a gated metric that is NaN on either side ("cannot
judge"); a configuration that ran in the baseline but is missing from the candidate; a
configuration that failed in the candidate. --allow-missing makes the NaN and
missing-configuration cases notes instead of failures.

Every run records a machine-speed probe; compare prints the candidate machine's speed
relative to the baseline's; --normalize scales every run's timed metrics to the
baseline's median speed by the run's own probe.

Only the summary metrics recorded in each run.json are compared; requests.parquet and
steps.parquet are not read, so a regression visible only in per-request rows is not seen.

Exit codes: 0 pass, 1 failure, 2 bad input (unreadable results, malformed gate, nothing
matched, --normalize without probes, an output path holding a file kvbench did not write).
"""


def main(argv: Sequence[str] | None = None) -> int:
    """``kvbench compare BASELINE CANDIDATE [--fail-on M:+N% ...] [--allow-missing] [--normalize]
    [--html OUT] [--markdown FILE] [--json FILE] [--json-bigger FILE] [--all]``.

    Prints the table, writes the HTML diff (default ``reports/compare-<candidate>.html``)
    and the optional Markdown / JSON outputs, and returns 0 (pass), 1 (a failure, see the
    module docstring) or 2 (bad input).
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
        "--normalize",
        action="store_true",
        help="scale every run's timed metrics to the baseline's median machine speed by the run's probe",
    )
    parser.add_argument(
        "--confidence",
        type=float,
        default=stats.DEFAULT_CONFIDENCE,
        help="confidence of the bootstrap interval for timed metrics (default %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=stats.DEFAULT_SEED, help="bootstrap seed (default %(default)s)"
    )
    parser.add_argument(
        "--html",
        default=None,
        help="HTML diff report path (default reports/compare-<candidate>.html; "
        "an existing file is replaced only if kvbench wrote it)",
    )
    parser.add_argument(
        "--markdown",
        default=None,
        metavar="FILE",
        help='append a Markdown summary to FILE (e.g. "$GITHUB_STEP_SUMMARY")',
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="FILE",
        help="the candidate's lower-is-better metrics for github-action-benchmark (tool: customSmallerIsBetter)",
    )
    parser.add_argument(
        "--json-bigger",
        default=None,
        metavar="FILE",
        help="the candidate's higher-is-better metrics for github-action-benchmark (tool: customBiggerIsBetter)",
    )
    parser.add_argument(
        "--all", action="store_true", help="print (and export) every metric, not only the headline ones"
    )
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160)
    try:
        result = compare(
            args.baseline,
            args.candidate,
            args.fail_on,
            allow_missing=args.allow_missing,
            normalize=args.normalize,
            confidence=args.confidence,
            seed=args.seed,
        )
    except (ResultsError, CompareError) as exc:
        console.print(f"kvbench compare: {exc}", highlight=False, markup=False)
        return 2
    print_table(result, console, show_all=args.all)
    out = args.html or Path("reports") / f"compare-{Path(args.candidate).resolve().name}.html"
    try:
        written = [write_html(result, out, args.baseline, args.candidate)]
        if args.markdown:
            summary = markdown_summary(result, args.baseline, args.candidate, show_all=args.all)
            written.append(append_markdown(args.markdown, summary))
        for path, direction in ((args.json, "lower"), (args.json_bigger, "higher")):
            if path:
                written.append(write_benchmark_json(path, benchmark_entries(result, direction, args.all)))
    except (PageOutputError, CompareError) as exc:
        console.print(f"kvbench compare: {exc}", highlight=False, markup=False)
        return 2
    console.print(f"written: {', '.join(str(p) for p in written)}", highlight=False, markup=False)
    return 0 if result.passed else 1
