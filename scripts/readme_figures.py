"""The README's "What it measured here" tables, generated from results instead of typed.

    python scripts/readme_figures.py [--results DIR] [--run] [--only NAME ...] [--write | --check]
    python scripts/readme_figures.py --benchmark-json FILE [FILE ...] [--write | --check]

Each table lives in README.md between ``<!-- figures:NAME begin -->`` and
``<!-- figures:NAME end -->``, NAME being the experiment it shows, and is rendered from
that experiment's sweep: ``DIR/NAME`` (``--results``, default ``results``), except
``gqa_vs_mha``, rendered from the shipped baseline ``results/baselines/gqa_vs_mha``
(5 interleaved repeats). ``--run`` first runs the sweeps missing under ``DIR``
(``kvbench sweep +experiment=NAME run.results_dir=DIR``; complete runs are skipped).

- no flag: print the tables;
- ``--write``: replace the tables in README.md;
- ``--check``: compare every deterministic figure in README.md with the results and exit 1
  naming each figure that differs (the test suite does this for the real-mode experiments
  against fresh runs; the simulated ``seed_claims*`` sweeps take minutes on a 2-core
  machine, so they are checked here, by ``--check --run``).

Deterministic figures are those whose value is a function of the workload, engine and
config (``kvbench.metrics`` source ``config`` or ``schedule``; every non-host figure of a
simulation): these experiments replay offline or closed-loop (concurrency 1) arrivals, so
the schedule does not depend on the machine's speed. A configuration's repeats must agree
on them exactly. Timed figures (wall-clock latencies and throughputs) are the mean over a
configuration's repeats, marked with ``~`` in their header, and each table with one says
the machine-speed probe (``kvbench.probe``, median over its runs) they were measured at.

``--benchmark-json`` renders the ``sim_speed`` block instead: the simulation speed figures
(BENCH_FIGURES) from pytest-benchmark JSON files written by ``--benchmark-json FILE`` runs
of tests/benchmarks (tests/benchmarks/rounds.py puts each figure in ``extra_info`` as
``KEY_min`` / ``KEY_median`` / ``KEY_max``, with the rounds, load average and probe). Every
cell is a measured time, so ``--check`` compares only the block's headers and row labels.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvbench import metrics, results
from kvbench.summary_view import metric_doc

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BASELINES = ROOT / "results" / "baselines"
TIMED_MARK = " ~"


class FiguresError(ValueError):
    """Results that cannot fill a table (a row with no run, repeats that disagree on a
    deterministic figure) or a README without a table's markers."""


@dataclass(frozen=True)
class Column:
    """A metric column: ``header`` as the README writes it, ``style`` a key of STYLES."""

    header: str
    metric: str
    style: str


@dataclass(frozen=True)
class Row:
    """A table row: its label and the runs-frame values that select its configuration."""

    label: str
    select: Mapping[str, object]


@dataclass(frozen=True)
class Figure:
    """One README table: the sweep it comes from (``experiment``), the sentence above it,
    the label column's header, its rows and columns."""

    experiment: str
    caption: str
    label_header: str
    rows: tuple[Row, ...]
    columns: tuple[Column, ...]
    baseline: bool = False  # rendered from results/baselines/EXPERIMENT


def _thousands(value: float) -> str:
    return f"{value:,.0f}"


STYLES: dict[str, Callable[[float], str]] = {
    "int": _thousands,  # counts and bytes, exact
    "percent": lambda v: f"{100 * v:.1f}",  # a fraction as a percentage, 1 decimal
    "fraction": lambda v: f"{v:.3f}",
    "ms": lambda v: f"{v:.1f}",
    "rate": _thousands,  # tokens/s
}


def _rows(key: str, values: Sequence[tuple[str, object]], **fixed: object) -> tuple[Row, ...]:
    return tuple(Row(label, {**fixed, key: value}) for label, value in values)


ENGINES = (("paged", "paged"), ("slab (max length)", "slab"), ("slab (per request)", "slab_request"))
PREFIX_CACHES = (("block-hash", "block_hash"), ("radix", "radix"), ("none", "none"))
HARDWARE = (("H100-80GB", "h100-80gb"), ("H200-141GB", "h200-141gb"))
TTFT = Column("TTFT median ms", "ttft_ms_median", "ms")
TPOT = Column("TPOT median ms", "tpot_ms_median", "ms")
OUTPUT = Column("output tok/s", "output_tokens_per_s", "rate")

FIGURES: tuple[Figure, ...] = (
    Figure(
        "gqa_vs_mha",
        "`kvbench sweep +experiment=gqa_vs_mha` (paged engine, 24 offline requests; the shipped "
        "baseline, 5 repeats):",
        "model",
        _rows(
            "model.name",
            (
                ("tiny-mha (8 KV heads)", "tiny-mha"),
                ("tiny-gqa (2 KV heads)", "tiny-gqa"),
                ("tiny-mqa (1 KV head)", "tiny-mqa"),
            ),
        ),
        (
            Column("KV bytes/token", "kv_bytes_per_token", "int"),
            Column("peak KV bytes", "kv_peak_allocated_bytes", "int"),
            Column("peak running seqs", "peak_num_running", "int"),
            OUTPUT,
            TPOT,
            TTFT,
        ),
        baseline=True,
    ),
    Figure(
        "paged_vs_slab",
        "`+experiment=paged_vs_slab` (the same 10 MiB KV budget, one offline batch):",
        "traffic, engine",
        tuple(
            row
            for traffic in ("chat", "random")
            for row in _rows("engine", [(f"{traffic}, {a}", b) for a, b in ENGINES], workload=traffic)
        ),
        (
            Column("peak running seqs", "peak_num_running", "int"),
            Column("token-state share at peak %", "kv_token_fraction_at_peak", "percent"),
            Column("peak KV bytes", "kv_peak_allocated_bytes", "int"),
            OUTPUT,
            TTFT,
        ),
    ),
    Figure(
        "block_size",
        "`+experiment=block_size` (chat, one request at a time in conversation order):",
        "block size",
        _rows("engine.block_size", [(str(size), size) for size in (8, 16, 32, 64, 128)]),
        (
            Column("token-state share at peak %", "kv_token_fraction_at_peak", "percent"),
            Column("prefix hit rate", "prefix_hit_rate", "fraction"),
            Column("peak KV bytes", "kv_peak_allocated_bytes", "int"),
            TTFT,
        ),
    ),
    Figure(
        "parallel_sampling",
        "`+experiment=parallel_sampling` (offline; KV saved by sharing prompt blocks with copy-on-write):",
        "workload",
        _rows("workload", (("best-of-4", "best_of_n"), ("beam search (width 4)", "beam_search"))),
        (
            Column("KV saved by sharing %", "kv_sharing_saved_fraction", "percent"),
            Column("peak KV bytes", "kv_peak_allocated_bytes", "int"),
            Column("peak running seqs", "peak_num_running", "int"),
            TPOT,
        ),
    ),
    Figure(
        "prefix_caching",
        "`+experiment=prefix_caching` (one request at a time, in order; hit rates in tokens; the "
        "bound is the same requests through an unbounded block cache):",
        "traffic, prefix cache",
        tuple(
            row
            for traffic in ("chat", "rag", "agentic", "random")
            for row in _rows(
                "engine.prefix_cache", [(f"{traffic}, {a}", b) for a, b in PREFIX_CACHES], workload=traffic
            )
        ),
        (
            Column("prefix hit rate", "prefix_hit_rate", "fraction"),
            Column("reuse bound", "prefix_reuse_upper_bound", "fraction"),
            TTFT,
        ),
    ),
    Figure(
        "seed_claims",
        "`+experiment=seed_claims` (simulated Llama-3-70B, FP8 weights, bf16 KV, paged engine, pool "
        "sized like vLLM):",
        "hardware, traffic",
        tuple(
            row
            for name, hardware in HARDWARE
            for row in _rows(
                "workload",
                [(f"{name}, {w}", w) for w in ("chat", "rag", "agentic")],
                **{"hardware.name": hardware},
            )
        ),
        (
            Column("hit rate, 1st admission", "prefix_hit_rate_first_admission", "fraction"),
            Column("reuse bound", "prefix_reuse_upper_bound", "fraction"),
            Column("peak running seqs", "peak_num_running", "int"),
            Column("preemptions", "num_preemptions", "int"),
            Column("output tok/s", "output_tokens_per_s", "rate"),
        ),
    ),
    Figure(
        "seed_claims_best_of_8",
        "`+experiment=seed_claims_best_of_8` (simulated Llama-3-70B, best-of-8 on 2,000-token "
        "prompts, 256 output tokens):",
        "hardware",
        _rows("hardware.name", HARDWARE),
        (
            Column("KV saved by sharing", "kv_sharing_saved_fraction", "fraction"),
            Column("preemptions", "num_preemptions", "int"),
            Column("peak running seqs", "peak_num_running", "int"),
        ),
    ),
    Figure(
        "seed_claims_mooncake",
        "`+experiment=seed_claims_mooncake` (simulated Llama-3-70B, 128K context, first 1,000 requests "
        "of each Mooncake trace, recorded speed and 60x slower):",
        "hardware, trace, replay speed",
        tuple(
            Row(
                f"{name}, {trace}, {speed}",
                {
                    "hardware.name": hardware,
                    "workload": f"mooncake_{trace}",
                    "workload_params.time_scale": scale,
                },
            )
            for name, hardware in HARDWARE
            for trace in ("conversation", "synthetic")
            for speed, scale in (("1x", 1.0), ("1/60", 60.0))
        ),
        (
            Column("first admission", "prefix_hit_rate_first_admission", "fraction"),
            Column("bound", "prefix_reuse_upper_bound", "fraction"),
            Column("all admissions", "prefix_hit_rate", "fraction"),
            Column("preemptions", "num_preemptions", "int"),
            Column("rejected", "num_rejected", "int"),
        ),
    ),
)
FIGURES_BY_NAME: dict[str, Figure] = {figure.experiment: figure for figure in FIGURES}


# --------------------------------------------------------------------------- tables
@dataclass(frozen=True)
class Table:
    """A rendered table: headers (label first), rows of cells, which columns are timed."""

    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    timed: tuple[bool, ...]  # per metric column
    probe_line: str  # "" when no column is timed


def is_deterministic(metric: str, runs: pd.DataFrame) -> bool:
    """Whether ``metric`` is a function of workload, engine and config in these runs (see
    the module doc): its catalogue source is not timed for a clock-free schedule."""
    doc = metric_doc(metric)
    source = doc.source if isinstance(doc, metrics.MetricDoc) else metrics.CONFIG
    simulated = "mode" in runs and bool((runs["mode"] == "sim").all())
    return not metrics.is_timed(source, simulated=simulated, wall_clock_schedule=False)


def _select(runs: pd.DataFrame, figure: Figure, row: Row) -> pd.DataFrame:
    mask = pd.Series(True, index=runs.index)
    for column, value in row.select.items():
        if column not in runs:
            raise FiguresError(f"{figure.experiment}: the runs have no column {column!r}")
        mask &= runs[column].astype(str) == str(value)
    chosen = runs[mask & (runs["status"] == "ok")]
    if chosen.empty:
        raise FiguresError(f"{figure.experiment}: no ok run for row {row.label!r} ({dict(row.select)})")
    return chosen


def _value(figure: Figure, row: Row, chosen: pd.DataFrame, column: Column, deterministic: bool) -> float:
    values = pd.to_numeric(chosen[column.metric], errors="coerce").to_numpy(dtype=float)
    if not np.isfinite(values).all():
        raise FiguresError(f"{figure.experiment}: row {row.label!r} has no {column.metric}")
    if deterministic and len(set(values.tolist())) > 1:
        raise FiguresError(
            f"{figure.experiment}: row {row.label!r}: the repeats disagree on the deterministic "
            f"{column.metric} ({sorted(set(values.tolist()))})"
        )
    return float(values.mean())


def probe_line(runs: pd.DataFrame) -> str:
    """The machine-speed probe, median over ``runs``, as the line under a timed table."""
    parts = []
    for key, unit in (
        ("probe_compute_gflops", "GFLOP/s fp32 matmul"),
        ("probe_memory_gbps", "GB/s copy"),
        ("probe_python_mops", "M Python loop iterations/s"),
    ):
        column = f"env.{key}"
        values = pd.to_numeric(runs[column], errors="coerce").dropna() if column in runs else pd.Series()
        if len(values):
            parts.append(f"{float(values.median()):.3g} {unit}")
    probe = ", ".join(parts) if parts else "not recorded"
    return f"Timed columns (~) are means over the repeats, measured at machine-speed probe: {probe}."


def render_table(figure: Figure, runs: pd.DataFrame) -> Table:
    """``figure`` filled from ``runs`` (a results.load runs frame). Raises FiguresError."""
    deterministic = [is_deterministic(column.metric, runs) for column in figure.columns]
    headers = (
        figure.label_header,
        *(c.header + ("" if det else TIMED_MARK) for c, det in zip(figure.columns, deterministic)),
    )
    rows = []
    used = []
    for row in figure.rows:
        chosen = _select(runs, figure, row)
        used.append(chosen)
        cells = [
            STYLES[column.style](_value(figure, row, chosen, column, det))
            for column, det in zip(figure.columns, deterministic)
        ]
        rows.append((row.label, *cells))
    timed = tuple(not det for det in deterministic)
    line = probe_line(pd.concat(used)) if any(timed) else ""
    return Table(headers, tuple(rows), timed, line)


def markdown(figure: Figure, table: Table) -> str:
    """The README block of ``table`` (without its markers)."""
    align = ["---", *("---:" for _ in figure.columns)]
    lines = [figure.caption, "", _line(table.headers), _line(align)]
    lines += [_line(row) for row in table.rows]
    if table.probe_line:
        lines += ["", table.probe_line]
    return "\n".join(lines)


def _line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


# --------------------------------------------------------------------------- README blocks
def markers(name: str) -> tuple[str, str]:
    return f"<!-- figures:{name} begin -->", f"<!-- figures:{name} end -->"


def block_span(text: str, name: str) -> tuple[int, int]:
    """Start and end offsets of the text between ``name``'s markers in ``text``."""
    begin, end = markers(name)
    start = text.find(begin)
    stop = text.find(end)
    if start < 0 or stop < start:
        raise FiguresError(f"README.md has no {begin} ... {end} block")
    return start + len(begin), stop


def replace_block(text: str, name: str, body: str) -> str:
    start, stop = block_span(text, name)
    return text[:start] + "\n" + body + "\n" + text[stop:]


def parse_rows(body: str) -> list[tuple[str, ...]]:
    rows = []
    for line in body.splitlines():
        line = line.strip()
        if line.startswith("|") and line.endswith("|") and not re.fullmatch(r"\|[\s:|-]+\|", line):
            rows.append(tuple(cell.strip() for cell in line[1:-1].split("|")))
    return rows


def check_block(text: str, figure: Figure, table: Table) -> list[str]:
    """The differences between the README's block of ``figure`` and ``table``: headers,
    row labels and every deterministic cell (timed cells and the probe line may differ).
    Empty when the README is up to date."""
    start, stop = block_span(text, figure.experiment)
    lines = parse_rows(text[start:stop])
    if not lines:
        return [f"{figure.experiment}: README.md's block has no table"]
    problems = []
    readme_headers, readme_rows = lines[0], lines[1:]
    if readme_headers != table.headers:
        problems.append(f"{figure.experiment}: headers {readme_headers} != {table.headers}")
    if [r[0] for r in readme_rows] != [r[0] for r in table.rows]:
        problems.append(
            f"{figure.experiment}: rows {[r[0] for r in readme_rows]} != {[r[0] for r in table.rows]}"
        )
    if problems:
        return problems
    for readme_row, row in zip(readme_rows, table.rows):
        if len(readme_row) != len(row):
            problems.append(f"{figure.experiment}: row {row[0]!r} has {len(readme_row) - 1} figures")
            continue
        for header, timed, written, fresh in zip(table.headers[1:], table.timed, readme_row[1:], row[1:]):
            if not timed and written != fresh:
                problems.append(
                    f"{figure.experiment}: row {row[0]!r}, {header!r}: README.md says {written}, "
                    f"the results give {fresh}"
                )
    return problems


# --------------------------------------------------------------------------- benchmark figures
BENCH_BLOCK = "sim_speed"
BENCH_CAPTION = (
    "Simulation speed (`pytest tests/benchmarks -o python_files='bench_*.py' --benchmark-enable "
    "--benchmark-json FILE`; CPU time, min / median / max over interleaved rounds):"
)
BENCH_HEADERS = ("figure", "min", "median", "max", "rounds", "load avg (1 min)", "probe (M it/s)", "goal")
BENCH_STYLES: dict[str, Callable[[float], str]] = {
    "rate": _thousands,
    "seconds": lambda v: f"{v:.2f}",
    "us": lambda v: f"{v:.2f}",
    "ratio": lambda v: f"{v:.3f}",
    "signed_percent": lambda v: f"{100 * v:+.1f} %",
    "gib": lambda v: f"{v / 2**30:.2f}",
}


@dataclass(frozen=True)
class BenchFigure:
    """One row of the ``sim_speed`` block: ``extra_info`` key ``KEY`` of the benchmark named
    ``test`` (pytest-benchmark's ``name``, parameters included), either as its
    ``KEY_min`` / ``KEY_median`` / ``KEY_max`` over rounds or, with ``spread=False``, one
    value ``KEY`` (a process peak). ``expect``: ``extra_info`` values the run must have
    had for the label to be true (e.g. the number of requests)."""

    label: str
    test: str
    key: str
    style: str
    goal: str
    spread: bool = True
    expect: Mapping[str, float | str] = field(default_factory=dict)


SIM = "test_sim_mooncake_conversation_llama3_70b"
SLAB = "test_slab_vs_paged_cpu_time_and_slope"
BENCH_FIGURES: tuple[BenchFigure, ...] = (
    BenchFigure(
        "ShareGPT-like, requests/s of CPU",
        "test_sim_sharegpt_like_requests_per_second",
        "requests_per_cpu_s",
        "rate",
        ">= 5,000",
    ),
    BenchFigure(
        "Mooncake conversation, 12,031 requests at 128K: CPU s, trace load included",
        SIM,
        "mooncake_12031_cpu_s",
        "seconds",
        "<= 10",
        expect={"mooncake_12031_num_requests": 12031},
    ),
    BenchFigure(
        "Mooncake conversation, 12,031 requests at 128K: peak RSS GiB",
        SIM,
        "peak_rss_bytes",
        "gib",
        "<= 0.93 (1 GB)",
        spread=False,
        expect={"mooncake_12031_num_requests": 12031},
    ),
    BenchFigure(
        "Mooncake conversation: slope of CPU s against requests, 1,000 to 12,031",
        SIM,
        "mooncake_slope",
        "ratio",
        "<= 1.02",
        expect={"mooncake_slope_small_requests": 1000, "mooncake_slope_large_requests": 12031},
    ),
    *(
        BenchFigure(
            f"scheduler, {num_seqs} running, block-hash: us of CPU per sequence per step",
            f"test_scheduler_cpu_per_running_sequence_step[{num_seqs}-sim]",
            "block_hash_us_per_seq_step",
            "us",
            "<= 2",
        )
        for num_seqs in (16, 256)
    ),
    BenchFigure(
        "prefix caching at 0 % hits, simulation: CPU overhead",
        "test_prefix_cache_overhead_at_zero_hits_in_simulation",
        "overhead",
        "signed_percent",
        "<= +2 %",
    ),
    BenchFigure(
        "slab (issue 17): CPU s / paged's, Mooncake conversation, 12,031 requests at 128K",
        SLAB,
        "slab_over_paged_12031",
        "ratio",
        "<= 2",
    ),
    BenchFigure(
        "slab (issue 17): slope of CPU s against requests, 1,000 to 12,031",
        SLAB,
        "slab_slope",
        "ratio",
        "<= 1.1",
        expect={"slope_small_requests": 1000, "slope_large_requests": 12031},
    ),
    *(
        BenchFigure(
            f"block pool, {mix}: per-op cost at 16x the blocks / 1x",
            f"test_block_pool_pairs[{mix}]",
            "cost_ratio_16x",
            "ratio",
            "flat (1.0)",
        )
        for mix in ("single", "batched64", "revive")
    ),
)


def load_benchmarks(paths: Sequence[Path]) -> dict[str, Mapping[str, Any]]:
    """The benchmarks of pytest-benchmark JSON files by ``name``. Raises FiguresError on
    an unreadable file, one without a ``benchmarks`` list, or a name in two files."""
    found: dict[str, Mapping[str, Any]] = {}
    source: dict[str, Path] = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise FiguresError(f"{path}: not a readable pytest-benchmark JSON file ({exc})") from None
        benchmarks = data.get("benchmarks") if isinstance(data, dict) else None
        if not isinstance(benchmarks, list):
            raise FiguresError(f"{path}: no 'benchmarks' list (write it with pytest --benchmark-json FILE)")
        for bench in benchmarks:
            name = bench.get("name") if isinstance(bench, dict) else None
            if not isinstance(name, str) or not isinstance(bench.get("extra_info"), dict):
                raise FiguresError(f"{path}: a benchmark without a name or extra_info: {str(bench)[:120]}")
            if name in found:
                raise FiguresError(f"{path}: benchmark {name!r} is also in {source[name]}")
            found[name], source[name] = bench, path
    return found


def _bench_value(figure: BenchFigure, info: Mapping[str, Any], key: str) -> float:
    value = info.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise FiguresError(f"{figure.test}: extra_info has no number {key!r} (for {figure.label!r})")
    return float(value)


def render_bench_table(benchmarks: Mapping[str, Mapping[str, Any]]) -> Table:
    """The ``sim_speed`` table from ``load_benchmarks``' result: one row per BENCH_FIGURES
    entry with its benchmark's Python probe, the rest of the probe (median over the rows'
    benchmarks) below. Raises FiguresError naming
    the benchmark and key that is missing or that ran with other settings than the label's."""
    rows = []
    used: dict[str, Mapping[str, Any]] = {}  # each benchmark's probe counts once
    for figure in BENCH_FIGURES:
        bench = benchmarks.get(figure.test)
        if bench is None:
            raise FiguresError(f"no benchmark {figure.test!r} in the JSON (for {figure.label!r})")
        info = bench["extra_info"]
        for key, wanted in figure.expect.items():
            if info.get(key) != wanted:
                raise FiguresError(
                    f"{figure.test}: extra_info {key!r} is {info.get(key)!r}, the figure {figure.label!r} "
                    f"needs {wanted!r}"
                )
        style = BENCH_STYLES[figure.style]
        if figure.spread:
            cells = [style(_bench_value(figure, info, f"{figure.key}_{s}")) for s in ("min", "median", "max")]
        else:
            cells = ["-", style(_bench_value(figure, info, figure.key)), "-"]
        before = _bench_value(figure, info, "load_avg_1m_before")
        after = _bench_value(figure, info, "load_avg_1m_after")
        rounds = int(_bench_value(figure, info, "rounds"))
        # Each row's own machine speed: benchmarks re-measured in another sitting (another
        # machine, or the same one under other load) stay comparable through it.
        mops = _bench_value(figure, info, "probe_python_mops")
        rows.append(
            (figure.label, *cells, str(rounds), f"{before:.2f} -> {after:.2f}", f"{mops:.3g}", figure.goal)
        )
        used[figure.test] = info
    probes: dict[str, list[float]] = {}
    for info in used.values():
        for key, value in info.items():
            if key.startswith("probe_") and isinstance(value, int | float) and not isinstance(value, bool):
                probes.setdefault(key, []).append(float(value))
    parts = [
        f"{statistics.median(probes[key]):.3g} {unit}"
        for key, unit in (("probe_compute_gflops", "GFLOP/s fp32 matmul"), ("probe_memory_gbps", "GB/s copy"))
        if key in probes
    ]
    line = (
        "Probe column: the machine-speed probe's Python loop speed (`kvbench.probe`) in the "
        "benchmark's own process; absolute CPU times scale roughly with it, ratios and slopes far less. Median over the benchmarks "
        f"of the rest of the probe: {', '.join(parts) or 'not recorded'}."
    )
    return Table(BENCH_HEADERS, tuple(rows), tuple(True for _ in BENCH_HEADERS[1:]), line)


def bench_markdown(table: Table) -> str:
    """The README block of the ``sim_speed`` table (without its markers)."""
    align = ["---", *("---:" for _ in table.headers[1:])]
    lines = [BENCH_CAPTION, "", _line(table.headers), _line(align), *(_line(row) for row in table.rows)]
    return "\n".join([*lines, "", table.probe_line])


def check_bench_block(text: str, table: Table) -> list[str]:
    """The differences between README.md's ``sim_speed`` block and ``table`` in headers
    and row labels (every cell is timed)."""
    figure = Figure(BENCH_BLOCK, BENCH_CAPTION, BENCH_HEADERS[0], (), ())
    return check_block(text, figure, table)


# --------------------------------------------------------------------------- command line
def sweep_dir(figure: Figure, results_dir: Path) -> Path:
    return BASELINES / figure.experiment if figure.baseline else results_dir / figure.experiment


def run_sweep(experiment: str, results_dir: Path) -> None:
    """``kvbench sweep +experiment=EXPERIMENT`` into ``results_dir`` (no report)."""
    command = [sys.executable, "-m", "kvbench", "sweep", f"+experiment={experiment}"]
    command += [f"run.results_dir={results_dir}", "run.report=false"]
    done = subprocess.run(command, check=False)
    if done.returncode != 0:
        raise FiguresError(f"{' '.join(command)} failed (exit {done.returncode})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="results", help="where the sweeps are (DIR/EXPERIMENT)")
    parser.add_argument("--run", action="store_true", help="run the sweeps first (complete runs are kept)")
    parser.add_argument("--only", nargs="+", choices=sorted(FIGURES_BY_NAME), help="these tables only")
    parser.add_argument(
        "--benchmark-json",
        nargs="+",
        type=Path,
        metavar="FILE",
        help=f"render the {BENCH_BLOCK} block from these pytest-benchmark JSON files instead",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the tables in README.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if a deterministic figure is stale")
    args = parser.parse_args(argv)
    if args.benchmark_json:
        return bench_main(args.benchmark_json, write=args.write, check=args.check)
    results_dir = Path(args.results).resolve()
    chosen = [FIGURES_BY_NAME[name] for name in args.only] if args.only else list(FIGURES)
    text = README.read_text()
    problems = []
    try:
        for figure in chosen:
            if args.run and not figure.baseline:
                run_sweep(figure.experiment, results_dir)
            table = render_table(figure, results.load(sweep_dir(figure, results_dir)).runs)
            if args.check:
                problems += check_block(text, figure, table)
            elif args.write:
                text = replace_block(text, figure.experiment, markdown(figure, table))
            else:
                print(markdown(figure, table) + "\n")
    except (FiguresError, results.ResultsError) as exc:
        print(f"readme_figures: {exc}", file=sys.stderr)
        return 2
    if args.write:
        README.write_text(text)
        print(f"readme_figures: wrote {len(chosen)} table(s) into {README}")
    for problem in problems:
        print(f"stale: {problem}", file=sys.stderr)
    if args.check and not problems:
        print(f"readme_figures: {len(chosen)} table(s) match the results")
    return 1 if problems else 0


def bench_main(paths: Sequence[Path], *, write: bool, check: bool) -> int:
    """``main`` for ``--benchmark-json``: print, write or check the ``sim_speed`` block."""
    try:
        table = render_bench_table(load_benchmarks(paths))
        text = README.read_text()
        if check:
            problems = check_bench_block(text, table)
        elif write:
            README.write_text(replace_block(text, BENCH_BLOCK, bench_markdown(table)))
            print(f"readme_figures: wrote the {BENCH_BLOCK} block into {README}")
            return 0
        else:
            print(bench_markdown(table))
            return 0
    except FiguresError as exc:
        print(f"readme_figures: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"stale: {problem}", file=sys.stderr)
    if not problems:
        print(f"readme_figures: the {BENCH_BLOCK} block matches the benchmarks' rows")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
